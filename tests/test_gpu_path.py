"""The GPU path where this machine can check it: the fp16/bf16 export TensorRT parses, the
optimization profile, and (on a GPU with TensorRT) the TensorRT engine against ONNX Runtime.

The Triton kernels and the Triton runner are in test_triton_kernels.py (interpreter on CPU).
The TensorRT code is type-checked against tensorrt-stubs by `make typecheck`.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import onnx  # noqa: E402

from kvflow.build.builder import tensorrt_available  # noqa: E402
from kvflow.build.engine_config import BuildLimits  # noqa: E402
from kvflow.build.export import export_onnx  # noqa: E402
from kvflow.model.config import ModelConfig  # noqa: E402
from kvflow.model.llama import LlamaForCausalLM  # noqa: E402
from kvflow.plugins.torch_op import ONNX_DOMAIN, ONNX_OP_TYPE  # noqa: E402

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, eos_token_ids=(2,))


@pytest.mark.slow
@pytest.mark.parametrize(("dtype", "onnx_type"), [(torch.float16, onnx.TensorProto.FLOAT16),
                                                  (torch.bfloat16, onnx.TensorProto.BFLOAT16)])
def test_half_precision_export_is_valid_and_typed_for_a_strongly_typed_network(
        tmp_path, dtype, onnx_type):
    net = LlamaForCausalLM(TINY, 16, 256).to(dtype).eval()
    graph = export_onnx(net, 16, tmp_path / "model.onnx")
    onnx.checker.check_model(str(tmp_path / "model.onnx"))
    typed = onnx.shape_inference.infer_shapes(onnx.load(str(tmp_path / "model.onnx")))
    types = {v.name: v.type.tensor_type.elem_type
             for v in [*typed.graph.value_info, *typed.graph.output]}
    nodes = [n for n in graph.graph.node if (n.domain, n.op_type) == (ONNX_DOMAIN, ONNX_OP_TYPE)]
    assert len(nodes) == TINY.num_hidden_layers
    # TensorRT's strongly typed network keeps these types: the plugin gets half precision.
    assert all(types[n.input[0]] == onnx_type for n in nodes)
    assert types["logits"] == onnx.TensorProto.FLOAT  # the contract: fp32 logits


def test_optimization_profile_spans_the_build_limits():
    from kvflow.build.profile import profile_shapes

    shapes = profile_shapes(BuildLimits(1024, 512, 32, 16), TINY)
    assert shapes["input_ids"] == ((1,), (16,), (512,))
    assert shapes["block_tables"] == ((1, 1), (16, 32), (32, 64))
    assert shapes["query_start_loc"][2] == (33,)
    assert shapes["kv_cache_ptrs"][0] == (2, 2)
    for lo, opt, hi in shapes.values():
        assert all(a <= b <= c for a, b, c in zip(lo, opt, hi, strict=True))


@pytest.mark.skipif(tensorrt_available() is not None,
                    reason=f"TensorRT engine test: {tensorrt_available()}")
def test_tensorrt_engine_matches_onnx_runtime(tiny_models, tmp_path):  # pragma: no cover
    import numpy as np

    from kvflow import LLM, SamplingParams
    from kvflow.build.builder import build_engine

    folder = tiny_models["llama-gqa4"][0]
    engines = {}
    for backend in ("onnxruntime", "tensorrt"):
        engines[backend] = tmp_path / backend
        build_engine(str(folder), engines[backend], backend=backend,
                     dtype="float32" if backend == "onnxruntime" else "float16",
                     max_model_len=256, max_num_tokens=256, max_batch_size=16, block_size=16,
                     progress=lambda _m: None)
    prompts = [[5, 9, 13, 2, 7], list(range(3, 40))]
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2)
    outs = {b: LLM(e).generate(prompts, params) for b, e in engines.items()}
    for ref, got in zip(outs["onnxruntime"], outs["tensorrt"], strict=True):
        first_ref, first_got = ref.logprobs[0], got.logprobs[0]
        assert max(first_got, key=first_got.get) == max(first_ref, key=first_ref.get)
        common = first_ref.keys() & first_got.keys()
        np.testing.assert_allclose([first_got[t] for t in common],
                                   [first_ref[t] for t in common], atol=5e-2)


@pytest.mark.slow
def test_gpu_check_script_runs_every_part_in_a_dry_run(tmp_path):
    """benchmarks/gpu_check.py at toy sizes on the CPU, so that the script the next GPU session
    runs is known to work end to end (its figures here mean nothing)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", reason="OpenAI Triton is not installed")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, str(script), "--dry-run", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = json.loads(out.read_text())
    for part in ("kernels", "bandwidth", "runner", "tensorrt"):
        assert results[f"{part} check"].startswith("ok"), results[f"{part} check"]
    assert results["kernel float16 max rel error"] < results["kernel float16 bound"]
    assert results["1B graphs vs eager max rel logit diff"] < 1e-4
    assert "TensorRT" in results


def test_enforce_eager_reaches_the_engine_plan(tiny_engines):
    """``--enforce-eager`` becomes the engine option ``cuda_graphs=False``; unset, the runner
    decides (graphs on a CUDA device)."""
    from kvflow.cli import make_parser
    from kvflow.orchestrator.llm import plan_engine
    from kvflow.orchestrator.options import engine_overrides

    engine = tiny_engines["llama-gqa4", "torch"]
    parser = make_parser()
    args = parser.parse_args(["serve", "--engine", str(engine), "--enforce-eager"])
    assert plan_engine(engine, **engine_overrides(args)).cuda_graphs is False
    args = parser.parse_args(["serve", "--engine", str(engine)])
    assert plan_engine(engine, **engine_overrides(args)).cuda_graphs is None


def test_tensorrt_plugin_signatures_survive_trtp_validation():
    """``tensorrt.plugin`` checks the registered functions with ``issubclass`` on their raw
    annotations (``inspect.signature``, strings not evaluated): a ``from __future__ import
    annotations`` or a ``tuple[Tensor, ...]`` would make importing the plugin fail on a GPU.
    TensorRT is not installable here, so the source is checked for both."""
    import ast
    from pathlib import Path

    import kvflow.plugins

    source = Path(kvflow.plugins.__file__).parent / "tensorrt_plugin.py"
    tree = ast.parse(source.read_text())
    futures = [a.name for node in tree.body if isinstance(node, ast.ImportFrom)
               and node.module == "__future__" for a in node.names]
    assert "annotations" not in futures
    decorated = {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)
                 and any("trtp" in ast.unparse(d) for d in node.decorator_list)}
    assert set(decorated) == {"paged_attention_desc", "paged_attention_impl"}
    impl = decorated["paged_attention_impl"]
    impl_args = {a.arg: ast.unparse(a.annotation) for a in impl.args.args}
    assert impl_args["outputs"] == "tuple[trtp.Tensor]"
    assert impl_args["stream"] == "int"
    assert list(impl_args)[-2:] == ["outputs", "stream"]


@pytest.mark.slow
def test_kernels_compile_for_hopper_without_a_gpu(tmp_path):
    """Every launch the runners make, compiled for sm_90 by the triton wheel's own ptxas:
    what the interpreter cannot check (tl.dot's minimum sizes, shared memory per block)."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton", reason="OpenAI Triton is not installed")
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "kernel_resources.py"
    out = tmp_path / "kernel_resources.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # compiled here, not recalled
    proc = subprocess.run([sys.executable, str(script), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    launches = json.loads(out.read_text())["launches"]
    assert len(launches) == 2 * 2 * 5  # shapes x dtypes x (3 attention, KV write, merge)
    assert all("error" not in row and row["shared"] <= 232448 for row in launches)
    # K/V tiles stream with 16-byte copies: the decode kernel stays bandwidth-capable.
    decode = next(r for r in launches if r["launch"] == "Llama-3-8B bf16 decode: attention")
    assert decode["vec16"] > 0 and decode["stack"] == 0
