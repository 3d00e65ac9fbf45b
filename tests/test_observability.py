"""What kvflow lets you see: the metric catalogue, the fragmentation gauge, the step timeline
(Chrome Trace Event JSON), the served series that follow from a fixed workload, a real
Prometheus scraping them, and the Grafana dashboard's queries."""

from __future__ import annotations

import json
import re
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from kvflow.kv_manager import KVCacheManager
from kvflow.observability.metrics import METRICS, MetricsRegistry, all_series, series_key
from kvflow.observability.trace_summary import load, summarize
from tests.helpers import post, scrape, wait_for

REPO = Path(__file__).resolve().parents[1]


# --- the fragmentation gauge -----------------------------------------------------------------

def test_fragmentation_equals_a_hand_computed_case():
    kv = KVCacheManager(num_blocks=12, block_size=4)
    assert kv.fragmentation([]) == 0.0  # nothing used
    assert kv.allocate_slots("a", 6)  # blocks [4 tokens][2 tokens]
    assert kv.allocate_slots("b", 12)  # three blocks allocated for 9 tokens: [4][4][1]
    kv.fork("a", "c", 6)  # c shares both of a's blocks, the half-full one included
    # used: 2 (a, shared with c) + 3 (b) = 5 blocks = 20 slots; unfilled: 2 (a's tail, once)
    # + 3 (b's last block) = 5
    filled = [("a", 6), ("b", 9), ("c", 6)]
    assert kv.fragmentation(filled) == pytest.approx(5 / 20)
    # A sequence not listed: its blocks count as full (the gauge never overstates).
    assert kv.fragmentation([("b", 9)]) == pytest.approx(3 / 20)
    kv.free("b")
    assert kv.fragmentation([("a", 6), ("c", 6)]) == pytest.approx(2 / 8)


# --- the catalogue and its text format ------------------------------------------------------

def test_registry_writes_the_prometheus_text_format_of_every_series():
    reg = MetricsRegistry()
    key = series_key("kvflow_iteration_tokens", "kind", "prefill")
    for v in (0, 3, 100, 10**6):
        reg.histograms[key].observe(v)
    text = reg.exposition({"model": "m"})
    samples = {}
    for line in text.splitlines():
        if line.startswith("#"):
            assert re.fullmatch(r"# (HELP|TYPE) kvflow_\w+ .+", line), line
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    names = {k.split("{")[0] for k in samples}
    assert names == set(all_series())
    buckets = [v for k, v in samples.items()
               if k.startswith('kvflow_iteration_tokens_bucket{model="m",kind="prefill"')]
    assert buckets == sorted(buckets) and buckets[-1] == 4  # cumulative, +Inf holds all
    assert samples['kvflow_iteration_tokens_count{model="m",kind="prefill"}'] == 4
    assert samples['kvflow_iteration_tokens_sum{model="m",kind="prefill"}'] == 10**6 + 103
    assert samples['kvflow_iteration_tokens_bucket{model="m",kind="prefill",le="1"}'] == 1
    # Every labeled series exists from the start, at 0.
    assert samples['kvflow_request_success_total{model="m",finished_reason="timeout"}'] == 0


# --- the step timeline -----------------------------------------------------------------------

def check_trace_schema(doc: dict) -> None:
    """The Trace Event format's rules that Perfetto and chrome://tracing rely on."""
    assert isinstance(doc["traceEvents"], list) and doc["traceEvents"]
    for e in doc["traceEvents"]:
        assert e["ph"] in ("X", "M", "C", "i"), e
        assert isinstance(e["pid"], int) and isinstance(e["name"], str)
        if e["ph"] != "M":
            assert isinstance(e["ts"], int | float) and e["ts"] >= 0, e
        if e["ph"] == "X":
            assert isinstance(e["tid"], int) and e["dur"] >= 0, e
        if e["ph"] == "C":
            assert all(isinstance(v, int | float) for v in e["args"].values())
    assert doc["displayTimeUnit"] in ("ms", "ns")


def request_tracks(doc: dict) -> dict[str, list[dict]]:
    """Request id -> its events, in order."""
    names = {e["tid"]: e["args"]["name"].removeprefix("req ") for e in doc["traceEvents"]
             if e["ph"] == "M" and e["pid"] == 2 and e["name"] == "thread_name"}
    tracks: dict[str, list[dict]] = {rid: [] for rid in names.values()}
    for e in doc["traceEvents"]:
        if e["pid"] == 2 and e["ph"] != "M":
            tracks[names[e["tid"]]].append(e)
    return tracks


def trace_ttft_s(events: list[dict]) -> float:
    """Arrival (the start of the first wait) to the end of the chunk that sampled the first
    token, from a request's track."""
    arrival = next(e["ts"] for e in events if e["name"] == "waiting")
    first = next(e for e in events if e["name"] in ("prefill", "recompute")
                 and e["args"]["sampled"])
    return (first["ts"] + first["dur"] - arrival) / 1e6


def step_events(doc: dict) -> list[dict]:
    return [e for e in doc["traceEvents"] if e.get("cat") == "step"]


def test_llm_step_timeline_agrees_with_the_request_metrics(tiny_engines, tmp_path):
    """A run that preempts: the trace loads with the Trace Event schema, each request's TTFT
    from its track equals its metrics' within one step, and every preemption is in it."""
    from kvflow import LLM, SamplingParams

    path = tmp_path / "steps.json"
    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    with LLM(engine, num_kv_blocks=14, max_num_seqs=4, preemption_mode="recompute",
             trace_steps=str(path), debug_checks=True) as llm:
        outs = llm.generate([[1 + i, 2, 3, 4, 5, 6] for i in range(6)],
                            SamplingParams(max_tokens=14, ignore_eos=True, temperature=0.0))
        preemptions = llm.engine.counters.preemptions
        steps = llm.engine.counters.steps
    assert preemptions > 0  # the pool is small enough to force some
    doc = load(path)
    check_trace_schema(doc)
    assert doc["otherData"]["source"] == "engine" and doc["otherData"]["steps"] == steps
    events = step_events(doc)
    assert len(events) == steps
    assert sum(len(e["args"]["preempted"]) for e in events) == preemptions
    longest = max(e["dur"] for e in events) / 1e6
    tracks = request_tracks(doc)
    assert sum(1 for evs in tracks.values() for e in evs if e["name"] == "preempted") \
        == preemptions
    for out in outs:
        evs = tracks[out.request_id]
        assert abs(trace_ttft_s(evs) - out.metrics.ttft_s) <= longest
        finished = [e for e in evs if e["name"] == "finished"]
        assert [e["args"]["reason"] for e in finished] == ["length"]
        # Each token was sampled by a decode step or by the last chunk of a (re)prefill.
        assert sum(e["args"]["tokens"] for e in evs if e["name"] == "decode") + sum(
            1 for e in evs if e["name"] in ("prefill", "recompute") and e["args"]["sampled"]
        ) == 14
    text = summarize(path)
    assert f"{steps} steps from the engine" in text and "| preempted |" in text
    assert "The 10 longest steps" in text


def test_simulated_timeline_is_bounded_and_series_carry_the_catalogue(tmp_path):
    from kvflow.orchestrator.options import EngineOptions
    from kvflow.sim.cost_model import LINEAR_FEATURES, LinearCostModel
    from kvflow.sim.simulator import simulate
    from kvflow.workloads.specs import RequestSpec

    specs = [RequestSpec(0.01 * i, 40 + 7 * i, 12) for i in range(20)]
    cost = LinearCostModel(dict.fromkeys(LINEAR_FEATURES, 1e-3))
    path = tmp_path / "sim.json"
    sched = EngineOptions(max_num_seqs=8, max_num_batched_tokens=128, trace_steps=str(path),
                          trace_max_steps=25)
    result = simulate(specs, cost, sched, num_blocks=40, block_size=16)
    doc = load(path)
    check_trace_schema(doc)
    assert doc["otherData"]["source"] == "simulator"
    assert len(step_events(doc)) == 25  # the ring: the last 25 steps
    assert doc["otherData"]["dropped_steps"] == len(result.steps) - 25
    assert [e["args"]["step"] for e in step_events(doc)] == list(
        range(len(result.steps) - 24, len(result.steps) + 1))
    # The simulator's server series: every series of the catalogue, under its name.
    last = result.series[-1]
    for m in METRICS.values():
        for key in m.series():
            if m.kind == "histogram":
                name, brace, labels = key.partition("{")
                assert f"{name}_count{brace}{labels}" in last, key
            else:
                assert key in last, key
    assert last[series_key("kvflow_request_success_total", "finished_reason", "length")] == 20
    assert last["kvflow_request_generation_tokens_sum"] == 20 * 12
    assert last["kvflow_request_prompt_tokens_sum"] == sum(s.prompt_tokens for s in specs)
    assert last['kvflow_iteration_tokens_sum{kind="prefill"}'] \
        == last["kvflow_prompt_tokens_total"]
    assert last['kvflow_iteration_tokens_count{kind="decode"}'] == len(result.steps)
    assert last["kvflow_decode_itl_with_prefill_seconds_count"] \
        + last["kvflow_decode_itl_without_prefill_seconds_count"] \
        == last["kvflow_inter_token_latency_seconds_count"] == 20 * 11


def sim_engine(tmp_path, **options):
    from kvflow.orchestrator.engine import LLMEngine
    from kvflow.orchestrator.options import EngineOptions
    from kvflow.sim.cost_model import LINEAR_FEATURES, LinearCostModel
    from kvflow.sim.runner import SIM_EOS, SimClock, SimRunner, sim_engine_config

    clock = SimClock()
    sched = EngineOptions(max_num_seqs=8, max_num_batched_tokens=64,
                          trace_steps=str(tmp_path / "t.json"), **options)
    runner = SimRunner(sim_engine_config(4, 256, 64, 8), 40,
                       LinearCostModel(dict.fromkeys(LINEAR_FEATURES, 1e-3)), clock)
    return LLMEngine(runner, None, sched, (SIM_EOS,), clock=clock), clock


def test_an_end_between_steps_is_drawn_before_the_ring_starts(tmp_path):
    """An abort between steps rides on the next step's record; when that step is the oldest
    the ring kept, the abort is still drawn, at a timestamp >= 0."""
    from kvflow import SamplingParams

    engine, clock = sim_engine(tmp_path, trace_max_steps=1)
    for rid in ("stay", "gone"):
        engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=50, ignore_eos=True),
                           request_id=rid)
    engine.step()
    engine.abort_request("gone")
    clock.now += 1.0
    engine.step()
    doc = load(engine.write_trace())
    check_trace_schema(doc)
    ends = {rid: [e["args"]["reason"] for e in evs if e["name"] == "finished"]
            for rid, evs in request_tracks(doc).items()}
    assert ends == {"gone": ["abort"], "stay": []}


def test_timeline_of_a_group_and_an_abort(tmp_path):
    from kvflow import SamplingParams

    engine, _ = sim_engine(tmp_path)
    engine.add_request(list(range(1, 9)), SamplingParams(n=3, max_tokens=1, ignore_eos=True),
                       request_id="g")
    engine.add_request(list(range(1, 9)), SamplingParams(max_tokens=50, ignore_eos=True),
                       request_id="gone")
    engine.step()
    engine.step()
    engine.abort_request("gone")
    engine.abort_request("g")  # already ended: no second mark
    doc = load(engine.write_trace())
    check_trace_schema(doc)
    ends = {rid: [e["args"]["reason"] for e in evs if e["name"] == "finished"]
            for rid, evs in request_tracks(doc).items()}
    assert ends == {"g#0": ["length"], "g#1": ["length"], "g#2": ["length"],
                    "gone": ["abort"]}
    assert engine.counters.finished_by_reason == {"length": 1, "abort": 1}


# --- served: the series follow from the workload, Prometheus scrapes them --------------------

def series(server) -> dict[str, float]:
    """The server's kvflow_* series by the catalogue's keys (``model`` dropped; no buckets)."""
    out = {}
    for key, value in scrape(server).items():
        name, _, labels = key.partition("{")
        pairs = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        pairs.pop("model", None)
        if "le" not in pairs:
            out[series_key(name, *next(iter(pairs.items()))) if pairs else name] = value
    return out


PROMPTS = ["The history of paged attention", "Explain continuous batching",
           "Write a haiku about GPUs", "What is a KV cache?", "Name three prime numbers",
           "Describe the scheduler of an LLM server"]
MAX_TOKENS = [64, 12, 20, 8, 16, 10]


@pytest.mark.slow
def test_served_series_follow_from_a_fixed_workload(triton_server, default_engines):
    """Six requests (the first decoding while the others prefill), one refused by admission
    and one by the front door: every new series moves as the workload says."""
    from kvflow.client import stream_generate
    from kvflow.text.tokenizer import EngineTokenizer, tokenize_prompt

    tok = EngineTokenizer(default_engines["onnxruntime"])
    prompt_tokens = [len(tokenize_prompt(tok, p)) for p in PROMPTS]
    def settled() -> dict[str, float] | None:
        """Idle, and published: two scrapes agree (the metrics thread lags the engine)."""
        a = series(triton_server)
        time.sleep(0.3)
        b = series(triton_server)
        idle = b["kvflow_num_requests_running"] == 0 == b["kvflow_num_requests_waiting"]
        return b if idle and a == b else None

    before = wait_for(settled, what="an idle server")

    finals = {}

    def send(i: int) -> None:
        *_, finals[i] = stream_generate(
            triton_server.grpc_url, PROMPTS[i],
            {"max_tokens": MAX_TOKENS[i], "ignore_eos": True, "temperature": 0.0},
            request_id=f"obs-{i}")

    first = threading.Thread(target=send, args=(0,))
    first.start()
    # NOTE: so that its decodes share steps with the others' prefills (the split of the ITL
    # below is checked against the timeline, not assumed).
    wait_for(lambda: series(triton_server)["kvflow_generation_tokens_total"]
             > before["kvflow_generation_tokens_total"] or not first.is_alive(),
             what="the first request decoding")
    rest = [threading.Thread(target=send, args=(i,)) for i in range(1, len(PROMPTS))]
    for t in rest:
        t.start()
    for t in [first, *rest]:
        t.join()
    assert [finals[i].num_input_tokens for i in range(len(PROMPTS))] == prompt_tokens
    assert post(triton_server, {"text_input": "x " * 1100})[0] == 400  # over max_model_len
    assert post(triton_server, {"text_input": "x", "max_tokens": 0})[0] == 400  # malformed
    n = len(PROMPTS)
    key_len = series_key("kvflow_request_success_total", "finished_reason", "length")
    key_bad = series_key("kvflow_request_rejected_total", "reason", "bad_request")
    after = wait_for(lambda: (s := series(triton_server))[key_len] - before[key_len] == n
                     and s[key_bad] - before[key_bad] == 2 and s, what="the workload counted")

    def d(key: str) -> float:
        return after[key] - before.get(key, 0.0)

    for reason in ("stop", "abort", "timeout"):
        assert d(series_key("kvflow_request_success_total", "finished_reason", reason)) == 0
    for name in ("kvflow_request_prompt_tokens", "kvflow_request_generation_tokens",
                 "kvflow_time_per_output_token_seconds", "kvflow_request_prefill_time_seconds",
                 "kvflow_request_decode_time_seconds", "kvflow_e2e_request_latency_seconds",
                 "kvflow_time_to_first_token_seconds"):
        assert d(f"{name}_count") == n, name
    assert d("kvflow_request_prompt_tokens_sum") == sum(prompt_tokens)
    assert d("kvflow_request_generation_tokens_sum") == sum(MAX_TOKENS)
    assert d("kvflow_generation_tokens_total") == sum(MAX_TOKENS)
    steps = d("kvflow_engine_steps_total")
    for key in ('kvflow_iteration_tokens_count{kind="prefill"}',
                'kvflow_iteration_tokens_count{kind="decode"}',
                "kvflow_schedule_time_seconds_count", "kvflow_model_time_seconds_count",
                "kvflow_sampling_time_seconds_count", "kvflow_postprocess_time_seconds_count",
                "kvflow_iteration_num_seqs_count"):
        assert d(key) == steps, key
    assert d('kvflow_iteration_tokens_sum{kind="prefill"}') == d("kvflow_prompt_tokens_total")
    decodes = sum(MAX_TOKENS) - n  # every token after a request's first
    assert d('kvflow_iteration_tokens_sum{kind="decode"}') == decodes
    with_prefill = d("kvflow_decode_itl_with_prefill_seconds_count")
    assert with_prefill + d("kvflow_decode_itl_without_prefill_seconds_count") \
        == d("kvflow_inter_token_latency_seconds_count") == decodes
    assert after["kvflow_kv_cache_fragmentation_ratio"] == 0.0  # nothing holds blocks now
    assert 0 < d("kvflow_schedule_time_seconds_sum") < d("kvflow_engine_step_seconds_total")

    # The step timeline, written now on SIGUSR1: the same requests, the same TTFTs.
    trace = Path(triton_server.cfg.engine_args["trace_steps"])
    mtime = trace.stat().st_mtime_ns if trace.exists() else 0
    assert triton_server.write_trace() == 1
    wait_for(lambda: trace.exists() and trace.stat().st_mtime_ns != mtime,
             what="the timeline")
    doc = load(trace)
    check_trace_schema(doc)
    longest = max(e["dur"] for e in step_events(doc)) / 1e6
    tracks = {rid.rsplit("-", 1)[0]: evs for rid, evs in request_tracks(doc).items()
              if rid.startswith("obs-")}
    assert sorted(tracks) == sorted(f"obs-{i}" for i in range(n))
    for i in range(n):
        evs = tracks[f"obs-{i}"]
        assert [e["args"]["reason"] for e in evs if e["name"] == "finished"] == ["length"]
        assert sum(e["args"]["tokens"] for e in evs if e["name"] == "decode") \
            == MAX_TOKENS[i] - 1
        assert not any(e["name"] == "preempted" for e in evs)
    ttft_trace = sum(trace_ttft_s(evs) for evs in tracks.values())
    assert abs(ttft_trace - d("kvflow_time_to_first_token_seconds_sum")) <= n * longest
    # The decodes made in steps that also prefilled ("mixed"): the with-prefill ITL's count.
    mixed = sum(1 for e in step_events(doc) if e["name"] == "mixed"
                for r in e["args"]["requests"] if r.startswith("obs-") and " decode " in r)
    assert mixed == with_prefill


def grafana_exprs() -> list[str]:
    doc = json.loads((REPO / "deploy/grafana/kvflow.json").read_text())
    assert doc["panels"], "no panels"
    exprs = []
    for panel in doc["panels"]:
        assert panel["title"] and panel["targets"], panel
        exprs += [t["expr"] for t in panel["targets"]]
    return exprs


def test_readme_documents_every_series():
    readme = (REPO / "README.md").read_text()
    missing = [name for name in METRICS if f"`{name}" not in readme]
    assert not missing, f"README's metrics table lacks {missing}"


def test_grafana_dashboard_queries_name_exported_series():
    exported = set(all_series())
    doc = json.loads((REPO / "deploy/grafana/kvflow.json").read_text())
    titles = " | ".join(p["title"] for p in doc["panels"]).lower()
    for topic in ("first token", "inter-token", "end-to-end", "running and waiting",
                  "fragmentation", "prefix cache hit", "tokens per step", "preemptions"):
        assert topic in titles, topic
    ids = [p["id"] for p in doc["panels"]]
    assert len(ids) == len(set(ids))
    for expr in grafana_exprs():
        names = set(re.findall(r"\bkvflow_\w+", expr))
        assert names and names <= exported, (expr, names - exported)
    assert {n for e in grafana_exprs() for n in re.findall(r"\bkvflow_\w+", e)} >= {
        f"{m.name}_bucket" if m.kind == "histogram" else m.name
        for m in METRICS.values() if m.name in (
            "kvflow_kv_cache_fragmentation_ratio", "kvflow_request_rejected_total",
            "kvflow_request_timeout_total", "kvflow_num_preemptions_total",
            "kvflow_time_to_first_token_seconds", "kvflow_inter_token_latency_seconds")}


@pytest.mark.slow
def test_prometheus_scrapes_every_series(triton_server, tmp_path):
    """Debian's prometheus (the Makefile installs it) with deploy/prometheus.yml pointed at the
    server: a PromQL query over each series answers, and each dashboard query parses."""
    import shutil

    from kvflow.utils.procs import free_port, spawn

    binary = shutil.which("prometheus")
    if binary is None:  # `make test` installs it where it can (as root, as in CI)
        pytest.skip("prometheus is not installed (make prometheus installs Debian's package)")
    target = urllib.parse.urlsplit(triton_server.metrics_url).netloc
    config = (REPO / "deploy/prometheus.yml").read_text()
    assert '"127.0.0.1:8002"' in config
    config = config.replace('"127.0.0.1:8002"', f'"{target}"').replace(
        "scrape_interval: 5s", "scrape_interval: 1s")
    (tmp_path / "prometheus.yml").write_text(config)
    port = free_port()
    with open(tmp_path / "log", "wb") as log:
        proc = spawn(
            subprocess.Popen,
            [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
             f"--storage.tsdb.path={tmp_path / 'data'}",
             f"--web.listen-address=127.0.0.1:{port}"],
            stdout=subprocess.DEVNULL, stderr=log, start_new_session=True)
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(expr: str) -> dict:
        url = f"{api}/query?" + urllib.parse.urlencode({"query": expr})
        try:
            return json.loads(urllib.request.urlopen(url, timeout=10).read())
        except urllib.error.HTTPError as e:
            return json.loads(e.read())
        except OSError:
            return {"status": "down"}

    try:
        post(triton_server, {"text_input": "Hello", "max_tokens": 4})
        for m in METRICS.values():
            if m.dynamic:  # a series per adapter name: none without one loaded
                continue
            expr = f"{m.name}_count" if m.kind == "histogram" else m.name
            result = wait_for(lambda e=expr: (r := query(e))["status"] == "success"
                              and r["data"]["result"], what=f"a PromQL answer for {expr}")
            assert all(s["metric"]["model"] == "kvflow" for s in result)
            if m.label is not None:
                assert {s["metric"][m.label] for s in result} == set(m.values)
        for expr in grafana_exprs():
            expr = expr.replace("$__rate_interval", "1m").replace("$model", ".*")
            reply = query(expr)
            assert reply["status"] == "success", (expr, reply)
    finally:
        proc.terminate()
        proc.wait(30)
