"""The KV tiers through the real engine: a prefix evicted from the pool, or left by an earlier
process in the disk tier, comes back and changes no output."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow import LLM, SamplingParams
from kvflow.console.state import engine_state
from kvflow.observability.metrics import EngineMetrics
from kvflow.runtime.kv_cache import HostKVPool

pytestmark = pytest.mark.slow  # greedy runs of a tiny engine, seconds each

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
DISK = 1 << 24


@pytest.fixture(scope="module", params=["torch", "onnxruntime"])
def engine_dir(request, tiny_engines):
    return tiny_engines["llama-gqa4", request.param]


def prompt(seed: int, n: int = 41) -> list[int]:
    return np.random.default_rng(seed).integers(3, 300, size=n).tolist()


def cold(engine_dir, prompts, salts=None):
    """The reference: every prompt computed from scratch, no cache, no tiers."""
    with LLM(engine_dir, enable_prefix_caching=False, kv_cache_dtype="fp32") as llm:
        return [o.token_ids for o in llm.generate(prompts, GREEDY, cache_salts=salts)]


def disk_tier(llm):
    tiers = llm.engine.kv.tiers
    assert tiers is not None and tiers.stores[-1].medium == "disk"
    return tiers


def test_host_pool_blocks_round_trip_as_bytes():
    pool = HostKVPool(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    rng = np.random.default_rng(0)
    for a in (*pool.k, *pool.v):
        a[:] = rng.standard_normal(a.shape)
    payloads = pool.read_blocks([1, 2])
    assert [len(p) for p in payloads] == [pool.block_nbytes] * 2
    pool.write_blocks([3, 0], payloads)
    for a in (*pool.k, *pool.v):
        assert np.array_equal(a[3], a[1]) and np.array_equal(a[0], a[2])
    with pytest.raises(ValueError, match="payload is 3 bytes"):
        pool.write_blocks([1], [b"abc"])
    pool.close()


def test_a_prefix_restored_from_disk_after_a_restart_gives_the_cold_output(engine_dir,
                                                                            tmp_path):
    first, returning = prompt(1), prompt(1) + [7, 8, 9, 10, 11]
    opts = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=DISK, kv_cache_dtype="fp32")
    with LLM(engine_dir, **opts) as llm:
        llm.generate([first], GREEDY)
    assert any((tmp_path / "kv").rglob("*.kvb")), "nothing persisted at shutdown"
    assert (tmp_path / "kv").stat().st_mode & 0o777 == 0o700
    with LLM(engine_dir, **opts) as llm:  # a new process' engine on the same folder
        (out,) = llm.generate([returning], GREEDY)
        tiers = disk_tier(llm)
        assert tiers.counters["disk"].hits == 40 // 4  # the 10 full blocks of ``first``
        assert tiers.num_prefetched == 10  # loaded off the engine thread, while it waited
        llm.engine.kv.check_integrity()
        gauges, totals = EngineMetrics.state(llm.engine)
    assert totals['kvflow_kv_tier_hits_total{medium="disk"}'] == 10
    assert totals['kvflow_kv_tier_loaded_bytes_total{medium="disk"}'] > 0
    assert totals['kvflow_kv_tier_hits_total{medium="cpu"}'] == 0
    assert gauges['kvflow_kv_tier_usage_bytes{medium="disk"}'] > 0
    assert out.cached_tokens == 40
    assert out.token_ids == cold(engine_dir, [returning])[0]


def test_eviction_to_the_tiers_and_back_under_a_small_pool(engine_dir, tmp_path):
    prompts = [prompt(s, 21) for s in range(6)]
    again = [p + [5, 6] for p in prompts]
    # 15 usable blocks of 4 tokens: each request takes 8, so every prompt evicts the last;
    # the host tier holds 12 blocks of 1 KiB (2 layers, K and V, 4 tokens x 2 heads x 8
    # fp32), so it passes blocks down to the disk too.
    with LLM(engine_dir, num_kv_blocks=16, kv_watermark=0.0, kv_cache_dtype="fp32",
             max_num_seqs=1, kv_offload_bytes=12 * 1024, kv_disk_dir=str(tmp_path / "kv"),
             kv_disk_bytes=DISK, debug_checks=True) as llm:
        llm.generate(prompts, GREEDY)
        outs = llm.generate(again, GREEDY)
        tiers = llm.engine.kv.tiers
        tiers.drain()  # the stores' counters are the writer thread's
        assert llm.engine.kv.pool.num_evictions > 0
        assert tiers.counters["cpu"].stored_blocks > 0 and tiers.counters["disk"].stored_blocks > 0
        assert tiers.counters["cpu"].hits + tiers.counters["disk"].hits > 0
        llm.engine.kv.check_integrity()
        shown = engine_state(llm.engine)["tiers"]
    assert [t["medium"] for t in shown] == ["cpu", "disk"]
    assert shown[0]["capacity_bytes"] == 12 * 1024 and 0 < shown[0]["bytes"] <= 12 * 1024
    assert all(o.cached_tokens == 20 for o in outs)
    assert [o.token_ids for o in outs] == cold(engine_dir, again)


def test_a_salted_prefix_is_never_restored_for_another_salt(engine_dir, tmp_path):
    p = prompt(2)
    opts = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=DISK, kv_cache_dtype="fp32")
    with LLM(engine_dir, **opts) as llm:
        llm.generate([p], GREEDY, cache_salts=["tenant-a"])
    with LLM(engine_dir, **opts) as llm:
        other, none, own = llm.generate([p + [1], p + [1], p + [1]], GREEDY,
                                        cache_salts=["tenant-b", None, "tenant-a"])
    assert other.cached_tokens == 0 and none.cached_tokens == 0
    assert own.cached_tokens == 40
    assert own.token_ids == other.token_ids == none.token_ids


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_corrupt_tier_file_is_recomputed_and_counted(engine_dir, tmp_path, damage):
    p = prompt(3)
    opts = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=DISK, kv_cache_dtype="fp32")
    with LLM(engine_dir, **opts) as llm:
        llm.generate([p], GREEDY)
    files = sorted((tmp_path / "kv").rglob("*.kvb"))
    assert files
    for f in files:
        data = bytearray(f.read_bytes())
        if damage == "truncate":
            f.write_bytes(data[:len(data) // 2])
        else:
            data[-5] ^= 0xFF
            f.write_bytes(bytes(data))
    with LLM(engine_dir, **opts) as llm:
        (out,) = llm.generate([p + [4]], GREEDY)
        assert disk_tier(llm).stores[-1].stats.corrupt >= 1
        llm.engine.kv.check_integrity()
    assert out.cached_tokens == 0
    assert out.token_ids == cold(engine_dir, [p + [4]])[0]
