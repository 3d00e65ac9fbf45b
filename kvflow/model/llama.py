"""The decoder over a packed batch and a paged KV cache, for every family kvflow runs.

One ``forward`` is one engine step: the new tokens of every scheduled sequence packed together
(no padding), with their positions and KV slots; attention goes through one
``kvflow::paged_attention`` op per layer. Parameter names are kvflow's
(:mod:`kvflow.model.weight_names`: HF's, with Phi-3's fused linears split and Gemma's norms
stored ``1 + w``). The same module is run eagerly by the PyTorch runner and exported to ONNX by
``kvflow build-engine``.

The Llama layer, and what each family adds to it (all from :class:`ModelConfig`'s fields):

- Qwen3 / Gemma 3 (``qk_norm``): an RMSNorm over each head of q and k, before RoPE;
- Gemma 2/3 (``sandwich_norm``): norms on the attention output and around the MLP, the
  embedding times ``sqrt(hidden)``, GeGLU (``gelu_pytorch_tanh``), the attention scale from
  ``query_pre_attn_scalar``, Gemma 2's attention soft-cap (in the op) and final logit soft-cap;
- per-layer sliding windows (Mistral, Gemma 2/3), passed to the op; Gemma 3's sliding layers
  rotate with their own RoPE table (:mod:`kvflow.model.rope`);
- Phi-3 / Phi-4-mini: longrope tables and a partial rotary factor.
"""

from __future__ import annotations

import torch
from torch import nn

from kvflow.model.config import ModelConfig
from kvflow.model.rope import apply_rope, local_rope_cache, rope_cache, uses_local_rope
from kvflow.plugins import torch_op  # noqa: F401  (registers torch.ops.kvflow.paged_attention)

__all__ = ["LlamaForCausalLM", "RMSNorm", "StepMetadata", "computed_buffers", "rope_cache"]


def computed_buffers(cfg: ModelConfig, max_positions: int) -> dict[str, torch.Tensor]:
    """The step model's buffers, by name, in fp32: computed from the config, never read from a
    checkpoint (the RoPE tables; Gemma's embedding multiplier)."""
    cos, sin = rope_cache(cfg, max_positions)
    out = {"rope_cos": cos, "rope_sin": sin}
    if any(uses_local_rope(cfg)):
        out["rope_local_cos"], out["rope_local_sin"] = local_rope_cache(cfg, max_positions)
    if cfg.embedding_multiplier != 1.0:
        # HF multiplies by a tensor of the multiplier in the activations' dtype.
        out["embed_scale"] = torch.tensor(cfg.embedding_multiplier, dtype=torch.float32)
    return out


class RMSNorm(nn.Module):
    """HF's Llama RMSNorm (Gemma's ``1 + w`` is folded into the stored weight)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


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
    """q/k/v projections, optional per-head q/k norms, RoPE, the paged attention op, o_proj."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, block_size: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.block_size = block_size
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        self.scale = cfg.attention_scale
        self.sliding_window = cfg.layer_sliding_windows()[layer_idx]
        self.logit_softcap = float(cfg.attn_logit_softcapping or 0.0)
        h = cfg.hidden_size
        qd, kvd = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(h, qd, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(h, kvd, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(h, kvd, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(qd, h, bias=False)
        self.q_norm: RMSNorm | None = None
        self.k_norm: RMSNorm | None = None
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: StepMetadata) -> torch.Tensor:
        t = x.shape[0]
        q = self.q_proj(x).view(t, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(t, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = torch.ops.kvflow.paged_attention(
            q.reshape(t, -1), k.reshape(t, -1), v, meta.kv_cache_ptrs, meta.slot_mapping,
            meta.block_tables, meta.seq_lens, meta.query_start_loc, self.layer_idx,
            self.num_heads, self.num_kv_heads, self.head_dim, self.block_size, self.scale,
            self.sliding_window, self.logit_softcap,
        )
        return self.o_proj(out)


class LlamaMLP(nn.Module):
    """SwiGLU, or GeGLU (tanh GELU) for Gemma: ``down(act(gate(x)) * up(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.hidden_act == "gelu_pytorch_tanh"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x)
        act = (nn.functional.gelu(gate, approximate="tanh") if self.gelu
               else nn.functional.silu(gate))
        return self.down_proj(act * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm attention and MLP with residuals; Gemma's sandwich norms when configured.

    Without ``sandwich_norm``, ``post_attention_layernorm`` is the MLP's input norm (HF's Llama
    name); with it, the attention output's norm, and ``pre_feedforward_layernorm`` /
    ``post_feedforward_layernorm`` wrap the MLP (HF's Gemma names)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, block_size: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_idx, block_size)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_feedforward_layernorm: RMSNorm | None = None
        self.post_feedforward_layernorm: RMSNorm | None = None
        if cfg.sandwich_norm:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                meta: StepMetadata) -> torch.Tensor:
        attn = self.self_attn(self.input_layernorm(x), cos, sin, meta)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + attn
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attn)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, block_size: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, i, block_size) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaForCausalLM(nn.Module):
    """A decoder whose ``forward`` is one packed engine step (any family of
    :class:`ModelConfig`; the name is the Llama layer they all extend).

    Args:
        cfg: the model's shape.
        block_size: tokens per KV block (an attribute of every PagedAttention node).
        max_positions: size of the RoPE tables; positions beyond it are out of contract.
    """

    # Buffers registered in __init__: declared so that indexing them type-checks as a Tensor.
    rope_cos: torch.Tensor
    rope_sin: torch.Tensor
    rope_local_cos: torch.Tensor
    rope_local_sin: torch.Tensor
    embed_scale: torch.Tensor

    def __init__(self, cfg: ModelConfig, block_size: int, max_positions: int) -> None:
        super().__init__()
        self.config = cfg
        self.model = LlamaModel(cfg, block_size)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for name, value in computed_buffers(cfg, max_positions).items():
            self.register_buffer(name, value, persistent=False)
        self.local_rope = uses_local_rope(cfg)
        self.scales_embedding = cfg.embedding_multiplier != 1.0
        self.final_logit_softcap = cfg.final_logit_softcapping

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
        if self.scales_embedding:
            x = x * self.embed_scale.to(x.dtype)
        rope = [(self.rope_cos[positions].to(x.dtype).unsqueeze(1),
                 self.rope_sin[positions].to(x.dtype).unsqueeze(1))]
        if any(self.local_rope):
            rope.append((self.rope_local_cos[positions].to(x.dtype).unsqueeze(1),
                         self.rope_local_sin[positions].to(x.dtype).unsqueeze(1)))
        for layer, local in zip(self.model.layers, self.local_rope, strict=True):
            cos, sin = rope[int(local)]
            x = layer(x, cos, sin, meta)
        x = self.model.norm(x[logits_indices])
        logits = self.lm_head(x)
        if self.final_logit_softcap:
            cap = self.final_logit_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def load_hf_state_dict(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load kvflow-named weights (:func:`kvflow.model.weight_names.to_kvflow_names` of HF's);
        refuses missing or unexpected tensors by name."""
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
