"""Speculative decoding served: through the real tritonserver and the real OpenAI frontend,
streams deliver every token once and in order (their text is the offline non-speculative
engine's), usage reports the accepted drafts, and the metrics count drafts and acceptances."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvflow import LLM, SamplingParams
from kvflow.client import stream_generate
from tests.helpers import metric, scrape, wait_for, wait_idle

pytestmark = pytest.mark.slow  # tritonserver and the frontend

PROMPT = "one two three one two three one two three one two"
# The tiny model's weights are random: its greedy choices are near ties that the machine's
# arithmetic (its thread count) can flip, and what it writes need not repeat the prompt, so the
# n-gram proposer might find nothing to draft. The regex holds the output to the prompt's
# pattern (the tiny tokenizer has one token per byte: one tokenization), so that drafts come
# and are accepted on any machine.
GREEDY = {"max_tokens": 48, "temperature": 0, "ignore_eos": True,
          "guided_regex": "( three one two){20}"}  # longer than max_tokens: cut there


@pytest.fixture(scope="module")
def spec_server(tiny_engines, tmp_path_factory):
    """A tritonserver of a tiny engine with prompt-lookup speculation, invariants checked
    every step, and the OpenAI frontend in front of it."""
    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer
    from kvflow.utils.procs import free_port

    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    folder = tmp_path_factory.mktemp("spec")
    cfg = ServerConfig.on_free_ports(engine, {"speculative": "ngram", "debug_checks": True,
                                              "num_speculative_tokens": 6},
                                     ready_timeout_s=300)
    with TritonServer(cfg, log_path=folder / "tritonserver.log") as server:
        frontend = FrontendProcess(FrontendConfig((server.grpc_url,), port=free_port(),
                                                  metrics_urls=(server.metrics_url,)),
                                   log_path=folder / "frontend.log")
        frontend.start()
        try:
            yield engine, server, frontend
        finally:
            assert frontend.stop() == 0


def offline_text(engine) -> str:
    with LLM(engine) as llm:  # no speculation
        return llm.generate([PROMPT], SamplingParams.from_dict(GREEDY))[0].text


def test_triton_stream_delivers_every_token_once_in_order(spec_server):
    engine, server, _ = spec_server
    wait_idle(server)
    before = scrape(server)
    chunks = list(stream_generate(server.grpc_url, PROMPT, GREEDY))
    assert len(chunks) > 2, "the response was not streamed"
    counts = [c.num_output_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 48
    assert 0 < chunks[-1].num_accepted_tokens <= chunks[-1].num_draft_tokens
    assert "".join(c.text for c in chunks) == offline_text(engine)
    after = wait_for(lambda: (s := scrape(server)) and metric(
        s, "kvflow_request_success_total") > metric(before, "kvflow_request_success_total")
        and s, what="the request's metrics")
    drafts = (metric(after, "kvflow_spec_decode_num_draft_tokens_total")
              - metric(before, "kvflow_spec_decode_num_draft_tokens_total"))
    accepted = (metric(after, "kvflow_spec_decode_num_accepted_tokens_total")
                - metric(before, "kvflow_spec_decode_num_accepted_tokens_total"))
    verified = (metric(after, "kvflow_spec_decode_acceptance_length_count")
                - metric(before, "kvflow_spec_decode_acceptance_length_count"))
    assert drafts > 0 and 0 < accepted <= drafts and verified > 0
    # Every output token came from a step: the plain ones, and each verification's extra.
    generated = (metric(after, "kvflow_generation_tokens_total")
                 - metric(before, "kvflow_generation_tokens_total"))
    assert generated == 48


def test_openai_stream_and_usage_report_the_accepted_drafts(spec_server):
    engine, _, frontend = spec_server
    with urllib.request.urlopen(f"{frontend.url}/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]
    body = {"model": model, "prompt": PROMPT, "max_tokens": 48, "temperature": 0,
            "guided_regex": GREEDY["guided_regex"],
            "ignore_eos": True}
    whole = _post(frontend, body)
    assert whole["choices"][0]["text"] == offline_text(engine)
    details = whole["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] > 0
    assert details["rejected_prediction_tokens"] >= 0
    streamed = _stream(frontend, {**body, "stream": True,
                                  "stream_options": {"include_usage": True}})
    texts = [c["choices"][0]["text"] for c in streamed if c.get("choices")]
    assert "".join(texts) == whole["choices"][0]["text"]
    assert streamed[-1]["usage"]["completion_tokens"] == 48
    # A request may turn speculation off: it drafts nothing.
    off = _post(frontend, {**body, "speculative": False})
    assert off["choices"][0]["text"] == whole["choices"][0]["text"]
    assert "completion_tokens_details" not in off["usage"]


def _post(frontend, body: dict) -> dict:
    req = urllib.request.Request(f"{frontend.url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stream(frontend, body: dict) -> list[dict]:
    req = urllib.request.Request(f"{frontend.url}/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    chunks = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for line in r:
            line = line.strip()
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[6:]))
    return chunks
