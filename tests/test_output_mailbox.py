"""Outputs on their way from the engine loop to a slower consumer (the Triton backend's
responder): a consumer that keeps up gets every step's output alone, at once; one that falls
behind gets the outputs waiting as one, whose text, tokens and logprobs are the same."""

from __future__ import annotations

import threading

import pytest

from kvflow import SamplingParams
from kvflow.orchestrator.engine_loop import EngineLoop
from kvflow.orchestrator.output_mailbox import OutputMailbox, coalesce_outputs
from kvflow.orchestrator.outputs import RequestOutput

WAIT_S = 120  # generous: a busy machine; no test compares a duration
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture()
def engine(tiny_engines):
    from kvflow.orchestrator.llm import create_engine

    engine = create_engine(str(tiny_engines["llama-gqa4", "torch"]), debug_checks=True)
    yield engine
    engine.close()


def step_outputs(engine, prompt: str, params: SamplingParams) -> list[RequestOutput]:
    """Every output of one request, one per step, straight from the engine."""
    engine.add_request(prompt, params, request_id="r")
    outputs = []
    while engine.has_unfinished_requests():
        outputs += engine.step()
    return outputs


def test_coalesced_runs_add_up_to_the_step_by_step_outputs(engine):
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=7, n=2, logprobs=2,
                            prompt_logprobs=1, ignore_eos=True)
    outputs = step_outputs(engine, "hello world", params)
    assert len(outputs) > 4 and outputs[-1].finished
    last = outputs[-1]
    for cuts in ([1], [3], [2, 5], list(range(1, len(outputs)))):
        runs = [outputs[a:b] for a, b in zip([0, *cuts], [*cuts, len(outputs)], strict=True)]
        merged = [coalesce_outputs(run) for run in runs]
        assert merged[-1].finished and not any(m.finished for m in merged[:-1])
        for j in range(2):
            assert "".join(m.outputs[j].delta_text for m in merged) == last.outputs[j].text
            assert ([t for m in merged for t in m.outputs[j].delta_token_ids]
                    == last.outputs[j].token_ids)
            assert merged[-1].outputs[j].logprobs == last.outputs[j].logprobs
            assert merged[-1].outputs[j].finish_reason == last.outputs[j].finish_reason
        # The prompt logprobs, sent once, ride on the merged output that held them.
        carrying = [m for m in merged if m.prompt_logprobs is not None]
        assert len(carrying) == 1
        assert carrying[0].prompt_logprobs == next(o.prompt_logprobs for o in outputs
                                                   if o.prompt_logprobs is not None)
        assert merged[-1].num_output_tokens == last.num_output_tokens


def test_an_abort_or_error_is_never_merged_into_the_text_before_it(engine):
    outputs = step_outputs(engine, "hello", GREEDY)
    aborted = RequestOutput.failed("r", None, None, finish_reason="abort")
    failed = RequestOutput.failed("r", "engine error: boom", None, finish_reason="abort")
    box = OutputMailbox()
    for out in [*outputs[:3], aborted]:
        box.put(out)
    taken = box.take()
    assert len(taken) == 2 and taken[1] is aborted
    assert taken[0].delta_token_ids == outputs[2].token_ids
    for out in [outputs[0], failed]:
        box.put(out)
    assert box.take() == [outputs[0], failed]
    assert box.take() == []


class Consumer(threading.Thread):
    """A consumer thread: takes from ``box`` as soon as it holds something, until the final
    output."""

    def __init__(self, box: OutputMailbox) -> None:
        super().__init__(daemon=True)
        self.box = box
        self.taken: list[RequestOutput] = []
        self.changed = threading.Condition()

    def run(self) -> None:
        while not (self.taken and self.taken[-1].finished):
            outs = self.box.wait_take(WAIT_S)
            with self.changed:
                self.taken += outs
                self.changed.notify_all()

    def tokens_taken(self) -> int:
        return sum(len(o.delta_token_ids) for o in self.taken)


def test_a_consumer_that_keeps_up_gets_one_output_per_token(engine):
    box = OutputMailbox()
    consumer = Consumer(box)
    given: list[RequestOutput] = []

    def hook(_loop, outs):  # on the loop thread, before the step's outputs are delivered
        # The loop goes on once the consumer took the last step's token: it keeps up.
        with consumer.changed:
            assert consumer.changed.wait_for(lambda: consumer.tokens_taken() == len(given),
                                             WAIT_S)
        given.extend(outs)

    consumer.start()
    loop = EngineLoop(engine, step_hook=hook)
    try:
        loop.submit("r", "hello world", GREEDY, box.put)
        consumer.join(WAIT_S)
    finally:
        loop.shutdown()
    assert len(consumer.taken) == len(given) == 12
    assert [o.delta_token_ids for o in consumer.taken] == [o.delta_token_ids for o in given]
    assert "".join(o.delta_text for o in consumer.taken) == given[-1].text


def test_a_consumer_that_falls_behind_gets_fewer_outputs_with_the_same_text(engine):
    box = OutputMailbox()
    given: list[RequestOutput] = []
    finished = threading.Event()

    def put(out: RequestOutput) -> None:
        given.append(out)
        box.put(out)
        if out.finished:
            finished.set()

    loop = EngineLoop(engine)
    try:
        loop.submit("r", "hello world", GREEDY, put)
        assert finished.wait(WAIT_S)
    finally:
        loop.shutdown()
    consumer = Consumer(box)  # it starts once the engine has finished: far behind
    consumer.start()
    consumer.join(WAIT_S)
    assert len(given) == 12 and len(consumer.taken) == 1
    (out,) = consumer.taken
    assert out.delta_token_ids == out.token_ids == given[-1].token_ids
    assert out.delta_text == out.text == given[-1].text
    assert out.finished and out.finish_reason == "length"
