"""The engine's KV tiers (``kv_offload_bytes``, ``kv_disk_dir``): the stores made from the
options, under a namespace that pins the engine, the runner and the KV layout."""

from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor

from kvflow.kv_manager import KVCacheManager
from kvflow.kv_manager.tier_disk import DiskBlockStore
from kvflow.kv_manager.tier_store import BlockStore, HostBlockStore, tier_namespace
from kvflow.kv_manager.tiers import KVTiers
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.scheduler.output import SchedulerOutput
from kvflow.runtime.base import ModelRunner


def runner_namespace(runner: ModelRunner) -> bytes:
    """The disk tier's namespace of ``runner``'s KV: its model (the checkpoint's digest), its
    engine build (the whole engine config), the runner (kernels differ in the last bits), the
    KV dtype and the block size. Any difference gives another folder: never a misread."""
    engine = runner.engine
    build = hashlib.sha256(json.dumps(engine.to_dict(), sort_keys=True).encode()).hexdigest()
    return tier_namespace({
        "model": str(engine.source.get("sha256", "")), "build": build,
        "runner": runner.name, "kv_dtype": runner.kv_cache_dtype,
        "block_size": str(runner.block_size)})


def attach_tiers(kv: KVCacheManager, options: EngineOptions, runner: ModelRunner) -> None:
    """Give ``kv`` the tiers the options ask for (:func:`make_tiers`), if any."""
    tiers = make_tiers(options, runner)
    if tiers is not None:
        kv.attach_tiers(tiers)


def make_tiers(options: EngineOptions, runner: ModelRunner) -> KVTiers | None:
    """The tiers the options ask for (host above disk), or None: none asked, or no prefix
    cache to keep."""
    if not options.enable_prefix_caching or not (options.kv_offload_bytes or
                                                 options.kv_disk_dir):
        return None
    try:  # refuse at start, not at the first eviction
        runner.read_blocks([])
    except NotImplementedError as e:
        raise ValueError(f"kv_offload_bytes / kv_disk_dir: {e}; use the onnxruntime, torch, "
                         "triton or tensorrt runner, or turn the tiers off") from None
    stores: list[BlockStore] = []
    if options.kv_offload_bytes:
        stores.append(HostBlockStore(options.kv_offload_bytes))
    if options.kv_disk_dir is not None:
        stores.append(DiskBlockStore(options.kv_disk_dir, options.kv_disk_bytes,
                                     runner_namespace(runner)))
    # One loader and one writer thread: tier reads and writes (a file, a checksum, a host
    # copy) leave the engine thread free; one writer keeps the stores' LRU order the
    # evictions'.
    return KVTiers(stores, runner.read_blocks,
                   loader=ThreadPoolExecutor(1, thread_name_prefix="kvflow-kv-tiers"),
                   writer=ThreadPoolExecutor(1, thread_name_prefix="kvflow-kv-tier-writer"))


def after_schedule(kv: KVCacheManager, runner: ModelRunner, sched: SchedulerOutput) -> None:
    """The tiers' part of a step, after the scheduler's transfers (which free blocks) and
    before the model runs: write the restored prefixes into the pool. When nothing runs and
    nothing timed out, a waiting request's prefix may be loading: wait (bounded,
    :meth:`~kvflow.kv_manager.tiers.KVTiers.wait_for_loads`) for a load rather than have the
    engine loop spin on empty steps."""
    tiers = kv.tiers
    if tiers is None:
        return
    tiers.flush_restores(runner.write_blocks)
    if sched.is_empty and not sched.timed_out:
        tiers.wait_for_loads()


def close_tiers(kv: KVCacheManager) -> None:
    """Detach and close ``kv``'s tiers, first writing the blocks cached in the pool and the
    host tier to the disk tier (when there is one): the next process on the same
    ``kv_disk_dir`` finds them. Runs before the runner closes (it reads the pool)."""
    tiers = kv.tiers
    if tiers is None:
        return
    kv.tiers, kv.pool.on_evict_block = None, None
    try:
        if tiers.stores[-1].medium == "disk":
            tiers.persist(kv.pool)
    finally:
        tiers.close()
