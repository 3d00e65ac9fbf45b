"""The multi-LoRA product (Punica's SGMV) three ways against the NumPy reference: the native
``kvflow::LoraMatMul`` op (each ISA variant this CPU runs), the PyTorch reference, and the
OpenAI Triton kernel (in Triton's interpreter without a GPU); and the slot pool itself."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest

try:
    import torch
except ImportError:  # the native op's tests need no torch
    torch = None
if torch is not None and not torch.cuda.is_available():
    # NOTE: set before triton is imported: it picks the interpreter at jit time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from onnx import TensorProto, helper

from kvflow.plugins import ort_custom_ops, ort_isa
from kvflow.plugins.op_names import ONNX_DOMAIN
from kvflow.runtime import lora_pool
from kvflow.runtime.lora_pool import LoraGroup, LoraPool, lora_reference

QKV = LoraGroup("qkv", ("q_proj", "k_proj", "v_proj"), 64, (48, 16, 16))
DOWN = LoraGroup("down", ("down_proj",), 96, (64,))
# Parts whose widths and starts are no multiple of the kernel's column block.
ODD = LoraGroup("gate_up", ("gate_proj", "up_proj"), 40, (21, 13))


@dataclass(frozen=True)
class Adapter:
    """The attributes of kvflow.lora.LoraAdapter the pool reads."""

    name: str
    rank: int
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]


def make_adapter(name: str, rank: int, modules: dict[str, int], layers: int = 2,
                 seed: int = 0) -> Adapter:
    """Random A and B for ``modules`` (name -> rank: ranks may differ per module)."""
    rng = np.random.default_rng(seed)
    shapes = {m: (g.in_features, n) for g in (QKV, DOWN, ODD)
              for m, n in zip(g.modules, g.out_features, strict=True)}
    weights = {}
    for layer in range(layers):
        for m, r in modules.items():
            k, n = shapes[m]
            weights[layer, m] = (rng.normal(0, 0.3, (r, k)).astype(np.float32),
                                 rng.normal(0, 0.3, (n, r)).astype(np.float32))
    return Adapter(name, rank, weights)


def make_pool(max_loras: int = 3, max_rank: int = 8, dtype=np.float32) -> LoraPool:
    """Slot 0: every module at rank 8; slot 1: q and v only, rank 3 (k left out: rank 0);
    slot 2 (when there is one) stays empty."""
    pool = LoraPool([QKV, DOWN, ODD], num_layers=2, max_loras=max_loras, max_rank=max_rank,
                    dtype=dtype)
    pool.load(0, make_adapter("all", 8, {"q_proj": 8, "k_proj": 8, "v_proj": 8,
                                         "down_proj": 8, "gate_proj": 7, "up_proj": 5}, seed=1))
    pool.load(1, make_adapter("qv", 3, {"q_proj": 3, "v_proj": 3, "up_proj": 6}, seed=2))
    return pool


def lora_model(group: LoraGroup, module: int, rank: int, num_slots: int, **attrs) -> bytes:
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("y_in", f, ["T", group.columns]),
              helper.make_tensor_value_info("x", f, ["T", group.in_features]),
              helper.make_tensor_value_info("lora_ptrs", TensorProto.INT64, ["M", 3]),
              helper.make_tensor_value_info("lora_slots", TensorProto.INT32, ["S"])]
    node = helper.make_node("LoraMatMul", [i.name for i in inputs], ["y"], domain=ONNX_DOMAIN,
                            module=module, part_cols=list(group.out_features), rank=rank,
                            num_slots=num_slots, **attrs)
    graph = helper.make_graph([node], "lora", inputs,
                              [helper.make_tensor_value_info("y", f, ["T", group.columns])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(ONNX_DOMAIN, 1)]
                             ).SerializeToString()


def session(library, model: bytes, threads: int = 2):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.register_custom_ops_library(str(library))
    return ort.InferenceSession(model, opts, providers=["CPUExecutionProvider"])


def isas() -> list[str]:
    """The best variant this CPU runs, and AVX2 and the portable build where it runs them."""
    best = ort_isa.runnable()[0]
    return [best, *(isa for isa in ("avx2", "portable") if isa != best and ort_isa.supported(isa))]


def mixed_slots(t: int, seed: int = 3) -> np.ndarray:
    return np.random.default_rng(seed).choice([-1, 0, 1, 2], size=t).astype(np.int32)


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("parallel_min_work", [0, 2**31 - 1])
@pytest.mark.parametrize(("group", "layer"), [(QKV, 1), (DOWN, 0), (ODD, 1)])
@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_native_op_matches_the_reference(isa, parallel_min_work, group, layer, dtype):
    """Mixed slots (base, a full adapter, one with ranks below max and a module left out, an
    empty slot) over several parts, the pool in float32 or float16: the op adds what the
    reference adds (from the pool's values), threaded or not."""
    library = ort_custom_ops.library(isa=isa)
    if library is None:
        pytest.skip(f"no {isa} library: {ort_custom_ops.unavailable_reason(isa=isa)}")
    pool = make_pool(dtype=dtype)
    try:
        rng = np.random.default_rng(4)
        t = 37
        y = rng.normal(size=(t, group.columns)).astype(np.float32)
        x = rng.normal(size=(t, group.in_features)).astype(np.float32)
        slots = mixed_slots(t)
        row = pool.row(layer, group.name)
        sess = session(library, lora_model(group, row, 8, 3, parallel_min_work=parallel_min_work,
                                           weight_dtype=int(dtype == np.float16)))
        out = sess.run(["y"], {"y_in": y, "x": x, "lora_ptrs": pool.ptrs,
                               "lora_slots": slots})[0]
        want = lora_reference(y, x, pool.a[group.name][layer], pool.bt[group.name][layer],
                              pool.ranks[group.name][layer], slots, group.part_columns())
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        base = slots < 0
        assert np.array_equal(out[base], y[base]), "base tokens are untouched"
        assert not np.allclose(out[slots == 0], y[slots == 0]), "the adapter changed its rows"
        if group is QKV:  # slot 1 leaves k_proj out: those columns stay the base's
            k_cols = slice(*group.part_columns()[1])
            assert np.array_equal(out[slots == 1][:, k_cols], y[slots == 1][:, k_cols])
    finally:
        pool.close()


@pytest.mark.skipif(ort_custom_ops.library() is None, reason="the native op is unavailable")
def test_native_op_without_adapters_is_the_identity_and_refuses_bad_slots():
    pool = make_pool()
    try:
        sess = session(ort_custom_ops.library(), lora_model(QKV, pool.row(0, "qkv"), 8, 3))
        y = np.random.default_rng(0).normal(size=(5, QKV.columns)).astype(np.float32)
        x = np.ones((5, QKV.in_features), np.float32)
        feeds = {"y_in": y, "x": x, "lora_ptrs": pool.ptrs}
        out = sess.run(["y"], {**feeds, "lora_slots": np.zeros(0, np.int32)})[0]
        assert np.array_equal(out, y)
        out = sess.run(["y"], {**feeds, "lora_slots": np.full(5, -1, np.int32)})[0]
        assert np.array_equal(out, y)
        with pytest.raises(Exception, match=r"lora_slots\[2\] = 3 is outside -1"):
            sess.run(["y"], {**feeds, "lora_slots": np.array([0, 1, 3, -1, 0], np.int32)})
        with pytest.raises(Exception, match="lora_slots has shape"):
            sess.run(["y"], {**feeds, "lora_slots": np.zeros(4, np.int32)})
    finally:
        pool.close()


def test_pool_checks_adapters_and_frees_what_it_registered():
    before = lora_pool.registered_arrays()
    pool = make_pool(max_loras=2, max_rank=4 + 4)
    assert lora_pool.registered_arrays() == before + 3 * 2 * 3  # (A, Bt, ranks) x layers x groups
    assert pool.ranks["qkv"][0, 1].tolist() == [3, 0, 3]
    too_big = make_adapter("big", 9, {"q_proj": 9})
    with pytest.raises(ValueError, match="rank 9, above max_lora_rank 8"):
        pool.load(1, too_big)
    assert pool.slot_names == ["all", "qv"], "a refused adapter writes nothing"
    with pytest.raises(ValueError, match="module 'lm_head' is no LoRA target"):
        pool.load(0, Adapter("head", 2, {(0, "lm_head"): (np.zeros((2, 64)), np.zeros((9, 2)))}))
    with pytest.raises(ValueError, match=r"expected A \[r, 64\] and B \[16, r\]"):
        pool.load(0, Adapter("bad", 2, {(0, "k_proj"): (np.zeros((2, 64)), np.zeros((48, 2)))}))
    with pytest.raises(ValueError, match="slot 2 is outside the pool's slots 0..1"):
        pool.load(2, too_big)
    pool.clear(0)
    assert not pool.a["qkv"][:, 0].any() and not pool.ranks["down"][:, 0].any()
    pool.close()
    assert lora_pool.registered_arrays() == before


@pytest.mark.skipif(torch is None, reason="no torch")
def test_torch_reference_matches_numpy():
    from kvflow.plugins.lora_torch import lora_apply, slot_segments

    pool = make_pool()
    try:
        rng = np.random.default_rng(5)
        x = rng.normal(size=(29, DOWN.in_features)).astype(np.float32)
        y = rng.normal(size=(29, DOWN.columns)).astype(np.float32)
        slots = mixed_slots(29)
        a, bt, ranks = (pool.a["down"][0][:, 0], pool.bt["down"][0], pool.ranks["down"][0][:, 0])
        out = lora_apply(torch.from_numpy(y), torch.from_numpy(x), torch.from_numpy(a),
                         torch.from_numpy(bt), slot_segments(slots), ranks.tolist())
        want = lora_reference(y, x, pool.a["down"][0], pool.bt["down"][0],
                              pool.ranks["down"][0], slots, DOWN.part_columns())
        np.testing.assert_allclose(out.numpy(), want, rtol=1e-5, atol=1e-5)
    finally:
        pool.close()


@pytest.mark.skipif(torch is None, reason="no torch")
def test_triton_kernel_matches_numpy():
    pytest.importorskip("triton", reason="OpenAI Triton is not installed")
    from kvflow.plugins.lora_triton import lora_apply_triton

    device = "cuda" if torch.cuda.is_available() else "cpu"
    pool = make_pool()
    try:
        rng = np.random.default_rng(6)
        for t in (1, 13):
            x = rng.normal(size=(t, DOWN.in_features)).astype(np.float32)
            y = rng.normal(size=(t, DOWN.columns)).astype(np.float32)
            slots = mixed_slots(t, seed=t)
            a, bt = pool.a["down"][0][:, 0], pool.bt["down"][0]
            ranks = pool.ranks["down"][0][:, 0]

            def dev(v: np.ndarray):
                return torch.from_numpy(np.ascontiguousarray(v)).to(device)

            out = lora_apply_triton(dev(y), dev(x), dev(a), dev(bt), dev(ranks), dev(slots))
            want = lora_reference(y, x, pool.a["down"][0], pool.bt["down"][0],
                                  pool.ranks["down"][0], slots, DOWN.part_columns())
            np.testing.assert_allclose(out.cpu().numpy(), want, rtol=1e-4, atol=1e-4)
    finally:
        pool.close()
