"""kvflow on NVIDIA Dynamo, with real parts: etcd, NATS, two `kvflow dynamo-worker` processes on
the default model, and Dynamo's own frontend (`python -m dynamo.frontend`) with its KV router
and, on the same workers, a round-robin one; the clients are the `openai` package and plain
HTTP. Also the worker's pure parts: the KV event wire format and the request mapping."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import msgspec
import pytest

from kvflow.dynamo.events import block_id, encode_events
from kvflow.dynamo.protocol import chunks_of, sampling_params_from
from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvflow.utils.procs import spawn
from tests.helpers import kvflow_samples, received_events
from tests.helpers import metric as serving_metric

REPO = Path(__file__).resolve().parents[1]


def _dynamo_missing() -> str | None:
    try:
        import dynamo.common.backend  # noqa: F401
        import dynamo.frontend  # noqa: F401
    except ImportError as e:
        return f"NVIDIA Dynamo is not installed (make dynamo): {e}"
    for binary, package in (("etcd", "etcd-server"), ("nats-server", "nats-server")):
        if shutil.which(binary) is None:
            return f"{binary} is not installed (Debian's {package}; make dynamo)"
    return None


needs_dynamo = pytest.mark.skipif(_dynamo_missing() is not None,
                                  reason=_dynamo_missing() or "")


# --- the pure parts ---------------------------------------------------------------------------

def test_kv_events_chain_blocks_in_vllm_wire_format():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    kv.pool.record_events()
    assert kv.allocate_slots("a", 4)
    kv.cache_blocks("a", [5, 6, 7, 8], 4)
    kv.free("a")
    stored = kv.pool.take_events()
    assert kv.allocate_slots("b", 6)  # needs all three blocks: both cached ones are evicted
    removed = kv.pool.take_events()
    wire = encode_events(stored + removed, block_size=2)
    h1, h2 = (block_id(e.block_hash) for e in stored)
    assert wire[0] == ["BlockStored", [h1, h2], None, [5, 6, 7, 8], 2, None, "GPU"]
    assert wire[1][0] == "BlockRemoved" and sorted(wire[1][1]) == sorted([h1, h2])
    assert len(wire) == 2
    assert all(0 <= h < 2**63 for h in (h1, h2))
    # What Dynamo's relay decodes: msgpack of [ts, events, dp_rank].
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode([0.0, wire, 0]))
    assert batch[1][0][0] == "BlockStored" and batch[1][0][2] is None


def test_salted_blocks_are_not_published():
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_caching=True)
    kv.pool.record_events()
    assert kv.allocate_slots("a", 2)
    kv.cache_blocks("a", [1, 2], 2, salt=b"tenant-a")
    assert encode_events(kv.pool.take_events(), 2) == []


def test_dynamo_request_maps_onto_the_one_sampling_validation():
    params = sampling_params_from({
        "token_ids": [1, 2, 3],
        "sampling_options": {"temperature": 0.5, "top_p": 0.9, "seed": 7, "n": None,
                             "guided_decoding": {"choice": ["yes", "no"], "backend": None}},
        "stop_conditions": {"max_tokens": 12, "min_tokens": 2, "stop_token_ids_hidden": [2],
                            "ignore_eos": False},
        "output_options": {"logprobs": None}})
    assert (params.temperature, params.top_p, params.seed) == (0.5, 0.9, 7)
    assert (params.max_tokens, params.min_tokens, params.stop_token_ids) == (12, 2, (2,))
    assert params.structured is not None
    # No max_tokens: until the context is full, as the OpenAI API means it.
    assert sampling_params_from({"token_ids": [1]}).max_tokens is None
    with pytest.raises(ValueError, match="temperature"):
        sampling_params_from({"token_ids": [1], "sampling_options": {"temperature": -1.0}})
    with pytest.raises(ValueError, match="sampling_options.use_beam_search"):
        sampling_params_from({"token_ids": [1], "sampling_options": {"use_beam_search": True}})


def test_chunks_carry_deltas_finish_reason_and_cached_tokens():
    seqs = [CompletionOutput(0, "", [4, 5], "", [5], "length"),
            CompletionOutput(1, "", [6], "", [], None)]
    out = RequestOutput("r", seqs, finished=False, num_prompt_tokens=40,
                        metrics=RequestMetrics(0.0), cached_tokens=32)
    ended: set[int] = set()
    assert chunks_of(out, ended) == [{"token_ids": [5], "index": 0, "finish_reason": "length"}]
    seqs = [CompletionOutput(0, "", [4, 5], "", [], "length"),
            CompletionOutput(1, "", [6, 7], "", [7], "abort")]
    out = RequestOutput("r", seqs, finished=True, num_prompt_tokens=40,
                        metrics=RequestMetrics(0.0), cached_tokens=32)
    (chunk,) = chunks_of(out, ended)  # sequence 0 told its end before: not again
    assert chunk["finish_reason"] == "cancelled" and chunk["index"] == 1
    assert chunk["completion_usage"] == {"prompt_tokens": 40, "completion_tokens": 4,
                                         "total_tokens": 44,
                                         "prompt_tokens_details": {"cached_tokens": 32}}


def test_every_finish_reason_has_a_dynamo_name():
    from kvflow.dynamo.protocol import FINISH_REASONS
    from kvflow.orchestrator.request import RequestStatus

    for status in RequestStatus:
        reason = status.finish_reason
        if reason is not None and status is not RequestStatus.REJECTED:  # rejected: an error
            assert FINISH_REASONS[reason] in ("stop", "length", "cancelled"), reason


def test_zmq_publisher_clears_first_holds_events_and_filters_unknown_removals():
    from kvflow.dynamo.events import ZmqEventPublisher
    from kvflow.kv_manager.block_pool import BlockRemoved, BlockStored

    pub = ZmqEventPublisher(block_size=2)
    a, b, stranger = bytes([1]) * 32, bytes([2]) * 32, bytes([3]) * 32
    pub.put([BlockStored(a, None, (1, 2))])  # before anyone subscribes: held
    # b's parent was never stored (b is dropped), nor was the stranger (its removal too).
    events = received_events(pub, [BlockStored(b, stranger, (5, 6)), BlockRemoved(stranger),
                                   BlockRemoved(a)], 3)
    assert events == [["AllBlocksCleared"],
                      ["BlockStored", [block_id(a)], None, [1, 2], 2, None, "GPU"],
                      ["BlockRemoved", [block_id(a)], "GPU"]]


@pytest.mark.slow
@needs_dynamo
def test_model_card_is_shared_by_path_and_renewed_with_the_engine(default_engines, tmp_path):
    from kvflow.build.engine_config import EngineConfig
    from kvflow.dynamo.worker import model_card_for

    src = Path(default_engines["onnxruntime"])
    engine = tmp_path / "engine"
    engine.mkdir()
    for name in ("engine_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja"):
        (engine / name).write_bytes((src / name).read_bytes())
    config = EngineConfig.load(engine)
    card = model_card_for(config, engine, 1024)
    assert model_card_for(config, engine, 1024) == card  # every worker: the same path
    cfg = json.loads((card / "config.json").read_text())
    assert cfg["max_position_embeddings"] == 1024 and (card / "tokenizer.json").is_file()
    assert "chat_template" in json.loads((card / "tokenizer_config.json").read_text())
    assert model_card_for(config, engine, 2048) != card
    (engine / "chat_template.jinja").write_text("{{ messages }}")  # a rebuilt engine
    assert model_card_for(config, engine, 1024) != card
    assert not list(engine.glob(".dynamo_card_*"))  # no staging folder left


# --- the cluster ------------------------------------------------------------------------------

TOPICS = ["the planets of the solar system", "the history of ancient Rome",
          "cooking fresh pasta at home"]


def system_prompt(topic: int, tag: str) -> str:
    """A long system prompt (about 140 tokens) that starts with ``tag``, so that the two
    frontends' workloads share no prefix beyond the chat template's first block."""
    return f"[{tag}] " + f"You are an expert on {TOPICS[topic]}. " * 14 + "Answer briefly."


def metric(text: str, name: str, **labels: str) -> float:
    """The sum of a kvflow series' samples in Prometheus text, over the labels not given."""
    return serving_metric(kvflow_samples(text), name, **labels)


@pytest.fixture(scope="module")
def cluster(default_engines, tmp_path_factory):
    from kvflow.dynamo.launcher import Cluster

    if _dynamo_missing():
        pytest.skip(_dynamo_missing() or "")
    c = Cluster(str(default_engines["onnxruntime"]), workers=2,
                frontends={"kv": 0, "round-robin": 0}, model_name="smollm2",
                worker_args=["--max-num-seqs", "8"],
                root=tmp_path_factory.mktemp("dynamo-cluster"))
    c.start()
    yield c
    procs = list(c.procs)
    c.stop()
    assert [p.name for p in procs if p.alive] == []  # nothing stays behind


def client(cluster, mode: str):
    from openai import OpenAI

    return OpenAI(base_url=cluster.url(mode), api_key="none", timeout=120, max_retries=0)


def run_prefix_workload(cluster, mode: str, rounds: int = 4) -> list[list[int]]:
    """Three long system prompts, each asked ``rounds`` questions, round by round (prompt 0, 1,
    2, 0, 1, 2, ...), one at a time; each prefix's cached_tokens, in order."""
    c = client(cluster, mode)
    cached: list[list[int]] = [[] for _ in TOPICS]
    for q in range(rounds):
        for t in range(len(TOPICS)):
            r = c.chat.completions.create(
                model="smollm2", max_tokens=2, temperature=0,
                messages=[{"role": "system", "content": system_prompt(t, mode)},
                          {"role": "user", "content": f"Question {q}: one fact, please."}])
            assert r.choices[0].finish_reason in ("length", "stop")
            cached[t].append(r.usage.prompt_tokens_details.cached_tokens)
    return cached


@pytest.mark.slow
@needs_dynamo
def test_kv_router_sends_each_prefix_to_the_worker_that_holds_it(cluster):
    def hits() -> float:
        return sum(metric(cluster.worker_metrics(i), "kvflow_prefix_cache_hits_total")
                   for i in range(2))

    before = hits()
    kv = run_prefix_workload(cluster, "kv")
    after_kv = hits()
    rr = run_prefix_workload(cluster, "round-robin")
    after_rr = hits()
    # The workers' own prefix-hit counters agree with what each response reported.
    assert after_kv - before == sum(map(sum, kv))
    assert after_rr - after_kv == sum(map(sum, rr))
    # The system prompt alone is ~9 blocks: a hit on the worker holding it covers them all.
    full = 16 * 8
    # KV router: after its first request, every request of a prefix finds it cached.
    for seq in kv:
        assert seq[0] < full and all(c >= full for c in seq[1:]), kv
    # Round robin over an odd number of prefixes alternates each prefix between the two
    # workers: its second request lands where the prefix is not, and misses.
    for seq in rr:
        assert seq[1] < full, rr
    assert sum(map(sum, kv)) > sum(map(sum, rr))
    # Both workers served, and each reports its load and cache series.
    for i in range(2):
        text = cluster.worker_metrics(i)
        for name in ("kvflow_num_requests_running", "kvflow_num_requests_waiting",
                     "kvflow_kv_cache_usage_ratio"):
            assert re.search(rf"^{name}{{", text, re.M), name
        assert re.search(r"^dynamo_component_", text, re.M)


@pytest.mark.slow
@needs_dynamo
def test_bad_input_gets_a_clear_error_naming_the_field(cluster):
    """What the frontend lets through, the worker checks (the same validation as Triton's):
    a 400 that names the field and its limit, and the cluster goes on serving."""
    import openai

    c = client(cluster, "kv")
    with pytest.raises(openai.BadRequestError, match="n is 12; max_num_seqs is 8"):
        c.completions.create(model="smollm2", prompt="Hi", max_tokens=2, n=12)
    with pytest.raises(openai.BadRequestError, match="(?s)guided_regex.*unclosed group"):
        c.completions.create(model="smollm2", prompt="Hi", max_tokens=2,
                             extra_body={"guided_regex": "(("})
    r = c.completions.create(model="smollm2", prompt="Hi", max_tokens=2)
    assert r.usage.completion_tokens == 2


@pytest.mark.slow
@needs_dynamo
def test_cancel_mid_stream_frees_the_blocks_on_the_worker(cluster):
    c = client(cluster, "kv")

    def totals() -> tuple[float, float, float]:
        texts = [cluster.worker_metrics(i) for i in range(2)]
        return (sum(metric(t, "kvflow_request_success_total", finished_reason="abort")
                    for t in texts),
                sum(metric(t, "kvflow_num_requests_running") for t in texts),
                sum(metric(t, "kvflow_kv_cache_usage_ratio") for t in texts))

    aborted0 = totals()[0]
    stream = c.completions.create(model="smollm2", prompt="Write a long story about a dragon.",
                                  max_tokens=400, temperature=0.8, seed=1, stream=True,
                                  extra_body={"ignore_eos": True})
    for got, _chunk in enumerate(stream, 1):
        if got == 3:
            break
    running_mid = totals()[1]
    stream.close()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        aborted, running, usage = totals()
        if aborted > aborted0 and running == 0 and usage == 0:
            break
        time.sleep(0.5)
    assert running_mid >= 1
    assert (aborted, running, usage) == (aborted0 + 1, 0, 0)


@pytest.mark.slow
@needs_dynamo
def test_a_killed_worker_is_routed_around_and_nothing_hangs(cluster):
    """Last in this module: it leaves the cluster with one worker."""
    c = client(cluster, "round-robin")
    results: list[object] = []

    def one(i: int) -> None:
        try:
            r = c.completions.create(model="smollm2", prompt=f"Count to {i}:", max_tokens=48,
                                     extra_body={"ignore_eos": True})
            results.append(r.usage.completion_tokens)
        except Exception as e:  # noqa: BLE001  (a request on the killed worker may fail)
            results.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    time.sleep(1.0)
    cluster.kill_worker(0)
    for t in threads:
        t.join(150)
    assert not any(t.is_alive() for t in threads), "a request hung after its worker died"
    # Those on the live worker finished; those on the dead one were moved to it
    # (--migration-limit) or failed fast.
    assert len(results) == 4 and sum(isinstance(r, int) for r in results) >= 2, results
    served0 = metric(cluster.worker_metrics(1), "kvflow_request_success_total")
    # New requests all go to the worker left, and all succeed.
    for i in range(4):
        r = client(cluster, "round-robin").completions.create(
            model="smollm2", prompt=f"Say {i}", max_tokens=3)
        assert r.usage.completion_tokens == 3
    assert metric(cluster.worker_metrics(1), "kvflow_request_success_total") == served0 + 4


@pytest.mark.slow
@needs_dynamo
def test_cluster_up_serves_and_ctrl_c_stops_everything(default_engines, tmp_path):
    proc = spawn(
        subprocess.Popen,
        [sys.executable, "-m", "kvflow.cli", "cluster", "up", "--engine",
         str(default_engines["onnxruntime"]), "--workers", "1", "--http-port", "0",
         "--dir", str(tmp_path / "c")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    url = None
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r"OpenAI API: (http://127\.0\.0\.1:\d+/v1)", line)
            if m:
                url = m.group(1)
                break
        assert url, "".join(lines)
        from openai import OpenAI

        r = OpenAI(base_url=url, api_key="none", max_retries=0).completions.create(
            model=Path(default_engines["onnxruntime"]).name, prompt="Hi", max_tokens=2)
        assert r.usage.completion_tokens == 2
        children = _session_pids(proc.pid)
        assert len(children) >= 4  # etcd, nats, a worker, the frontend
        proc.send_signal(signal.SIGINT)
        assert proc.wait(180) == 0  # a busy 2-core CI machine: etcd, NATS, worker, frontend
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.5)
    assert [p for p in children if _alive(p)] == []  # nothing stays behind


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _session_pids(sid: int) -> list[int]:
    """Live processes whose session or parent chain starts at ``sid``'s processes."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,stat="], capture_output=True, text=True).stdout
    rows = [tuple(line.split()[:3]) for line in out.splitlines() if line.strip()]
    parent = {int(p): int(pp) for p, pp, st in rows if not st.startswith("Z")}
    found = []
    for pid in parent:
        p = pid
        while p > 1:
            if p == sid and pid != sid:
                found.append(pid)
                break
            p = parent.get(p, 0)
    return found


@pytest.mark.slow
@needs_dynamo
def test_a_worker_whose_engine_fails_leaves_the_cluster_and_exits_nonzero(cluster):
    """After the killed-worker test: worker 0 comes back with an engine that fails at its
    third step. Requests it held fail (or migrate); it unregisters and exits 1, and every
    request after that is served by worker 1."""
    from kvflow import envs

    cluster.env[envs.FAIL_AFTER_STEPS] = "2"
    try:
        worker = cluster.start_worker(0)
        cluster.wait_workers(2)
    finally:
        del cluster.env[envs.FAIL_AFTER_STEPS]
    c = client(cluster, "round-robin")
    for i in range(6):  # round robin: some land on worker 0 until it fails
        try:
            c.completions.create(model="smollm2", prompt=f"Count to {i}:", max_tokens=8)
        except Exception:  # noqa: BLE001, S112  (a request held by the failing engine)
            continue
    assert worker.proc is not None and worker.proc.wait(timeout=120) == 1
    assert "the engine failed" in worker.log_path.read_text()
    for i in range(4):
        r = c.completions.create(model="smollm2", prompt=f"Say {i}", max_tokens=3)
        assert r.usage.completion_tokens == 3
