"""What one KV block costs: :class:`KVCacheSpec`, from a model's KV layout. Pure Python."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheSpec:
    """The KV layout of a model: what one block costs.

    One block holds ``block_size`` tokens of K and V for every layer:
    ``2 * num_layers * block_size * num_kv_heads * head_dim * dtype_bytes`` bytes.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype_bytes: int

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size", "dtype_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    @property
    def bytes_per_block(self) -> int:
        return (2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim
                * self.dtype_bytes)

    def num_blocks_for_bytes(self, kv_bytes: int) -> int:
        """Blocks (the null block included) that fit in a budget of ``kv_bytes``."""
        n = kv_bytes // self.bytes_per_block
        if n < 2:
            raise ValueError(
                f"kv_cache_bytes {kv_bytes} holds {n} blocks of {self.bytes_per_block} bytes; "
                "at least 2 are needed"
            )
        return int(n)
