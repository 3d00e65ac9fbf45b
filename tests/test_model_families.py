"""Each model family kvflow runs, exact to HF transformers on the fp32 path.

For each family a tiny random-weight checkpoint is made offline with transformers and saved as a
HF folder; kvflow builds an engine from it (the streamed build, through the loader and its
weight-name transforms) and its greedy tokens equal HF's ``generate``, on the torch and the ONNX
Runtime runners. The windowed families (Mistral, Gemma 2/3) have prompts longer than their
windows; Gemma 3 mixes sliding and full layers with their two RoPE tables; Phi-3 is Phi-4-mini's
shape (longrope, partial rotary factor, fused linears).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvflow.model.config import ModelConfig, UnsupportedModelError  # noqa: E402
from kvflow.runtime import create_runner  # noqa: E402
from tests.conftest import save_byte_tokenizer  # noqa: E402
from tests.helpers import greedy_generate  # noqa: E402

VOCAB = 320
SHAPE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96,
         "max_position_embeddings": 256, "bos_token_id": 1, "eos_token_id": 2,
         "pad_token_id": 0}
rng = np.random.default_rng(45)

# name -> (HF class, config overrides). Each exercises what its family adds to the Llama layer.
FAMILIES: dict[str, tuple[str, dict]] = {
    # q/k per-head norms; head_dim * heads != hidden (as Qwen3-0.6B's).
    "qwen3": ("Qwen3ForCausalLM", {"num_hidden_layers": 2, "num_attention_heads": 4,
                                   "num_key_value_heads": 2, "head_dim": 32,
                                   "tie_word_embeddings": False}),
    # Sandwich norms, GeGLU, sqrt(hidden) embedding, query_pre_attn_scalar, both soft-caps
    # (small, so that tanh bends), alternating window 8 < the prompt.
    "gemma2": ("Gemma2ForCausalLM", {"num_hidden_layers": 3, "num_attention_heads": 4,
                                     "num_key_value_heads": 2, "head_dim": 16,
                                     "query_pre_attn_scalar": 24, "sliding_window": 8,
                                     "attn_logit_softcapping": 2.0,
                                     "final_logit_softcapping": 1.5,
                                     "tie_word_embeddings": False}),
    # Sliding layers (window 6, local theta) and full layers (global theta, linear scaling as
    # Gemma 3 4B's), q/k norms.
    "gemma3": ("Gemma3ForCausalLM", {
        "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 32, "query_pre_attn_scalar": 16, "sliding_window": 6,
        "layer_types": ["sliding_attention", "sliding_attention", "full_attention",
                        "sliding_attention"],
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}),
    # Phi-4-mini's shape: fused qkv / gate_up, longrope, 3/4 of each head rotated. The
    # sequence stays below original_max_position_embeddings: past it HF's generate re-rotates
    # the whole cache with the long factors, kvflow only the new tokens (kvflow/model/rope.py).
    "phi3": ("Phi3ForCausalLM", {
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 256, "original_max_position_embeddings": 40,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attention_dropout": 0.0,
        "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.75,
                            "short_factor": rng.uniform(1.0, 1.5, 6).round(3).tolist(),
                            "long_factor": rng.uniform(1.0, 8.0, 6).round(3).tolist()}}),
    # Llama 3.1/3.2's rope scaling.
    "llama3": ("LlamaForCausalLM", {
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 64}}),
    # Every layer windowed (7 < the prompt), no cap on the engine's length.
    "mistral": ("MistralForCausalLM", {"num_hidden_layers": 2, "num_attention_heads": 4,
                                       "num_key_value_heads": 1, "sliding_window": 7}),
}
PROMPT_LEN, NEW_TOKENS = 21, 12
RUNNERS = ("torch", "onnxruntime")
TOL = 1e-4  # fp32 weights, activations and KV cache
# The ONNX export makes an engine slow to build (seconds): the quick run (-m "not slow") builds
# the two families whose graphs differ most from Llama's, the full run every family's.
QUICK_ONNX = ("gemma3", "phi3")


def quick_unless_onnx(family: str, runner_name: str = "onnxruntime") -> tuple:
    """The slow marker for an ONNX engine the quick run does not build."""
    return () if runner_name != "onnxruntime" or family in QUICK_ONNX else (pytest.mark.slow,)


def make_family_model(name: str, folder: Path):
    """A random-weight HF model of family ``name`` saved to ``folder``; returns the model."""
    cls_name, overrides = FAMILIES[name]
    config_cls = getattr(transformers, cls_name.replace("ForCausalLM", "Config")
                         .replace("Gemma3Config", "Gemma3TextConfig"))
    config = config_cls(**{**SHAPE, **overrides})
    config.architectures = [cls_name]
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, cls_name)(config).eval()
    gemma = name.startswith("gemma")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith(("q_norm.weight", "k_norm.weight")) and not gemma:
                p.uniform_(0.3, 0.7)  # else Qwen3's attention is so sharp that tokens repeat
            elif n.endswith("norm.weight"):  # Gemma's norms multiply by 1 + w
                p.uniform_(-0.4, 0.4) if gemma else p.uniform_(0.6, 1.4)
            else:  # larger than the init, so that attention is not uniform
                # (a tied table predicts its own token: small, so that outputs vary)
                p.normal_(0.0, 0.03 if config.tie_word_embeddings and "embed" in n else 0.1)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    save_byte_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def family_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    made: dict[str, tuple[Path, object]] = {}

    def get(name: str) -> tuple[Path, object]:
        if name not in made:
            made[name] = (root / name, make_family_model(name, root / name))
        return made[name]

    return get


@pytest.fixture(scope="module")
def family_engines(family_models, tmp_path_factory):
    from kvflow.build.builder import build_engine

    root = tmp_path_factory.mktemp("family-engines")
    built: dict[tuple[str, str], Path] = {}

    def get(name: str, backend: str) -> Path:
        if (name, backend) not in built:
            path = root / f"{name}-{backend}"
            build_engine(str(family_models(name)[0]), path, backend=backend,
                         max_model_len=128, max_num_tokens=64, max_batch_size=4, block_size=4,
                         progress=lambda _msg: None)
            built[name, backend] = path
        return built[name, backend]

    return get


def hf_greedy(hf, prompt: list[int], new_tokens: int) -> tuple[list[int], np.ndarray]:
    """HF's own greedy ``generate`` (its cache, its masks), never stopping at an EOS: the
    tokens and each step's logits."""
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                      min_new_tokens=new_tokens, eos_token_id=None, pad_token_id=0,
                      output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(prompt):].tolist(), torch.cat(out.logits).numpy()


@pytest.mark.parametrize(("family", "runner_name"), [
    pytest.param(f, r, marks=quick_unless_onnx(f, r), id=f"{f}-{r}")
    for f in FAMILIES for r in RUNNERS])
def test_greedy_tokens_equal_hf_generate(family_models, family_engines, family, runner_name):
    _, hf = family_models(family)
    prompt = np.random.default_rng(len(family)).integers(3, VOCAB, PROMPT_LEN).tolist()
    want, want_logits = hf_greedy(hf, prompt, NEW_TOKENS)
    runner = create_runner(runner_name, family_engines(family, runner_name), 32,
                           kv_cache_dtype="fp32")
    try:
        got, logits = greedy_generate(runner, prompt, NEW_TOKENS)
        # Chunked prefill: chunks that start inside and beyond a window.
        chunked, _ = greedy_generate(runner, prompt, NEW_TOKENS, chunk=5)
    finally:
        runner.close()
    assert got == want
    assert chunked == want
    # The logits too: a final soft-cap (Gemma 2) is monotonic, so only they can show it.
    np.testing.assert_allclose(np.stack(logits), want_logits, atol=TOL, rtol=0)


@pytest.mark.parametrize("family", [pytest.param(f, marks=quick_unless_onnx(f))
                                    for f in FAMILIES])
def test_ort_rewrites_take_every_family_graph(family_engines, family):
    """The ONNX Runtime runner's fusions match the new graph shapes (q/k norms over
    [tokens, heads, head_dim], RoPE after them, partial and scaled RoPE, GeGLU in the last
    layer): nothing is left unfused, and the greedy test above shows them exact."""
    runner = create_runner("onnxruntime", family_engines(family, "onnxruntime"), 8)
    try:
        layers = runner.engine.model.num_hidden_layers
        for report in runner.fusions:
            assert report.skipped == {}, report.summary()
            assert report.applied["RotaryEmbedding"] == 2 * layers
            assert report.applied["logits_rows_early"] == 1
    finally:
        runner.close()


@pytest.mark.parametrize("family", ["gemma2", "gemma3", "mistral"])
def test_window_families_build_past_their_window(family_models, family_engines, family):
    """The engine's max_model_len is not capped at the window (it was, before windows ran)."""
    from kvflow.build.engine_config import EngineConfig

    engine = EngineConfig.load(family_engines(family, "torch"))
    assert engine.limits.max_model_len == 128
    assert max(engine.model.layer_sliding_windows()) < PROMPT_LEN
    expected = 7 if family == "mistral" else None  # only Mistral's window is every layer's
    assert engine.model.uniform_sliding_window == expected


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_round_trips_through_the_engine_config(family_models, family):
    folder, hf = family_models(family)
    cfg = ModelConfig.from_hf_config(json.loads((folder / "config.json").read_text()))
    assert ModelConfig.from_dict(json.loads(json.dumps(cfg.to_dict()))) == cfg
    assert cfg.architecture == {"llama3": "llama"}.get(family, family)


def test_longrope_tables_equal_hf_short_and_long():
    """Positions below original_max_position_embeddings rotate with the short factors, the
    rest with the long ones, both scaled by the attention factor, as HF's Phi-3 computes them
    for a forward pass that stays on one side."""
    from kvflow.model.rope import rope_cache

    config = transformers.Phi3Config(**{**SHAPE, **FAMILIES["phi3"][1]})
    cfg = ModelConfig.from_hf_config({**config.to_dict(), "architectures": ["Phi3ForCausalLM"]})
    assert cfg.rotary_dim == 12 and cfg.rope_type == "longrope"
    cos, sin = rope_cache(cfg, 128)
    rotary = transformers.models.phi3.modeling_phi3.Phi3RotaryEmbedding(config)
    x = torch.zeros(1, dtype=torch.float32)
    for positions in (torch.arange(0, 40), torch.arange(40, 128)):
        hf_cos, hf_sin = rotary(x, positions[None, :])
        torch.testing.assert_close(cos[positions], hf_cos[0], rtol=0, atol=0)
        torch.testing.assert_close(sin[positions], hf_sin[0], rtol=0, atol=0)


def test_gemma3_multimodal_config_reads_its_text_decoder():
    text = {"model_type": "gemma3_text", "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 6, "sliding_window": 16, "rope_theta": 1e6,
            "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0}}
    cfg = ModelConfig.from_hf_config({"architectures": ["Gemma3ForConditionalGeneration"],
                                      "text_config": text})
    assert cfg.architecture == "gemma3" and cfg.vocab_size == 262208 and cfg.head_dim == 256
    assert cfg.layer_sliding_windows() == (16, 16, 16, 16, 16, 0)  # HF's pattern of 6
    assert (cfg.rope_theta, cfg.rope_local_base_freq) == (1e6, 1e4)
    assert cfg.rope_scaling == {"rope_type": "linear", "factor": 8.0}
    assert cfg.embedding_multiplier == 8.0 and cfg.qk_norm and cfg.sandwich_norm


def test_generation_config_eos_ids_replace_the_configs():
    hf = {"architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "eos_token_id": 7}
    assert ModelConfig.from_hf_config(hf).eos_token_ids == (7,)
    both = ModelConfig.from_hf_config(hf, {"eos_token_id": [5, 7]})
    assert both.eos_token_ids == (5, 7)


def test_unknown_architecture_is_refused_with_the_list():
    with pytest.raises(UnsupportedModelError, match="Gemma2ForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_hf_config({"architectures": ["FalconForCausalLM"]})


@pytest.mark.parametrize("family", ["mistral", "gemma3"])
def test_the_engine_serves_window_families_as_hf(family_models, family_engines, family):
    """Through the engine: a batch of prompts, longer and shorter than the window, with
    chunked prefill, the KV manager releasing blocks past Mistral's window (every layer's), the
    pool's invariants checked every step: each greedy output equals HF's."""
    from kvflow import LLM, SamplingParams

    _, hf = family_models(family)
    prompts = [np.random.default_rng(n).integers(3, VOCAB, n).tolist() for n in (30, 9, 21)]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    with LLM(family_engines(family, "torch"), kv_cache_dtype="fp32", debug_checks=True,
             max_num_batched_tokens=16) as llm:
        if family == "mistral":
            assert llm.engine.kv.sliding_window == 7
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs, strict=True):
        assert list(out.outputs[0].token_ids) == hf_greedy(hf, prompt, NEW_TOKENS)[0]
