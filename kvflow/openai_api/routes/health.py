"""``GET /health`` (200 once a tritonserver is ready) and ``GET /metrics``: the servers'
Prometheus text, then the frontend's own: requests by endpoint and status, Triton requests in
flight by server, and ``/v1/responses``' store (entries, bytes, evictions)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter
from fastapi.responses import PlainTextResponse

from kvflow.openai_api.frontend import Frontend, fetch_metrics


def router(fe: Frontend) -> APIRouter:
    routes = APIRouter()

    @routes.get("/health")
    async def health() -> Any:
        ready = await fe.pool.ready()
        return PlainTextResponse("ok" if ready else "no tritonserver is ready",
                                 status_code=200 if ready else 503)

    @routes.get("/metrics")
    async def metrics() -> Any:
        texts = await asyncio.gather(*(asyncio.to_thread(fetch_metrics, url)
                                       for url in fe.cfg.metrics_urls))
        own = await asyncio.to_thread(frontend_metrics, fe)
        return PlainTextResponse("".join(texts) + "\n".join(own) + "\n",
                                 media_type="text/plain; version=0.0.4")

    return routes


def frontend_metrics(fe: Frontend) -> list[str]:
    """The frontend's own Prometheus lines."""
    own = ["# HELP kvflow_openai_requests_total OpenAI API requests, by endpoint and "
           "HTTP status.", "# TYPE kvflow_openai_requests_total counter"]
    own += [f'kvflow_openai_requests_total{{endpoint="{e}",status="{s}"}} {n}'
            for (e, s), n in sorted(fe.counts.items())]
    own += ["# HELP kvflow_openai_requests_in_flight Triton requests in flight, by server.",
            "# TYPE kvflow_openai_requests_in_flight gauge"]
    own += [f'kvflow_openai_requests_in_flight{{server="{u}"}} {n}'
            for u, n in zip(fe.cfg.triton_urls, fe.pool.in_flight, strict=True)]
    count, size = fe.store.totals()
    own += ["# HELP kvflow_openai_responses_stored Responses kept for previous_response_id "
            "(/v1/responses, store: true).", "# TYPE kvflow_openai_responses_stored gauge",
            f"kvflow_openai_responses_stored {count}",
            "# HELP kvflow_openai_responses_stored_bytes Their JSON's bytes.",
            "# TYPE kvflow_openai_responses_stored_bytes gauge",
            f"kvflow_openai_responses_stored_bytes {size}",
            "# HELP kvflow_openai_responses_evicted_total Stored responses evicted to keep "
            "the store within its bounds (least recently used first).",
            "# TYPE kvflow_openai_responses_evicted_total counter",
            f"kvflow_openai_responses_evicted_total {fe.store.evictions}"]
    return own
