"""The native ``kvflow::PagedAttention`` ORT kernel against the PyTorch reference.

Each case runs a one-node ONNX graph in an ONNX Runtime session with the library registered,
on a host pool (numpy arrays reached by address, as the runner's), and compares its output and
the pool it wrote with :func:`paged_attention_ref` on a copy.
"""

from __future__ import annotations

import shutil

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from kvflow.plugins import ort_custom_ops
from kvflow.plugins.paged_attention_ref import paged_attention_ref, random_step

LIB = ort_custom_ops.library()
needs_lib = pytest.mark.skipif(LIB is None, reason=f"custom-op library unavailable: "
                               f"{ort_custom_ops.unavailable_reason()}")
# fp16 K/V against fp32 K/V, same inputs (values ~N(0, 1)): the rounding of the keys and values
# (relative 2^-11) moves outputs by well under this.
FP16_ATOL = 5e-3


def make_session(heads: int, kv_heads: int, head_dim: int, block_size: int,
                 num_blocks: int | None, kv_dtype: int = 0, threads: int = 1,
                 **extra_attrs: int) -> ort.InferenceSession:
    """A session over one PagedAttention node (layer 0), its inputs the graph's."""
    model = ort_custom_ops.paged_attention_model(heads, kv_heads, head_dim, block_size,
                                                 num_blocks, kv_dtype, **extra_attrs)
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(str(LIB))
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def run_op(case: dict, heads: int, kv_heads: int, head_dim: int, block_size: int,
           k_pool: np.ndarray, v_pool: np.ndarray, kv_dtype: int = 0, threads: int = 1,
           attrs: dict[str, int | float] | None = None, **overrides: np.ndarray) -> np.ndarray:
    """Run the node on ``case`` (a :func:`random_step` dict) with the given pools, in place."""
    sess = make_session(heads, kv_heads, head_dim, block_size, k_pool.shape[0], kv_dtype,
                        threads=threads, **(attrs or {}))
    t = case["q"].shape[0]
    feeds = {"q": case["q"].reshape(t, -1).numpy(), "k": case["k"].reshape(t, -1).numpy(),
             "v": case["v"].reshape(t, -1).numpy(),
             "kv_cache_ptrs": np.array([[k_pool.ctypes.data, v_pool.ctypes.data]], np.int64),
             "slot_mapping": case["slot_mapping"].numpy(),
             "block_tables": case["block_tables"].numpy(), "seq_lens": case["seq_lens"].numpy(),
             "query_start_loc": case["query_start_loc"].numpy(), **overrides}
    return sess.run(["out"], feeds)[0]


def spread_blocks(case: dict, block_size: int, stride: int = 3) -> None:
    """Move block ``b`` of the case's pool to ``stride * b + 1``, in place: tables with holes
    (unowned blocks between a sequence's) and a pool larger than the blocks in use."""
    def spread(ids: torch.Tensor) -> torch.Tensor:
        return ids * stride + 1

    for key in ("k_cache", "v_cache"):
        old = case[key]
        new = torch.randn((old.shape[0] * stride + 1, *old.shape[1:]), dtype=old.dtype)
        new[spread(torch.arange(old.shape[0]))] = old
        case[key] = new
    case["block_tables"] = spread(case["block_tables"]).to(torch.int32)
    slots = case["slot_mapping"]
    case["slot_mapping"] = torch.where(
        slots >= 0, spread(slots // block_size) * block_size + slots % block_size, slots)


def check_against_ref(seqs: list[tuple[int, int]], heads: int, kv_heads: int, head_dim: int = 64,
                      block_size: int = 16, kv_dtype: int = 0, threads: int = 1,
                      pad_slots: tuple[int, ...] = (), holes: bool = False,
                      parallel_min_work: int | None = None, sliding_window: int | None = None,
                      logit_softcap: float | None = None) -> np.ndarray:
    """The kernel's output and written pool equal the reference's on the same step."""
    case = random_step(seqs, heads, kv_heads, head_dim, block_size, torch.float32,
                       torch.Generator().manual_seed(len(seqs) * 31 + heads))
    if holes:
        spread_blocks(case, block_size)
    for t in pad_slots:  # padding tokens: nothing written, output still computed
        case["slot_mapping"][t] = -1
    dtype = np.float32 if kv_dtype == 0 else np.float16
    k_pool = np.ascontiguousarray(case["k_cache"].numpy().astype(dtype))
    v_pool = np.ascontiguousarray(case["v_cache"].numpy().astype(dtype))
    k_ref, v_ref = torch.from_numpy(k_pool.copy()), torch.from_numpy(v_pool.copy())
    given = dict(parallel_min_work=parallel_min_work, sliding_window=sliding_window,
                 logit_softcap=logit_softcap)
    attrs = {k: v for k, v in given.items() if v is not None}  # None: the attribute is absent
    out = run_op(case, heads, kv_heads, head_dim, block_size, k_pool, v_pool, kv_dtype, threads,
                 attrs)
    want = paged_attention_ref(case["q"], case["k"], case["v"], k_ref, v_ref,
                               case["slot_mapping"], case["block_tables"], case["seq_lens"],
                               case["query_start_loc"], case["scale"],
                               sliding_window=sliding_window or 0,
                               logit_softcap=logit_softcap or 0.0)
    np.testing.assert_allclose(out, want.reshape(out.shape).numpy(), atol=2e-5, rtol=1e-4)
    np.testing.assert_array_equal(k_pool, k_ref.numpy())
    np.testing.assert_array_equal(v_pool, v_ref.numpy())
    return out


@needs_lib
@pytest.mark.parametrize("kv_dtype", [0, 1])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("seqs", [
    [(37, 1)],                               # decode
    [(40, 23)],                              # prefill chunk on earlier context
    [(0, 70)],                               # first chunk of a prompt: several query tiles
    [(5, 1), (0, 9), (100, 1), (17, 30), (12, 3)],  # mixed batch
    [(700, 1), (300, 2)],                    # contexts spanning many blocks
], ids=["decode", "chunk", "prompt", "mixed", "long"])
def test_matches_reference(seqs, heads, kv_heads, kv_dtype):
    check_against_ref(seqs, heads, kv_heads, kv_dtype=kv_dtype)


@needs_lib
@pytest.mark.parametrize("threads", [1, 2])
def test_parallel_step_matches_reference(threads):
    # Large enough to go to ORT's thread pool; a head_dim that is no multiple of 8, and a
    # block size that is no multiple of the kernel's 16-key chunk.
    check_against_ref([(200, 1)] * 6 + [(90, 40)], 8, 2, head_dim=36, block_size=12,
                      threads=threads)
    check_against_ref([(2, 1)] * 3, 8, 2, threads=threads, parallel_min_work=0)
    # Few items, long decodes: their keys split into parts on several threads, then merged.
    check_against_ref([(1500, 1), (700, 1), (40, 9)], 8, 2, threads=threads,
                      parallel_min_work=0)
    check_against_ref([(1500, 1)], 9, 3, kv_dtype=1, threads=threads, parallel_min_work=0)


@needs_lib
def test_bad_attribute_is_refused_at_load():
    with pytest.raises(Exception, match=r"attribute kv_dtype = 7 is outside|kv_dtype 7 is none"):
        make_session(4, 2, 64, 16, num_blocks=8, kv_dtype=7)


@needs_lib
def test_output_shape_is_inferred():
    # ORT's optimizers downstream of the node see [T, H*D]: here through a Relu whose output
    # the graph leaves undeclared.
    model = onnx.load_from_string(ort_custom_ops.paged_attention_model(4, 2, 8, 16, 10))
    model.graph.node[0].output[0] = "attn"
    model.graph.node.append(onnx.helper.make_node("Relu", ["attn"], ["out"]))
    del model.graph.output[:]
    model.graph.output.append(onnx.helper.make_tensor_value_info("out", onnx.TensorProto.FLOAT,
                                                                 None))
    opts = ort.SessionOptions()
    opts.register_custom_ops_library(str(LIB))
    sess = ort.InferenceSession(model.SerializeToString(), opts,
                                providers=["CPUExecutionProvider"])
    assert sess.get_outputs()[0].shape == ["T", 32]


@needs_lib
def test_block_table_with_holes():
    # random_step already scatters blocks out of order; here the ids also skip blocks, and the
    # tables' padding (block 0) is a block nobody owns.
    out = check_against_ref([(60, 4), (10, 1), (33, 17)], 6, 2, holes=True)
    assert out.shape == (22, 6 * 64)


@needs_lib
def test_padding_slots_write_nothing():
    check_against_ref([(30, 6)], 9, 3, pad_slots=(1, 4))


@needs_lib
def test_tokens_past_the_batch_are_zero():
    case = random_step([(20, 3)], 4, 2, 64, 16, torch.float32, torch.Generator().manual_seed(3))
    k_pool, v_pool = case["k_cache"].numpy().copy(), case["v_cache"].numpy().copy()
    for key in ("q", "k", "v"):
        case[key] = torch.cat([case[key], torch.ones_like(case[key][:2])])
    case["slot_mapping"] = torch.cat([case["slot_mapping"], torch.tensor([-1, -1])])
    out = run_op(case, 4, 2, 64, 16, k_pool, v_pool)
    assert out.shape == (5, 256)
    assert not out[3:].any() and out[:3].any()


@needs_lib
def test_empty_step():
    case = random_step([(3, 1)], 4, 2, 64, 16, torch.float32, torch.Generator().manual_seed(2))
    k_pool, v_pool = case["k_cache"].numpy().copy(), case["v_cache"].numpy().copy()
    empty = {"q": np.zeros((0, 256), np.float32), "k": np.zeros((0, 128), np.float32),
             "v": np.zeros((0, 128), np.float32), "slot_mapping": np.zeros(0, np.int64),
             "block_tables": np.zeros((0, 1), np.int32), "seq_lens": np.zeros(0, np.int32),
             "query_start_loc": np.zeros(1, np.int32)}
    assert run_op(case, 4, 2, 64, 16, k_pool, v_pool, **empty).shape == (0, 256)


@needs_lib
def test_fp16_pool_close_to_fp32_pool():
    seqs = [(300, 1), (120, 20), (0, 5)]
    case = random_step(seqs, 9, 3, 64, 16, torch.float32, torch.Generator().manual_seed(7))
    outs = []
    for dtype, code in ((np.float32, 0), (np.float16, 1)):
        k_pool = case["k_cache"].numpy().astype(dtype)
        v_pool = case["v_cache"].numpy().astype(dtype)
        outs.append(run_op(case, 9, 3, 64, 16, k_pool, v_pool, kv_dtype=code))
    np.testing.assert_allclose(outs[1], outs[0], atol=FP16_ATOL)
    assert not np.array_equal(outs[1], outs[0])  # the fp16 pool is really read as fp16


@needs_lib
def test_fp16_write_rounds_like_numpy():
    # Normal, subnormal, ties, overflow past 65504 and signed zero: the bits numpy would store.
    case = random_step([(0, 2)], 2, 2, 8, 16, torch.float32, torch.Generator().manual_seed(5))
    special = torch.tensor([1e-6, -3e-8, 1.0 + 2 ** -11, 1.0 + 3 * 2 ** -11, 65519.0, 65520.0,
                            7e4, -0.0], dtype=torch.float32)
    case["k"][0] = special.view(2, 4).repeat(1, 2)
    case["v"][1] = -special.view(2, 4).repeat(1, 2)
    k_pool, v_pool = (case[key].numpy().astype(np.float16) for key in ("k_cache", "v_cache"))
    with np.errstate(over="ignore"):
        run_op(case, 2, 2, 8, 16, k_pool, v_pool, kv_dtype=1)
        slots = case["slot_mapping"].numpy()
        for pool, new in ((k_pool, case["k"]), (v_pool, case["v"])):
            written = pool.reshape(-1, 2, 8)[slots]
            np.testing.assert_array_equal(written.view(np.uint16),
                                          new.numpy().astype(np.float16).view(np.uint16))


@needs_lib
@pytest.mark.parametrize("field,value,message", [
    ("slot_mapping", 10_000, r"slot_mapping\[0\] = 10000 is past the KV pool"),
    ("block_tables", 99, r"block_tables\[0, 1\] = 99 is outside the KV pool's \d+ blocks"),
    ("seq_lens", 2, r"seq_lens\[0\] = 2 is below its 4 new tokens"),
    ("kv_cache_ptrs", 0, r"kv_cache_ptrs\[0\] holds a null address"),
    ("query_start_loc", 1, r"query_start_loc must run from 0"),
])
def test_bad_input_is_an_error_naming_it(field, value, message):
    case = random_step([(20, 4)], 4, 2, 64, 16, torch.float32, torch.Generator().manual_seed(1))
    k_pool, v_pool = case["k_cache"].numpy().copy(), case["v_cache"].numpy().copy()
    before = k_pool.copy()
    bad = (np.array([[k_pool.ctypes.data, v_pool.ctypes.data]], np.int64)
           if field == "kv_cache_ptrs" else case[field].numpy().copy())
    bad.reshape(-1)[1 if field == "block_tables" else 0] = value
    with pytest.raises(Exception, match=message):
        run_op(case, 4, 2, 64, 16, k_pool, v_pool, **{field: bad})
    np.testing.assert_array_equal(k_pool, before)  # checked before anything is written


@needs_lib
def test_missing_num_blocks_is_refused_at_load():
    with pytest.raises(Exception, match="no integer attribute num_blocks"):
        make_session(4, 2, 64, 16, num_blocks=None)


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_library_builds_where_compiler_and_headers_exist():
    try:
        ort_custom_ops.find_headers()
    except ort_custom_ops.CustomOpsUnavailable as e:
        pytest.skip(str(e))
    assert LIB is not None, ort_custom_ops.unavailable_reason()
    assert ort_custom_ops.unavailable_reason() is None
    assert LIB.is_file() and LIB.name.startswith("libkvflow-ortops-")


def test_reason_names_missing_headers(tmp_path):
    assert ort_custom_ops.library(tmp_path) is None
    reason = ort_custom_ops.unavailable_reason(tmp_path)
    assert "onnxruntime_c_api.h" in reason and str(tmp_path) in reason


@pytest.mark.skipif(shutil.which("g++") is None, reason="no g++ on this machine")
def test_reason_quotes_the_compiler(tmp_path):
    (tmp_path / "onnxruntime_c_api.h").write_text("#error these headers are broken\n")
    assert ort_custom_ops.library(tmp_path) is None
    reason = ort_custom_ops.unavailable_reason(tmp_path)
    assert "failed on paged_attention_ort.cc" in reason and "these headers are broken" in reason
