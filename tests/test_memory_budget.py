"""The KV pool sized from memory (issue 44): the fraction cap, the refusal with its numbers,
the overrides, and the one-line budget."""

import pytest

from kvflow.orchestrator.llm import plan_engine
from kvflow.orchestrator.memory_budget import (
    MemoryBudgetError,
    available_host_memory,
    size_pool,
)

GB = 10**9
BLOCK = 2 << 20  # 2 MB a block of 16 tokens: 131 KB a token (a 1B model's fp16 KV is 32 KB)


def _size(**kw):
    args = dict(weights=1 * GB, available=8 * GB, bytes_per_block=BLOCK, block_size=16,
                max_model_len=4096, max_num_seqs=64, fraction=0.5, kv_cache_bytes=None,
                num_kv_blocks=None, swap_bytes=256 << 20)
    args.update(kw)
    return size_pool(**args)


@pytest.mark.parametrize("fraction", [0.01, 0.1, 0.5, 0.9, 1.0])
@pytest.mark.parametrize("available", [3 * GB, 8 * GB, 24 * GB, 200 * GB])
def test_pool_never_exceeds_the_fraction_of_what_the_weights_leave(fraction, available):
    budget = _size(fraction=fraction, available=available)
    free = available - 1 * GB - (256 << 20)
    seq_blocks = 4096 // 16 + 1
    pool = budget.num_blocks * BLOCK
    assert budget.num_blocks <= 64 * 256 + 1  # never more than the sequences could use
    if budget.sized_by == "memory" and budget.num_blocks > seq_blocks:
        assert pool <= fraction * free
    # One full-length sequence always fits (or the engine is refused).
    assert budget.num_blocks >= seq_blocks
    assert budget.num_host_blocks == (256 << 20) // BLOCK


def test_pool_holds_what_the_sequences_need_when_memory_allows():
    budget = _size(available=200 * GB, max_num_seqs=4, max_model_len=1024)
    assert budget.sized_by == "max_num_seqs" and budget.num_blocks == 4 * 64 + 1
    assert budget.pool_tokens == 4 * 1024


def test_refusal_names_weights_kv_per_token_and_available():
    with pytest.raises(MemoryBudgetError) as e:
        _size(weights=7 * GB, available=7 * GB + 100 * (1 << 20))
    msg = str(e.value)
    for part in ("weights 7.00 GB", "max_model_len=4096", "131.07 KB per token",
                 "swap_space_bytes 268.44 MB", "7.10 GB available"):
        assert part in msg, msg


def test_overrides_are_taken_as_given():
    assert _size(num_kv_blocks=40).num_blocks == 40
    by_bytes = _size(kv_cache_bytes=100 * BLOCK)
    assert (by_bytes.num_blocks, by_bytes.sized_by) == (100, "kv_cache_bytes")
    assert _size(kv_cache_bytes=10**6 * BLOCK).num_blocks == 64 * 256 + 1  # capped at the need
    with pytest.raises(ValueError, match="kv_cache_bytes .* at least 2"):
        _size(kv_cache_bytes=BLOCK)
    device = _size(available=None)  # a GPU pool: the fixed default
    assert device.sized_by == "device" and device.num_blocks == (1 << 30) // BLOCK


def test_available_memory_is_positive_and_at_most_the_machine():
    with open("/proc/meminfo") as f:
        total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal"))
    assert 0 < available_host_memory() <= total


def test_plan_sizes_a_real_engine_and_describes_it(tiny_engines):
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    plan = plan_engine(engine, max_num_seqs=4)
    budget = plan.budget
    seq_blocks = -(-plan.scheduler.max_model_len // budget.block_size)
    assert budget.sized_by == "max_num_seqs" and plan.num_blocks == 4 * seq_blocks + 1
    assert budget.weights_bytes > 0
    line = budget.describe()
    assert line.startswith("memory budget: weights ") and f"{budget.pool_tokens} tokens" in line
    small = plan_engine(engine, max_num_seqs=4, kv_cache_memory_fraction=1e-9)
    assert small.num_blocks == seq_blocks + 1 and small.budget.sized_by == "memory"
    with pytest.raises(ValueError, match="kv_cache_memory_fraction must be in"):
        plan_engine(engine, kv_cache_memory_fraction=1.5)


def test_the_lora_slot_pool_is_set_aside_before_the_kv_pool():
    from kvflow.runtime.lora_pool import LoraPool, fused_groups, module_groups, pool_bytes
    from kvflow.sim.runner import sim_engine_config

    cfg = sim_engine_config(4, 256, 64, 8).model
    for groups in (fused_groups(cfg), module_groups(cfg)):  # the ORT and the torch layouts
        pool = LoraPool(groups, cfg.num_hidden_layers, max_loras=3, max_rank=8)
        try:
            held = sum(x.nbytes for arrays in (pool.a, pool.bt) for x in arrays.values())
        finally:
            pool.close()
        assert pool_bytes(cfg, 3, 8) == held
    plain, lora = _size(available=4 * GB), _size(available=4 * GB, lora_bytes=1 * GB)
    assert lora.sized_by == plain.sized_by == "memory"
    assert lora.num_blocks < plain.num_blocks and "LoRA slots" in lora.describe()
    with pytest.raises(MemoryBudgetError, match="LoRA slots"):
        _size(available=2 * GB, lora_bytes=1 * GB)
