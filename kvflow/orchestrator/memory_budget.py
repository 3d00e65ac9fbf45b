"""The KV pool sized from memory, as vLLM sizes its pool from what the weights leave.

By default the pool holds what ``max_num_seqs`` sequences of ``max_model_len`` tokens could ever
use, capped by ``kv_cache_memory_fraction`` of the memory available after the weights. The
memory is the host's for the host runners (``onnxruntime``, ``torch``): ``MemAvailable``, and the
cgroup's limit when one is set (a container's); the GPU runners keep a fixed default (their pool
is device memory, which the orchestrator does not query). ``kv_cache_bytes`` or
``num_kv_blocks`` override the sizing.

What else takes host memory beside the pool is set aside first: the swap space, the LoRA slot
pool, and on the host runners the host KV tier (``kv_offload_bytes``, more host memory holding
the blocks the pool evicts). A GPU runner's host tier takes no device memory, so its pool
does not shrink for it.

When the weights and one full-length sequence's KV do not fit in what is available, the engine
is refused at load, with the numbers (:class:`MemoryBudgetError`). :meth:`MemoryBudget.describe`
is the one line ``kvflow serve`` and ``LLM`` log at start.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_KV_CACHE_BYTES = 1 << 30  # the GPU runners' pool, when not sized from memory
HOST_RUNNERS = ("onnxruntime", "torch")
# The engine folder's files that hold weights (EngineConfig.files keys); a runner maps or reads
# them whole, so they count against the memory the pool may take.
WEIGHT_FILES = ("onnx_data", "weights", "plan")


class MemoryBudgetError(ValueError):
    """The engine does not fit in the memory available: the message has the numbers."""


@dataclass(frozen=True)
class MemoryBudget:
    """How an engine's memory is split at load.

    Attributes:
        weights_bytes: the engine's weight files (what its runner maps or loads).
        available_bytes: host memory available before the load; None for a device pool.
        bytes_per_block: one KV block, all layers, K and V, in the pool's element type.
        block_size: tokens per block.
        num_blocks: the KV pool (block 0 is the reserved null block).
        num_host_blocks: the swap space, in blocks of the same size.
        sized_by: ``num_kv_blocks``, ``kv_cache_bytes``, ``memory`` (the fraction cap),
            ``max_num_seqs`` (what the sequences can use, under the cap) or ``device``.
    """

    weights_bytes: int
    available_bytes: int | None
    bytes_per_block: int
    block_size: int
    num_blocks: int
    num_host_blocks: int
    sized_by: str
    lora_bytes: int = 0  # the LoRA slot pool, beside the weights (0: LoRA off)
    host_tier_bytes: int = 0  # the host KV tier set aside (kv_offload_bytes; host runners)

    @property
    def pool_tokens(self) -> int:
        """Tokens the pool holds (the null block excluded)."""
        return (self.num_blocks - 1) * self.block_size

    def describe(self) -> str:
        """One line: weights, KV pool (and the tokens it holds), swap, what was available."""
        avail = "" if self.available_bytes is None else \
            f"; {_size(self.available_bytes)} available at start"
        return (f"memory budget: weights {_size(self.weights_bytes)}, KV pool "
                f"{_size(self.num_blocks * self.bytes_per_block)} ({self.pool_tokens} tokens, "
                f"{self.num_blocks} blocks, sized by {self.sized_by}), swap "
                f"{_size(self.num_host_blocks * self.bytes_per_block)}"
                f"{f', LoRA slots {_size(self.lora_bytes)}' if self.lora_bytes else ''}"
                f"{f', host KV tier {_size(self.host_tier_bytes)}' if self.host_tier_bytes else ''}"
                f"{avail}")


def _size(n: int) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


def available_host_memory() -> int:
    """Bytes the host can give without swapping: ``MemAvailable``, and no more than the
    cgroup (v2) limit leaves, when one is set."""
    available = None
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    if available is None:  # pragma: no cover - every Linux since 3.14 has it
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        current = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max":
            available = min(available, max(0, int(limit) - current))
    except (OSError, ValueError):
        pass
    return available


def weights_bytes(engine_dir: str | Path, files: dict[str, str]) -> int:
    """The size of an engine folder's weight files."""
    total = 0
    for key in WEIGHT_FILES:
        if key in files:
            path = Path(engine_dir) / files[key]
            if path.is_file():
                total += path.stat().st_size
    return total


def size_pool(*, weights: int, available: int | None, bytes_per_block: int, block_size: int,
              max_model_len: int, max_num_seqs: int, fraction: float,
              kv_cache_bytes: int | None, num_kv_blocks: int | None,
              swap_bytes: int, lora_bytes: int = 0, host_tier_bytes: int = 0) -> MemoryBudget:
    """The pool's size in blocks, and why (see the module doc).

    ``available``: host bytes available before the weights load, or None for a device pool
    (sized by ``kv_cache_bytes``, default :data:`DEFAULT_KV_CACHE_BYTES`). Raises
    :class:`MemoryBudgetError` when the host KV tier's ``host_tier_bytes`` alone exceed what
    the weights, the swap space and the LoRA slot pool's ``lora_bytes`` leave of
    ``available``, or when all of them plus one ``max_model_len`` sequence do. On a device
    pool ``host_tier_bytes`` is ignored: it is host memory, not the device's.
    """
    host_blocks = swap_bytes // bytes_per_block
    seq_blocks = -(-max_model_len // block_size)
    needed = max_num_seqs * seq_blocks + 1
    if available is None:
        host_tier_bytes = 0
    else:
        left = available - weights - lora_bytes - swap_bytes
        if host_tier_bytes and host_tier_bytes > left:
            raise MemoryBudgetError(
                f"kv_offload_bytes {_size(host_tier_bytes)} (the host KV tier) exceeds the "
                f"{_size(max(left, 0))} of host memory left for KV ({_size(available)} "
                f"available - weights {_size(weights)} - swap_space_bytes {_size(swap_bytes)}"
                f"{f' - LoRA slots {_size(lora_bytes)}' if lora_bytes else ''}); lower "
                "kv_offload_bytes, or free memory")
        one_seq = (seq_blocks + 1) * bytes_per_block
        if weights + lora_bytes + one_seq + swap_bytes + host_tier_bytes > available:
            per_token = bytes_per_block // block_size
            lora = f" + LoRA slots {_size(lora_bytes)}" if lora_bytes else ""
            tier = (f" + kv_offload_bytes {_size(host_tier_bytes)}" if host_tier_bytes
                    else "")
            raise MemoryBudgetError(
                f"the engine does not fit in memory: weights {_size(weights)}{lora} + one "
                f"max_model_len={max_model_len} sequence's KV {_size(one_seq)} "
                f"({_size(per_token)} per token) + swap_space_bytes {_size(swap_bytes)}{tier} "
                f"> {_size(available)} available; lower max_model_len, swap_space_bytes"
                f"{' or kv_offload_bytes' if host_tier_bytes else ''}, or free memory")

    def budget(blocks: int, sized_by: str) -> MemoryBudget:
        return MemoryBudget(weights, available, bytes_per_block, block_size, blocks,
                            host_blocks, sized_by, lora_bytes, host_tier_bytes)

    if num_kv_blocks is not None:
        return budget(num_kv_blocks, "num_kv_blocks")
    if kv_cache_bytes is not None or available is None:
        by_bytes = (kv_cache_bytes or DEFAULT_KV_CACHE_BYTES) // bytes_per_block
        if by_bytes < 2:
            raise ValueError(f"kv_cache_bytes {kv_cache_bytes} holds {by_bytes} blocks of "
                             f"{bytes_per_block} bytes; at least 2 are needed")
        if by_bytes < needed:
            return budget(by_bytes, "kv_cache_bytes" if kv_cache_bytes else "device")
        return budget(needed, "max_num_seqs")
    free = max(0, available - weights - lora_bytes - swap_bytes - host_tier_bytes)
    cap = int(free * fraction) // bytes_per_block
    if cap >= needed:
        return budget(needed, "max_num_seqs")
    # Never below one full-length sequence (which fits: checked above).
    return budget(max(cap, seq_blocks + 1), "memory")
