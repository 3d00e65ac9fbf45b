"""Each family read from a GGUF as llama.cpp's converter writes it (tests/gguf_convert.py) gives
what its HF folder gives: the same config, field by field; the same kvflow-named tensors (the
folder's through kvflow/model/weight_names.py); and an engine built from the GGUF generates
HF's greedy tokens (fp32)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from kvflow.model.checkpoint_tensors import GGUFTensors, hf_folder_config  # noqa: E402
from kvflow.model.weight_names import to_kvflow_names  # noqa: E402
from tests.conftest import BuiltOnFirstUse, save_byte_tokenizer  # noqa: E402
from tests.gguf_convert import convert  # noqa: E402

VOCAB = 259  # the byte-level tokenizer's 256 bytes + 3 specials: no padding rows
BASE = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
        "tie_word_embeddings": False}
# name -> (HF model class, its config class, config overrides)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    # head_dim 32 != hidden / heads: the GGUF's key_length must win.
    "qwen3": ("Qwen3ForCausalLM", "Qwen3Config", {"head_dim": 32}),
    "gemma2": ("Gemma2ForCausalLM", "Gemma2Config",
               {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
                "attn_logit_softcapping": 5.0, "final_logit_softcapping": 3.0,
                "tie_word_embeddings": True}),
    # Six layers: llama.cpp's pattern makes the sixth full, the others sliding; linear RoPE
    # scaling on the full layers, the local theta on the sliding ones.
    "gemma3": ("Gemma3ForCausalLM", "Gemma3TextConfig",
               {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 6,
                "num_hidden_layers": 6, "tie_word_embeddings": True,
                "rope_parameters": {
                    "full_attention": {"rope_type": "linear", "factor": 2.0,
                                       "rope_theta": 1_000_000.0},
                    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}}),
    # Phi-4-mini's shape: partial rotary (12 of 16 dims), longrope from position 32.
    "phi3": ("Phi3ForCausalLM", "Phi3Config",
             {"partial_rotary_factor": 0.75, "original_max_position_embeddings": 32,
              "max_position_embeddings": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
              "rope_parameters": {"rope_type": "longrope", "rope_theta": 10000.0,
                                  "partial_rotary_factor": 0.75,
                                  "original_max_position_embeddings": 32,
                                  "short_factor": [1.0, 1.25, 1.5, 2.0, 2.5, 3.0],
                                  "long_factor": [1.5, 2.0, 4.0, 8.0, 16.0, 32.0]}}),
    "llama3": ("LlamaForCausalLM", "LlamaConfig",
               {"num_attention_heads": 8, "rope_parameters": {
                   "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192}}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", {"tie_word_embeddings": True}),
}


def make_family_model(name: str, folder: Path):
    """A random-weight HF model of family ``name`` saved in ``folder``, with a byte-level BPE
    tokenizer (tests/conftest.py's, whose vocabulary is the model's)."""
    cls_name, config_name, overrides = FAMILIES[name]
    config = getattr(transformers, config_name)(**{**BASE, **overrides})
    config.architectures = [cls_name]
    torch.manual_seed(sum(map(ord, name)))
    model = getattr(transformers, cls_name)(config).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.normal_(0.0, 0.08)
            if "norm" in n:  # Gemma's norms are 1 + w: both forms stay away from 0
                p.uniform_(-0.4, 0.4) if name.startswith("gemma") else p.uniform_(0.6, 1.4)
    folder.mkdir(parents=True)
    model.save_pretrained(folder, safe_serialization=True)
    save_byte_tokenizer(folder)
    return model


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """name -> (HF folder, HF model, F32 GGUF, Q8_0 GGUF), each made when first read."""
    root = tmp_path_factory.mktemp("families")

    def make(name: str):
        folder = root / name
        model = make_family_model(name, folder)
        return (folder, model, convert(folder, root / f"{name}.f32.gguf"),
                convert(folder, root / f"{name}.q8_0.gguf", "Q8_0"))

    return BuiltOnFirstUse(FAMILIES, make)


def _gguf(path: Path) -> GGUFTensors:
    return GGUFTensors(path, lambda _out: None)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gguf_config_equals_the_hf_folders(families, name):
    folder, _, f32, _ = families[name]
    got, want = _gguf(f32).config.to_dict(), hf_folder_config(folder).to_dict()
    assert list(got) == list(want)
    for field, value in want.items():
        assert got[field] == value, field


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_gguf_tensors_equal_the_hf_folders_in_kvflow_names(families, name):
    """F32 GGUF == HF folder (streamed, kvflow names) == the HF model's state dict through
    to_kvflow_names, bit for bit; rows of a fused tensor read alone equal the whole's."""
    from kvflow.model.loader import open_checkpoint

    folder, model, f32, _ = families[name]
    gguf, hf = _gguf(f32), open_checkpoint(str(folder))
    memory = dict(to_kvflow_names(hf.config, model.state_dict().items()))
    tied = hf.config.tie_word_embeddings
    assert set(gguf.names()) - {"lm_head.weight"} == set(hf.names()) - {"lm_head.weight"}
    assert set(hf.names()) <= set(memory)
    assert not [n for n in gguf.names() if "qkv_proj" in n or "gate_up_proj" in n]
    for n in hf.names():
        if tied and n == "lm_head.weight":
            continue
        assert gguf.shape(n) == hf.shape(n), n
        np.testing.assert_array_equal(gguf.fp32(n), hf.fp32(n), err_msg=n)
        np.testing.assert_array_equal(hf.fp32(n), memory[n].numpy(), err_msg=n)
        if len(hf.shape(n)) == 2:
            np.testing.assert_array_equal(gguf.fp32_rows(n, 3, 9), hf.fp32(n)[3:9], err_msg=n)
            np.testing.assert_array_equal(hf.fp32_rows(n, 3, 9), hf.fp32(n)[3:9], err_msg=n)


@pytest.mark.parametrize("name", ["phi3", "llama3", "gemma3"])
def test_q8_0_gguf_keeps_each_parts_blocks(families, name):
    """A Q8_0 file: each kvflow weight's blocks (rows of a fused tensor, unpermuted rows) are
    the ones its fp32 values decode from, and close to the HF values."""
    from kvflow.model.loader import open_checkpoint
    from kvflow.model.quant import dequantize

    folder, _, _, q8 = families[name]
    gguf = _gguf(q8)
    ref = open_checkpoint(str(folder))
    for n in gguf.names():
        q = gguf.quantized(n)
        if len(gguf.shape(n)) != 2:
            assert q is None
            continue
        assert q is not None and q.shape == gguf.shape(n), n
        np.testing.assert_array_equal(dequantize(q), gguf.fp32(n), err_msg=n)
        np.testing.assert_array_equal(dequantize(gguf.quantized_columns(n, 32, 64)),
                                      gguf.fp32(n)[:, 32:64], err_msg=n)
        if n != "lm_head.weight" or not ref.config.tie_word_embeddings:
            np.testing.assert_allclose(gguf.fp32(n), ref.fp32(n), atol=2e-3, rtol=0, err_msg=n)


# --- engines built from the GGUFs ---------------------------------------------------------
LIMITS = {"max_model_len": 128, "max_num_tokens": 64, "max_batch_size": 4, "block_size": 4}
# Windows of 6 < the prompt. Phi-3's sequence stays below its original length (32): past it,
# HF's generate drops its cache and re-rotates every key with the long factors, where kvflow
# keeps each key as rotated at its position (kvflow/model/rope.py).
PROMPT_LEN, NEW_TOKENS = 21, 11


@pytest.mark.parametrize(("name", "backend"), [
    *[(n, "torch") for n in sorted(FAMILIES)], ("phi3", "onnxruntime"),
    ("gemma2", "onnxruntime")])
def test_gguf_engine_generates_hf_greedy_tokens(families, tmp_path, name, backend):
    """The streamed build of the F32 GGUF (its tokenizer converted by transformers): greedy
    tokens and logits equal HF's ``generate`` on the folder's model."""
    from kvflow.build.builder import build_engine
    from kvflow.runtime import create_runner
    from tests.helpers import greedy_generate
    from tests.test_model_families import hf_greedy

    _, model, f32, _ = families[name]
    build_engine(str(f32), tmp_path / "e", backend=backend, progress=lambda _m: None, **LIMITS)
    prompt = np.random.default_rng(len(name)).integers(3, VOCAB, PROMPT_LEN).tolist()
    want, want_logits = hf_greedy(model, prompt, NEW_TOKENS)
    runner = create_runner(backend, tmp_path / "e", 32, kv_cache_dtype="fp32")
    try:
        got, logits = greedy_generate(runner, prompt, NEW_TOKENS)
    finally:
        runner.close()
    assert got == want
    np.testing.assert_allclose(np.stack(logits), want_logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["phi3", "gemma2"])
def test_q8_0_gguf_streamed_engine_equals_the_in_memory_build(families, tmp_path, name):
    """Blocks cut from Phi-3's fused tensors and Gemma's +1 norms, streamed into the ONNX
    engine: the bytes the in-memory build writes."""
    from kvflow.build.builder import build_engine
    from tests.test_build_stream import LIMITS as STREAM_LIMITS
    from tests.test_build_stream import assert_same_engine, reference_engine

    q8 = families[name][3]
    build_engine(str(q8), tmp_path / "s", progress=lambda _m: None, **STREAM_LIMITS)
    reference_engine(str(q8), tmp_path / "r")
    assert_same_engine(tmp_path / "s", tmp_path / "r")
    config = json.loads((tmp_path / "s" / "engine_config.json").read_text())
    assert "Q8_0" in config["quantization"]


LLAMA_CPP = Path(os.environ.get("KVFLOW_LLAMA_CPP_SRC",
                                Path(__file__).parent.parent / "reports/peers/llama.cpp/src"))


@pytest.mark.skipif(not (LLAMA_CPP / "convert_hf_to_gguf.py").is_file(),
                    reason="no llama.cpp checkout (KVFLOW_LLAMA_CPP_SRC)")
@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_test_converter_writes_what_llama_cpps_converter_writes(families, tmp_path, name):
    """llama.cpp's convert_hf_to_gguf.py itself (vocabulary aside) writes the same metadata and
    the same tensors as tests/gguf_convert.py, and kvflow reads the HF folder's config from
    it."""
    import subprocess
    import sys

    from gguf import GGUFReader

    folder, _, ours, _ = families[name]
    real = tmp_path / "real.gguf"
    subprocess.run([sys.executable, str(Path(__file__).parent / "llama_cpp_convert.py"),
                    str(LLAMA_CPP), str(folder), str(real)], check=True, capture_output=True)
    a, b = GGUFReader(str(real)), GGUFReader(str(ours))

    def meta(r: GGUFReader) -> dict:
        return {k: f.contents() for k, f in r.fields.items()
                if not k.startswith(("general.", "tokenizer.", "GGUF."))}

    assert meta(a) == meta(b)
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for x, y in zip(a.tensors, b.tensors, strict=True):
        assert x.tensor_type == y.tensor_type, x.name
        np.testing.assert_array_equal(np.asarray(x.data), np.asarray(y.data), err_msg=x.name)
    assert _gguf(real).config == hf_folder_config(folder)
