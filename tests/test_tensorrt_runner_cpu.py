"""The TensorRT runner's CPU parts: its buffer planning and input packing (pure), and its CUDA
calls through cuda-python's real bindings up to the first one that needs a device.

The runner itself needs an NVIDIA GPU and TensorRT (tests/test_gpu_path.py runs it there);
here a machine without one must get a clear "no CUDA device" error, never an import error.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvflow.build.engine_config import BuildLimits, EngineConfig
from kvflow.build.profile import INPUT_DTYPES, profile_shapes
from kvflow.kv_manager import KVCacheManager
from kvflow.model.config import ModelConfig
from kvflow.runtime.cuda_kv_pool import block_runs, copies_in_order_are_safe
from kvflow.runtime.step_builder import SeqChunk, build_step
from kvflow.runtime.tensorrt_buffers import ALIGNMENT, STEP_INPUTS, plan_buffers, unpack

TINY = ModelConfig(architecture="llama", vocab_size=128, hidden_size=64, intermediate_size=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, eos_token_ids=(2,))
LIMITS = BuildLimits(max_model_len=256, max_num_tokens=64, max_batch_size=8, block_size=16)


def make_step(lens: list[int], start: list[int] | None = None, sample: bool = True):
    """A step of sequences with ``lens`` new tokens each, after ``start`` cached ones."""
    start = start or [0] * len(lens)
    kv = KVCacheManager(64, LIMITS.block_size)
    chunks = []
    for i, (s, n) in enumerate(zip(start, lens, strict=True)):
        kv.allocate_slots(i, s + n)
        chunks.append(SeqChunk(i, list(range(3, 3 + s + n)), s, n, sample))
    return build_step(kv, chunks)


def test_buffers_are_sized_from_the_profiles_largest_shapes():
    plan = plan_buffers(LIMITS, TINY)
    shapes = profile_shapes(LIMITS, TINY)
    assert tuple(plan.inputs) == STEP_INPUTS
    for name, slot in plan.inputs.items():
        assert slot.max_shape == shapes[name][2]
        assert slot.dtype == INPUT_DTYPES[name]
    assert plan.inputs["block_tables"].max_shape == (8, 16)  # 256 positions / 16 per block
    assert plan.inputs["block_tables"].max_nbytes == 8 * 16 * 4
    assert plan.kv_cache_ptrs.max_shape == (2, 2)
    assert plan.logits.max_shape == (8, 128) and plan.logits.dtype == np.float32
    # Each input slot rounded up to TensorRT's 256-byte alignment.
    assert plan.staging_nbytes == sum(-(-s.max_nbytes // ALIGNMENT) * ALIGNMENT
                                      for s in plan.inputs.values())
    assert plan.device_nbytes == plan.staging_nbytes + ALIGNMENT + 8 * 128 * 4


def test_a_packed_step_reads_back_as_the_engine_contracts_arrays():
    plan = plan_buffers(LIMITS, TINY)
    step = make_step([5, 1, 17], start=[0, 20, 3])
    staging = np.zeros(plan.staging_nbytes, np.uint8)
    packed = plan.pack(step, staging)
    assert all(off % ALIGNMENT == 0 for off in packed.offsets.values())
    assert packed.nbytes <= plan.staging_nbytes
    got = unpack(packed, staging, plan)
    for name in STEP_INPUTS:
        want = getattr(step, name)
        assert got[name].dtype == INPUT_DTYPES[name]
        np.testing.assert_array_equal(got[name], want)
    assert packed.num_logits == 3


def test_a_step_that_samples_nothing_still_asks_the_engine_for_one_row():
    plan = plan_buffers(LIMITS, TINY)
    step = make_step([9], sample=False)  # a middle prefill chunk
    packed = plan.pack(step, np.zeros(plan.staging_nbytes, np.uint8))
    assert packed.shapes["logits_indices"] == (1,)
    assert packed.num_logits == 0


def test_a_step_outside_the_profile_is_refused_by_name():
    plan = plan_buffers(LIMITS, TINY)
    step = make_step([40, 40])  # 80 tokens; the profile takes 64
    with pytest.raises(ValueError, match=r"input_ids of shape \(80,\).*at most \(64,\)"):
        plan.pack(step, np.zeros(plan.staging_nbytes, np.uint8))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 60), st.integers(1, 12)), min_size=1, max_size=5))
def test_any_step_within_the_limits_packs_and_reads_back(seqs):
    plan = plan_buffers(LIMITS, TINY)
    step = make_step([n for _, n in seqs], start=[s for s, _ in seqs])
    staging = np.full(plan.staging_nbytes, 0xAB, np.uint8)
    packed = plan.pack(step, staging)
    got = unpack(packed, staging, plan)
    for name in STEP_INPUTS:
        np.testing.assert_array_equal(got[name], getattr(step, name))
    ends = sorted((packed.offsets[n], packed.offsets[n] + got[n].nbytes) for n in STEP_INPUTS)
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:], strict=False))  # no overlap


def test_block_copies_merge_runs_of_consecutive_blocks_but_never_overlapping_ones():
    assert block_runs([(4, 10), (5, 11), (6, 12), (9, 3)]) == [(4, 10, 3), (9, 3, 1)]
    # (1 -> 2, 2 -> 3) as one copy would read block 2 while writing it.
    assert block_runs([(1, 2), (2, 3)]) == [(1, 2, 1), (2, 3, 1)]
    assert block_runs([]) == []
    # Between the device pool and the swap space the same block numbers never overlap.
    assert block_runs([(1, 1), (2, 2), (3, 3)], same_pool=False) == [(1, 1, 3)]


def test_block_copies_in_order_are_safe_unless_a_destination_is_also_a_source():
    """The host pool reads every source first; the device pool copies in order where that
    gives the same result, and stages the sources through host memory where it would not."""

    def in_order(pairs, blocks):
        for src, dst in pairs:
            blocks[dst] = blocks[src]
        return blocks

    def sources_first(pairs, blocks):
        src, dst = zip(*pairs, strict=True)
        blocks[list(dst)] = blocks[list(src)]
        return blocks

    for pairs in ([(1, 5), (2, 6), (3, 7)], [(1, 5), (2, 6), (5, 7)], [(1, 2), (2, 1)],
                  [(4, 10), (5, 11)]):
        same = (in_order(pairs, np.arange(12)) == sources_first(pairs, np.arange(12))).all()
        if copies_in_order_are_safe(pairs):
            assert same, pairs
    assert not copies_in_order_are_safe([(1, 5), (2, 6), (5, 7)])  # 7 would get old 1
    assert not copies_in_order_are_safe([(1, 2), (2, 1)])  # a swap


# --- cuda-python's real bindings, on a machine without a GPU ----------------------------------

cuda = pytest.importorskip("kvflow.runtime.cuda_runtime")


def _has_device() -> bool:
    try:
        cuda.device_count()
    except cuda.CudaError:
        return False
    return True


no_gpu = pytest.mark.skipif(cuda.cudart is not None and _has_device(),
                            reason="a CUDA device is present: the GPU tests run the runner")


def test_cuda_python_is_installed():
    """make test installs cuda-python: the runner's module must be importable here."""
    assert cuda.cudart is not None


@no_gpu
@pytest.mark.parametrize("call", [
    lambda: cuda.device_count(), lambda: cuda.use_device(0), lambda: cuda.DeviceBuffer(1024),
    lambda: cuda.PinnedBuffer(1024), lambda: cuda.Stream()])
def test_every_cuda_allocation_without_a_gpu_says_no_cuda_device(call):
    with pytest.raises(cuda.NoCudaDevice, match="no CUDA device: cuda"):
        call()


def test_closing_frees_everything_even_after_an_error_then_raises_the_first():
    closed = []

    def fail(name):
        def close():
            closed.append(name)
            raise cuda.CudaError("cudaFree", "cudaErrorIllegalAddress", name)
        return close

    with pytest.raises(cuda.CudaError, match="first"):
        cuda.close_all([fail("first"), lambda: closed.append("b"), fail("second")])
    assert closed == ["first", "b", "second"]


def test_cuda_errors_are_raised_with_their_names():
    err = cuda.cudart.cudaError_t.cudaErrorMemoryAllocation
    with pytest.raises(cuda.CudaError, match="cudaMalloc failed: cudaErrorMemoryAllocation") as e:
        cuda.check("cudaMalloc", (err, None))
    assert e.value.name == "cudaErrorMemoryAllocation"
    assert not isinstance(e.value, cuda.NoCudaDevice)
    assert cuda.check("cudaMalloc", (cuda.cudart.cudaError_t.cudaSuccess, 1234)) == 1234


@no_gpu
def test_the_tensorrt_runner_without_a_gpu_fails_with_no_cuda_device(tmp_path):
    from kvflow.runtime.tensorrt_runner import TensorRTRunner

    engine = EngineConfig(TINY, "tensorrt", "float16", LIMITS, {"name": "x", "sha256": "0"},
                          {"onnx": "model.onnx", "plan": "model.plan"})
    engine.save(tmp_path)
    with pytest.raises(cuda.NoCudaDevice, match="no CUDA device"):
        TensorRTRunner(tmp_path, engine, num_blocks=8)


@no_gpu
def test_without_a_gpu_the_tensorrt_backend_says_why():
    from kvflow.build.builder import tensorrt_available

    reason = tensorrt_available()
    assert reason is not None
    assert "TensorRT is not installed" in reason or "no CUDA device" in reason


def test_the_tensorrt_runner_path_imports_no_torch(tmp_path):
    """The runner moves buffers and streams through cuda-python: importing it, and running it
    up to its first CUDA call, loads no torch (only the plugin's Triton kernels need it)."""
    import subprocess
    import sys

    engine = EngineConfig(TINY, "tensorrt", "float16", LIMITS, {"name": "x", "sha256": "0"},
                          {"plan": "model.plan"})
    engine.save(tmp_path)
    code = (
        "import sys\n"
        "from kvflow.build.engine_config import EngineConfig\n"
        "from kvflow.runtime.cuda_runtime import CudaError\n"
        "from kvflow.runtime.tensorrt_runner import TensorRTRunner\n"
        f"engine = EngineConfig.load({str(tmp_path)!r})\n"
        "try:\n"
        f"    TensorRTRunner({str(tmp_path)!r}, engine, 8).close()\n"
        "except (CudaError, ImportError, FileNotFoundError) as e:\n"
        "    print(type(e).__name__, file=sys.stderr)\n"
        "print(','.join(m for m in ('torch', 'onnxruntime') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "", f"imported: {out.stdout.strip()}"
