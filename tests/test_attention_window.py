"""Sliding windows and logit soft-capping in every PagedAttention implementation.

Each implementation (the PyTorch reference, the torch op, the NumPy and numba host kernels, the
native ONNX Runtime op, the OpenAI Triton kernel) is checked against a dense float64 reference
written here with an explicit mask (``p - window < j <= p``), on steps whose blocks wholly
before a sequence's window have been released as the KV manager releases them: their
block-table entries replaced by block 0, and block 0 filled with NaN. A kernel that reads any
of them, or weights them, returns NaN.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    # NOTE: before triton is imported: the Triton kernel then runs in the interpreter.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvflow.plugins import (  # noqa: E402
    kv_registry,
    ort_custom_ops,
    torch_op,  # noqa: E402,F401  (registers torch.ops.kvflow)
)
from kvflow.plugins.attention_options import first_block  # noqa: E402
from kvflow.plugins.paged_attention_host import paged_attention_host  # noqa: E402
from kvflow.plugins.paged_attention_native import paged_attention_native  # noqa: E402
from kvflow.plugins.paged_attention_ref import paged_attention_ref, random_step  # noqa: E402
from tests.helpers import run_host_attention  # noqa: E402

LIB = ort_custom_ops.library()
HOST_IMPLS = ["ref", "torch_op", "host", "native", "ort"]


def make_step(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int = 16,
              block_size: int = 4, seed: int = 0) -> dict:
    """A random step (fp32) of sequences given as (cached tokens, new tokens)."""
    return random_step(seqs, heads, kv_heads, head_dim, block_size, torch.float32,
                       torch.Generator().manual_seed(seed))


def dense_reference(step: dict, window: int, cap: float) -> np.ndarray:
    """Attention in float64 over each sequence's keys gathered position by position, with the
    mask written out: new token i of a sequence of length L with n new tokens sits at
    p = L - n + i and sees keys j with j <= p and, given a window, j > p - window."""
    k_pool = step["k_cache"].double().numpy().copy()
    v_pool = step["v_cache"].double().numpy().copy()
    q, k, v = (step[x].double().numpy() for x in ("q", "k", "v"))
    block_size, kvh = k_pool.shape[1], k_pool.shape[2]
    for t, slot in enumerate(step["slot_mapping"].tolist()):
        if slot >= 0:
            k_pool[slot // block_size, slot % block_size] = k[t]
            v_pool[slot // block_size, slot % block_size] = v[t]
    tokens, heads, head_dim = q.shape
    group = heads // kvh
    out = np.zeros((tokens, heads, head_dim))
    qsl, lens = step["query_start_loc"].tolist(), step["seq_lens"].tolist()
    tables = step["block_tables"].numpy()
    for s, length in enumerate(lens):
        n = qsl[s + 1] - qsl[s]
        j = np.arange(length)
        blocks = tables[s, j // block_size]
        keys, values = k_pool[blocks, j % block_size], v_pool[blocks, j % block_size]
        for i in range(n):
            p = length - n + i
            visible = (j <= p) & ((j > p - window) if window else True)
            for h in range(heads):
                scores = keys[:, h // group] @ q[qsl[s] + i, h] * step["scale"]
                if cap:
                    scores = cap * np.tanh(scores / cap)
                scores = np.where(visible, scores, -np.inf)
                w = np.exp(scores - scores.max())
                out[qsl[s] + i, h] = (w / w.sum()) @ values[:, h // group]
    return out.reshape(tokens, heads * head_dim)


def release_before_window(step: dict, window: int) -> dict:
    """A copy of ``step`` whose blocks wholly before the window of each sequence's earliest new
    token are released: table entries 0, block 0 (the null block) all NaN."""
    out = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in step.items()}
    block_size = out["k_cache"].shape[1]
    qsl = out["query_start_loc"].tolist()
    for s, length in enumerate(out["seq_lens"].tolist()):
        out["block_tables"][s, : first_block(length, qsl[s + 1] - qsl[s], window,
                                             block_size)] = 0
    out["k_cache"][0] = float("nan")
    out["v_cache"][0] = float("nan")
    return out


def run_ort(fn_step: dict, heads: int, kv_heads: int, head_dim: int, window: int | None,
            cap: float | None, threads: int = 1) -> np.ndarray:
    """The native ORT op on ``fn_step`` (attributes None: absent from the node)."""
    import onnxruntime as ort

    attrs = {k: v for k, v in (("sliding_window", window), ("logit_softcap", cap))
             if v is not None}
    k_pool = fn_step["k_cache"].numpy().copy()
    v_pool = fn_step["v_cache"].numpy().copy()
    model = ort_custom_ops.paged_attention_model(heads, kv_heads, head_dim, k_pool.shape[1],
                                                 k_pool.shape[0],
                                                 0 if k_pool.dtype == np.float32 else 1, **attrs)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(str(LIB))
    sess = ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])
    t = fn_step["q"].shape[0]
    feeds = {"q": fn_step["q"].reshape(t, -1).float().numpy(),
             "k": fn_step["k"].reshape(t, -1).float().numpy(),
             "v": fn_step["v"].reshape(t, -1).float().numpy(),
             "kv_cache_ptrs": np.array([[k_pool.ctypes.data, v_pool.ctypes.data]], np.int64),
             **{x: fn_step[x].numpy() for x in ("slot_mapping", "block_tables", "seq_lens",
                                                 "query_start_loc")}}
    return sess.run(["out"], feeds)[0]


def run_torch_op(step: dict, heads: int, kv_heads: int, head_dim: int, window: int,
                 cap: float) -> np.ndarray:
    """``torch.ops.kvflow.paged_attention`` on a registered host pool (the reference path)."""
    k_pool, v_pool = step["k_cache"].numpy().copy(), step["v_cache"].numpy().copy()
    ptrs = torch.tensor([[kv_registry.register(k_pool), kv_registry.register(v_pool)]])
    t = step["q"].shape[0]
    try:
        out = torch.ops.kvflow.paged_attention(
            step["q"].reshape(t, -1), step["k"].reshape(t, -1), step["v"].reshape(t, -1), ptrs,
            step["slot_mapping"], step["block_tables"], step["seq_lens"],
            step["query_start_loc"], 0, heads, kv_heads, head_dim, k_pool.shape[1],
            step["scale"], window, cap)
    finally:
        kv_registry.unregister(k_pool)
        kv_registry.unregister(v_pool)
    return out.numpy()


def run_impl(impl: str, step: dict, heads: int, kv_heads: int, window: int,
             cap: float) -> np.ndarray:
    """``impl``'s output ``[tokens, heads * head_dim]`` on a copy of ``step``."""
    head_dim = step["q"].shape[2]
    t = step["q"].shape[0]
    if impl == "ref":
        fresh = {k: (v.clone() if torch.is_tensor(v) else v) for k, v in step.items()}
        return paged_attention_ref(**fresh, sliding_window=window,
                                   logit_softcap=cap).reshape(t, -1).numpy()
    if impl == "torch_op":
        return run_torch_op(step, heads, kv_heads, head_dim, window, cap)
    if impl == "ort":
        if LIB is None:
            pytest.skip(f"custom-op library unavailable: {ort_custom_ops.unavailable_reason()}")
        return run_ort(step, heads, kv_heads, head_dim, window, cap)
    fn = {"host": paged_attention_host, "native": paged_attention_native}[impl]
    out, _, _ = run_host_attention(functools.partial(fn, sliding_window=window,
                                                     logit_softcap=cap),
                                   step, heads, kv_heads, head_dim)
    return out


def check(impl: str, seqs: list[tuple[int, int]], heads: int, kv_heads: int, window: int,
          cap: float, head_dim: int = 16, block_size: int = 4, seed: int = 0) -> None:
    step = make_step(seqs, heads, kv_heads, head_dim, block_size, seed)
    want = dense_reference(step, window, cap)
    released = release_before_window(step, window)
    got = run_impl(impl, released, heads, kv_heads, window, cap)
    assert np.isfinite(got).all(), f"{impl} read a released block"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


# (cached, new) per sequence: decodes with contexts shorter than, equal to and longer than the
# windows below, prefill chunks starting before, at and after the window boundary.
MIXED = [(0, 9), (3, 1), (15, 1), (40, 1), (20, 12), (6, 18), (70, 5), (33, 1)]


@pytest.mark.parametrize("impl", HOST_IMPLS)
@pytest.mark.parametrize("window", [0, 1, 7, 16, 34, 200])
@pytest.mark.parametrize("cap", [0.0, 1.5])
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (9, 3)])
def test_mixed_steps_match_the_dense_reference(impl, window, cap, heads, kv_heads):
    check(impl, MIXED, heads, kv_heads, window, cap)


@pytest.mark.parametrize("impl", ["ref", "host", "ort"])
def test_released_blocks_poison_attention_that_ignores_the_window(impl):
    """The check above has teeth: without the window, the same step reads the NaN blocks."""
    step = release_before_window(make_step(MIXED, 8, 2), 7)
    assert np.isnan(run_impl(impl, step, 8, 2, 0, 0.0)).any()


@pytest.mark.parametrize("impl", HOST_IMPLS)
def test_a_long_prefill_chunk_crosses_the_window_in_many_tiles(impl):
    # 150 new tokens after 60 cached ones, window 23: every query tile (the ORT op's hold up to
    # 64 rows) has rows whose windows start several 16-key chunks apart.
    check(impl, [(60, 150)], 8, 2, 23, 0.0, head_dim=36, block_size=16)


@pytest.mark.parametrize("impl", ["native", "ort"])
def test_parallel_and_split_decodes_with_a_window(impl):
    # Long decodes: the ORT op splits their keys over threads (FlashDecoding) from the window.
    seqs = [(1500, 1), (900, 1), (300, 40)]
    step = make_step(seqs, 8, 2, 32, 16, seed=4)
    released = release_before_window(step, 600)
    want = dense_reference(step, 600, 0.0)
    if impl == "ort":
        if LIB is None:
            pytest.skip(f"custom-op library unavailable: {ort_custom_ops.unavailable_reason()}")
        got = run_ort(released, 8, 2, 32, 600, None, threads=2)
    else:
        got = run_impl(impl, released, 8, 2, 600, 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("impl", ["native", "ort"])
def test_float16_pools_with_a_window_and_a_cap(impl):
    step = make_step([(50, 1), (30, 20), (9, 1)], 8, 2, 16, 4, seed=2)
    for key in ("k", "v", "k_cache", "v_cache"):  # values an fp16 pool holds exactly
        step[key] = step[key].half().float()
    want = dense_reference(step, 13, 4.0)
    released = release_before_window(step, 13)
    released["k_cache"], released["v_cache"] = (released["k_cache"].half(),
                                                released["v_cache"].half())
    got = run_impl(impl, released, 8, 2, 13, 4.0)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


@pytest.mark.skipif(LIB is None, reason="custom-op library unavailable")
def test_ort_node_without_the_attributes_is_full_causal_attention():
    """A node exported before the attributes existed (both absent) loads and attends fully."""
    step = make_step(MIXED, 9, 3)
    got = run_ort(step, 9, 3, 16, None, None)
    np.testing.assert_allclose(got, dense_reference(step, 0, 0.0), rtol=1e-4, atol=2e-5)


@pytest.mark.skipif(LIB is None, reason="custom-op library unavailable")
@pytest.mark.parametrize(("attr", "value", "message"), [
    ("sliding_window", -1, r"attribute sliding_window = -1 is outside \[0, "),
    ("logit_softcap", -2.0, r"attribute logit_softcap = -2\.0+ is not a finite number >= 0"),
])
def test_ort_refuses_bad_attributes_at_load(attr, value, message):
    import onnxruntime as ort

    model = ort_custom_ops.paged_attention_model(4, 2, 16, 4, 8, **{attr: value})
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(LIB))
    with pytest.raises(Exception, match=message):
        ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("impl", ["ref", "host", "native"])
@pytest.mark.parametrize(("window", "cap", "message"), [
    (-3, 0.0, r"sliding_window must be an integer >= 0 .* got -3"),
    (4, -1.0, r"logit_softcap must be a finite number >= 0 .* got -1\.0"),
    (4, float("inf"), r"logit_softcap must be a finite number >= 0 .* got inf"),
])
def test_python_implementations_refuse_bad_options(impl, window, cap, message):
    step = make_step([(5, 1)], 4, 2)
    with pytest.raises(ValueError, match=message):
        run_impl(impl, step, 4, 2, window, cap)


@settings(max_examples=30, deadline=None)
@given(
    seqs=st.lists(st.tuples(st.integers(0, 90), st.integers(1, 30)), min_size=1, max_size=4),
    shape=st.sampled_from([(4, 4, 8), (8, 2, 16), (9, 3, 12), (6, 1, 16)]),
    block_size=st.sampled_from([1, 4, 16]),
    window=st.integers(0, 120),
    cap=st.sampled_from([0.0, 0.3, 30.0]),
    seed=st.integers(0, 2**16),
)
def test_every_host_implementation_matches_the_dense_reference(seqs, shape, block_size, window,
                                                               cap, seed):
    heads, kv_heads, head_dim = shape
    step = make_step(seqs, heads, kv_heads, head_dim, block_size, seed)
    want = dense_reference(step, window, cap)
    released = release_before_window(step, window)
    for impl in ("ref", "host", "native") + (("ort",) if LIB is not None else ()):
        got = run_impl(impl, released, heads, kv_heads, window, cap)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5, err_msg=impl)


def test_export_writes_both_attributes_and_their_defaults():
    """The torch op's trailing arguments default to 0, and the ONNX node always carries both
    (TensorRT's plugin declares them as fields, without defaults)."""
    import onnx

    class Layer(torch.nn.Module):
        def __init__(self, **options: float) -> None:
            super().__init__()
            self.options = options

        def forward(self, q, k, v, ptrs, slots, tables, lens, qsl):
            return torch.ops.kvflow.paged_attention(q, k, v, ptrs, slots, tables, lens, qsl,
                                                    0, 2, 1, 4, 4, 0.5, **self.options)

    i32, i64 = torch.int32, torch.int64
    args = (torch.zeros(3, 8), torch.zeros(3, 4), torch.zeros(3, 4),
            torch.zeros(1, 2, dtype=i64), torch.zeros(3, dtype=i64),
            torch.zeros(1, 2, dtype=i32), torch.zeros(1, dtype=i32), torch.zeros(2, dtype=i32))
    for options, want in (({}, (0, 0.0)),
                          ({"sliding_window": 7, "logit_softcap": 30.0}, (7, 30.0))):
        program = torch.onnx.export(Layer(**options), args, dynamo=True,
                                    custom_translation_table=torch_op.onnx_translation_table())
        node = next(n for n in program.model_proto.graph.node if n.op_type == "PagedAttention")
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        assert (attrs["sliding_window"], attrs["logit_softcap"]) == want


# The OpenAI Triton kernel: compiled on a GPU, else in Triton's interpreter (slow: few cases).
TRITON_CASES = {
    "decodes": ([(3, 1), (15, 1), (40, 1), (90, 1)], 8, 2, 16, 0.0, {}),
    "chunks-crossing": ([(20, 12), (6, 18), (70, 5)], 9, 3, 7, 1.5, {}),
    "window-equals-context": ([(31, 1), (0, 32)], 4, 4, 32, 0.0, {}),
    "split-kv": ([(300, 1), (17, 1), (120, 1)], 8, 2, 50, 2.0, {"num_splits": 4}),
    "small-block-n": ([(64, 40)], 8, 2, 21, 0.0, {"block_n": 16, "block_m": 8}),
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_kernel_matches_the_dense_reference(case):
    pytest.importorskip("triton", reason="OpenAI Triton is not installed")
    from kvflow.plugins.paged_attention_triton import paged_attention_triton

    seqs, heads, kv_heads, window, cap, options = TRITON_CASES[case]
    step = make_step(seqs, heads, kv_heads, 16, 4, seed=9)
    want = dense_reference(step, window, cap)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    released = {k: (v.to(device) if torch.is_tensor(v) else v)
                for k, v in release_before_window(step, window).items()}
    out = paged_attention_triton(**released, sliding_window=window, logit_softcap=cap,
                                 **options)
    got = out.reshape(out.shape[0], -1).cpu().numpy()
    assert np.isfinite(got).all(), "the kernel read a released block"
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)
