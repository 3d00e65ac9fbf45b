"""The engine's input shapes at the build limits: the TensorRT optimization profile, the
TensorRT runner's buffer sizes and the build report all read them from here (pure Python)."""

from __future__ import annotations

import numpy as np

from kvflow.build.engine_config import BuildLimits
from kvflow.model.config import ModelConfig

# The engine I/O contract's element types (docs/design.md, "Engine I/O contract").
INPUT_DTYPES: dict[str, np.dtype] = {
    "input_ids": np.dtype(np.int64), "positions": np.dtype(np.int64),
    "kv_cache_ptrs": np.dtype(np.int64), "slot_mapping": np.dtype(np.int64),
    "block_tables": np.dtype(np.int32), "seq_lens": np.dtype(np.int32),
    "query_start_loc": np.dtype(np.int32), "logits_indices": np.dtype(np.int64),
}
LOGITS_DTYPE = np.dtype(np.float32)

Shape = tuple[int, ...]


def profile_shapes(limits: BuildLimits, cfg: ModelConfig) -> dict[str, tuple[Shape, Shape, Shape]]:
    """(min, opt, max) shape of every engine input, from the build limits.

    ``opt`` is a decode batch at half the limits, the step a server runs most."""
    max_tokens, max_seqs = limits.max_num_tokens, limits.max_batch_size
    max_blocks = -(-limits.max_model_len // limits.block_size)
    opt_seqs = max(1, max_seqs // 2)
    opt_blocks = max(1, max_blocks // 2)
    tokens = ((1,), (min(opt_seqs, max_tokens),), (max_tokens,))
    layers = (cfg.num_hidden_layers, 2)
    return {
        "input_ids": tokens,
        "positions": tokens,
        "slot_mapping": tokens,
        "kv_cache_ptrs": (layers, layers, layers),
        "block_tables": ((1, 1), (opt_seqs, opt_blocks), (max_seqs, max_blocks)),
        "seq_lens": ((1,), (opt_seqs,), (max_seqs,)),
        "query_start_loc": ((2,), (opt_seqs + 1,), (max_seqs + 1,)),
        "logits_indices": ((1,), (opt_seqs,), (max_seqs,)),
    }


def logits_max_shape(limits: BuildLimits, cfg: ModelConfig) -> Shape:
    """The most logits one engine call returns: a row per ``logits_indices`` entry."""
    return (profile_shapes(limits, cfg)["logits_indices"][2][0], cfg.vocab_size)
