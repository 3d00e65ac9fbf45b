"""The Llama-family decoder over a packed batch and a paged KV cache.

One ``forward`` is one engine step: the new tokens of every scheduled sequence packed together
(no padding), with their positions and KV slots; attention goes through one
``kvflow::paged_attention`` op per layer. Parameter names equal HF transformers' so that HF
state dicts load as they are. The same module is run eagerly by the PyTorch runner and exported
to ONNX by ``kvflow build-engine``.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from kvflow.model.config import ModelConfig
from kvflow.plugins import torch_op  # noqa: F401  (registers torch.ops.kvflow.paged_attention)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (fp32), with linear or llama3 scaling, computed as HF does."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
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


def rope_cache(cfg: ModelConfig, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables ``[max_positions, head_dim]`` (HF's non-interleaved layout)."""
    inv = rope_inv_freq(cfg)
    pos = torch.arange(max_positions, dtype=torch.int64).float()
    freqs = pos[:, None] * inv[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class StepMetadata:
    """The per-step tensors every layer's attention reads (see the engine I/O contract)."""

    def __init__(self, kv_cache_ptrs: torch.Tensor, slot_mapping: torch.Tensor,
                 block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 query_start_loc: torch.Tensor) -> None:
        self.kv_cache_ptrs = kv_cache_ptrs
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.query_start_loc = query_start_loc


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, block_size: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.block_size = block_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.head_dim**-0.5
        h = cfg.hidden_size
        qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, qd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, kvd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, kvd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(qd, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: StepMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        out = torch.ops.kvflow.paged_attention(
            q.reshape(t, -1), k.reshape(t, -1), v, meta.kv_cache_ptrs, meta.slot_mapping,
            meta.block_tables, meta.seq_lens, meta.query_start_loc, self.layer_idx,
            self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, self.scale,
        )
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, block_size: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, block_size)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: StepMetadata) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, block_size) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A Llama-family decoder whose ``forward`` is one packed engine step.

    Args:
        cfg: the model's shape.
        block_size: tokens per KV block (an attribute of every PagedAttention node).
        max_positions: size of the RoPE tables; positions beyond it are out of contract.
    """

    # Buffers registered in __init__: declared so that indexing them type-checks as a Tensor.
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor

    def __init__(self, cfg: ModelConfig, block_size: int, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, block_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        cos, sin = rope_cache(cfg, max_positions)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_cache_ptrs: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        query_start_loc: torch.Tensor,
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """One step; returns fp32 logits ``[len(logits_indices), vocab_size]``."""
        meta = StepMetadata(kv_cache_ptrs, slot_mapping, block_tables, seq_lens, query_start_loc)
        x = self.model.embed_tokens(input_ids)
        cos = self.rope_cos[positions].to(x.dtype).unsqueeze(1)
        sin = self.rope_sin[positions].to(x.dtype).unsqueeze(1)
        for layer in self.model.layers:
            x = layer(x, cos, sin, meta)
        x = self.model.norm(x[logits_indices])
        return self.lm_head(x).float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load HF-named weights; refuses missing or unexpected tensors by name."""
        expected = set(self.state_dict())
        if self.config.tie_word_embeddings:
            expected.discard("lm_head.weight")
            state_dict = {k: v for k, v in state_dict.items() if k != "lm_head.weight"}
        state_dict = {k: v for k, v in state_dict.items() if "rotary_emb" not in k}
        missing = sorted(expected - set(state_dict))
        unexpected = sorted(set(state_dict) - expected)
        if missing or unexpected:
            raise ValueError(
                f"checkpoint does not match the model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        self.load_state_dict(state_dict, strict=False)
