"""The KV tiers on the device pools: the Triton runner's ``DeviceKVPool`` (on CUDA when there is
one, else on the host, where the runner's kernels run in Triton's interpreter) and, on a GPU,
the TensorRT runner's ``CudaKVPool``. A block leaves as the host pool's bytes and comes back
unchanged, and a prefix restored from the disk tier changes no output.

benchmarks/gpu_session.sh runs this file on a GPU."""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    # NOTE: must be set before triton is imported: it picks the interpreter at jit time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton", reason="OpenAI Triton is not installed")

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.runtime.kv_cache import HostKVPool  # noqa: E402
from kvflow.runtime.triton_runner import KV_TORCH_DTYPES, DeviceKVPool  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
LAYOUT = dict(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def device_pool(kv_dtype: str, seed: int = 0) -> DeviceKVPool:
    """A device pool of :data:`LAYOUT` whose every block holds random K/V."""
    pool = DeviceKVPool(**LAYOUT, dtype=KV_TORCH_DTYPES[kv_dtype], device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    for a in (*pool.k, *pool.v):
        a.copy_(torch.randn(a.shape, generator=gen))
    return pool


@pytest.mark.parametrize("kv_dtype", sorted(KV_TORCH_DTYPES))
def test_device_pool_blocks_round_trip_as_bytes(kv_dtype):
    pool = device_pool(kv_dtype)
    try:
        assert pool.read_blocks([]) == []
        payloads = pool.read_blocks([1, 4, 2])
        assert [len(p) for p in payloads] == [pool.block_nbytes] * 3
        assert pool.block_nbytes == 2 * 2 * 4 * 2 * 8 * pool.k[0].element_size()
        before = [a.clone() for a in (*pool.k, *pool.v)]
        pool.write_blocks([5, 3, 0], payloads)
        for a, old in zip((*pool.k, *pool.v), before, strict=True):
            for dst, src in ((5, 1), (3, 4), (0, 2)):
                assert torch.equal(a[dst], old[src])
            assert torch.equal(a[1:3], old[1:3]) and torch.equal(a[4], old[4])  # untouched
    finally:
        pool.close()


@pytest.mark.parametrize("kv_dtype", ["fp32", "fp16"])
def test_device_pool_payloads_are_the_host_pools_bytes(kv_dtype):
    pool = device_pool(kv_dtype, seed=1)
    host = HostKVPool(**LAYOUT, dtype=pool.k[0].cpu().numpy().dtype)
    try:
        for h, d in zip((*host.k, *host.v), (*pool.k, *pool.v), strict=True):
            h[:] = d.cpu().numpy()
        assert pool.read_blocks([3, 1]) == host.read_blocks([3, 1])
        host.write_blocks([2], pool.read_blocks([5]))  # and back the other way
        pool.write_blocks([4], host.read_blocks([2]))
        for h, d in zip((*host.k, *host.v), (*pool.k, *pool.v), strict=True):
            np.testing.assert_array_equal(d[4].cpu().numpy(), h[5])
    finally:
        pool.close()
        host.close()


def test_device_pool_refuses_bad_payloads_and_blocks_by_name():
    pool = device_pool("fp16")
    try:
        (payload,) = pool.read_blocks([1])
        with pytest.raises(ValueError, match=f"block 2's payload is 3 bytes, the pool's "
                                             f"blocks hold {len(payload)}"):
            pool.write_blocks([1, 2], [payload, b"abc"])
        with pytest.raises(ValueError, match="2 blocks but 1 payloads"):
            pool.write_blocks([1, 2], [payload])
        with pytest.raises(ValueError, match="block 6 is not in the pool's 6 blocks"):
            pool.read_blocks([6])
        with pytest.raises(ValueError, match="block -1 is not in the pool's 6 blocks"):
            pool.write_blocks([-1], [payload])
    finally:
        pool.close()
    with pytest.raises(RuntimeError, match="closed"):
        pool.read_blocks([1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the TensorRT runner's pool: a GPU")
@pytest.mark.parametrize("kv_dtype", sorted(KV_TORCH_DTYPES))
def test_cuda_kv_pool_takes_and_gives_the_device_pools_bytes(kv_dtype):
    """The TensorRT runner's cuda-python pool (no TensorRT needed) round-trips the Triton
    runner's payloads, and lays them out as the engine I/O contract says."""
    from kvflow.runtime import cuda_runtime as cuda
    from kvflow.runtime.cuda_kv_pool import CudaKVPool

    if cuda.cudart is None:
        pytest.skip("cuda-python (cuda.bindings) is not installed")

    ref = device_pool(kv_dtype, seed=2)
    stream = cuda.Stream()
    pool = CudaKVPool(**LAYOUT, kv_cache_dtype=kv_dtype, stream=stream)
    try:
        payloads = ref.read_blocks([1, 2, 3, 5])
        pool.write_blocks([2, 3, 4, 1], payloads)  # a run of three, then one
        assert pool.read_blocks([2, 3, 4, 1]) == payloads
        assert pool.read_blocks([4, 2]) == [payloads[2], payloads[0]]
        k0 = torch.as_tensor(pool.arrays[0], device=DEVICE).view(ref.k[0].dtype)
        assert torch.equal(k0[2], ref.k[0][1]) and torch.equal(k0[1], ref.k[0][5])
        with pytest.raises(ValueError, match="payload is 3 bytes"):
            pool.write_blocks([1], [b"abc"])
    finally:
        pool.close()
        stream.close()
        ref.close()


def test_triton_runner_restores_a_disk_tier_prefix_with_the_cold_tokens(tiny_engines,
                                                                         tmp_path):
    """A prompt whose prefix a previous engine left in the disk tier: restored through
    ``write_blocks``, it gives the greedy tokens of a cold prefill."""
    engine = tiny_engines["llama-gqa4", "torch"]
    first = np.random.default_rng(5).integers(3, 300, size=17).tolist()
    returning = first + [7, 8, 9]
    opts = dict(runner="triton", kv_cache_dtype="fp32", max_num_seqs=2,
                max_num_batched_tokens=32)
    tiers = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=1 << 22)
    with LLM(engine, **opts, **tiers) as llm:
        llm.generate([first], GREEDY)
    with LLM(engine, **opts, **tiers) as llm:  # a new engine on the same folder
        (out,) = llm.generate([returning], GREEDY)
        assert llm.engine.kv.tiers.counters["disk"].hits == 4  # the 4 full blocks of ``first``
        llm.engine.kv.check_integrity()
    assert out.cached_tokens == 16
    with LLM(engine, **opts, enable_prefix_caching=False) as llm:
        (cold,) = llm.generate([returning], GREEDY)
    assert out.token_ids == cold.token_ids
