"""Driving a running server with a workload: each request sent at its arrival time through a
:class:`~kvflow.loadgen.clients.LoadClient` and timed on the client, while the server's
metrics endpoint is scraped for the running batch, the waiting queue and KV usage."""

from __future__ import annotations

import argparse
import queue
import threading
import time
import urllib.request
from typing import Any

from kvflow.loadgen.clients import LoadClient, OpenAIClient, TritonGrpcClient
from kvflow.reports.summary import RequestTiming
from kvflow.workloads.specs import RequestSpec

SERIES = ("kvflow_num_requests_running", "kvflow_num_requests_waiting",
          "kvflow_kv_cache_usage_ratio")


class MetricsScraper(threading.Thread):
    """Samples the server's running batch, waiting queue and KV usage every ``period_s``;
    a context manager that scrapes while its block runs."""

    def __init__(self, url: str, period_s: float = 0.25) -> None:
        super().__init__(name="kvflow-bench-scraper", daemon=True)
        self.url, self.period_s = url, period_s
        self.samples: list[dict[str, float]] = []
        self._halt = threading.Event()
        self.t0 = time.perf_counter()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                text = urllib.request.urlopen(self.url, timeout=2).read().decode()
                row = {"t_s": time.perf_counter() - self.t0}
                for line in text.splitlines():
                    name = line.split("{")[0].split(" ")[0]
                    if name in SERIES:
                        row[name] = float(line.rsplit(" ", 1)[1])
                self.samples.append(row)
            except OSError:
                pass
            self._halt.wait(self.period_s)

    def stop(self) -> None:
        self._halt.set()
        self.join(5)

    def __enter__(self) -> MetricsScraper:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def run_load(url: str | LoadClient, specs: list[RequestSpec], texts: list[str],
             max_concurrency: int | None,
             progress: bool = True,
             desc: str = "requests") -> tuple[list[RequestTiming], float]:
    """Send request ``i`` (prompt ``texts[i]``, greedy, exactly ``specs[i].output_tokens``) at its
    arrival time, at most ``max_concurrency`` in flight, each client connection reused; returns
    client-side timings (in request order; a failed request's with its error) and the
    duration. All arrivals at 0 with a concurrency bound is a closed loop. ``url``: a Triton
    gRPC ``host:port``, or any :class:`LoadClient`."""
    client = TritonGrpcClient(url) if isinstance(url, str) else url
    limit = threading.BoundedSemaphore(max_concurrency or len(specs))
    clients: queue.SimpleQueue[Any] = queue.SimpleQueue()
    timings: list[RequestTiming | None] = [None] * len(specs)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(specs), desc=desc, unit="req")

    def one(i: int, spec: RequestSpec) -> None:
        send = time.perf_counter()
        times: list[float] = []
        prompt_tokens, error, kind, conn = spec.prompt_tokens, None, None, None
        try:
            try:
                conn = clients.get_nowait()
            except queue.Empty:
                conn = client.connect()
            seen = 0
            for num_output, num_prompt in client.stream(conn, texts[i], spec.output_tokens,
                                                        tenant=spec.tenant):
                now = time.perf_counter()
                times.extend([now] * (num_output - seen))
                seen, prompt_tokens = num_output, num_prompt
            clients.put(conn)
        except Exception as e:  # noqa: BLE001  a failed request is counted, not fatal
            kind = getattr(e, "kind", type(e).__name__)
            error = " ".join(str(e).split()) or kind  # one line, for summary.md
            if conn is not None:
                client.close(conn)
        finally:
            limit.release()
        timings[i] = RequestTiming(send, times, prompt_tokens, len(times), error is None,
                                   error, kind)
        if bar is not None:
            bar.update(1)

    threads = []
    t0 = time.perf_counter()
    for i, spec in enumerate(specs):
        delay = t0 + spec.arrival_s - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        limit.acquire()
        t = threading.Thread(target=one, args=(i, spec), daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()
    duration = time.perf_counter() - t0
    if bar is not None:
        bar.close()
    while True:
        try:
            client.close(clients.get_nowait())
        except queue.Empty:
            break
    return [t for t in timings if t is not None], duration


def load_client(args: argparse.Namespace) -> LoadClient:
    """The client of ``--backend`` (and ``--endpoint``) at ``--url``."""
    if getattr(args, "backend", "triton") == "openai":
        return OpenAIClient(args.url or "http://localhost:9000", chat=args.endpoint == "chat")
    return TritonGrpcClient(args.url or "localhost:8001")
