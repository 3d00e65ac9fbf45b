"""``kvflow dynamo-worker``: kvflow's engine as an NVIDIA Dynamo backend worker.

The worker is Dynamo's *unified backend* contract (``dynamo.common.backend``): Dynamo's Rust
``Worker`` owns the runtime, discovery (etcd), model registration, the endpoint, cancellation
monitoring and shutdown; :class:`KvflowDynamoEngine` supplies the engine. That engine is
kvflow's :class:`~kvflow.orchestrator.async_engine.AsyncLLMEngine` over the same
:func:`~kvflow.orchestrator.llm.create_engine` that the Triton backend runs: one scheduler, one
KV manager, one validation of the sampling options (:mod:`kvflow.dynamo.protocol`).

What the worker gives Dynamo:

- **The model**, registered token-in, token-out (``ModelInput.Tokens``) under a Hugging
  Face-style card folder written from the engine folder (:func:`write_model_card`), so that
  ``python -m dynamo.frontend`` tokenizes, applies the chat template and serves the OpenAI API.
- **KV events** from kvflow's prefix cache (:mod:`kvflow.dynamo.events`): ``BlockStored`` and
  ``BlockRemoved`` as blocks enter and leave the cache, ``AllBlocksCleared`` first; a block
  computed under a LoRA adapter carries its ``lora_id``, and each event its ``medium``: the
  pool, or the host or disk tier (``--kv-offload-bytes``, ``--kv-disk-dir``), whose blocks a
  restarted worker announces at start.
- **LoRA adapters** (``--lora-modules NAME=PATH``): a request selects one by ``lora_name`` (or
  a ``model`` that names it: :func:`~kvflow.dynamo.protocol.lora_name_of`).
- **Its load**: after every step a snapshot of KV blocks used, total and the prefix-cache hit
  rate (the router's load input and Dynamo's ``dynamo_component_*`` gauges), a forward-pass
  metrics record (requests running and waiting, prefill and decode tokens) for Dynamo's planner,
  and every ``kvflow_*`` series of the Triton server on the worker's ``/metrics``
  (``DYN_SYSTEM_PORT``).
- **Cancellation**: a client that goes away (or a frontend that stops the stream) aborts the
  request in the engine, which frees its KV blocks before the next step.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import itertools
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import AsyncGenerator, Collection
from pathlib import Path
from typing import Any

from kvflow.dynamo.events import ZmqEventPublisher
from kvflow.dynamo.protocol import (
    cache_salt_of,
    chunks_of,
    lora_name_of,
    sampling_params_from,
    tenant_of,
    write_model_card,
)
from kvflow.orchestrator.outputs import ErrorCode

log = logging.getLogger("kvflow.dynamo")
SNAPSHOT_PERIOD_S = 0.05  # the load snapshot and forward-pass record, at most this often

try:  # Dynamo is an optional dependency (make dynamo); the CLI says so when it is missing
    from dynamo.common.backend import EngineConfig as DynamoEngineConfig
    from dynamo.common.backend import LLMEngine as DynamoLLMEngine
    from dynamo.common.backend import LlmRegistration, WorkerConfig
    from dynamo.common.backend.publisher import ComponentSnapshot, ZmqSource
    from dynamo.common.utils.token_ids import normalize_request_token_ids
    from dynamo.llm import HttpError
    from dynamo.llm.exceptions import EngineShutdown, InvalidArgument
except ImportError as e:  # pragma: no cover - exercised only without Dynamo
    _DYNAMO_IMPORT_ERROR: ImportError | None = e
    DynamoLLMEngine = object  # type: ignore[misc,assignment]
else:
    _DYNAMO_IMPORT_ERROR = None

def require_dynamo() -> None:
    if _DYNAMO_IMPORT_ERROR is not None:
        raise SystemExit(f"kvflow dynamo-worker needs NVIDIA Dynamo (`make dynamo`): "
                         f"{_DYNAMO_IMPORT_ERROR}")


CARD_FORMAT = 1  # bump when write_model_card writes something else


def model_card_for(config: Any, engine_dir: Path, context_length: int) -> Path:
    """The engine's Dynamo model card folder, written once and shared by its workers.

    Every worker of one model must register the same card (Dynamo's frontend keeps the first
    card's checksum, which covers its path, and rejects workers whose card differs), so the
    card lives at a path fixed by what goes into it: ``dynamo_card_<digest>`` inside the engine
    folder (or, where that is read-only, in ``~/.cache/kvflow``), the digest over the tokenizer
    files, the engine config, the context length and the card format. A rebuilt engine gets a
    card of its own. It is built aside and renamed into place, so workers starting together
    never see half a card.
    """
    import shutil

    h = hashlib.sha256(f"{CARD_FORMAT}:{context_length}".encode())
    for name in ("engine_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        f = engine_dir / name
        h.update(name.encode() + (f.read_bytes() if f.is_file() else b"-"))
    name = f"dynamo_card_{h.hexdigest()[:16]}"
    for parent in (engine_dir.resolve(), Path.home() / ".cache" / "kvflow"):
        card = parent / name
        if (card / "config.json").is_file():
            return card
        try:
            parent.mkdir(parents=True, exist_ok=True)
            staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=parent))
        except OSError:
            continue
        try:
            write_model_card(config, engine_dir, staging, context_length)
            os.rename(staging, card)
        except FileExistsError:  # another worker got there first: its card is the same
            shutil.rmtree(staging, ignore_errors=True)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            if not (card / "config.json").is_file():
                raise OSError(f"writing the Dynamo model card {card}: {e}") from e
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        return card
    raise OSError(f"no writable place for the Dynamo model card of {engine_dir}")


class KvflowDynamoEngine(DynamoLLMEngine):
    """kvflow's engine behind Dynamo's ``LLMEngine`` contract (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, overrides: dict[str, Any]) -> None:
        from kvflow.build.engine_config import EngineConfig

        self.args, self.overrides = args, overrides
        self.engine_dir = Path(args.engine)
        self.config = EngineConfig.load(self.engine_dir)
        self.model_name = args.model_name or self.engine_dir.resolve().name
        # The card's context length is the engine's: the frontend refuses longer prompts.
        max_len = overrides.get("max_model_len") or self.config.limits.max_model_len
        self.card = model_card_for(self.config, self.engine_dir, max_len)
        self.engine: Any = None
        self.aengine: Any = None
        self._ids = itertools.count()
        self._live: dict[str, str] = {}  # Dynamo's request id -> kvflow's, for abort
        self._next_snapshot = 0.0
        self._hook_failures = 0
        self.events: ZmqEventPublisher | None = None
        self._snapshots: Any = None
        self._fpm: Any = None
        self._worker_id = 0
        self._metrics_lock = threading.Lock()
        self._registry: Any = None
        self._collector: Any = None
        self._closed = False
        self.failure: BaseException | None = None  # the engine loop's, if it died

    @classmethod
    async def from_args(cls, argv: list[str] | None = None
                        ) -> tuple[KvflowDynamoEngine, WorkerConfig]:
        from kvflow.dynamo.worker_args import add_worker_args
        from kvflow.orchestrator.options import add_engine_option_args

        p = argparse.ArgumentParser(prog="kvflow dynamo-worker")
        add_worker_args(p)
        add_engine_option_args(p)
        return cls.from_parsed(p.parse_args(argv))

    @classmethod
    def from_parsed(cls, args: argparse.Namespace) -> tuple[KvflowDynamoEngine, WorkerConfig]:
        """The engine (not started) and Dynamo's worker config, from parsed flags."""
        from kvflow.orchestrator.options import engine_overrides

        engine = cls(args, engine_overrides(args))
        config = WorkerConfig(
            namespace=args.namespace, component=args.component, endpoint="generate",
            model_name=str(engine.card), served_model_name=engine.model_name,
            endpoint_types="chat,completions", discovery_backend=args.discovery_backend,
            request_plane=args.request_plane, event_plane=args.event_plane,
            enable_kv_routing=True)
        return engine, config

    # --- lifecycle ------------------------------------------------------------------------
    async def start(self, worker_id: int) -> DynamoEngineConfig:
        from kvflow.observability.metrics import EngineMetrics, MetricsRegistry
        from kvflow.orchestrator.async_engine import AsyncLLMEngine
        from kvflow.orchestrator.llm import create_engine

        self._worker_id = worker_id
        engine = self.engine = await asyncio.to_thread(create_engine, str(self.engine_dir),
                                                       **self.overrides)
        self._registry, self._collector = MetricsRegistry(), EngineMetrics()
        if self.args.kv_events and engine.options.enable_prefix_caching:
            engine.kv.pool.record_events()
            self.events = ZmqEventPublisher(engine.kv.block_size)
            # The KV tiers publish straight from their stores (whichever thread stores); a
            # disk tier first announces the blocks an earlier process left (its headers read).
            for store in engine.kv.tiers.stores if engine.kv.tiers is not None else ():
                await asyncio.to_thread(store.record_events, self.events.put)
        self.aengine = AsyncLLMEngine(engine, step_hook=self._on_step,
                                      on_failure=self._on_engine_failure)
        opts = engine.options
        log.info("kvflow worker %s: %s, %d KV blocks of %d tokens (%s, %d bytes each)",
                 worker_id, self.model_name, engine.kv.pool.num_usable_blocks,
                 engine.kv.block_size, engine.runner.kv_cache_dtype, engine.kv.bytes_per_block)
        return DynamoEngineConfig(
            model=str(self.card), served_model_name=self.model_name,
            llm=LlmRegistration(context_length=opts.max_model_len,
                                kv_cache_block_size=engine.kv.block_size,
                                total_kv_blocks=engine.kv.pool.num_usable_blocks,
                                max_num_seqs=opts.max_num_seqs,
                                max_num_batched_tokens=opts.max_num_batched_tokens))

    async def kv_event_sources(self) -> list[Any]:
        return [] if self.events is None else [ZmqSource(endpoint=self.events.endpoint)]

    def component_metrics_dp_ranks(self) -> list[int]:
        return [0]

    def attach_snapshot_publisher(self, publisher: Any) -> None:
        self._snapshots = publisher

    async def on_endpoint_ready(self, endpoint: Any) -> None:
        try:
            from dynamo._core import FpmDirectPublisher

            self._fpm = FpmDirectPublisher(endpoint, str(endpoint.connection_id()), 1)
        except Exception as e:  # the planner's input only: serving goes on without it
            log.warning("no forward-pass metrics publisher: %r", e)

    async def register_prometheus(self, metrics: Any) -> None:
        labels = {"worker_id": str(self._worker_id), "model": self.model_name}

        def exposition() -> str:
            with self._metrics_lock:
                return self._registry.exposition(labels)

        metrics.register_prometheus_expfmt_callback(exposition)

    async def cleanup(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.aengine is not None:
            await asyncio.to_thread(self.aengine.shutdown)
        elif self.engine is not None:  # start failed after the engine was built
            self.engine.close()
        if self.events is not None:
            self.events.close()
        if self._fpm is not None:
            self._fpm.shutdown()

    # --- requests -------------------------------------------------------------------------
    # Dynamo's LLMEngine types requests and chunks as TypedDicts (GenerateRequest,
    # GenerateChunk); ours are the same wire dicts, built and read as plain dicts.
    async def generate(self, request: dict[str, Any],  # type: ignore[override]
                       context: Any) -> AsyncGenerator[dict[str, Any], None]:
        normalize_request_token_ids(request)  # a packed buffer (DYN_TOKEN_IDS_AS_BYTES) too
        try:
            params = sampling_params_from(request)
            lora_name = lora_name_of(request, self._adapters())
        except ValueError as e:
            raise InvalidArgument(str(e)) from None
        # Dynamo's ids are unique per frontend, not across frontends: ours must be unique.
        dyn_id = str(context.id())
        request_id = f"{dyn_id}-{next(self._ids)}"
        self._live[dyn_id] = request_id
        try:
            stream = self.aengine.add_request(
                request_id, list(request.get("token_ids") or []), params,
                is_cancelled=context.is_stopped, tenant=tenant_of(request),
                cache_salt=cache_salt_of(request), lora_name=lora_name)
        except RuntimeError as e:  # the engine loop is gone: let the frontend go elsewhere
            self._live.pop(dyn_id, None)
            raise EngineShutdown(str(e)) from None
        ended: set[int] = set()
        try:
            async for out in stream:
                if out.error is not None:
                    if out.error_code == ErrorCode.BAD_REQUEST:
                        raise InvalidArgument(out.error)
                    if out.error_code == ErrorCode.OVERLOADED:
                        raise HttpError(503, out.error)
                    raise EngineShutdown(out.error)
                if out.finished and out.aborted and not context.is_stopped():
                    # Aborted by the worker's shutdown, not by the client: an error the
                    # frontend can migrate (--migration-limit), not a short answer.
                    raise EngineShutdown("the worker is shutting down")
                for chunk in chunks_of(out, ended):
                    yield chunk
        finally:
            self._live.pop(dyn_id, None)
            await stream.aclose()  # an early exit aborts the request: its blocks are freed

    def _adapters(self) -> Collection[str]:
        """The LoRA adapters the engine holds (a request's ``model`` may name one). NOTE: read
        off the engine's thread: a name being loaded or unloaded right now may be missed, and
        the engine then answers for it."""
        lora = getattr(self.engine, "lora", None)
        return () if lora is None else lora.adapters.keys()

    async def abort(self, context: Any) -> None:
        request_id = self._live.get(str(context.id()))
        if self.aengine is not None and request_id is not None:
            self.aengine.abort(request_id)

    def _on_engine_failure(self, error: BaseException) -> None:
        """The engine loop died (its waiters have their errors, migrated by the frontend):
        stop the worker as SIGTERM would (Dynamo unregisters it, so no request is routed
        here again), and ``serve`` then exits 1 for a supervisor to restart it."""
        self.failure = error
        log.error("the engine failed (%r): stopping this worker", error)
        os.kill(os.getpid(), signal.SIGTERM)

    # --- after every step (on the engine loop's thread) -----------------------------------
    def _on_step(self, loop: Any, outputs: list[Any]) -> None:
        """After each step: kvflow's series, the KV events, and (at most 20 times a second)
        the load snapshot and the forward-pass record. Never raises: a failure to report must
        not stop the engine (it is logged, the first few times)."""
        try:
            self._report(loop, outputs)
        except Exception:  # noqa: BLE001
            self._hook_failures += 1
            if self._hook_failures <= 5:
                log.exception("reporting after a step failed (%d so far)", self._hook_failures)

    def _report(self, loop: Any, outputs: list[Any]) -> None:
        engine = loop.engine
        with self._metrics_lock:
            self._registry.apply(self._collector.collect(engine, outputs, loop.serving_time_s))
        if self.events is not None:
            self.events.put(engine.kv.pool.take_events())
        now = time.monotonic()
        if now < self._next_snapshot:
            return
        self._next_snapshot = now + SNAPSHOT_PERIOD_S
        pool, counters = engine.kv.pool, engine.counters
        if self._snapshots is not None:
            hit = (counters.prefix_cache_hits / counters.prefix_cache_queries
                   if counters.prefix_cache_queries else None)
            self._snapshots.publish(0, ComponentSnapshot(
                kv_used_blocks=pool.num_used_blocks, kv_total_blocks=pool.num_usable_blocks,
                gpu_cache_usage=pool.usage, dp_rank=0, kv_cache_hit_rate=hit))
        if self._fpm is not None and engine.step_stats:
            self._publish_fpm(engine)

    def _publish_fpm(self, engine: Any) -> None:
        """The last step as Dynamo's planner reads it: what it scheduled (by the step's own
        record) and what waits."""
        sched, last = engine.scheduler, engine.step_stats[-1]
        running = {r.request_id: r for r in sched.running}
        prefill_reqs = prefill_kv = decode_reqs = decode_kv = 0
        for request_id, num_tokens in last.scheduled:
            r = running.get(request_id)
            context = r.num_computed_tokens if r is not None else num_tokens
            if num_tokens > 1 or (r is not None and r.num_output_tokens <= 1):
                prefill_reqs += 1
                prefill_kv += context
            else:
                decode_reqs += 1
                decode_kv += context
        queued = queued_tokens = 0
        for r in sched.waiting:
            queued += 1
            queued_tokens += r.num_prompt_tokens
        self._fpm.publish(
            dp_rank=0, scheduled_num_prefill_requests=prefill_reqs,
            scheduled_sum_prefill_tokens=last.num_prefill_tokens,
            scheduled_sum_prefill_kv_tokens=prefill_kv,
            scheduled_num_decode_requests=decode_reqs,
            scheduled_sum_decode_kv_tokens=decode_kv,
            queued_num_prefill_requests=queued, queued_sum_prefill_tokens=queued_tokens,
            queued_num_decode_requests=0, queued_sum_decode_kv_tokens=0,
            wall_time_secs=last.model_time_s + last.overhead_time_s)


def serve(args: argparse.Namespace) -> int:
    """Run one worker until SIGINT or SIGTERM (Dynamo's Worker drains it, then cleans up)."""
    require_dynamo()
    from dynamo.common.backend.run import run

    engines: list[KvflowDynamoEngine] = []

    async def factory(argv: list[str] | None) -> tuple[KvflowDynamoEngine, WorkerConfig]:
        engine, config = KvflowDynamoEngine.from_parsed(args)
        engines.append(engine)
        return engine, config

    run(KvflowDynamoEngine, engine_factory=factory)
    failure = next((e.failure for e in engines if e.failure is not None), None)
    if failure is not None:
        print(f"kvflow dynamo-worker: the engine failed: {failure!r}", file=sys.stderr)
        return 1
    return 0
