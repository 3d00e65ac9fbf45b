"""The host KV tier in the memory budget: on the host runners the KV pool is host memory, and
so is the host tier (``kv_offload_bytes``), so the pool is sized from what the tier leaves, and
a tier that cannot fit is refused at start with its numbers. A GPU runner's pool is device
memory: its host tier does not shrink it."""

import pytest

from kvflow.orchestrator.llm import plan_engine
from kvflow.orchestrator.memory_budget import MemoryBudgetError, available_host_memory
from tests.test_memory_budget import BLOCK, GB, _size


def test_the_host_tier_is_set_aside_before_the_host_pool_is_sized():
    plain, tiered = _size(available=8 * GB), _size(available=8 * GB, host_tier_bytes=2 * GB)
    assert plain.sized_by == tiered.sized_by == "memory"
    # The pool takes its fraction of what the weights, the swap and the tier leave.
    assert tiered.num_blocks == _size(available=6 * GB).num_blocks < plain.num_blocks
    assert tiered.num_blocks == int((8 * GB - 1 * GB - (256 << 20) - 2 * GB) * 0.5) // BLOCK
    assert tiered.host_tier_bytes == 2 * GB and "host KV tier 2.00 GB" in tiered.describe()
    assert plain.host_tier_bytes == 0 and "host KV tier" not in plain.describe()


def test_a_host_tier_larger_than_the_memory_left_is_refused_with_both_numbers():
    # 8 GB - 1 GB of weights - 268 MB of swap leave 6.73 GB.
    with pytest.raises(MemoryBudgetError) as e:
        _size(available=8 * GB, host_tier_bytes=7 * GB)
    msg = str(e.value)
    for part in ("kv_offload_bytes 7.00 GB", "6.73 GB of host memory left", "8.00 GB available"):
        assert part in msg, msg
    # It fits alone, but not with one full-length sequence's KV (526 MB here).
    with pytest.raises(MemoryBudgetError, match=r"\+ kv_offload_bytes 6.50 GB > 8.00 GB"):
        _size(available=8 * GB, host_tier_bytes=int(6.5 * GB))


def test_a_device_pool_ignores_the_host_tier():
    plain, tiered = _size(available=None), _size(available=None, host_tier_bytes=100 * GB)
    assert tiered.num_blocks == plain.num_blocks == (1 << 30) // BLOCK
    assert tiered.host_tier_bytes == 0 and tiered.sized_by == "device"


def test_a_real_engine_plan_sets_the_host_tier_aside(tiny_engines):
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    plan = plan_engine(engine, max_num_seqs=4, kv_offload_bytes=1 << 20)
    assert plan.budget.host_tier_bytes == 1 << 20
    # No prefix cache: no tier, nothing set aside.
    off = plan_engine(engine, max_num_seqs=4, kv_offload_bytes=1 << 20,
                      enable_prefix_caching=False)
    assert off.budget.host_tier_bytes == 0
    too_big = 2 * available_host_memory()
    with pytest.raises(MemoryBudgetError, match="kv_offload_bytes .* exceeds the .* of host "
                                                "memory left for KV"):
        plan_engine(engine, kv_offload_bytes=too_big)
