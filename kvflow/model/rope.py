"""RoPE tables of the step model, computed as HF transformers computes them (fp32).

Each table is ``[max_positions, rotary_dim]`` in HF's non-interleaved layout (the two halves of a
row repeat); the step model gathers the rows of its tokens' positions. Families:

- ``default``, ``linear``, ``llama3``: one set of inverse frequencies for every position;
- ``longrope`` (Phi-3/3.5/4-mini): ``short_factor`` below ``original_max_position_embeddings``,
  ``long_factor`` from it on, per position, and cos/sin scaled by the attention factor. HF
  rotates a whole sequence with one set, chosen by its length: its ``generate`` recomputes the
  whole cache with the long factors when a sequence first grows past the original length
  (``Phi3ForCausalLM.prepare_inputs_for_generation``). A paged cache keeps each key as it was
  rotated (as vLLM's does), so kvflow equals HF for sequences within the original length (4096
  for Phi-3.5-mini and Phi-4-mini) and differs from it beyond;
- Gemma 3: the sliding layers' own table (``rope_local_base_freq``, never scaled) beside the
  global one.
"""

from __future__ import annotations

import math

import torch

from kvflow.model.config import ModelConfig


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32) of the global layers, with linear or llama3 scaling,
    computed as HF does (longrope: :func:`longrope_inv_freqs`)."""
    inv = _base_inv_freq(cfg.rope_theta, cfg.rotary_dim)
    scaling = cfg.rope_scaling or {}
    if cfg.rope_type == "linear":
        return inv / float(scaling["factor"])
    if cfg.rope_type == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_ctx = float(scaling.get("original_max_position_embeddings", 8192))
        low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
        wavelen = 2 * math.pi / inv
        inv_llama = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_ctx / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_llama / factor + smooth * inv_llama
        is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(is_medium, smoothed, inv_llama)
    return inv


def longrope_inv_freqs(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Longrope's short and long inverse frequencies and its attention factor (HF's
    ``_compute_longrope_parameters``)."""
    scaling = cfg.rope_scaling or {}
    dim = cfg.rotary_dim
    original = int(scaling["original_max_position_embeddings"])
    factor = scaling.get("factor") or cfg.max_position_embeddings / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = (1.0 if factor <= 1.0
                            else math.sqrt(1 + math.log(factor) / math.log(original)))
    shape = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
    short, long = (1.0 / (torch.tensor(scaling[key], dtype=torch.float32)
                          * cfg.rope_theta ** shape) for key in ("short_factor", "long_factor"))
    return short, long, float(attention_factor)


def _tables(freqs: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    emb = torch.cat((freqs, freqs), dim=-1)
    if scale == 1.0:
        return emb.cos(), emb.sin()
    return emb.cos() * scale, emb.sin() * scale


def rope_cache(cfg: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_positions, rotary_dim]`` of the global (or only) layers."""
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    if cfg.rope_type == "longrope":
        short, long, attention_factor = longrope_inv_freqs(cfg)
        original = int((cfg.rope_scaling or {})["original_max_position_embeddings"])
        inv = torch.where((pos < original)[:, None], short[None, :], long[None, :])
        return _tables(pos[:, None] * inv, attention_factor)
    return _tables(pos[:, None] * rope_inv_freq(cfg)[None, :])


def local_rope_cache(cfg: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gemma 3's sliding layers' tables: theta ``rope_local_base_freq``, no scaling."""
    if cfg.rope_local_base_freq is None:
        raise ValueError("local_rope_cache needs rope_local_base_freq (Gemma 3)")
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    return _tables(pos[:, None] * _base_inv_freq(cfg.rope_local_base_freq, cfg.rotary_dim))


def uses_local_rope(cfg: ModelConfig) -> tuple[bool, ...]:
    """Per layer: whether it rotates with the local table (Gemma 3's sliding layers)."""
    if cfg.rope_local_base_freq is None:
        return (False,) * cfg.num_hidden_layers
    return tuple(w > 0 for w in cfg.layer_sliding_windows())


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[tokens, heads, head_dim]`` rotated on its first ``cos.shape[-1]`` dims (all of
    them but for a partial rotary factor, as Phi-4-mini's)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)
