"""kvflow::MatMulQ against ORT's fp32 MatMul and MatMulNBits (accuracy level 4, int8
activations) on the default model's (SmolLM2-135M) matmul shapes, one intra-op thread: the best
of ``--repeat`` runs, in microseconds. The machine's load shows in the figures: say how busy it
was when quoting them.

    python benchmarks/matmul_q.py [--rows 1 8 32] [--repeat 30]
    python benchmarks/matmul_q.py --engine engines/smollm2-135m   # a batch-1 decode step

With ``--engine``: the engine's whole decode step at batch 1 (a 64-token context) in one ORT
session with the native PagedAttention op, one thread, its matmuls three ways: fp32 weights,
MatMulNBits (int8 activations) and ``kvflow::MatMulQ`` (``fuse_for_ort(native_matmul=True)``).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from kvflow.plugins import ort_custom_ops
from kvflow.runtime.ort_graph_linear import pack_blocks

# (name, K, N, bits): Q/K/V merged (576 + 2 * 192), o, gate/up merged, down, the Q8_0 head.
SHAPES = [("qkv", 576, 960, 4), ("o", 576, 576, 4), ("gate_up", 576, 3072, 4),
          ("down", 1536, 576, 4), ("head", 576, 49152, 8)]
BLOCK = 32


def _model(node: onnx.NodeProto, k: int, n: int, inits: list, domain: str) -> bytes:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["M", k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["M", n])], inits)
    return helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(domain, 1)]).SerializeToString()


def models(k: int, n: int, bits: int, rng: np.random.Generator) -> dict[str, bytes]:
    """The three forms of one [K, N] matmul, with random weights."""
    nb = k // BLOCK
    scale = (rng.uniform(0.5, 2, (nb, n)) * 0.01).astype(np.float16).astype(np.float32)
    if bits == 4:
        codes = rng.integers(0, 16, (k, n)).astype(np.uint8)
        minimum = (-8 * scale).astype(np.float32)
    else:
        codes = rng.integers(-127, 128, (k, n)).astype(np.int8)
        minimum = None
    packed = pack_blocks(codes, scale, minimum)
    assert packed is not None  # fp16 scales
    native = helper.make_node("MatMulQ", ["x", "w"], ["y"], domain="kvflow", bits=bits, K=k, N=n)
    nbits_codes = rng.integers(0, 256, (n, nb, BLOCK * bits // 8), dtype=np.uint8)
    nbits = helper.make_node("MatMulNBits", ["x", "B", "S"], ["y"], domain="com.microsoft",
                             K=k, N=n, bits=bits, block_size=BLOCK, accuracy_level=4)
    fp32 = helper.make_node("MatMul", ["x", "W"], ["y"])
    return {
        "fp32": _model(fp32, k, n, [numpy_helper.from_array(
            rng.standard_normal((k, n)).astype(np.float32), "W")], "ai.onnx.ml"),
        "nbits_l4": _model(nbits, k, n, [numpy_helper.from_array(nbits_codes, "B"),
                                         numpy_helper.from_array(scale.T.ravel().copy(), "S")],
                           "com.microsoft"),
        "matmul_q": _model(native, k, n, [numpy_helper.from_array(packed, "w")], "kvflow"),
    }


def time_us(model: bytes, x: np.ndarray, repeat: int) -> float:
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 1
    opts.register_custom_ops_library(str(ort_custom_ops.library()))
    session = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    session.run(None, {"x": x})
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        session.run(None, {"x": x})
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def _time_step(session, kv, pool, tokens: list[int], start: int) -> float:
    """Seconds for one step of sequence "a" (``tokens[start:]`` new; a decode when one)."""
    from kvflow.runtime.step_builder import SeqChunk, build_step

    n = len(tokens) - start
    assert kv.allocate_slots("a", start + n)
    s = build_step(kv, [SeqChunk("a", tokens, start, n, True)])
    t0 = time.perf_counter()
    session.run({"input_ids": s.input_ids, "positions": s.positions, "kv_cache_ptrs": pool.ptrs,
                 "slot_mapping": s.slot_mapping, "block_tables": s.block_tables,
                 "seq_lens": s.seq_lens, "query_start_loc": s.query_start_loc,
                 "logits_indices": s.logits_indices}, "logits")
    return time.perf_counter() - t0


def decode_step_ms(engine_dir: str, repeat: int) -> None:
    """Print the median and best ms of a batch-1 decode step, each matmul path."""
    from onnx import helper as onnx_helper

    from kvflow.build.engine_config import EngineConfig
    from kvflow.kv_manager import KVCacheManager
    from kvflow.runtime.kv_cache import HostKVPool
    from kvflow.runtime.ort_graph import fuse_for_ort
    from kvflow.runtime.ort_sessions import OneSession, attention_nodes, session_options

    engine = EngineConfig.load(engine_dir)
    m, block = engine.model, engine.limits.block_size
    exported = onnx.load(f"{engine_dir}/model.onnx")
    tokens = np.random.default_rng(0).integers(3, 1000, size=65).tolist()
    for label, int8, native in (("fp32", False, False), ("matmulnbits_l4", True, False),
                                ("matmul_q", False, True)):
        model, report = fuse_for_ort(exported, fp32_matmul=not int8 and not native,
                                     native_matmul=native)
        for node in attention_nodes(model):
            node.attribute.extend([onnx_helper.make_attribute("kv_dtype", 0),
                                   onnx_helper.make_attribute("num_blocks", 64)])
        session = OneSession(model, session_options(1, False, int8, ort_custom_ops.library()))
        pool = HostKVPool(m.num_hidden_layers, 64, block, m.num_key_value_heads, m.head_dim)
        kv = KVCacheManager(64, block)
        try:
            _time_step(session, kv, pool, tokens[:64], 0)
            times = sorted(_time_step(session, kv, pool, tokens, 64) for _ in range(repeat))
        finally:
            pool.close()
        print(f"{label:<15} decode step {1e3 * times[len(times) // 2]:6.2f} ms median, "
              f"{1e3 * times[0]:6.2f} best ({report.summary()})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeat", type=int, default=30)
    parser.add_argument("--engine", help="time this engine's batch-1 decode step instead")
    args = parser.parse_args()
    if ort_custom_ops.library() is None:
        raise SystemExit(f"no native op library: {ort_custom_ops.unavailable_reason()}")
    if args.engine:
        decode_step_ms(args.engine, args.repeat)
        return
    rng = np.random.default_rng(0)
    print(f"{'matmul':<8} {'K x N':>12} {'M':>3} {'fp32 us':>9} {'nbits_l4 us':>12} "
          f"{'matmul_q us':>12}")
    for name, k, n, bits in SHAPES:
        forms = models(k, n, bits, rng)
        for m in args.rows:
            x = rng.standard_normal((m, k)).astype(np.float32)
            t = {form: time_us(model, x, args.repeat) for form, model in forms.items()}
            print(f"{name:<8} {f'{k}x{n}':>12} {m:>3} {t['fp32']:>9.0f} {t['nbits_l4']:>12.0f} "
                  f"{t['matmul_q']:>12.0f}")


if __name__ == "__main__":
    main()
