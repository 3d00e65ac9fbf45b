"""The KV tiers benchmark's parts: the multi-turn chat workload, its closed-loop driver on a real
tiny engine, the hit-rate arithmetic and the report writer. Nothing here asserts a time."""

from __future__ import annotations

import json

import numpy as np
import pytest

from kvflow import LLM
from kvflow.bench.kv_tiers_report import restart_ratio, same_work_line, write_kv_tiers_report
from kvflow.bench.kv_tiers_sessions import (
    ChatSession,
    ChatWorkload,
    TurnResult,
    make_chat_workload,
    round_robin,
    serve_chat,
    summarize,
)
from kvflow.workloads.specs import RequestSpec

CORPUS = list(range(1000, 6000))
LENGTHS = [RequestSpec(0.0, 100, 20), RequestSpec(0.0, 300, 60), RequestSpec(0.0, 40, 4)]


def make_workload(**overrides):
    kw = {"working_set_tokens": 600, "turns": 3, "system_tokens": 16, "length_scale": 0.1,
          "max_message_tokens": 20, "max_reply_tokens": 5, "seed": 0}
    return make_chat_workload(CORPUS, LENGTHS, **{**kw, **overrides})


def turn(session, t, prompt, cached, output=4, ttft=0.1, arrival=0.0, finished=1.0):
    return TurnResult(session, t, prompt, cached, output, ttft, arrival, finished)


def test_workload_reaches_its_working_set_with_disjoint_messages():
    w = make_workload()
    assert w.system == CORPUS[:16]
    assert w.working_set_tokens() >= 600
    smaller = ChatWorkload(w.system, w.sessions[:-1])
    assert smaller.working_set_tokens() < 600  # the last session was needed
    pieces = [tok for s in w.sessions for m in s.messages for tok in m]
    assert len(pieces) == len(set(pieces)) and not set(pieces) & set(w.system)
    for s in w.sessions:
        assert len(s.messages) == 3
        # the trace's lengths x0.1, clipped: 10, 20 (30 clipped) or 4 tokens; replies 2, 5, 1
        assert {len(m) for m in s.messages} <= {10, 20, 4}
        assert set(s.reply_tokens) <= {2, 5, 1}


def test_workload_is_reproducible_and_sized_as_documented():
    w = make_workload()
    assert make_workload() == w
    assert make_workload(seed=1) != w
    s = w.sessions[0]
    assert w.max_prompt_tokens() >= 16 + sum(map(len, s.messages)) + sum(s.reply_tokens[:-1])
    assert w.num_turns == 3 * len(w.sessions)


def test_workload_refuses_bad_input_by_name():
    with pytest.raises(ValueError, match="turns must be >= 1"):
        make_workload(turns=0)
    with pytest.raises(ValueError, match="length_scale"):
        make_workload(length_scale=0.0)
    with pytest.raises(ValueError, match="corpus has 5000 tokens"):
        make_workload(working_set_tokens=10**6)
    with pytest.raises(ValueError, match="reply_tokens"):
        ChatSession([[1, 2]], [])


def test_round_robin_sends_every_sessions_turn_before_the_next_turn():
    w = ChatWorkload([1], [ChatSession([[2], [3]], [1, 1]), ChatSession([[4]], [1]),
                           ChatSession([[5], [6]], [1, 1])])
    assert round_robin(w) == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1)]


def test_summary_hit_rates_on_known_turns():
    results = [turn(0, 0, 100, 0, arrival=0.0, ttft=1.0), turn(1, 0, 100, 20, ttft=2.0),
               turn(0, 1, 200, 160, ttft=3.0), turn(1, 1, 200, 120, ttft=4.0, finished=10.0)]
    state = [{"medium": "cpu", "hits": 10}, {"medium": "disk", "hits": 5}]
    s = summarize(results, state, block_size=8)
    assert (s["prompt_tokens"], s["cached_tokens"], s["output_tokens"]) == (600, 300, 16)
    assert s["hit_rate"] == pytest.approx(0.5)
    assert s["tier_tokens"] == {"cpu": 80, "disk": 40}
    assert s["hit_rate_tiers"] == pytest.approx({"cpu": 80 / 600, "disk": 40 / 600})
    assert s["hit_rate_pool"] == pytest.approx(180 / 600)
    assert s["ttft_p50_s"] == pytest.approx(2.5)
    assert s["ttft_p99_s"] == pytest.approx(3.97)  # linear between the two largest
    assert s["span_s"] == 10.0 and s["output_tok_s"] == pytest.approx(1.6)
    assert s["ttft_by_turn_s"] == {0: 1.5, 1: 3.5}
    no_tiers = summarize(results, [], block_size=8)
    assert no_tiers["hit_rate_pool"] == no_tiers["hit_rate"] and no_tiers["hit_rate_tiers"] == {}
    with pytest.raises(ValueError, match="results"):
        summarize([], [], 8)


def fake_run(ttfts, hit_rate, rss):
    results = [turn(i % 2, i // 2, 100, round(100 * hit_rate), ttft=t)
               for i, t in enumerate(ttfts)]
    s = summarize(results, [{"medium": "cpu", "hits": 4}] if hit_rate > 0.5 else [], 10)
    s["peak_rss_bytes"] = rss
    s["turns_detail"] = [[r.session, r.turn, r.prompt_tokens, r.cached_tokens,
                          r.output_tokens, r.ttft_s] for r in results]
    return s


def test_report_writes_json_markdown_and_plot(tmp_path):
    runs = {"off": fake_run([0.4, 0.5, 0.9, 1.2], 0.1, 300 << 20),
            "host": fake_run([0.1, 0.2, 0.2, 0.3], 0.7, 420 << 20)}
    rounds = [{"prompt_tokens": 3980, "cold": {"ttft_s": 10.0, "peak_rss_bytes": 350 << 20},
               "restored": {"ttft_s": 0.5, "cached_tokens": 3968,
                            "peak_rss_bytes": 360 << 20}}]
    report = {"machine": {"model_name": "cpu", "widest": "AVX2", "native_isa": "avx2",
                          "cpus": 2},
              "busy_note": "Busy.", "command": "python benchmarks/kv_tiers.py",
              "config": {"engine": "e", "kv_cache_dtype": "fp16", "sessions": 2, "turns": 2,
                         "system_tokens": 8, "length_scale": 0.1, "max_message_tokens": 20,
                         "max_reply_tokens": 5, "num_kv_blocks": 4, "pool_tokens": 64,
                         "working_set_tokens": 640, "max_prompt_tokens": 100,
                         "concurrency": 1, "tier_options": {"off": {}, "host": {}}},
              "sessions": runs, "restart": {"prefix_tokens": 3968, "rounds": rounds}}
    lines = write_kv_tiers_report(tmp_path, report)
    assert {p.name for p in tmp_path.iterdir()} == {"report.json", "report.md", "ttft.png"}
    assert json.loads((tmp_path / "report.json").read_text())["config"]["pool_tokens"] == 64
    text = "\n".join(lines)
    assert "working set 10.0x the KV pool" in text
    assert "| off | 10.0% | 10.0% | - | - | 0.700 |" in text
    assert "| host | 70.0% | 60.0% | 10.0% | - | 0.200 |" in text
    assert "| 300 |" in text and "| 420 |" in text  # peak RSS in MB
    assert "| 0 | 3980 | 10.000 | 0.500 | 3968 | 0.050 | 350 | 360 |" in text
    assert restart_ratio(rounds) == pytest.approx(0.05)
    assert "Median restored / cold: 0.050" in text
    assert "the same 400 prompt tokens and 16 output tokens" in text
    assert same_work_line({**runs, "disk": {**runs["host"], "prompt_tokens": 390}}).startswith(
        "The configurations served different token counts: off 400 prompt")


def tiny_chat(num_sessions: int = 12) -> ChatWorkload:
    """Sessions of 3 turns, 10-token messages (ids of a 320-token vocabulary; a session's first
    token its own, so sessions share only the system prompt), 4-token replies."""
    sessions = []
    for s in range(num_sessions):
        messages = [np.random.default_rng([s, t]).integers(20, 310, size=10).tolist()
                    for t in range(3)]
        messages[0][0] = 3 + s
        sessions.append(ChatSession(messages, [4, 4, 4]))
    return ChatWorkload([300, 301, 302, 303, 304, 305], sessions)


@pytest.mark.slow  # a tiny engine's greedy runs, seconds
@pytest.mark.parametrize("tiers", [False, True])
def test_serve_chat_resends_the_conversation_and_the_tier_brings_it_back(tiny_engines,
                                                                         tiers):
    engine = tiny_engines["llama-gqa4", "onnxruntime"]  # block size 4
    # NOTE: between two turns of a session the 11 others fill >= 44 new blocks: more than the
    # pool's 32, so the pool alone has lost the session's history when it returns.
    w = tiny_chat()
    options = {"kv_offload_bytes": 1 << 24} if tiers else {}
    with LLM(engine, num_kv_blocks=32, **options) as llm:
        results = serve_chat(llm.engine, w, concurrency=2)
        state = llm.engine.kv.tiers.state() if tiers else []
        llm.engine.kv.check_integrity()
    assert sorted((r.session, r.turn) for r in results) == sorted(round_robin(w))
    for r in results:  # system + the messages so far + the replies before this turn
        assert r.prompt_tokens == 6 + 10 * (r.turn + 1) + 4 * r.turn
        assert r.output_tokens == 4
    later = [r for r in results if r.turn > 0]
    s = summarize(results, state, block_size=4)
    if tiers:
        # the previous prompt's full blocks come back from the host tier
        assert all(r.cached_tokens >= (r.prompt_tokens - 14) // 4 * 4 for r in later)
        assert s["tier_tokens"]["cpu"] > 0
        assert s["hit_rate"] > s["hit_rate_pool"]
    else:
        assert all(r.cached_tokens == 4 for r in later)  # the system prompt's one full block
