"""PagedAttention on the CPU: the numba kernel against the native ORT op, one layer's call.

SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16) on random data
(:func:`random_step`: blocks scattered over the pool), fp32 and fp16 pools. Each figure is the
best of ``--reps`` calls: wall milliseconds and the process's CPU milliseconds (on a busy
machine the second is the steadier). ORT runs one node in a session of 1 or 2 intra-op threads,
so its figures include ``InferenceSession.run``'s own cost (tens of microseconds).

    python benchmarks/attention_kernel.py [--cases decode-b1 prefill-2048-on-2048 ...]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import numpy as np
import onnxruntime as ort
import torch

from kvflow.plugins import kv_registry, ort_custom_ops
from kvflow.plugins.paged_attention_native import paged_attention_native
from kvflow.plugins.paged_attention_ref import random_step

HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE = 9, 3, 64, 16
CASES = {  # name: (cached tokens, new tokens) per sequence
    "decode-b1-ctx512": [(511, 1)],
    "decode-b1-ctx4096": [(4095, 1)],
    "decode-b32-ctx768": [(767, 1)] * 32,
    "prefill-2048-on-0": [(0, 2048)],
    "prefill-2048-on-2048": [(2048, 2048)],
}


def best_ms(fn: Callable[[], object], reps: int) -> str:
    fn()
    wall, cpu = [], []
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        wall.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return f"{min(wall) * 1e3:8.2f} ({min(cpu) * 1e3:7.2f} cpu)"


def run_case(seqs: list[tuple[int, int]], reps: int, lib: str) -> list[str]:
    case = random_step(seqs, HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, torch.float32,
                       torch.Generator().manual_seed(0))
    t = case["q"].shape[0]
    q, k, v = (case[x].reshape(t, -1).numpy() for x in ("q", "k", "v"))
    rest = {x: case[x].numpy() for x in ("slot_mapping", "block_tables", "seq_lens",
                                         "query_start_loc")}
    row = []
    for dtype, code in ((np.float32, 0), (np.float16, 1)):
        k_pool = np.ascontiguousarray(case["k_cache"].numpy().astype(dtype))
        v_pool = np.ascontiguousarray(case["v_cache"].numpy().astype(dtype))
        ptrs = np.array([[k_pool.ctypes.data, v_pool.ctypes.data]], np.int64)
        kv_registry.register(k_pool)
        kv_registry.register(v_pool)
        try:
            row.append(f"numba {dtype.__name__} " + best_ms(partial(
                paged_attention_native, q, k, v, ptrs, *rest.values(), layer_idx=0,
                num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                scale=HEAD_DIM ** -0.5), reps))
        except Exception as e:  # an fp16 pool before the numba kernel reads one
            row.append(f"numba {dtype.__name__} n/a ({type(e).__name__})")
        finally:
            kv_registry.unregister(k_pool)
            kv_registry.unregister(v_pool)
        model = ort_custom_ops.paged_attention_model(HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE,
                                                     k_pool.shape[0], code)
        for threads in (1, 2):
            opts = ort.SessionOptions()
            opts.intra_op_num_threads = threads
            opts.register_custom_ops_library(lib)
            sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
            feeds = {"q": q, "k": k, "v": v, "kv_cache_ptrs": ptrs, **rest}
            row.append(f"ort {threads}t {dtype.__name__} " +
                       best_ms(partial(sess.run, ["out"], feeds), reps))
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", nargs="*", default=list(CASES), choices=list(CASES))
    parser.add_argument("--reps", type=int, default=0,
                        help="calls per figure (default: 50 for decodes, 3 for prefills)")
    args = parser.parse_args()
    lib = ort_custom_ops.library()
    if lib is None:
        print(f"the native op is unavailable: {ort_custom_ops.unavailable_reason()}")
        return 1
    for name in args.cases:
        seqs = CASES[name]
        reps = args.reps or (50 if sum(n for _, n in seqs) < 100 else 3)
        print(f"{name}:")
        for figure in run_case(seqs, reps, str(lib)):
            print(f"  {figure}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
