"""benchmarks/random_checkpoints.py: the random checkpoints that benchmarks/model_sizes.py
writes load in kvflow as the shape they were written for, the GGUF and the safetensors folder
holding the same weights (to their 16-bit rounding), in the same layout (Q/K permutation)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from kvflow.model.loader import default_model_path, load_checkpoint

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "random_checkpoints.py"


def _module():
    spec = importlib.util.spec_from_file_location("random_checkpoints", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["random_checkpoints"] = module
    spec.loader.exec_module(module)
    return module


rc = _module()
# untied, unequal heads, a vocabulary padded past the tokenizer's 49152 tokens
SHAPE = rc.ModelShape("test-shape", hidden=128, layers=2, heads=4, kv_heads=2, ffn=256,
                      vocab=49216, tied=False, rope_theta=10000.0, context=1024)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    out = tmp_path_factory.mktemp("ckpt")
    # a shard limit smaller than the model: several shards and an index
    rc.write_checkpoints(SHAPE, default_model_path(), out / "m.gguf", out / "hf",
                         shard_bytes=4_000_000)
    return out / "m.gguf", out / "hf"


def _expected_config(config) -> None:
    assert config.architecture == "llama"
    assert (config.hidden_size, config.num_hidden_layers) == (SHAPE.hidden, SHAPE.layers)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert (config.intermediate_size, config.vocab_size) == (SHAPE.ffn, SHAPE.vocab)
    assert config.head_dim == 32
    assert config.tie_word_embeddings is False
    assert config.rope_theta == 10000.0
    assert config.max_position_embeddings == 1024
    assert config.eos_token_ids == (2,)


def test_gguf_loads_with_the_shape_and_a_padded_vocabulary(written: tuple[Path, Path]) -> None:
    from gguf import GGUFReader

    gguf, _ = written
    ckpt = load_checkpoint(str(gguf))
    _expected_config(ckpt.config)
    assert len(ckpt.state_dict) == len(SHAPE.tensors())
    for name, dims in SHAPE.tensors():
        assert tuple(ckpt.state_dict[name].shape) == dims, name
        assert bool(ckpt.state_dict[name].isfinite().all()), name
    assert float(ckpt.state_dict["model.norm.weight"].min()) == 1.0
    reader = GGUFReader(str(gguf))
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == SHAPE.vocab and tokens[-1] == f"[PAD{SHAPE.vocab - 1}]"
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    assert types["blk.0.attn_q.weight"] == "F16" and types["blk.0.attn_norm.weight"] == "F32"
    assert "output.weight" in types


def test_safetensors_folder_loads_the_same_weights(written: tuple[Path, Path]) -> None:
    gguf, hf = written
    shards = sorted(hf.glob("*.safetensors"))
    assert len(shards) > 1
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"]) == {name for name, _ in SHAPE.tensors()}
    per_shard = {f.name: [n for n, s in index["weight_map"].items() if s == f.name]
                 for f in shards}
    # at most the limit, unless one tensor alone is larger (the embedding: 12.6 MB)
    assert all(f.stat().st_size <= 4_000_000 + 4096 or len(per_shard[f.name]) == 1
               for f in shards)
    ckpt = load_checkpoint(str(hf))
    _expected_config(ckpt.config)
    from_gguf = load_checkpoint(str(gguf)).state_dict
    for name, dims in SHAPE.tensors():
        a, b = ckpt.state_dict[name].numpy(), from_gguf[name].numpy()
        assert a.shape == dims
        # bf16 and f16 roundings of the same values (weights ~ 0.02 * N(0, 1))
        np.testing.assert_allclose(a, b, atol=2e-3, err_msg=name)
    assert (hf / "tokenizer.json").is_file()
    assert float(np.abs(ckpt.state_dict["model.layers.0.self_attn.q_proj.weight"].numpy()).max()
                 ) < 0.2


def test_bf16_rounds_to_nearest_even() -> None:
    x = np.array([1.0, -2.5, 1.00390625, 1.01171875, 3.0e38], dtype=np.float32)
    bits = rc.to_bf16(x)
    back = (bits.astype(np.uint32) << 16).view(np.float32)
    # 1 + 2^-8 is a tie: to the even 1.0; 1 + 3*2^-8 ties up to 1 + 2^-6
    np.testing.assert_array_equal(back[:4], [1.0, -2.5, 1.0, 1.015625])
    assert np.isfinite(back[4])


def test_write_checkpoints_needs_an_output() -> None:
    with pytest.raises(ValueError, match="gguf_path or hf_dir"):
        rc.write_checkpoints(SHAPE, default_model_path())


def test_report_shows_figures_ratios_and_each_failure(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location(
        "model_sizes_report", SCRIPT.with_name("model_sizes_report.py"))
    assert spec is not None and spec.loader is not None
    report_mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report_mod)
    report = {"machine": {"cpu": "x", "cpus": 2, "cpu_flags": ["avx2"]}, "models": {
        "1b": {"checkpoint": {"params": 1_235_814_400, "q4_1_gguf_bytes": 891075936},
               "build": {"q4_1_gguf": {"wall_s": 60.0, "peak_rss_bytes": 15 << 30,
                                       "error": "killed by the benchmark at 15.00 GiB RSS",
                                       "tail": "exporting ONNX"}},
               "load": {"error": "no engine at e (run the build stage)"},
               "llamacpp": {"decode_tok_s": 20.0, "prefill_s": 10.0,
                            "peak_rss_bytes": 1 << 30},
               "served": {"llama.cpp": {"tok_s": 40.0}, "kvflow": {"tok_s": 50.0}}}}}
    report_mod.write_outputs(report, tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "60 / 15.00 (**failed**)" in text
    assert "1b build q4_1_gguf: killed by the benchmark at 15.00 GiB RSS" in text
    assert "1b load: no engine at e" in text
    assert "| 1.25x |" in text  # served 50 / 40
    assert (tmp_path / "model_sizes.png").stat().st_size > 0
