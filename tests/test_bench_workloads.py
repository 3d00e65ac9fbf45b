"""Benchmark workloads (arrivals, Azure trace, real-text prompts) and serving metrics."""

from __future__ import annotations

import numpy as np
import pytest

from kvflow.reports.summary import RequestTiming, summarize
from kvflow.workloads.arrivals import gamma_arrivals, poisson_arrivals, retime
from kvflow.workloads.azure import default_trace, load_azure_trace
from kvflow.workloads.prompts import CORPUS, make_prompt_ids, make_prompt_text
from kvflow.workloads.specs import RequestSpec
from kvflow.workloads.synthetic import random_workload, shared_prefix_workload

TRACE = default_trace()
needs_trace = pytest.mark.skipif(not TRACE.exists(), reason=f"Azure trace not found at {TRACE}")


# --- Azure trace -----------------------------------------------------------------------------

@needs_trace
def test_azure_trace_matches_readme():
    specs, rep = load_azure_trace(TRACE)
    assert len(specs) == rep["rows"] == 19366
    assert specs[0].arrival_s == 0.0
    arr = np.array([s.arrival_s for s in specs])
    assert np.all(np.diff(arr) >= 0)
    # One hour at ~5.5 req/s (README).
    assert 3500 < arr[-1] < 3700
    assert 5.0 < len(specs) / arr[-1] < 6.0
    assert rep["prompt_mean"] == pytest.approx(1155, abs=1)
    assert rep["output_mean"] == pytest.approx(211, abs=1)
    assert rep["prompt_clipped"] == rep["output_clipped"] == 0
    # Second row: 18:15:50.9951690 - 18:15:46.6805900, all 7 fractional digits kept.
    assert specs[1].arrival_s == pytest.approx(4.3145790, abs=1e-6)
    assert (specs[1].prompt_tokens, specs[1].output_tokens) == (396, 109)
    assert min(s.output_tokens for s in specs) >= 1


@needs_trace
def test_azure_trace_time_scale_and_clipping():
    full, _ = load_azure_trace(TRACE, limit=2000)
    fast, rep = load_azure_trace(TRACE, limit=2000, time_scale=2.0,
                                 max_prompt_tokens=1024, max_output_tokens=128)
    assert len(full) == len(fast) == rep["rows"] == 2000
    assert fast[-1].arrival_s == pytest.approx(full[-1].arrival_s / 2)
    assert rep["span_s"] == pytest.approx(fast[-1].arrival_s)
    p = np.array([s.prompt_tokens for s in full])
    o = np.array([s.output_tokens for s in full])
    assert rep["prompt_clipped"] == int((p > 1024).sum()) > 0
    assert rep["output_clipped"] == int((o > 128).sum()) > 0
    assert max(s.prompt_tokens for s in fast) == 1024
    assert max(s.output_tokens for s in fast) == 128
    assert rep["prompt_mean_original"] == pytest.approx(p.mean())
    assert rep["prompt_mean"] == pytest.approx(np.minimum(p, 1024).mean())
    assert rep["output_mean"] == pytest.approx(np.minimum(o, 128).mean())
    assert rep["output_mean"] < rep["output_mean_original"]


@needs_trace
def test_azure_trace_length_scale_keeps_the_shape_then_clips():
    full, _ = load_azure_trace(TRACE, limit=2000)
    small, rep = load_azure_trace(TRACE, limit=2000, length_scale=0.25, max_prompt_tokens=512)
    p = np.array([s.prompt_tokens for s in full])
    scaled = np.maximum(np.rint(p * 0.25), 1)
    assert [s.prompt_tokens for s in small] == np.minimum(scaled, 512).tolist()
    assert [s.arrival_s for s in small] == [s.arrival_s for s in full]
    assert rep["length_scale"] == 0.25
    assert rep["prompt_clipped"] == int((scaled > 512).sum()) > 0  # counted after scaling
    assert rep["output_mean"] == pytest.approx(
        np.maximum(np.rint(np.array([s.output_tokens for s in full]) * 0.25), 1).mean())
    with pytest.raises(ValueError, match="length_scale"):
        load_azure_trace(TRACE, limit=2, length_scale=0)


def test_retime_keeps_the_gap_pattern_at_the_new_mean_rate():
    specs = [RequestSpec(t, 5, 3) for t in (2.0, 2.5, 4.0, 6.0)]  # span 4 s, 3 gaps: 0.75/s
    fast = retime(specs, 3.0)
    assert [s.arrival_s for s in fast] == pytest.approx([0.0, 0.125, 0.5, 1.0])
    assert (len(fast) - 1) / fast[-1].arrival_s == pytest.approx(3.0)
    assert [s.arrival_s for s in retime(specs, float("inf"))] == [0.0] * 4
    assert [(s.prompt_tokens, s.output_tokens) for s in fast] == [(5, 3)] * 4
    with pytest.raises(ValueError, match="rate"):
        retime(specs, 0.0)


def test_azure_trace_small_file(tmp_path):
    f = tmp_path / "t.csv"
    f.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n"
                 "2023-11-16 23:59:59.9000000,10,0\n"
                 "2023-11-17 00:00:00.1500001,5000,7\n")
    specs, rep = load_azure_trace(f, max_prompt_tokens=100)
    assert [s.arrival_s for s in specs] == pytest.approx([0.0, 0.2500001], abs=1e-9)
    assert [s.prompt_tokens for s in specs] == [10, 100]
    assert specs[0].output_tokens == 1 and rep["output_raised"] == 1
    assert rep["prompt_clipped"] == 1
    with pytest.raises(ValueError, match="time_scale"):
        load_azure_trace(f, time_scale=0)
    with pytest.raises(ValueError, match="max_output_tokens"):
        load_azure_trace(f, max_output_tokens=0)
    bad = tmp_path / "bad.csv"
    bad.write_text("time,ContextTokens,GeneratedTokens\n1,2,3\n")
    with pytest.raises(ValueError, match="TIMESTAMP"):
        load_azure_trace(bad)


# --- arrival processes -----------------------------------------------------------------------

def _gaps(times: list[float]) -> np.ndarray:
    return np.diff(np.asarray(times))


@pytest.mark.parametrize("rate", [0.5, 10.0, 200.0])
def test_poisson_rate_and_cv(rate):
    t = poisson_arrivals(20000, rate, seed=0)
    assert t[0] == 0.0 and np.all(_gaps(t) >= 0)
    # 19,999 exponential gaps: relative std error of the mean ~0.7%, so 3% is > 4 sigma.
    assert (len(t) - 1) / t[-1] == pytest.approx(rate, rel=0.03)
    g = _gaps(t)
    assert g.std() / g.mean() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gamma_rate_and_cv(burstiness):
    t = gamma_arrivals(20000, 8.0, burstiness, seed=3)
    g = _gaps(t)
    # Relative std error of the mean gap is cv/sqrt(n) = 1.4% at burstiness 0.25.
    assert (len(t) - 1) / t[-1] == pytest.approx(8.0, rel=0.06 if burstiness < 1 else 0.03)
    assert g.std() / g.mean() == pytest.approx(1 / np.sqrt(burstiness), rel=0.1)


def test_arrivals_reproducible_and_bursty():
    assert poisson_arrivals(100, 5.0, seed=1) == poisson_arrivals(100, 5.0, seed=1)
    assert poisson_arrivals(100, 5.0, seed=1) != poisson_arrivals(100, 5.0, seed=2)
    assert gamma_arrivals(100, 5.0, 0.5, seed=1) == gamma_arrivals(100, 5.0, 0.5, seed=1)
    assert gamma_arrivals(100, 5.0, 0.5, seed=1) != gamma_arrivals(100, 5.0, 0.5, seed=2)
    cv = [(g.std() / g.mean()) for g in (_gaps(gamma_arrivals(20000, 5.0, b, seed=0))
                                         for b in (0.3, 1.0))]
    assert cv[0] > 1.5 * cv[1]
    assert poisson_arrivals(4, float("inf"), seed=0) == [0.0] * 4
    assert poisson_arrivals(1, 3.0, seed=0) == [0.0]


@pytest.mark.parametrize(("kwargs", "name"), [
    ({"n": 0, "rate": 1.0, "burstiness": 1.0}, "n"),
    ({"n": 5, "rate": 0.0, "burstiness": 1.0}, "rate"),
    ({"n": 5, "rate": float("nan"), "burstiness": 1.0}, "rate"),
    ({"n": 5, "rate": 1.0, "burstiness": 0.0}, "burstiness"),
])
def test_arrival_validation(kwargs, name):
    with pytest.raises(ValueError, match=f"^{name} "):
        gamma_arrivals(seed=0, **kwargs)


# --- synthetic workloads ---------------------------------------------------------------------

def test_random_workload():
    w = random_workload(2000, 100, 50, rate=10.0, burstiness=1.0, seed=0, range_ratio=0.5)
    assert all(isinstance(s, RequestSpec) for s in w)
    ins = np.array([s.prompt_tokens for s in w])
    outs = np.array([s.output_tokens for s in w])
    assert ins.min() >= 50 and ins.max() <= 150 and ins.mean() == pytest.approx(100, rel=0.05)
    assert outs.min() >= 25 and outs.max() <= 75
    fixed = random_workload(10, 100, 50, rate=float("inf"), burstiness=1.0, seed=0)
    assert {(s.arrival_s, s.prompt_tokens, s.output_tokens) for s in fixed} == {(0.0, 100, 50)}
    assert w == random_workload(2000, 100, 50, 10.0, 1.0, 0, 0.5)
    with pytest.raises(ValueError, match="range_ratio"):
        random_workload(10, 100, 50, 1.0, 1.0, 0, range_ratio=1.0)


def test_shared_prefix_workload():
    w = shared_prefix_workload(400, 512, 32, 16, rate=4.0, seed=0, num_prefixes=4)
    assert {s.prompt_tokens for s in w} == {544}
    assert {s.output_tokens for s in w} == {16}
    assert {s.prefix_group for s in w} == {0, 1, 2, 3}
    with pytest.raises(ValueError, match="num_prefixes"):
        shared_prefix_workload(4, 512, 32, 16, 4.0, 0, num_prefixes=0)


# --- prompts with a real byte-level BPE tokenizer --------------------------------------------

@pytest.fixture(scope="module")
def bpe():
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(CORPUS) * 3, trainer=trainer)
    return tok


def test_corpus_is_a_few_hundred_words():
    assert 300 <= len(" ".join(CORPUS).split()) <= 1000


@pytest.mark.parametrize("n", [1, 7, 128, 1000, 5000])
def test_prompt_ids_exact(bpe, n):
    def enc(s):
        return bpe.encode(s).ids

    ids = make_prompt_ids(enc, n, seed=3)
    assert len(ids) == n
    assert ids == make_prompt_ids(enc, n, seed=3)
    if n >= 7:
        assert ids != make_prompt_ids(enc, n, seed=4)  # another rotation of the corpus
    assert len(bpe.decode(ids).split()) >= min(n // 4, 1)  # real words, not byte garbage


@pytest.mark.parametrize("n", [1, 16, 100, 777, 3000])
@pytest.mark.parametrize("seed", [0, 5])
def test_prompt_text_exact(bpe, n, seed):
    def enc(s):
        return bpe.encode(s).ids

    text, count = make_prompt_text(enc, bpe.decode, n, seed)
    assert count == len(enc(text))
    assert count == n


def test_prompt_ids_custom_corpus_and_validation(bpe):
    def enc(s):
        return bpe.encode(s).ids

    assert len(make_prompt_ids(enc, 50, seed=0, corpus="hello world")) == 50
    with pytest.raises(ValueError, match="num_tokens"):
        make_prompt_ids(enc, 0, seed=0)


# --- metrics ---------------------------------------------------------------------------------

def test_request_timing_properties():
    t = RequestTiming(send_s=10.0, token_times_s=[10.5, 10.6, 10.8, 11.1], prompt_tokens=5,
                      output_tokens=4)
    assert t.ttft_s == pytest.approx(0.5)
    assert t.e2e_s == pytest.approx(1.1)
    assert t.tpot_s == pytest.approx(0.2)
    assert t.itls_s == pytest.approx([0.1, 0.2, 0.3])
    one = RequestTiming(0.0, [0.25], 3, 1)
    assert one.tpot_s is None and one.itls_s == [] and one.ttft_s == 0.25
    none = RequestTiming(0.0, [], 3, 0, ok=False)
    assert none.ttft_s is None and none.e2e_s is None


def test_summarize_known_answers():
    timings = [
        # ttft 100 ms, gaps 10, 30 ms -> tpot 20 ms, e2e 140 ms
        RequestTiming(0.0, [0.10, 0.11, 0.14], prompt_tokens=10, output_tokens=3),
        # ttft 300 ms, gap 50 ms -> tpot 50 ms, e2e 350 ms
        RequestTiming(1.0, [1.30, 1.35], prompt_tokens=20, output_tokens=2),
        # ttft 200 ms, one token: no tpot, no itl; e2e 200 ms
        RequestTiming(2.0, [2.20], prompt_tokens=30, output_tokens=1),
        # failed: ignored by every latency and throughput metric
        RequestTiming(3.0, [3.01, 3.02], prompt_tokens=40, output_tokens=2, ok=False),
    ]
    s = summarize(timings, duration_s=4.0)
    assert (s["completed"], s["failed"]) == (3, 1)
    assert s["request_throughput"] == pytest.approx(0.75)
    assert s["output_token_throughput"] == pytest.approx(6 / 4)
    assert s["total_token_throughput"] == pytest.approx(66 / 4)
    assert s["goodput"] == pytest.approx(0.75)  # no SLOs: every ok request is good

    ttft = s["ttft_ms"]  # [100, 200, 300]
    assert ttft["mean"] == pytest.approx(200) and ttft["median"] == pytest.approx(200)
    assert ttft["p90"] == pytest.approx(280)  # linear: 200 + 0.8 * 100
    assert ttft["p95"] == pytest.approx(290)
    assert ttft["p99"] == pytest.approx(298)
    tpot = s["tpot_ms"]  # [20, 50]
    assert tpot["mean"] == pytest.approx(35) and tpot["p90"] == pytest.approx(47)
    itl = s["itl_ms"]  # all gaps [10, 30, 50]
    assert itl["mean"] == pytest.approx(30) and itl["median"] == pytest.approx(30)
    assert itl["p99"] == pytest.approx(49.6)
    e2e = s["e2e_ms"]  # [140, 350, 200]
    assert e2e["median"] == pytest.approx(200) and e2e["mean"] == pytest.approx(230)

    # TTFT <= 250 ms drops request 2; TPOT <= 30 ms drops request 2 too; the one-token
    # request has no TPOT and stays good.
    assert summarize(timings, 4.0, slo_ttft_ms=250)["goodput"] == pytest.approx(2 / 4)
    assert summarize(timings, 4.0, slo_tpot_ms=30)["goodput"] == pytest.approx(2 / 4)
    both = summarize(timings, 4.0, slo_ttft_ms=150, slo_tpot_ms=30)
    assert both["good"] == 1 and both["goodput"] == pytest.approx(0.25)


def test_summarize_empty():
    s = summarize([], duration_s=0.0)
    assert s["completed"] == s["failed"] == 0
    assert s["request_throughput"] == s["goodput"] == s["output_token_throughput"] == 0.0
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(s[key]) == {"mean", "median", "p90", "p95", "p99"}
        assert all(v is None for v in s[key].values())
    s = summarize([RequestTiming(0.0, [], 1, 0, ok=False)], duration_s=1.0)
    assert s["failed"] == 1 and s["ttft_ms"]["mean"] is None
    with pytest.raises(ValueError, match="duration_s"):
        summarize([], duration_s=-1.0)


def test_prompt_text_adjusts_cut_when_round_trip_changes_count():
    # A decode that adds a character: the naive cut re-encodes one token too long.
    def enc(s):
        return [ord(c) for c in s]

    def dec_extra(ids):
        return "".join(map(chr, ids)) + "!"

    text, count = make_prompt_text(enc, dec_extra, 50, seed=0)
    assert count == len(enc(text)) == 50

    # No cut can reach the target: closest text and its true count come back.
    def dec_short(ids):
        return "".join(map(chr, ids[:10]))

    text, count = make_prompt_text(enc, dec_short, 50, seed=0)
    assert count == len(enc(text)) == 10


# --- the multi-tenant workload and its fairness measures --------------------------------------
def test_tenants_workload_has_a_heavy_tenant_with_long_prompts_and_light_chats():
    from kvflow.workloads.azure import load_azure_trace
    from kvflow.workloads.synthetic import tenants_workload

    lengths, _ = load_azure_trace(default_trace(), max_prompt_tokens=6144,
                                  max_output_tokens=2048)
    specs = tenants_workload(lengths, 400, 10.0, seed=1, num_light=4, heavy_share=0.5)
    assert len(specs) == 400
    assert [s.arrival_s for s in specs] == sorted(s.arrival_s for s in specs)
    heavy = [s for s in specs if s.tenant == "heavy"]
    light = [s for s in specs if s.tenant != "heavy"]
    assert len(heavy) == 200 and {s.tenant for s in light} == {f"light-{k}" for k in range(4)}
    assert min(s.prompt_tokens for s in heavy) > max(s.prompt_tokens for s in light)
    assert {s.priority for s in heavy} == {1} and {s.priority for s in light} == {0}
    # Same seed, same workload.
    again = tenants_workload(lengths, 400, 10.0, seed=1, num_light=4, heavy_share=0.5)
    assert again == specs
    with pytest.raises(ValueError, match="heavy_share"):
        tenants_workload(lengths, 10, 1.0, 0, heavy_share=1.0)


def test_max_min_shares_give_a_small_demand_all_it_asks():
    from kvflow.reports.summary import max_min_shares

    assert max_min_shares({"a": 10.0, "b": 100.0, "c": 100.0}, 110.0) == {
        "a": 10.0, "b": 50.0, "c": 50.0}
    assert max_min_shares({"a": 10.0, "b": 20.0}, 100.0) == {"a": 10.0, "b": 20.0}


def test_fairness_is_one_when_each_tenant_gets_its_share_and_lower_when_one_is_starved():
    from kvflow.reports.summary import tenant_summary

    def timing(send, first, n):
        return RequestTiming(send, [first + 0.01 * k for k in range(n)], 10, n)

    # Two tenants with equal work, served side by side: every window is fair.
    even = [timing(t, t + 0.1, 10) for t in range(10)] * 2
    tenants = ["a"] * 10 + ["b"] * 10
    assert tenant_summary(even, tenants)["jain_index"] == pytest.approx(1.0)
    # b's requests are all served only after a's: in the windows before, b got nothing.
    late = [timing(t, t + 0.1, 10) for t in range(10)] + [timing(t, 20 + t, 10)
                                                           for t in range(10)]
    summary = tenant_summary(late, tenants, heavy="a")
    assert summary["jain_index"] < 0.75
    assert summary["fair_share_ratio"]["b"] < summary["fair_share_ratio"]["a"]
    assert summary["light_ttft_ms"]["mean"] > 10_000  # b's wait, 20 s behind
    assert summary["longest_wait_ms"] == pytest.approx(20_000, rel=0.01)
