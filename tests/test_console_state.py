"""The console's snapshot against known engine states, on the simulated runner: requests and
their phases, blocks owned, shared by forks and prefix hits, cached when free, and the grid
summarised when the pool is large."""

from __future__ import annotations

import base64
import json

import pytest

from kvflow import SamplingParams
from kvflow.console.state import engine_state
from kvflow.orchestrator.engine import LLMEngine
from kvflow.orchestrator.options import EngineOptions
from kvflow.sim.cost_model import FixedCostModel
from kvflow.sim.runner import SIM_EOS, SimClock, SimRunner, sim_engine_config

BLOCK = 4


def make_engine(num_blocks: int = 40, **options) -> LLMEngine:
    runner = SimRunner(sim_engine_config(BLOCK, 128, 32, 8), num_blocks, FixedCostModel(1.0),
                       SimClock())
    config = EngineOptions(**{"max_num_seqs": 8, "max_num_batched_tokens": 16,
                              "max_model_len": 128, "debug_checks": True, **options})
    return LLMEngine(runner, None, config, (SIM_EOS,), clock=runner.clock)


def greedy(n: int = 1, max_tokens: int = 20) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, n=n)


def test_requests_phases_and_blocks():
    engine = make_engine()
    engine.add_request(list(range(10, 40)), greedy(), request_id="long", tenant="team-a",
                       priority=2)
    engine.add_request(list(range(50, 56)), greedy(), request_id="short")
    state = engine_state(engine)
    assert [(r["id"], r["state"]) for r in state["requests"]] == [("long", "waiting"),
                                                                   ("short", "waiting")]
    assert state["kv"]["cells"] == "." * 39 and state["kv"]["free"] == 39
    engine.step()  # 16 tokens: the long prompt's first chunk
    state = engine_state(engine)
    long = state["requests"][0]
    assert (long["state"], long["computed_tokens"], long["prompt_tokens"]) == ("prefill", 16,
                                                                                30)
    assert (long["tenant"], long["priority"], long["blocks"]) == ("team-a", 2, 4)
    assert state["steps"][-1]["prefill"] == 16 and state["steps"][-1]["batch"] == 1
    owned = [i for i, c in enumerate(state["kv"]["cells"]) if c == "o"]
    assert len(owned) == state["kv"]["owned"] == 4
    assert all(state["kv"]["owner"][i] == 0 and state["kv"]["refs"][i] == 1 for i in owned)
    while any(r["state"] != "decode" for r in engine_state(engine)["requests"]):
        engine.step()
    state = engine_state(engine)
    assert {r["state"] for r in state["requests"]} == {"decode"}
    assert all(r["ttft_s"] > 0 and r["output_tokens"] >= 1 for r in state["requests"])
    json.dumps(state)  # what the endpoint sends


def test_forks_share_blocks_and_finished_prefixes_stay_cached():
    engine = make_engine(enable_prefix_caching=True)
    engine.add_request(list(range(10, 26)), greedy(n=3, max_tokens=6), request_id="fork")
    engine.step()
    engine.step()
    kv = engine_state(engine)["kv"]
    assert kv["shared"] == 4 and set(kv["refs"][i] for i, c in enumerate(kv["cells"])
                                     if c == "s") == {3}
    while engine.has_unfinished_requests():
        engine.step()
    kv = engine_state(engine)["kv"]
    assert kv["owned"] == kv["shared"] == 0
    assert kv["cached"] >= 4 and kv["free"] + kv["cached"] == kv["num_blocks"]
    # A second request with the same prompt hits the cache: its blocks are owned again.
    engine.add_request(list(range(10, 26)), greedy(max_tokens=2), request_id="hit")
    engine.step()
    state = engine_state(engine)
    assert state["requests"][0]["cached_tokens"] > 0
    assert state["counters"]["prefix_cache_hits"] > 0


def test_the_snapshot_is_bounded_whatever_the_load():
    engine = make_engine(num_blocks=5001, max_num_seqs=64, max_num_batched_tokens=512)
    for i in range(200):
        engine.add_request([7] * 8 + [i], greedy(max_tokens=50), request_id=f"r{i}")
    for _ in range(5):
        engine.step()
    state = engine_state(engine, max_requests=32, max_cells=1000, max_steps=3)
    assert len(state["requests"]) == 32 and state["num_running"] + state["num_waiting"] == 200
    assert [r["state"] for r in state["requests"]][:1] == ["decode"]
    kv = state["kv"]
    assert kv["blocks_per_cell"] == 5 and len(kv["cells"]) == len(kv["refs"]) == 1000
    assert kv["owned"] + kv["shared"] + kv["free"] + kv["cached"] == 5000
    assert kv["cells"].count("o") > 0 and len(state["steps"]) == 3
    assert len(json.dumps(state)) < 64 << 10


# --- served: GET /v1/kvflow/state, fed by the backend over Triton -----------------------------


def _get(url: str, headers: dict | None = None) -> tuple[int, dict]:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}),
                                    timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def watch_a_chat_in_the_state(url: str, user: str) -> tuple[dict, dict, dict]:
    """Send a chat of tenant ``user`` and poll ``url``'s state until it decodes; returns that
    snapshot's server, the request seen, and the server's snapshot once the chat is done. The
    chat is the one request with a tenant (the session's other tests send none meanwhile)."""
    import threading

    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    done = threading.Event()

    def chat() -> None:
        client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "Count to fifty."}],
            max_tokens=200, temperature=0, extra_body={"ignore_eos": True, "user": user})
        done.set()

    thread = threading.Thread(target=chat)
    thread.start()
    seen = None
    while not done.is_set():
        status, body = _get(url + "/v1/kvflow/state")
        assert status == 200, body
        [server] = body["servers"]
        running = [r for r in server["requests"] if r["tenant"] is not None]
        if running and running[0]["state"] == "decode":
            seen = server, running[0]
            break
    thread.join()
    assert seen is not None, "the request never showed as decoding"
    return seen[0], seen[1], _get(url + "/v1/kvflow/state")[1]["servers"][0]


@pytest.mark.slow
def test_the_state_endpoint_shows_requests_running_then_gone(openai_frontend, triton_server):
    """By default a tenant and a request id show hashed: another key holder cannot read them,
    the console still tells them apart (a hash is stable while the frontend lives)."""
    import re

    seen, request, after = watch_a_chat_in_the_state(openai_frontend.url, "console")
    assert seen["url"] == triton_server.grpc_url
    assert re.fullmatch(r"t-[0-9a-f]{12}", request["tenant"]), request
    assert re.fullmatch(r"r-[0-9a-f]{12}", request["id"]), request
    assert "console" not in json.dumps(seen) and "chatcmpl" not in json.dumps(seen)
    assert request["blocks"] > 0 and request["output_tokens"] >= 1
    owners = [i for i, c in enumerate(seen["kv"]["cells"]) if c in "os"]
    assert owners and seen["kv"]["usage"] > 0 and seen["steps"]
    assert all(r["tenant"] is None for r in after["requests"])
    assert after["kv"]["owned"] + after["kv"]["shared"] == after["num_running"] == 0
    _, again, _ = watch_a_chat_in_the_state(openai_frontend.url, "console")
    assert again["tenant"] == request["tenant"] and again["id"] != request["id"]


@pytest.mark.slow
def test_with_console_show_tenants_the_state_shows_them(triton_server, tmp_path):
    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.utils.procs import free_port

    frontend = FrontendProcess(FrontendConfig((triton_server.grpc_url,), port=free_port(),
                                              console_show_tenants=True),
                               log_path=tmp_path / "frontend.log")
    frontend.start()
    try:
        _, request, _ = watch_a_chat_in_the_state(frontend.url, "console")
        assert request["tenant"] == "console" and request["id"].startswith("chatcmpl-")
    finally:
        assert frontend.stop() == 0


def test_the_flag_reaches_the_frontend_from_both_commands():
    from kvflow.cli import make_parser
    from kvflow.openai_api.config import config_from_args

    parser = make_parser()
    assert config_from_args(parser.parse_args(["openai"])).console_show_tenants is False
    assert config_from_args(parser.parse_args(
        ["openai", "--console-show-tenants"])).console_show_tenants is True
    assert parser.parse_args(["serve", "--console-show-tenants"]).console_show_tenants is True


@pytest.mark.slow
def test_with_an_api_key_the_state_needs_it(keyed_server, tmp_path):
    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.utils.procs import free_port

    frontend = FrontendProcess(FrontendConfig((keyed_server.grpc_url,), port=free_port(),
                                              api_key="s3cret-key"),
                               log_path=tmp_path / "frontend.log")
    frontend.start()
    try:
        assert _get(frontend.url + "/v1/kvflow/state")[0] == 401
        status, body = _get(frontend.url + "/v1/kvflow/state",
                            {"Authorization": "Bearer s3cret-key"})
        assert status == 200 and "kv" in body["servers"][0], body
        basic = "Basic " + base64.b64encode(b"me:s3cret-key").decode()
        assert _get(frontend.url + "/v1/kvflow/state", {"Authorization": basic})[0] == 401
    finally:
        assert frontend.stop() == 0


def test_a_simulated_run_feeds_the_same_console():
    """``kvflow simulate --console``: the run is paced to the wall clock and its engine's
    snapshots are served with the page; a chat gets a 400 (there is no model)."""
    import threading
    import urllib.error
    import urllib.request

    from kvflow.console.replay import ConsoleReplay
    from kvflow.sim.simulator import simulate
    from kvflow.utils.procs import free_port
    from kvflow.workloads.specs import RequestSpec

    console = ConsoleReplay(speed=1.0, port=free_port())
    try:
        specs = [RequestSpec(0.05 * i, 40, 30) for i in range(12)]
        seen: list[dict] = []

        def run() -> None:
            simulate(specs, FixedCostModel(0.01), EngineOptions(max_num_seqs=4,
                                                               max_num_batched_tokens=64),
                     200, block_size=4, on_step=console.on_step)

        thread = threading.Thread(target=run)
        thread.start()
        while thread.is_alive():
            status, body = _get(console.url + "v1/kvflow/state")
            assert status == 200
            server = body["servers"][0]
            if server.get("requests"):
                seen.append(server)
        thread.join()
        assert seen, "no snapshot showed a request"
        assert any(r["state"] == "decode" for s in seen for r in s["requests"])
        assert max(s["num_running"] for s in seen) <= 4
        with urllib.request.urlopen(console.url, timeout=10) as r:
            assert b"kvflow console" in r.read()
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(urllib.request.Request(
                console.url + "v1/chat/completions", b"{}", method="POST"), timeout=10)
        assert e.value.code == 400
    finally:
        console.close()


def test_the_redactor_hashes_tenants_and_ids_with_a_key_of_its_own():
    from kvflow.openai_api.security import StateRedactor

    snapshot = json.dumps({"requests": [{"id": "cmpl-1-0", "tenant": "acme"},
                                        {"id": "cmpl-2-1", "tenant": None},
                                        {"id": "cmpl-3-2", "tenant": "acme"}],
                           "kv": {"owner": [0, 2]}}).encode()
    one, other = StateRedactor(show=False), StateRedactor(show=False)
    server = json.loads(one.server_json("host:8001", snapshot))
    assert server["url"] == "host:8001" and server["kv"] == {"owner": [0, 2]}
    a, b, c = server["requests"]
    assert a["tenant"] == c["tenant"] == "t-" + one.hashed("acme") and b["tenant"] is None
    assert len({a["id"], b["id"], c["id"]}) == 3 and "cmpl" not in json.dumps(server)
    # Another process (another key): other hashes, so none can be looked up across them.
    assert json.loads(other.server_json("h", snapshot))["requests"][0]["tenant"] != a["tenant"]
    shown = json.loads(StateRedactor(show=True).server_json("h", snapshot))
    assert shown["requests"][0] == {"id": "cmpl-1-0", "tenant": "acme"}
