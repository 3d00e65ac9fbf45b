"""What the KV tiers count: a hit is a block restored into the pool, once, whatever was loaded
ahead for it (a prefetch that no restore takes, or a restore that stops early, reads bytes
but hits nothing); the metrics and the console say the same; and an engine whose only request
waits for its prefix to load waits for the load instead of spinning on empty steps."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from kvflow import LLM, SamplingParams
from kvflow.console.state import engine_state
from kvflow.kv_manager import KVCacheManager
from kvflow.kv_manager.tier_store import HostBlockStore
from kvflow.kv_manager.tiers import KVTiers
from kvflow.observability.metrics import EngineMetrics
from kvflow.runtime.kv_cache import HostKVPool
from tests.test_kv_tiers_writer import NUM_BLOCKS, compute

BLOCK = 4
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def finish_loads(tiers: KVTiers) -> None:
    while tiers.wait_for_loads(timeout_s=None):
        pass


def test_hits_count_restored_blocks_once_and_loads_count_what_was_read():
    mem = HostKVPool(num_layers=1, num_blocks=NUM_BLOCKS, block_size=BLOCK, num_kv_heads=1,
                     head_dim=2)
    tiers = KVTiers([HostBlockStore(1 << 20)], mem.read_blocks, loader=ThreadPoolExecutor(1),
                    writer=ThreadPoolExecutor(1))
    kv = KVCacheManager(NUM_BLOCKS, BLOCK, enable_caching=True)
    kv.attach_tiers(tiers)
    a, b = list(range(3, 15)), list(range(50, 62))  # 3 full blocks each
    compute(kv, mem, "a", a + [1])
    kv.free("a")
    compute(kv, mem, "b", b + [1])
    kv.free("b")
    compute(kv, mem, "fill", list(range(100, 124)))  # 6 blocks: a's and b's go to the tier
    kv.free("fill")
    tiers.drain()
    host, size = tiers.counters["cpu"], mem.block_nbytes
    assert host.stored_blocks == 6

    kv.prefetch_prefix("a1", a + [2])
    finish_loads(tiers)
    assert (host.hits, host.loaded_bytes) == (0, 3 * size)  # loaded ahead, nothing restored
    assert kv.restore_prefix("a1", a + [2], b"", max_blocks=1) == 1  # a restore cut short
    assert (host.hits, host.loaded_bytes) == (1, 3 * size)
    assert kv.restore_prefix("a1", a + [2], b"", max_blocks=10) == 2  # the rest, no reread
    assert (host.hits, host.loaded_bytes) == (3, 3 * size)
    tiers.flush_restores(mem.write_blocks)
    kv.free("a1")
    assert kv.restore_prefix("a2", a + [3], b"", max_blocks=10) == 0  # in the pool now
    kv.free("a2")
    kv.prefetch_prefix("b1", b + [2])  # a request that never runs
    finish_loads(tiers)
    kv.free("b1")
    assert (host.hits, host.loaded_bytes) == (3, 6 * size)
    (state,) = tiers.state()
    assert (state["hits"], state["loaded_bytes"]) == (3, 6 * size)
    kv.check_integrity()
    tiers.close()
    mem.close()


@pytest.mark.slow  # two tiny engines, seconds
def test_an_engine_waiting_for_its_prefix_load_waits_instead_of_spinning(tiny_engines,
                                                                          tmp_path):
    engine_dir = tiny_engines["llama-gqa4", "onnxruntime"]
    first = np.random.default_rng(5).integers(3, 300, size=81).tolist()  # 20 full blocks
    opts = dict(kv_disk_dir=str(tmp_path / "kv"), kv_disk_bytes=1 << 24,
                kv_cache_dtype="fp32")
    with LLM(engine_dir, **opts) as llm:
        llm.generate([first], GREEDY)
    with LLM(engine_dir, **opts) as llm:
        engine, tiers = llm.engine, llm.engine.kv.tiers
        # The loader is held back (a task waiting on an event goes first): the request waits.
        gate = threading.Event()
        tiers.loader.submit(gate.wait)
        engine.add_request(first[:80] + [9, 9], GREEDY)
        assert engine.step() == []  # bounded (load_wait_s): arrivals and aborts still go in
        # From here a load ends each empty step, however busy the machine (the bound is not a
        # time): without the wait, the engine would spin until the timer opens the gate.
        tiers.load_wait_s = 60.0
        threading.Timer(0.2, gate.set).start()
        calls, steps = 1, engine.counters.steps
        while engine.has_unfinished_requests():
            engine.step()
            calls += 1
        empty = calls - (engine.counters.steps - steps)
        assert tiers.num_prefetched == 20
        assert empty <= tiers.num_prefetched + 2
        disk = tiers.counters["disk"]
        assert disk.hits == 20 and tiers.stores[0].stats.blocks >= 20
        gauges, totals = EngineMetrics.state(engine)
        shown = engine_state(engine)["tiers"]
    assert totals['kvflow_kv_tier_hits_total{medium="disk"}'] == 20 == shown[0]["hits"]
    assert totals['kvflow_kv_tier_loaded_bytes_total{medium="disk"}'] == shown[0][
        "loaded_bytes"] == disk.loaded_bytes > 0
