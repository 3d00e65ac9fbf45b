"""The runner interface: one engine step in, the logits to sample out.

Every runner (ONNX Runtime, PyTorch, TensorRT, the simulator's) takes the same
:class:`StepInput` (the engine I/O contract, docs/design.md) and returns fp32 logits for the
positions the scheduler wants sampled. Runners own the device memory of the KV pool; the
:mod:`kvflow.kv_manager` decides which blocks hold what.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from kvflow.build.engine_config import EngineConfig

if TYPE_CHECKING:
    from kvflow.lora import LoraAdapter

RUNNERS = ("onnxruntime", "torch", "triton", "tensorrt")
# How the onnxruntime runner multiplies by a quantized engine's weights (EngineOptions).
QUANTIZED_MATMUL_MODES = ("auto", "int8", "fp32")

# The KV cache's element type (EngineOptions.kv_cache_dtype): each name a runner may be given,
# with its bytes. "auto" resolves per runner (resolve_kv_cache_dtype); bf16 is only ever what
# auto resolves to on a bfloat16 engine's device runner.
KV_CACHE_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
# The host pools' element types (HostKVPool, the host attention kernels, the ORT custom op's
# kv_dtype attribute: 0 fp32, 1 fp16).
KV_CACHE_NUMPY_DTYPES: dict[str, np.dtype] = {"fp32": np.dtype(np.float32),
                                             "fp16": np.dtype(np.float16)}
KV_CACHE_DTYPES = ("auto", "fp32", "fp16")  # the option's choices
KV_CACHE_DTYPES_NOT_BUILT = ("int8",)
# NOTE: what auto means on the host runners. onnxruntime, the CPU engine: fp16, because
# `kvflow bench quality` measured it free (docs/benchmarks.md: KL 5e-7 from fp32 KV, perplexity
# +0.0002) at half the bytes. torch, the reference runner: fp32. The device runners' auto is
# the engine's own dtype.
HOST_AUTO_KV_CACHE_DTYPES = {"onnxruntime": "fp16", "torch": "fp32"}
_ENGINE_KV_CACHE_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def check_kv_cache_dtype(name: str) -> None:
    """Refuse a ``kv_cache_dtype`` that is no choice, naming the choices (and saying so of one
    that is planned but not built)."""
    if name in KV_CACHE_DTYPES_NOT_BUILT:
        raise ValueError(f"kv_cache_dtype {name!r} is not built yet (an int8 cache needs "
                         f"per-token scales in the KV layout); choose one of {KV_CACHE_DTYPES}")
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {name!r}")


def resolve_kv_cache_dtype(name: str, engine: EngineConfig, runner: str | None) -> str:
    """The KV element type a runner allocates for option value ``name``: itself, or for
    ``auto`` :data:`HOST_AUTO_KV_CACHE_DTYPES` on the host runners and the engine's own dtype
    on the device runners (``runner`` None: the engine's backend)."""
    check_kv_cache_dtype(name)
    if name != "auto":
        return name
    if (runner or engine.backend) in HOST_AUTO_KV_CACHE_DTYPES:
        return HOST_AUTO_KV_CACHE_DTYPES[runner or engine.backend]
    return engine_kv_cache_dtype(engine)


def engine_kv_cache_dtype(engine: EngineConfig) -> str:
    """The KV element type of ``engine``'s own dtype (what device runners' auto means)."""
    return _ENGINE_KV_CACHE_DTYPES[engine.dtype]


def kv_cache_numpy_dtype(name: str) -> np.dtype:
    """The NumPy element type of a host KV pool of ``kv_cache_dtype`` ``name``."""
    if name not in KV_CACHE_NUMPY_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} cannot be a host KV pool's type; a host pool "
                         f"holds one of {tuple(KV_CACHE_NUMPY_DTYPES)}")
    return KV_CACHE_NUMPY_DTYPES[name]


def kv_bytes_per_block(engine: EngineConfig, kv_cache_dtype: str) -> int:
    """Bytes of one KV block (every layer's K and V) of ``engine`` in ``kv_cache_dtype``."""
    return (engine.model.kv_bytes_per_token(KV_CACHE_DTYPE_BYTES[kv_cache_dtype])
            * engine.limits.block_size)


@dataclass
class StepInput:
    """One engine step, host arrays. ``T`` packed new tokens of ``S`` sequences.

    Attributes:
        input_ids: int64 ``[T]`` token ids, sequence after sequence, no padding.
        positions: int64 ``[T]`` position of each token in its sequence.
        slot_mapping: int64 ``[T]`` KV pool slot (``block_id * block_size + offset``) to write;
            -1 writes nothing.
        block_tables: int32 ``[S, max_blocks]`` each sequence's blocks, padded with block 0.
        seq_lens: int32 ``[S]`` tokens of each sequence once this step's are written.
        query_start_loc: int32 ``[S + 1]`` where each sequence's new tokens start in the batch.
        logits_indices: int64 ``[N]`` packed rows whose next-token logits to return, in
            ascending order: each sampled sequence's last row, and for a sequence that asks for
            prompt logprobs, its chunk's prompt rows before it (so ``N`` may exceed ``S``).
        lora_slots: int32 ``[T]`` each packed token's LoRA slot (:meth:`ModelRunner.load_lora`),
            -1 for the base model; None when no token of the step uses an adapter (the runner
            then does no LoRA work at all).
    """

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    block_tables: np.ndarray
    seq_lens: np.ndarray
    query_start_loc: np.ndarray
    logits_indices: np.ndarray
    lora_slots: np.ndarray | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def max_query_len(self) -> int:
        """The most new tokens of any sequence (1 in a decode step)."""
        return int(np.diff(self.query_start_loc).max()) if self.num_seqs else 0

    @property
    def is_decode(self) -> bool:
        """Every sequence adds one token and has it sampled, in order: a decode step."""
        s = self.num_seqs
        return (s > 0 and self.num_tokens == s and len(self.logits_indices) == s
                and bool((self.logits_indices == np.arange(s)).all()))


class ModelRunner(ABC):
    """Executes engine steps against a KV pool of ``num_blocks`` blocks it allocated.

    Block 0 of the pool is the null block: block tables are padded with it and nothing is ever
    read from it.
    """

    name: str = "base"
    # Whether token ids index a real embedding table (the engine refuses ids outside the
    # vocabulary before they reach it); the simulator's runner reads no token.
    reads_token_ids: bool = True
    # Whether the runner reads the step's tokens, positions, slots and block tables; False
    # (the simulator's) gets a StepInput with only seq_lens, query_start_loc and
    # logits_indices filled, which the engine builds for a fraction of the cost.
    needs_inputs: bool = True
    # Whether enable_lora / load_lora work (runner-side multi-LoRA: a slot pool of adapters,
    # StepInput.lora_slots choosing one per token).
    supports_lora: bool = False

    def __init__(self, engine: EngineConfig, num_blocks: int, num_host_blocks: int = 0) -> None:
        self.engine = engine
        self.num_blocks = num_blocks
        self.num_host_blocks = num_host_blocks
        # The KV pool's element type (a KV_CACHE_DTYPE_BYTES name): the engine's own, unless
        # the runner allocates its pool in another (it then sets this).
        self.kv_cache_dtype = engine_kv_cache_dtype(engine)

    # What the engine needs of the model and the pool, so that it never reads the config.
    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        return self.engine.limits.block_size

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary (logits columns past it are padding)."""
        return self.engine.model.vocab_size

    @property
    def sliding_window(self) -> int | None:
        """Every layer's attention window in tokens, when all layers share one (Mistral's):
        the KV manager then releases blocks no query can see again. None: full attention,
        or windows that differ by layer (Gemma 3's), where no block is released."""
        return self.engine.model.uniform_sliding_window

    @property
    def kv_bytes_per_block(self) -> int:
        """Device bytes of one KV block, every layer's K and V, in :attr:`kv_cache_dtype`."""
        return kv_bytes_per_block(self.engine, self.kv_cache_dtype)

    @abstractmethod
    def execute(self, step: StepInput) -> np.ndarray:
        """Run one step; returns fp32 logits ``[len(step.logits_indices), vocab_size]``
        (every row asked for: a step's rows are at most its tokens, so memory stays
        O(chunk x vocab))."""

    def execute_argmax(self, step: StepInput) -> np.ndarray:
        """Run one step whose every sampled row is plain greedy; returns int64
        ``[len(step.logits_indices)]``, each row's most likely token. Runners that can take the
        argmax inside the model override this, so that no vocabulary-wide row leaves it."""
        logits = self.execute(step)
        return np.argmax(logits[:, : self.vocab_size], axis=1)

    def enable_lora(self, max_loras: int, max_rank: int) -> None:
        """Allocate the LoRA slot pool: ``max_loras`` adapters of rank at most ``max_rank``,
        all zeros. Runners without LoRA refuse it, naming themselves."""
        raise ValueError(f"the {self.name} runner does not serve LoRA adapters")

    def load_lora(self, slot: int, adapter: LoraAdapter) -> None:
        """Write ``adapter`` into pool slot ``slot`` (the modules it leaves out are zeroed)."""
        raise ValueError(f"the {self.name} runner does not serve LoRA adapters")

    @property
    def lora_pool_bytes(self) -> int:
        """Bytes of the LoRA slot pool (0 without one)."""
        return 0

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host swap blocks: ``(device_block, host_block)`` pairs."""
        raise NotImplementedError(f"the {self.name} runner cannot swap")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host swap blocks back: ``(host_block, device_block)`` pairs."""
        raise NotImplementedError(f"the {self.name} runner cannot swap")

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to device blocks, ``(src, dst)`` pairs (copy on write of a block
        forked sequences share)."""
        raise NotImplementedError(f"the {self.name} runner cannot copy blocks")

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        """Each block's KV (every layer's K and V, the pool's dtype) as bytes, for the KV
        tiers: what :meth:`write_blocks` puts back."""
        raise NotImplementedError(f"the {self.name} runner cannot read KV blocks (KV tiers)")

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        """Write :meth:`read_blocks` payloads into device blocks (a tier's restored prefix)."""
        raise NotImplementedError(f"the {self.name} runner cannot write KV blocks (KV tiers)")

    def close(self) -> None:  # noqa: B027  (optional hook)
        """Release the KV pool and any device resources."""

    def __enter__(self) -> ModelRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_payloads(block_ids: list[int], payloads: list[bytes], block_nbytes: int) -> None:
    """Refuse :meth:`KVPool.write_blocks` payloads that do not match the blocks: one per
    block, each ``block_nbytes`` long (a tier file of another layout, a torn copy)."""
    if len(block_ids) != len(payloads):
        raise ValueError(f"write_blocks: {len(block_ids)} blocks but {len(payloads)} payloads")
    for b, payload in zip(block_ids, payloads, strict=True):
        if len(payload) != block_nbytes:
            raise ValueError(f"write_blocks: block {b}'s payload is {len(payload)} bytes, "
                             f"the pool's blocks hold {block_nbytes}")


class KVPool(Protocol):
    """What a runner's KV pool does besides holding the cache: block swaps, block copies,
    blocks' bytes in and out (the KV tiers) and release
    (:class:`HostKVPool` on the host, ``DeviceKVPool`` on a GPU)."""

    def swap_out(self, pairs: list[tuple[int, int]]) -> None: ...

    def swap_in(self, pairs: list[tuple[int, int]]) -> None: ...

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None: ...

    def read_blocks(self, block_ids: list[int]) -> list[bytes]: ...

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None: ...

    def close(self) -> None: ...


class PoolRunner(ModelRunner):
    """A runner whose KV pool (and swap space) is ``self.pool``: swaps and close go to it."""

    pool: KVPool

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        self.pool.swap_out(pairs)

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        self.pool.swap_in(pairs)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self.pool.copy_blocks(pairs)

    def read_blocks(self, block_ids: list[int]) -> list[bytes]:
        return self.pool.read_blocks(block_ids)

    def write_blocks(self, block_ids: list[int], payloads: list[bytes]) -> None:
        self.pool.write_blocks(block_ids, payloads)

    def close(self) -> None:
        self.pool.close()
