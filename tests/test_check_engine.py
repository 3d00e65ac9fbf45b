"""``kvflow check-engine`` and ``build_report.json``: an engine against its references with
Polygraphy's Comparator, and every CPU build's Polygraphy inspection."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from kvflow.cli import main as kvflow_main

pytest.importorskip("torch")
pytest.importorskip("polygraphy")

import onnx  # noqa: E402
from onnx import numpy_helper  # noqa: E402

from kvflow.build.check_engine import check_engine, record_steps  # noqa: E402
from kvflow.build.engine_config import EngineConfig  # noqa: E402
from kvflow.build.export import save_graph  # noqa: E402

MODEL = "llama-gqa4"


def corrupt_weights(engine_dir, out):
    """A copy of ``engine_dir`` whose second layer's o_proj weight is negated."""
    shutil.copytree(engine_dir, out)
    model = onnx.load(str(out / "model.onnx"))
    (init,) = [t for t in model.graph.initializer if "layers.1" in t.name and "o_proj" in t.name]
    init.CopyFrom(numpy_helper.from_array(-numpy_helper.to_array(init), init.name))
    save_graph(model, out / "model.onnx")
    return out


def test_recorded_steps_are_a_prefill_then_a_decode_of_the_same_sequences(tiny_engines):
    engine = EngineConfig.load(tiny_engines[MODEL, "onnxruntime"])
    (prefill, decode), num_blocks = record_steps(engine)
    assert (prefill.name, decode.name) == ("prefill", "decode")
    assert prefill.step.num_seqs == decode.step.num_seqs == 4
    assert prefill.step.max_query_len > engine.limits.block_size  # crosses block boundaries
    assert decode.step.is_decode
    np.testing.assert_array_equal(decode.step.positions, prefill.step.seq_lens)
    used = {int(b) for b in decode.step.block_tables.ravel()} - {0}
    assert max(used) < num_blocks


def test_a_cpu_engine_matches_the_pytorch_reference_on_its_checkpoint(tiny_models, tiny_engines,
                                                                      capsys, tmp_path):
    engine = tiny_engines[MODEL, "onnxruntime"]
    report_path = tmp_path / "check.json"
    rc = kvflow_main(["check-engine", str(engine), "--model", str(tiny_models[MODEL][0]),
                      "--report", str(report_path), "--plot-dir", str(tmp_path / "plots")])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "passed: 2 outputs within tolerance" in out
    report = json.loads(report_path.read_text())
    assert report["passed"] and [r["step"] for r in report["results"]] == ["prefill", "decode"]
    assert report["tolerance"]["why"] == "fp16 KV cache"  # the onnxruntime runner's default
    assert (tmp_path / "plots" / "decode" / "error_metrics_logits.png").stat().st_size > 0


def test_an_engine_with_corrupted_weights_fails_and_names_the_first_output(
        tiny_models, tiny_engines, capsys, tmp_path):
    bad = corrupt_weights(tiny_engines[MODEL, "onnxruntime"], tmp_path / "bad")
    rc = kvflow_main(["check-engine", str(bad), "--model", str(tiny_models[MODEL][0]),
                      "--steps", "decode,prefill"])
    out = capsys.readouterr().out
    assert rc == 1
    assert "FAILED: step 'prefill', output 'logits' differs from the reference" in out
    # The engine's own graph on exact ONNX Runtime reads the same corrupted weights: the
    # onnxruntime reference checks arithmetic, not weights.
    assert check_engine(bad, reference="onnxruntime").passed


def test_decode_alone_is_compared_after_an_uncompared_prefill(tiny_models, tiny_engines):
    report = check_engine(tiny_engines[MODEL, "onnxruntime"], steps=["decode"],
                          model=str(tiny_models[MODEL][0]), quantized_matmul="fp32",
                          kv_cache_dtype="fp32")
    assert [r.step for r in report.results] == ["decode"]
    assert report.passed and report.tolerance.why == "fp32 throughout"
    assert report.results[0].max_abs < report.tolerance.atol


def test_bad_arguments_are_refused_by_name(tiny_models, tiny_engines, tmp_path):
    engine = tiny_engines[MODEL, "onnxruntime"]
    with pytest.raises(ValueError, match=r"--steps must name some of \('prefill', 'decode'\)"):
        check_engine(engine, steps=["warmup"])
    with pytest.raises(ValueError, match="--model: the engine was built from"):
        check_engine(engine)  # a tiny model's engine: its checkpoint must be named
    with pytest.raises(ValueError, match="not the checkpoint this engine was built from"):
        check_engine(engine, model=str(tiny_models["llama-mha-tied"][0]))


@pytest.mark.slow
def test_check_engine_passes_on_the_default_cpu_engine(default_engines, capsys):
    rc = kvflow_main(["check-engine", str(default_engines["onnxruntime"])])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "int8 activations" in out  # the default engine is quantized; auto decodes in int8


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_every_cpu_build_writes_a_polygraphy_report(tiny_engines, backend):
    engine = tiny_engines[MODEL, backend]
    report = json.loads((engine / "build_report.json").read_text())
    assert EngineConfig.load(engine).files["report"] == "build_report.json"
    cfg = EngineConfig.load(engine).model
    assert report["profile"]["block_tables"]["max"] == [16, 64]  # max_batch_size x 256/4
    if backend == "torch":
        assert report["torch"]["num_weights"] > 0
        return
    graph = onnx.load(str(engine / "model.onnx"), load_external_data=False).graph
    plugins = [n for n in graph.node if (n.domain, n.op_type) == ("kvflow", "PagedAttention")]
    assert report["onnx"]["num_layers"] == len(graph.node)
    assert report["onnx"]["num_plugins"] == len(plugins) == cfg.num_hidden_layers
    assert sum(report["onnx"]["layer_types"].values()) == len(graph.node)
    assert report["onnx"]["inputs"]["block_tables"] == {"dtype": "int32",
                                                       "shape": ["num_seqs", "max_blocks"]}
    assert report["onnx"]["outputs"]["logits"]["shape"] == ["num_logits", cfg.vocab_size]
    assert "---- 8 Graph Input(s) ----" in report["onnx"]["summary"]


@pytest.mark.slow
def test_a_half_precision_graph_cast_up_matches_the_reference_on_its_rounded_weights(
        tiny_models, tmp_path):
    """The onnxruntime reference of a TensorRT engine, on the CPU: the engine's fp16 graph cast
    up to fp32 computes what the PyTorch model computes on the fp16-rounded weights."""
    import dataclasses

    import torch
    from safetensors.torch import load_file

    from kvflow.build.builder import build_engine
    from kvflow.build.check_reference import reference_runner
    from kvflow.build.export import export_onnx
    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.runtime.torch_runner import TorchRunner

    folder = tiny_models[MODEL][0]
    ref_engine = build_engine(str(folder), tmp_path / "fp32", backend="torch",
                              max_model_len=256, max_num_tokens=256, max_batch_size=16,
                              block_size=4, progress=lambda _m: None)
    half_dir = tmp_path / "fp16"
    half_dir.mkdir()
    net = LlamaForCausalLM(ref_engine.model, 4, 256)
    net.load_hf_state_dict(load_file(str(tmp_path / "fp32" / "weights.safetensors")))
    export_onnx(net.to(torch.float16).eval(), 4, half_dir / "model.onnx")
    half = dataclasses.replace(ref_engine, backend="tensorrt", dtype="float16",
                               files={"onnx": "model.onnx", "onnx_data": "model.onnx.data"})
    half.save(half_dir)
    steps, num_blocks = record_steps(half)
    rounded = net.float().eval()  # the fp16-rounded weights, in fp32
    with reference_runner("onnxruntime", half_dir, half, num_blocks, None, tmp_path) as ort, \
            TorchRunner(half_dir, half, num_blocks, model=rounded) as ref:
        for recorded in steps:
            np.testing.assert_allclose(ort.execute(recorded.step), ref.execute(recorded.step),
                                       atol=1e-3, rtol=1e-3)
