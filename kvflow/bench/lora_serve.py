"""The served runs of the multi-LoRA benchmark (``benchmarks/lora.py``).

Each run starts a fresh ``kvflow serve`` (tritonserver) with its adapters loaded and its
``max_loras``, warms it (one request of the base and one of each adapter, so that the slot pool
starts full as in a server that has been up a while), then drives it with the load generator
(:func:`kvflow.loadgen.sender.run_load`, a closed loop of ``concurrency`` streams over Triton
gRPC) while sampling the server's peak RSS. The adapters' swap and eviction counters are read
from ``/metrics`` after the warm-up and after the load: their difference is the load's.
"""

from __future__ import annotations

import random
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from kvflow.bench.machine import PeakRss
from kvflow.loadgen.clients import RequestFailed, TritonGrpcClient
from kvflow.loadgen.sender import run_load
from kvflow.reports.summary import summarize
from kvflow.workloads.specs import RequestSpec

# name in the report -> Prometheus series (counters summed over their labels)
LORA_SERIES = {"swaps": "kvflow_lora_swaps_total", "evictions": "kvflow_lora_evictions_total",
               "resident": "kvflow_lora_resident"}


@dataclass(frozen=True)
class LoraRun:
    """One served configuration: the adapters the server loads (none: LoRA off), its
    ``max_loras``, and the adapters the requests are spread over (none: every request on the
    base)."""

    name: str
    loaded: tuple[str, ...] = ()
    max_loras: int | None = None
    mix: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        missing = [m for m in self.mix if m not in self.loaded]
        if missing:
            raise ValueError(f"run {self.name!r}: mix names adapters not loaded: {missing}")
        if self.loaded and (self.max_loras is None or self.max_loras < 1):
            raise ValueError(f"run {self.name!r}: max_loras must be >= 1 with adapters loaded, "
                             f"got {self.max_loras}")


def standard_runs(names: Sequence[str], max_loras: Sequence[int] = (4, 8)) -> list[LoraRun]:
    """The issue's runs: the base alone; one adapter (every request on it); all ``names``
    spread over the requests, once per ``max_loras``."""
    if not names:
        raise ValueError("the benchmark needs at least one adapter")
    one = names[0]
    runs = [LoraRun("base"), LoraRun("1 adapter", (one,), max(1, min(max_loras)), (one,))]
    for m in max_loras:
        runs.append(LoraRun(f"{len(names)} adapters, max_loras {m}", tuple(names), m,
                            tuple(names)))
    return runs


def assign_adapters(num_requests: int, mix: Sequence[str], seed: int) -> list[str | None]:
    """Which adapter each request uses: ``mix`` in equal shares (to within one request), in a
    seeded random order; all None (the base) for an empty mix."""
    if not mix:
        return [None] * num_requests
    order: list[str | None] = [mix[i % len(mix)] for i in range(num_requests)]
    random.Random(seed).shuffle(order)
    return order


class LoraTritonClient(TritonGrpcClient):
    """Triton gRPC streaming whose requests name an adapter: the load generator's per-request
    label (``RequestSpec.tenant``, passed to :meth:`stream` as ``tenant``) is the adapter's name,
    sent as ``sampling_parameters.lora_name`` as Triton's vLLM backend takes it; None: the
    base. (The benchmark has no tenants, so the label is free.)"""

    def stream(self, conn: Any, prompt: str, max_tokens: int,
               tenant: str | None = None) -> Iterator[tuple[int, int]]:
        sampling: dict[str, Any] = {"max_tokens": max_tokens, "temperature": 0.0,
                                    "ignore_eos": True}
        if tenant is not None:
            sampling["lora_name"] = tenant
        try:
            for chunk in conn.generate(prompt, sampling):
                yield chunk.num_output_tokens, chunk.num_input_tokens
        except RuntimeError as e:  # the stream's error, as StreamingClient raises it
            raise RequestFailed("triton error", str(e)) from None


def parse_lora_metrics(text: str) -> dict[str, float | None]:
    """The :data:`LORA_SERIES` values in a Prometheus exposition (each summed over its label
    sets; None when the server does not export it)."""
    out: dict[str, float | None] = dict.fromkeys(LORA_SERIES)
    by_series = {series: key for key, series in LORA_SERIES.items()}
    for line in text.splitlines():
        if line.startswith("#") or not line.strip():
            continue
        key = by_series.get(line.split("{")[0].split(" ")[0])
        if key is not None:
            out[key] = (out[key] or 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def read_lora_metrics(url: str) -> dict[str, float | None]:
    """:func:`parse_lora_metrics` of the server's metrics endpoint now."""
    with urllib.request.urlopen(url, timeout=10) as response:
        return parse_lora_metrics(response.read().decode())


def _stats(summary: dict[str, Any], key: str) -> dict[str, float | None]:
    s = summary[key]
    return {"p50": s["median"], "p99": s["p99"], "mean": s["mean"]}


def served_run(engine_dir: str | Path, run: LoraRun, adapters: Mapping[str, Path],
               specs: Sequence[RequestSpec], prompts: Sequence[str], concurrency: int, *,
               max_lora_rank: int, engine_args: Mapping[str, Any] | None = None,
               seed: int = 0, log_path: Path | None = None) -> dict[str, Any]:
    """Serve ``run`` and drive it; the run's figures (its ``error`` when the server did not
    start, which the report shows instead of figures)."""
    from kvflow.client import StreamingClient
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer

    args = dict(engine_args or {})
    if run.loaded:
        args.update(lora_modules={n: str(adapters[n]) for n in run.loaded},
                    max_loras=run.max_loras, max_lora_rank=max_lora_rank)
    labels = assign_adapters(len(specs), run.mix, seed)
    labelled = [replace(s, tenant=label) for s, label in zip(specs, labels, strict=True)]
    result: dict[str, Any] = {
        "name": run.name, "loaded": list(run.loaded), "max_loras": run.max_loras,
        "mix": list(run.mix), "requests": len(specs),
        "requests_per_adapter": {a: labels.count(a) for a in run.mix} if run.mix else {},
        "engine_args": {k: v for k, v in args.items() if k != "lora_modules"}}
    try:
        cfg = ServerConfig.on_free_ports(engine_dir, args, ready_timeout_s=600)
        server = TritonServer(cfg, log_path=log_path)
        server.start()
    except Exception as e:  # noqa: BLE001  the report says which run could not start, and why
        result["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
        return result
    try:
        assert server.proc is not None
        with StreamingClient(server.grpc_url) as warm:
            for name in (None, *run.loaded):
                sampling: dict[str, Any] = {"max_tokens": 2, "temperature": 0.0}
                if name is not None:
                    sampling["lora_name"] = name
                list(warm.generate(prompts[0], sampling))
        before = read_lora_metrics(server.metrics_url)
        with PeakRss(server.proc.pid) as rss:
            timings, duration = run_load(LoraTritonClient(server.grpc_url), labelled,
                                         list(prompts), concurrency, progress=False)
        after = read_lora_metrics(server.metrics_url)
    except Exception as e:  # noqa: BLE001  a warm-up refused (a bad adapter): said, not fatal
        result["error"] = f"{type(e).__name__}: {' '.join(str(e).split())[:600]}"
        return result
    finally:
        server.stop()
    summary = summarize(timings, duration)
    lora: dict[str, float | None] = {}
    for key in LORA_SERIES:
        b, a = before[key], after[key]
        lora[key] = a if key == "resident" else (None if a is None or b is None else a - b)
    result.update(
        completed=summary["completed"], failed=summary["failed"], duration_s=duration,
        output_tokens=summary["total_output_tokens"],
        output_tok_s=summary["output_token_throughput"],
        ttft_ms=_stats(summary, "ttft_ms"), tpot_ms=_stats(summary, "tpot_ms"),
        itl_ms=_stats(summary, "itl_ms"), lora=lora, peak_rss_bytes=rss.peak_bytes,
        errors=[{"index": i, "kind": t.error_kind, "error": t.error}
                for i, t in enumerate(timings) if not t.ok][:5])
    return result
