"""One request lifecycle: one place decides a request is finished (``Request.check_stop``, through
``Scheduler.update_from_output``), one place tokenizes (``LLMEngine.add_request``), and the
engine's counters and step stats are what observers read."""

from __future__ import annotations

import ast
import inspect

import pytest

from kvflow import LLM, SamplingParams
from kvflow.orchestrator import engine as engine_module
from kvflow.orchestrator.request import RequestStatus
from kvflow.orchestrator.scheduler.output import RunnerOutput
from kvflow.text.tokenizer import ChatPrompt, tokenize_prompt
from tests.helpers import make_request, make_scheduler_for_test


def step_with(sched, tokens, stop_strings=None):
    out = sched.schedule()
    sampled = {s.request.request_id: tokens[s.request.request_id]
               for s in out.scheduled if s.sample}
    finished = sched.update_from_output(
        out, RunnerOutput({rid: [t] for rid, t in sampled.items()}, stop_strings or {}))
    sched.check_integrity()
    return finished


def test_a_stop_string_finishes_the_request_in_update_from_output():
    sched = make_scheduler_for_test()
    sched.add_request(make_request("a", 5, max_tokens=10))
    sched.add_request(make_request("b", 5, max_tokens=10))
    assert step_with(sched, {"a": 7, "b": 7}) == []
    finished = step_with(sched, {"a": 7, "b": 7}, {"a": "###"})
    assert [r.request_id for r in finished] == ["a"]
    a = finished[0]
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == "###"
    assert "a" not in sched.kv.block_tables and "a" not in sched.requests
    assert [r.request_id for r in sched.running] == ["b"]


def test_check_stop_orders_the_reasons():
    # EOS past min_tokens first, then a stop token, then a stop string, then the length.
    r = make_request("r", 3, max_tokens=2, stop_token_ids=[9])
    r.append_output_token(7)
    assert r.check_stop() is None
    r.append_output_token(7)  # the length limit and a stop string on the same token
    assert r.check_stop("!!") == RequestStatus.FINISHED_STOPPED and r.stop_reason == "!!"
    assert r.check_stop() == RequestStatus.FINISHED_LENGTH
    r = make_request("r", 3, max_tokens=5, stop_token_ids=[9], min_tokens=2)
    r.append_output_token(9)  # a stop token before min_tokens does not stop
    assert r.check_stop() is None
    r.append_output_token(9)
    assert r.check_stop("x") == RequestStatus.FINISHED_STOPPED and r.stop_reason == 9
    r = make_request("r", 3, max_tokens=5)
    r.append_output_token(2)  # EOS
    assert r.check_stop() == RequestStatus.FINISHED_STOPPED and r.stop_reason is None


def test_the_engine_never_finishes_a_request_itself():
    """Only the scheduler's update_from_output (and an abort) finish a request: the engine
    module calls neither finish_request nor check_stop."""
    tree = ast.parse(inspect.getsource(engine_module))
    called = {node.func.attr for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
    assert "update_from_output" in called and "abort_request" in called
    assert not called & {"finish_request", "check_stop"}


@pytest.fixture(scope="module")
def llm(default_engines):
    # No step-time bound: the tests assert each step's composition, whatever the machine's speed.
    with LLM(default_engines["torch"], max_num_seqs=8, max_step_ms=0.0) as llm:
        yield llm


@pytest.mark.slow
def test_stop_string_text_and_reason_through_the_engine(llm):
    prompt = "The capital of France is"
    free = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0))[0]
    cut = free.text.index(".")
    out = llm.generate([prompt], SamplingParams(max_tokens=16, temperature=0, stop=["."]))[0]
    assert (out.finish_reason, out.stop_reason, out.text) == ("stop", ".", free.text[:cut])
    assert llm.engine.kv.pool.num_used_blocks == 0


@pytest.mark.slow
def test_chat_prompts_are_tokenized_by_the_engine_with_the_template(llm):
    messages = [{"role": "user", "content": "Name a colour."}]
    tok = llm.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages), add_special_tokens=False)
    assert tokenize_prompt(tok, ChatPrompt(messages)) == ids
    params = SamplingParams(max_tokens=6, temperature=0)
    by_chat = llm.chat(messages, params)
    by_ids = llm.generate([ids], params)[0]
    assert by_chat.num_prompt_tokens == len(ids)
    assert by_chat.token_ids == by_ids.token_ids


@pytest.mark.slow
def test_counters_and_step_stats_describe_what_ran(llm):
    before = llm.engine.counters.copy()
    llm.engine.step_stats.clear()
    outs = llm.generate([[5, 6, 7, 8, 9, 10], [11, 12, 13]],
                        SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    c = llm.engine.counters
    assert c.generation_tokens - before.generation_tokens == 8
    assert c.prompt_tokens - before.prompt_tokens == 6 + 3  # the prompts; decodes are not
    assert c.finished - before.finished == 2
    steps = list(llm.engine.step_stats)
    assert c.steps - before.steps == len(steps) == 4
    assert steps[0].scheduled == [(outs[0].request_id, 6), (outs[1].request_id, 3)]
    assert all(s.scheduled == [(outs[0].request_id, 1), (outs[1].request_id, 1)]
               for s in steps[1:])
    assert sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps) == 9 + 6


@pytest.mark.slow
def test_a_timed_out_request_returns_its_partial_text_and_frees_its_blocks(llm):
    """The deadline through the engine, on a clock the test moves: the final output carries
    ``timeout``, every token decoded so far and its text; the KV is free before the next step,
    and the timeout is counted by phase."""
    from kvflow.orchestrator.engine import LLMEngine
    from tests.helpers import FakeClock

    base = llm.engine
    clock = FakeClock()
    engine = LLMEngine(base.runner, base.tokenizer, base.options, base.eos_token_ids,
                       clock=clock)
    params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True, timeout_ms=5000)
    engine.add_request("Once upon a time", params, request_id="slow")
    engine.add_request("Hi", SamplingParams(max_tokens=200, temperature=0, ignore_eos=True,
                                            timeout_ms=9000), request_id="queued")
    outputs = []
    for _ in range(6):
        outputs += engine.step()
    clock.now = 5.0
    final = [o for o in engine.step() if o.finished]
    assert [o.request_id for o in final] == ["slow"]
    out = final[0]
    assert out.finish_reason == "timeout" and len(out.token_ids) == 6
    assert out.text == base.tokenizer.decode(out.token_ids)
    assert engine.kv.block_tables.keys() == {"queued"}
    assert engine.counters.timeouts_by_phase == {"decode": 1}
    assert engine.scheduler.num_running == 1
    engine.abort_request("queued")
    assert engine.kv.pool.num_used_blocks == 0
