"""What the tests share: the scheduler's small factories, the numerics checks, and the
served tests' HTTP and metrics helpers (fixtures live in conftest.py)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence

import numpy as np

from kvflow.kv_manager import KVCacheManager
from kvflow.orchestrator.options import EngineOptions
from kvflow.orchestrator.request import Request
from kvflow.orchestrator.sampling.params import SamplingParams
from kvflow.orchestrator.scheduler.output import RunnerOutput, SchedulerOutput
from kvflow.orchestrator.scheduler.registry import make_scheduler
from kvflow.runtime.base import ModelRunner
from kvflow.runtime.step_builder import SeqChunk, build_step

# The scheduler's factories: hand-built requests, a scheduler on a small KV pool, and a runner
# written by hand (no model). EOS ends a request; TOKEN is what the hand runner samples.
EOS = 2
TOKEN = 7


class FakeClock:
    """A clock the test moves by setting ``now``."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make_scheduler_for_test(num_blocks=64, block_size=4, clock=None, num_host_blocks=0, **cfg):
    """A scheduler over ``num_blocks`` KV blocks, with a 16-token step budget unless ``cfg``
    says otherwise (any other :class:`EngineOptions` field too)."""
    config = EngineOptions(**{"max_num_batched_tokens": 16, "max_model_len": 256,
                                "enable_prefix_caching": False, **cfg})
    kv = KVCacheManager(num_blocks, block_size, enable_caching=config.enable_prefix_caching,
                        num_host_blocks=num_host_blocks, bytes_per_block=1024)
    return make_scheduler(config, kv, clock or FakeClock())


def make_request(rid, prompt_len, max_tokens=4, priority=0, arrival=0.0, tenant=None,
                 **params):
    """A request of ``prompt_len`` distinct prompt tokens; ``params`` are SamplingParams'."""
    return Request(rid, list(range(10, 10 + prompt_len)),
                   SamplingParams(max_tokens=max_tokens, **params), arrival, priority, (EOS,),
                   tenant=tenant)


def run_step(sched, token=TOKEN, tokens=None) -> SchedulerOutput:
    """One step with a runner that samples ``token`` (or ``tokens[request_id]``) for everyone."""
    out = sched.schedule()
    sampled = {s.request.request_id: (tokens or {}).get(s.request.request_id, token)
               for s in out.scheduled if s.sample}
    sched.update_from_output(out, RunnerOutput({rid: [t] for rid, t in sampled.items()}))
    sched.check_integrity()
    return out


def chunks(out: SchedulerOutput) -> dict[str, int]:
    """request id -> tokens scheduled for it in the step ``out``."""
    return {s.request.request_id: s.num_new_tokens for s in out.scheduled}


def greedy_generate(runner: ModelRunner, prompt: Sequence[int], max_new: int,
                    chunk: int | None = None) -> tuple[list[int], list[np.ndarray]]:
    """Greedy tokens of one sequence run alone (prefill in chunks of ``chunk`` tokens)."""
    kv = KVCacheManager(runner.num_blocks, runner.engine.limits.block_size)
    seq, logits_seen = list(prompt), []
    done = 0
    try:
        while len(seq) - len(prompt) < max_new:
            n = len(seq) - done if chunk is None else min(chunk, len(seq) - done)
            assert kv.allocate_slots("s", done + n)
            sample = done + n == len(seq)
            logits = runner.execute(build_step(kv, [SeqChunk("s", seq, done, n, sample)]))
            done += n
            if sample:
                logits_seen.append(logits[0])
                seq.append(int(np.argmax(logits[0])))
    finally:
        kv.free("s")
    return seq[len(prompt):], logits_seen


def first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def assert_same_or_near_tie(ours: Sequence[int], ref: Sequence[int],
                            ref_logits: Sequence[np.ndarray], tol: float = 1e-4) -> None:
    """Token lists equal, or they first differ where the reference's top two are within tol."""
    i = first_divergence(ours, ref)
    if i is None:
        return
    top2 = np.sort(np.asarray(ref_logits[i], dtype=np.float64))[-2:]
    gap = float(top2[1] - top2[0])
    assert gap <= tol, (
        f"diverged at token {i}: ours {ours[i]} vs reference {ref[i]}, reference top-2 gap "
        f"{gap:.3g} > {tol} (not a near-tie)"
    )


# --- served tests: HTTP requests and the server's metrics -----------------------------------

# How long a wait on the server may take before the test gives up. A deadline only, never an
# expectation of speed: every wait polls for its condition and returns once it holds.
DEADLINE_S = 300.0


def drive_arrivals(engine, requests, max_steps: int = 4000) -> dict:  # type: ignore[no-untyped-def]
    """Step ``engine`` over ``requests`` ((id, prompt, params, step to arrive at[, priority])),
    each added at its step, until every one has finished; each request's final
    ``RequestOutput``, or "rejected"."""
    pending = sorted(requests, key=lambda r: r[3])
    results: dict = {}
    step = 0
    while pending or engine.has_unfinished_requests():
        while pending and pending[0][3] <= step:
            rid, prompt, params, _, *priority = pending.pop(0)
            _, rejected = engine.add_request(prompt, params, request_id=rid,
                                             priority=priority[0] if priority else 0)
            if rejected is not None:
                results[rid] = "rejected"
        for o in engine.step():
            if o.finished:
                results[o.request_id] = o
        step += 1
        assert step < max_steps, "no progress"
    return results


def received_events(pub, events: list, count: int) -> list:  # type: ignore[no-untyped-def]
    """Subscribe to ``pub`` (a :class:`~kvflow.dynamo.events.ZmqEventPublisher`), put
    ``events`` on it, and return the first ``count`` wire events a subscriber receives (those
    held before it subscribed come first); then close the subscriber and ``pub``."""
    import msgspec
    import zmq

    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    try:
        sub.connect(pub.endpoint)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.setsockopt(zmq.RCVTIMEO, 10_000)
        pub.put(events)
        received: list = []
        while len(received) < count:
            received += msgspec.msgpack.decode(sub.recv_multipart()[2])[1]
        return received
    finally:
        sub.close()
        ctx.term()
        pub.close()


def wait_for(predicate, timeout_s=DEADLINE_S, what="condition"):
    """Poll ``predicate`` until it returns something true, and return that."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := predicate():
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def scrape(server) -> dict[str, float]:
    """The server's kvflow_* series: {'name{labels}': value}."""
    return kvflow_samples(
        urllib.request.urlopen(server.metrics_url, timeout=DEADLINE_S).read().decode())


def kvflow_samples(text: str) -> dict[str, float]:
    """Prometheus text -> {'name{labels}': value} for the kvflow_* series."""
    out = {}
    for line in text.splitlines():
        if line.startswith("kvflow_"):
            key, value = line.rsplit(" ", 1)
            out[key] = float(value)
    return out


def metric(samples: dict[str, float], name: str, **labels: str) -> float:
    """The sum of series ``name`` over the samples whose labels include ``labels``."""
    total = 0.0
    for key, value in samples.items():
        if key.split("{")[0] == name and all(f'{k}="{v}"' in key for k, v in labels.items()):
            total += value
    return total


def wait_idle(server) -> None:
    """Until no request runs or waits (a previous test's cancelled ones included)."""
    def idle() -> bool:
        now = scrape(server)
        return (metric(now, "kvflow_num_requests_running") == 0
                and metric(now, "kvflow_num_requests_waiting") == 0)

    wait_for(idle, what="an idle server")


def settled_generation_tokens(server, before: dict[str, float]) -> float:
    """Output tokens generated since ``before``, once the engine is idle (KV free, nothing
    running or waiting)."""
    def idle() -> bool:
        now = scrape(server)
        return (metric(now, "kvflow_kv_cache_usage_ratio") == 0
                and metric(now, "kvflow_num_requests_running") == 0
                and metric(now, "kvflow_num_requests_waiting") == 0)

    wait_for(idle, what="KV usage back to zero, nothing running or waiting")
    return (metric(scrape(server), "kvflow_generation_tokens_total")
            - metric(before, "kvflow_generation_tokens_total"))


def http_post(server, path: str, body: dict) -> tuple[int, str]:
    """POST ``body`` as JSON to tritonserver's HTTP ``path``; (HTTP status, body text)."""
    req = urllib.request.Request(f"http://{server.http_url}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def post(server, body: bytes | dict, path: str = "generate",
         headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """POST to the model's ``path``; (HTTP status, JSON body)."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(f"http://{server.http_url}/v2/models/kvflow/{path}", data=data,
                                 headers=headers or {}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as resp:
            return resp.status, json.loads(resp.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def post_json(frontend, path: str, body: dict | bytes) -> tuple[int, dict]:
    """POST ``body`` (a dict, sent as JSON with any lone surrogate escaped as ``\\udc00``, or
    the raw bytes) to the OpenAI frontend; returns the status and the parsed answer."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    req = urllib.request.Request(frontend.url + path, data=data,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def run_host_attention(fn, step: dict, heads: int, kv_heads: int, head_dim: int):
    """Call a host PagedAttention kernel (``paged_attention_native`` or ``_host``) on a
    :func:`~kvflow.plugins.paged_attention_ref.random_step`'s tensors, its KV pool registered
    for the call (copies of ``step``'s, written in place) and unregistered after. Returns
    (output ``[tokens, heads * head_dim]``, k pool, v pool)."""
    from kvflow.plugins import kv_registry

    k_cache, v_cache = step["k_cache"].numpy().copy(), step["v_cache"].numpy().copy()
    ptrs = np.array([[kv_registry.register(k_cache), kv_registry.register(v_cache)]], np.int64)
    t = step["q"].shape[0]
    try:
        out = fn(step["q"].reshape(t, -1).numpy(), step["k"].reshape(t, -1).numpy(),
                 step["v"].reshape(t, -1).numpy(), ptrs, step["slot_mapping"].numpy(),
                 step["block_tables"].numpy(), step["seq_lens"].numpy(),
                 step["query_start_loc"].numpy(), layer_idx=0, num_heads=heads,
                 num_kv_heads=kv_heads, head_dim=head_dim, scale=step["scale"])
    finally:
        kv_registry.unregister(k_cache)
        kv_registry.unregister(v_cache)
    return out, k_cache, v_cache


def byte_level_tokenizer():
    """A byte-level tokenizer, one token per byte (and ``</s>``), as llguidance reads it: the
    grammar tests' vocabulary."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    vocab["</s>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["</s>"])
    return tok


def run_weather_agent(url: str, model: str, model_class: str, streamed: bool = False
                      ) -> tuple[str, list[str]]:
    """The OpenAI Agents SDK's agent with one function tool (``get_weather``) against the
    OpenAI frontend at ``url``, through its ``model_class`` (``OpenAIResponsesModel`` or
    ``OpenAIChatCompletionsModel``): the final output and the cities the tool was called with.
    ``tool_choice`` required makes even the 135M model call the tool (a constrained output);
    ``stop_on_first_tool`` makes the tool's result the answer."""
    import asyncio

    import agents
    import openai

    agents.set_tracing_disabled(True)  # the SDK would send traces to OpenAI
    cities: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        cities.append(city)
        return f"Sunny and 21C in {city}."

    async def run() -> str:
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
        agent = agents.Agent(
            name="weather", instructions="Answer with the weather tool.", tools=[get_weather],
            model=getattr(agents, model_class)(model=model, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", temperature=0,
                                                max_tokens=64),
            tool_use_behavior="stop_on_first_tool")
        if streamed:
            result = agents.Runner.run_streamed(agent, "What's the weather in Paris?")
            async for _event in result.stream_events():
                pass
        else:
            result = await agents.Runner.run(agent, "What's the weather in Paris?")
        await client.close()
        return str(result.final_output)

    return asyncio.run(run()), cities
