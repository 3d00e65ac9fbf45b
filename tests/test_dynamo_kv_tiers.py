"""Dynamo's KV router and kvflow's disk tier, with real parts (etcd, NATS, `kvflow dynamo-worker`
processes on the default model, Dynamo's frontend): a worker restarted on its disk tier
announces the blocks there (``BlockStored``, medium ``CPU_TIER2``), and the router sends each
returning prompt to the worker whose disk holds its prefix."""

from __future__ import annotations

import contextlib
import json
import time
import urllib.error
import urllib.request

import pytest

from kvflow.utils.procs import ServeError
from tests.helpers import kvflow_samples
from tests.helpers import metric as serving_metric
from tests.test_dynamo import _dynamo_missing, needs_dynamo

TOPICS = ["the planets", "ancient Rome", "fresh pasta", "jazz music", "chess openings",
          "volcanoes"]
FULL = 5 * 16  # the shortest system prompt's full blocks, tokens (block size 16)


def ask(cluster, topic: int, question: int) -> int:
    """One chat request on the KV router's frontend; its cached_tokens."""
    from openai import OpenAI

    client = OpenAI(base_url=cluster.url("kv"), api_key="none", timeout=120, max_retries=0)
    r = client.chat.completions.create(
        model="smollm2", max_tokens=2, temperature=0,
        messages=[{"role": "system", "content": f"You are an expert on {TOPICS[topic]}. " * 14},
                  {"role": "user", "content": f"Question {question}: one fact, please."}])
    assert r.usage is not None
    details = r.usage.prompt_tokens_details
    return (details.cached_tokens or 0) if details is not None else 0


def served(cluster, worker: int) -> float:
    return serving_metric(kvflow_samples(cluster.worker_metrics(worker)),
                          "kvflow_request_success_total")


def frontend_json(cluster, path: str) -> dict:
    """A frontend route's JSON, whatever its status (/health is a 503 without workers)."""
    try:
        with urllib.request.urlopen(cluster.frontend_urls["kv"] + path, timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        with e:
            return json.loads(e.read())


def wait_frontend_workers(cluster, n: int, timeout_s: float = 120.0) -> None:
    """Until the frontend lists exactly ``n`` workers' endpoints and each one's KV query
    source (the router's way to read a worker's cache state), and, with workers, the model."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, ValueError):
            kinds = [i["endpoint"] for i in frontend_json(cluster, "/health").get("instances",
                                                                                  [])]
            models = [m.get("id") for m in frontend_json(cluster, "/v1/models").get("data", [])]
            if (kinds.count("generate") == n and (n == 0 or "smollm2" in models)
                    and sum(k.startswith("worker_kv_query_source") for k in kinds) == n):
                return
        time.sleep(0.5)
    raise ServeError(f"the frontend did not list {n} workers in {timeout_s} s")


def restart(cluster, *workers: int) -> None:
    for i in workers:
        cluster.start_worker(i)
    cluster.wait_workers(len(workers))
    wait_frontend_workers(cluster, len(workers))


def stop(cluster, worker: int) -> None:
    """Stop a worker as SIGTERM does (its pool goes to its disk tier), until the frontend has
    let it go."""
    proc = cluster.worker_procs[worker]
    proc.terminate()
    assert proc.stop(120) == 0, proc.tail()
    wait_frontend_workers(cluster, 0)


@pytest.mark.slow
@needs_dynamo
def test_the_kv_router_sends_a_returning_prompt_to_the_disk_tier_that_holds_it(
        default_engines, tmp_path):
    from kvflow.dynamo.launcher import Cluster

    if _dynamo_missing():
        pytest.skip(_dynamo_missing() or "")
    disk = [tmp_path / f"kv-disk-{i}" for i in range(2)]
    cluster = Cluster(
        str(default_engines["onnxruntime"]), workers=1, frontends={"kv": 0},
        model_name="smollm2", worker_args=["--max-num-seqs", "8"],
        worker_extra_args={i: ["--kv-disk-dir", str(d), "--kv-disk-bytes", str(1 << 30)]
                           for i, d in enumerate(disk)},
        root=tmp_path / "cluster")
    procs = []
    try:
        # Each worker alone serves half the topics, and keeps them on its disk at shutdown.
        cluster.start()
        halves = {0: [0, 2, 4], 1: [1, 3, 5]}
        for t in halves[0]:
            ask(cluster, t, 0)
        stop(cluster, 0)
        restart(cluster, 1)
        for t in halves[1]:
            ask(cluster, t, 0)
        stop(cluster, 1)
        assert all(list(d.glob("*/*/*.kvb")) for d in disk)

        # Both back, their pools empty: only their disk tiers, announced at start, tell the
        # router where each topic's system prompt is.
        restart(cluster, 0, 1)
        cached = {t: ask(cluster, t, 1) for t in range(len(TOPICS))}
        assert all(c >= FULL for c in cached.values()), cached
        assert (served(cluster, 0), served(cluster, 1)) == (3, 3)  # each its own half
        procs = list(cluster.procs)
    finally:
        cluster.stop()
    assert [p.name for p in procs if p.alive] == []
