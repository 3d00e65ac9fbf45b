"""The model description every part of kvflow shares: a Llama-style decoder with GQA and the
per-family blocks of Qwen3, Gemma 2/3 and Phi-3 (docs/design.md, "Model families")."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

# HF `architectures` values kvflow runs, and the family each one is.
SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    # Gemma 3's multimodal checkpoints: kvflow runs their text decoder (config's text_config).
    "Gemma3ForConditionalGeneration": "gemma3",
    "Phi3ForCausalLM": "phi3",
}
# HF `model_type` values, for configs without `architectures`.
MODEL_TYPES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3",
               "gemma2": "gemma2", "gemma3_text": "gemma3", "gemma3": "gemma3", "phi3": "phi3"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
HIDDEN_ACTS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("sliding_attention", "full_attention")
GEMMA = ("gemma2", "gemma3")
# What HF's Gemma2Config / Gemma3TextConfig assume for a key a config.json leaves out.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0,
               "sliding_window": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
               "head_dim": 256, "max_position_embeddings": 8192},
    "gemma3": {"hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
               "attn_logit_softcapping": None, "final_logit_softcapping": None,
               "sliding_window": 4096, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
               "head_dim": 256, "max_position_embeddings": 131072, "vocab_size": 262208,
               "num_attention_heads": 8, "num_key_value_heads": 4},
}


class UnsupportedModelError(ValueError):
    """The checkpoint is not a decoder kvflow can run."""


@dataclass(frozen=True)
class ModelConfig:
    """Shape and hyper-parameters of a decoder: Llama 2/3, Mistral, Qwen2/3, Gemma 2/3, Phi-3/4.

    Field names follow HF transformers' configs so that ``from_hf_config`` is a straight read.
    The fields after ``sliding_window`` describe the per-family blocks; their defaults are the
    Llama block, so engine configs written before they existed still load.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    sliding_window: int | None = None
    hidden_act: str = "silu"
    # Per-head RMSNorm of q and k before RoPE (Qwen3, Gemma 3).
    qk_norm: bool = False
    # Gemma: norms on the attention output and around the MLP (post_attention_layernorm is then
    # the attention output's norm, pre_feedforward_layernorm the MLP input's).
    sandwich_norm: bool = False
    embedding_multiplier: float = 1.0
    # Attention scale = query_pre_attn_scalar ** -0.5 (else head_dim ** -0.5).
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None
    # Per layer "sliding_attention" | "full_attention"; None: every layer is sliding if
    # sliding_window is set, else full.
    layer_types: tuple[str, ...] | None = None
    # RoPE theta of the sliding layers (Gemma 3), which take no rope_scaling.
    rope_local_base_freq: float | None = None
    # RoPE rotates the first partial_rotary_factor * head_dim dims of each head (Phi-4-mini).
    partial_rotary_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES.values():
            raise UnsupportedModelError(
                f"architecture must be one of {sorted(set(SUPPORTED_ARCHITECTURES.values()))}, "
                f"got {self.architecture!r}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise UnsupportedModelError(f"{name} must be a positive integer, got {value!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise UnsupportedModelError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in HIDDEN_ACTS:
            raise UnsupportedModelError(
                f"hidden_act must be one of {HIDDEN_ACTS}, got {self.hidden_act!r}")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise UnsupportedModelError(
                f"sliding_window must be >= 1 or None, got {self.sliding_window!r}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise UnsupportedModelError(
                    f"layer_types has {len(self.layer_types)} entries, expected "
                    f"num_hidden_layers = {self.num_hidden_layers}")
            bad = sorted(set(self.layer_types) - set(LAYER_TYPES))
            if bad:
                raise UnsupportedModelError(f"layer_types must be in {LAYER_TYPES}, got {bad}")
        if not 0.0 < self.partial_rotary_factor <= 1.0 or self.rotary_dim % 2:
            raise UnsupportedModelError(
                f"partial_rotary_factor must be in (0, 1] and give an even number of rotated "
                f"dims, got {self.partial_rotary_factor} (head_dim {self.head_dim})")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise UnsupportedModelError(
                f"rope_scaling.rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}"
            )
        if rope_type == "longrope":
            self._check_longrope()

    def _check_longrope(self) -> None:
        scaling = self.rope_scaling or {}
        for key in ("short_factor", "long_factor"):
            factors = scaling.get(key)
            if not isinstance(factors, list | tuple) or len(factors) != self.rotary_dim // 2:
                raise UnsupportedModelError(
                    f"rope_scaling.{key} must be a list of rotary_dim / 2 = "
                    f"{self.rotary_dim // 2} numbers, got {factors!r}")
        if not isinstance(scaling.get("original_max_position_embeddings"), int):
            raise UnsupportedModelError(
                "rope_scaling.original_max_position_embeddings must be an integer for longrope")

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return str(self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default")))

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (HF: int(head_dim * factor))."""
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def attention_scale(self) -> float:
        """The factor on q.k: ``query_pre_attn_scalar ** -0.5`` (Gemma), else
        ``head_dim ** -0.5``."""
        return float(self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    def layer_sliding_windows(self) -> tuple[int, ...]:
        """Per layer, the attention window in tokens (0 = full causal attention): a query at
        position p sees keys at positions p - window < j <= p."""
        window = self.sliding_window or 0
        if self.layer_types is None:
            return (window,) * self.num_hidden_layers
        return tuple(window if t == "sliding_attention" else 0 for t in self.layer_types)

    @property
    def uniform_sliding_window(self) -> int | None:
        """The window when every layer has the same nonzero one (Mistral), else None: only then
        may the KV manager release blocks that fall out of the window."""
        windows = set(self.layer_sliding_windows())
        if len(windows) == 1 and 0 not in windows:
            return windows.pop()
        return None

    @property
    def num_parameters(self) -> int:
        """Parameter count (embeddings counted once when tied)."""
        h, i, kv = self.hidden_size, self.intermediate_size, self.num_key_value_heads
        q_dim, kv_dim = self.num_attention_heads * self.head_dim, kv * self.head_dim
        attn = h * q_dim + 2 * h * kv_dim + q_dim * h
        if self.attention_bias:
            attn += q_dim + 2 * kv_dim
        if self.qk_norm:
            attn += 2 * self.head_dim
        layer = attn + 3 * h * i + (4 if self.sandwich_norm else 2) * h
        emb = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + emb + h

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_bytes

    # ----------------------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, hf: dict[str, Any],
                       generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Read a HF ``config.json`` dict; refuse an architecture kvflow does not run, by name.

        ``generation_config``: the checkpoint's ``generation_config.json``; its EOS ids, when it
        has any, are the ones HF's ``generate`` stops on, so they replace the config's.
        """
        arch = _architecture(hf)
        if "text_config" in hf:  # a multimodal checkpoint: its text decoder
            hf = {**hf["text_config"], "architectures": hf.get("architectures")}
        hf = {**_FAMILY_DEFAULTS.get(arch, {}), **hf}
        heads = int(hf["num_attention_heads"])
        head_dim = hf.get("head_dim") or hf["hidden_size"] // heads
        eos = hf.get("eos_token_id")
        if generation_config and generation_config.get("eos_token_id") is not None:
            eos = generation_config["eos_token_id"]
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope = _read_rope(hf, arch)
        sliding, layer_types = _read_windows(hf, arch)
        gemma = arch in GEMMA
        scalar = hf.get("query_pre_attn_scalar") if gemma else None
        return cls(
            architecture=arch,
            vocab_size=int(hf["vocab_size"]),
            hidden_size=int(hf["hidden_size"]),
            intermediate_size=int(hf["intermediate_size"]),
            num_hidden_layers=int(hf["num_hidden_layers"]),
            num_attention_heads=heads,
            num_key_value_heads=int(hf.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-5)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            attention_bias=bool(hf.get("attention_bias", arch == "qwen2")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            sliding_window=sliding,
            layer_types=layer_types,
            hidden_act=str(hf.get("hidden_activation") or hf.get("hidden_act") or "silu"),
            qk_norm=arch in ("qwen3", "gemma3"),
            sandwich_norm=gemma,
            embedding_multiplier=float(hf["hidden_size"]) ** 0.5 if gemma else 1.0,
            query_pre_attn_scalar=float(scalar) if scalar else None,
            attn_logit_softcapping=_positive(hf.get("attn_logit_softcapping")) if gemma else None,
            final_logit_softcapping=(_positive(hf.get("final_logit_softcapping")) if gemma
                                     else None),
            **rope,
        )

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["eos_token_ids"] = list(self.eos_token_ids)
        if self.layer_types is not None:
            d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids", ()))
        if d.get("layer_types") is not None:
            d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)


# --- reading HF configs -----------------------------------------------------------------------
def _architecture(hf: dict[str, Any]) -> str:
    archs = hf.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is not None:
        return arch
    model_type = hf.get("model_type")
    if not archs and model_type in MODEL_TYPES:
        return MODEL_TYPES[str(model_type)]
    raise UnsupportedModelError(f"unknown architecture {archs or model_type!r}: kvflow runs "
                                f"{sorted(SUPPORTED_ARCHITECTURES)}")


def _positive(value: Any) -> float | None:
    return float(value) if value else None


def _read_rope(hf: dict[str, Any], arch: str) -> dict[str, Any]:
    """``rope_theta``, ``rope_scaling``, ``rope_local_base_freq`` and ``partial_rotary_factor``
    from HF's v4 keys (``rope_theta``, ``rope_scaling``) or v5's ``rope_parameters`` (nested by
    layer type for Gemma 3)."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    local_theta = None
    if arch == "gemma3":
        local_theta = float(hf.get("rope_local_base_freq") or 10_000.0)
        if "full_attention" in params or "sliding_attention" in params:
            sliding = params.get("sliding_attention") or {}
            if sliding.get("rope_type", "default") != "default":
                raise UnsupportedModelError(
                    f"rope_parameters.sliding_attention.rope_type must be 'default', got "
                    f"{sliding.get('rope_type')!r}")
            local_theta = float(sliding.get("rope_theta") or local_theta)
            params = params.get("full_attention") or {}
    # HF v5 fills rope_parameters from the top-level keys only where it lacks them.
    scaling = dict(params)
    theta = (scaling.pop("rope_theta", None) or hf.get("rope_theta")
             or (1_000_000.0 if arch == "gemma3" else 10000.0))
    partial = scaling.pop("partial_rotary_factor", None) or hf.get("partial_rotary_factor") or 1.0
    rope_type = scaling.get("rope_type", scaling.get("type"))
    if arch == "phi3" and rope_type in ("su", "yarn"):  # HF's Phi3Config reads these as longrope
        rope_type = scaling["rope_type"] = "longrope"
    if rope_type == "longrope":
        # HF: a config's top-level original_max_position_embeddings wins (Phi-3 keeps it there).
        scaling["original_max_position_embeddings"] = int(
            hf.get("original_max_position_embeddings")
            or scaling.get("original_max_position_embeddings")
            or hf.get("max_position_embeddings", 2048))
    return {"rope_theta": float(theta),
            "rope_scaling": scaling if rope_type not in (None, "default") else None,
            "rope_local_base_freq": local_theta, "partial_rotary_factor": float(partial)}


def _read_windows(hf: dict[str, Any], arch: str) -> tuple[int | None, tuple[str, ...] | None]:
    """``sliding_window`` and ``layer_types`` as HF's config class of ``arch`` derives them."""
    sliding = hf.get("sliding_window")
    layers = int(hf["num_hidden_layers"])
    types = hf.get("layer_types")
    if arch == "llama":
        return None, None
    if arch in ("qwen2", "qwen3"):
        if not hf.get("use_sliding_window", False) or not sliding:
            return None, None
        first = int(hf.get("max_window_layers", 28))
        types = types or ["sliding_attention" if i >= first else "full_attention"
                          for i in range(layers)]
    elif arch == "gemma2":
        types = types or ["sliding_attention" if (i + 1) % 2 else "full_attention"
                          for i in range(layers)]
    elif arch == "gemma3":
        if hf.get("use_bidirectional_attention"):
            raise UnsupportedModelError(
                "use_bidirectional_attention must be false: kvflow runs causal decoders")
        pattern = int(hf.get("sliding_window_pattern", 6))
        types = types or ["sliding_attention" if (i + 1) % pattern else "full_attention"
                          for i in range(layers)]
    return (int(sliding) if sliding else None), (tuple(types) if types else None)
