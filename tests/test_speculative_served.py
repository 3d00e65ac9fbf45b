"""Speculative decoding served: through the real tritonserver and the real OpenAI frontend,
on free text (greedy, the fp32 path), the speculative output is the same server's
non-speculative output token for token; streams deliver every token once and in order, usage
reports the accepted drafts, and the metrics count drafts and acceptances."""

from __future__ import annotations

import json
import urllib.request

import pytest

from kvflow.client import stream_generate
from tests.helpers import metric, scrape, wait_for, wait_idle

pytestmark = pytest.mark.slow  # tritonserver and the frontend

# Free text: the tiny model's (random) greedy continuation, which falls into loops that the
# n-gram proposer drafts. Nothing holds the output to a pattern, so a verification that
# accepted a wrong draft would show. Each is compared with the same server's output for
# ``speculative: false`` (same arithmetic, same threads: no near tie flips between them).
PROMPTS = ["one two three one two three one two three one two",
           "the cat sat on the mat. the cat sat on the mat. the cat"]
GREEDY = {"max_tokens": 48, "temperature": 0, "ignore_eos": True}
FP32 = {"quantized_matmul": "fp32", "kv_cache_dtype": "fp32"}


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
                                              "num_speculative_tokens": 6, **FP32},
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


def test_triton_stream_delivers_every_token_once_in_order(spec_server):
    _, server, _ = spec_server
    wait_idle(server)
    before = scrape(server)
    accepted_total = 0
    for prompt in PROMPTS:
        chunks = list(stream_generate(server.grpc_url, prompt, GREEDY))
        assert len(chunks) > 2, "the response was not streamed"
        counts = [c.num_output_tokens for c in chunks]
        assert counts == sorted(counts) and counts[-1] == 48
        assert 0 <= chunks[-1].num_accepted_tokens <= chunks[-1].num_draft_tokens
        accepted_total += chunks[-1].num_accepted_tokens
        plain = list(stream_generate(server.grpc_url, prompt, {**GREEDY, "speculative": False}))
        assert plain[-1].num_draft_tokens == 0 and plain[-1].num_output_tokens == 48
        assert "".join(c.text for c in chunks) == "".join(c.text for c in plain)
    assert accepted_total > 0, "no draft was accepted: the comparison tested nothing"
    after = wait_for(lambda: (s := scrape(server)) and metric(
        s, "kvflow_request_success_total") >= metric(before, "kvflow_request_success_total")
        + 2 * len(PROMPTS) and s, what="the requests' metrics")
    drafts = (metric(after, "kvflow_spec_decode_num_draft_tokens_total")
              - metric(before, "kvflow_spec_decode_num_draft_tokens_total"))
    accepted = (metric(after, "kvflow_spec_decode_num_accepted_tokens_total")
                - metric(before, "kvflow_spec_decode_num_accepted_tokens_total"))
    verified = (metric(after, "kvflow_spec_decode_acceptance_length_count")
                - metric(before, "kvflow_spec_decode_acceptance_length_count"))
    assert drafts > 0 and accepted == accepted_total <= drafts and verified > 0
    # Every output token came from a step: the plain ones, and each verification's extra.
    generated = (metric(after, "kvflow_generation_tokens_total")
                 - metric(before, "kvflow_generation_tokens_total"))
    assert generated == 48 * 2 * len(PROMPTS)


def test_openai_output_equals_the_non_speculative_token_for_token(spec_server):
    _, _, frontend = spec_server
    with urllib.request.urlopen(f"{frontend.url}/v1/models", timeout=60) as r:
        model = json.loads(r.read())["data"][0]["id"]
    accepted = 0
    for prompt in PROMPTS:
        body = {"model": model, "prompt": prompt, "logprobs": 1, **GREEDY}
        whole = _post(frontend, body)
        plain = _post(frontend, {**body, "speculative": False})
        assert "completion_tokens_details" not in plain["usage"]
        # Token for token: each token's text and its logprob (two tokens that both print as
        # U+FFFD still differ there).
        spec_lp, plain_lp = whole["choices"][0]["logprobs"], plain["choices"][0]["logprobs"]
        assert spec_lp["tokens"] == plain_lp["tokens"] and len(spec_lp["tokens"]) == 48
        assert spec_lp["token_logprobs"] == pytest.approx(plain_lp["token_logprobs"], abs=1e-4)
        assert whole["choices"][0]["text"] == plain["choices"][0]["text"]
        details = whole["usage"]["completion_tokens_details"]
        assert details["rejected_prediction_tokens"] >= 0
        accepted += details["accepted_prediction_tokens"]
        streamed = _stream(frontend, {**body, "stream": True,
                                      "stream_options": {"include_usage": True}})
        texts = [c["choices"][0]["text"] for c in streamed if c.get("choices")]
        assert "".join(texts) == whole["choices"][0]["text"]
        assert streamed[-1]["usage"]["completion_tokens"] == 48
    assert accepted > 0, "no draft was accepted: the comparison tested nothing"


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
