"""``kvflow bench quality``: the windowing, perplexity equal to HF transformers' on the same
weights and windows, KL divergence and top-1 agreement, llama-perplexity's output parsed, and
the report files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from kvflow.bench import quality
from kvflow.bench.peers import parse_perplexity
from kvflow.cli import main as cli_main

torch = pytest.importorskip("torch")

TINY = "llama-gqa4"


@pytest.mark.parametrize(("n", "context", "stride"),
                         [(100, 32, 16), (100, 32, 31), (97, 32, 7), (33, 32, 16), (2, 2, 1),
                          (10, 64, 16)])
def test_windows_score_every_token_after_the_first_exactly_once(n, context, stride):
    windows = quality.sliding_windows(n, context, stride)
    scored = [p for w in windows for p in range(w.first, w.end)]
    assert scored == list(range(1, n))
    for w in windows:
        assert w.end - w.begin <= context and w.begin < w.first < w.end <= n
        assert w.begin % stride == 0
    # Past the first window, every scored token sees at least context - stride tokens.
    assert all(w.first - w.begin >= context - stride for w in windows[1:])


@pytest.mark.parametrize(("n", "context", "stride", "field"),
                         [(100, 1, 1, "--context"), (100, 32, 32, "--stride"),
                          (100, 32, 0, "--stride"), (1, 32, 16, "at least 2 tokens")])
def test_bad_windowing_is_refused_by_name(n, context, stride, field):
    with pytest.raises(ValueError, match=field):
        quality.sliding_windows(n, context, stride)


def test_kl_and_top1_against_itself_and_by_hand():
    rng = np.random.default_rng(0)
    lp = quality.log_softmax(rng.normal(size=(5, 11)))
    assert quality.kl_and_top1(lp, lp) == (0.0, 5)
    p, q = np.log([[0.5, 0.25, 0.25]]), np.log([[0.25, 0.5, 0.25]])
    kl, same = quality.kl_and_top1(p, q)
    assert kl == pytest.approx(0.5 * math.log(2) + 0.25 * math.log(0.5))
    assert same == 0
    np.testing.assert_allclose(np.exp(lp).sum(axis=-1), 1.0, rtol=1e-12)


def hf_perplexity(hf, ids: list[int], windows) -> float:
    """HF's own sliding-window perplexity on the same windows, from its logits."""
    nll, count = 0.0, 0
    with torch.no_grad():
        for w in windows:
            logits = hf(torch.tensor([ids[w.begin:w.end]])).logits[0].double()
            lp = torch.log_softmax(logits, dim=-1)
            for p in range(w.first, w.end):
                nll -= float(lp[p - w.begin - 1, ids[p]])
                count += 1
    assert count == len(ids) - 1
    return math.exp(nll / count)


@pytest.mark.parametrize("backend", ["onnxruntime", "torch"])
def test_fp32_perplexity_equals_hf_on_the_same_weights_and_windows(tiny_models, tiny_engines,
                                                                   backend):
    folder, hf = tiny_models[TINY]
    engine = str(tiny_engines[TINY, backend])
    ids = np.random.default_rng(1).integers(3, 250, size=90).tolist()
    windows = quality.sliding_windows(len(ids), 32, 12)
    expected = hf_perplexity(hf, ids, windows)

    tally = quality.llm_pass(engine, "fp32", ids, windows, log=lambda _m: None)
    assert tally.tokens == len(ids) - 1
    assert tally.perplexity == pytest.approx(expected, rel=1e-4)

    score, close = quality.runner_scorer(engine, "fp32", 32)
    systems = {n: quality.System(n, engine, "fp32") for n in ("ref", "again", "hf")}
    try:
        quality.logits_pass(ids, windows, {"ref": score, "again": score,
                                           "hf": quality.hf_scorer(str(folder))},
                            systems, "ref", log=lambda _m: None)
    finally:
        close()
    for s in systems.values():
        assert s.logits.tokens == s.logits.kl_tokens == len(ids) - 1
        assert s.logits.perplexity == pytest.approx(expected, rel=1e-4)
    # The reference against itself: KL 0, top-1 always the same.
    for name in ("ref", "again"):
        assert systems[name].logits.as_dict()["mean_kl"] == 0.0
        assert systems[name].logits.as_dict()["top1_agreement"] == 1.0
    assert systems["hf"].logits.as_dict()["mean_kl"] < 1e-6


def test_command_writes_the_report(tiny_models, tiny_engines, tmp_path, capsys):
    folder, hf = tiny_models[TINY]
    engine = tiny_engines[TINY, "onnxruntime"]
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 20)
    out = tmp_path / "report"
    code = cli_main(["bench", "quality", "--engine", str(engine), "--text", str(text),
                     "--context", "48", "--stride", "16", "--max-tokens", "120",
                     "--hf", str(folder), "--llama-cpp", "none", "--out", str(out)])
    assert code == 0
    assert {p.name for p in out.iterdir()} >= {"summary.md", "report.json", "quality.png"}
    report = json.loads((out / "report.json").read_text())
    assert report["tokens"] == 120 and report["llama_cpp"] == []
    by_name = {s["name"]: s for s in report["systems"]}
    ref = by_name[report["reference"]]
    assert ref["full_vocabulary"]["mean_kl"] == 0.0
    assert ref["full_vocabulary"]["top1_agreement"] == 1.0
    assert "not quantized" in ref["note"]  # a tiny fp32 engine: one path, and it says so
    assert set(by_name) == {report["reference"], "hf-transformers fp32"}
    ppl = ref["prompt_logprobs"]["perplexity"]
    assert ppl == pytest.approx(ref["full_vocabulary"]["perplexity"], rel=1e-4)
    assert ppl == pytest.approx(by_name["hf-transformers fp32"]["full_vocabulary"]["perplexity"],
                                rel=1e-4)
    summary = (out / "summary.md").read_text()
    assert "| hf-transformers fp32 |" in summary and summary in capsys.readouterr().out


def test_bad_options_are_refused_by_name(tiny_engines, tmp_path):
    engine = str(tiny_engines[TINY, "torch"])
    base = ["bench", "quality", "--engine", engine, "--llama-cpp", "none", "--hf", "none",
            "--out", str(tmp_path)]
    for extra, field in ((["--context", "256"], "max_model_len of 256"),
                         (["--modes", "int4"], "--modes"),
                         (["--max-tokens", "1"], "--max-tokens"),
                         (["--text", str(tmp_path / "missing.txt")], "--text")):
        with pytest.raises(SystemExit) as e:
            cli_main(base + extra)
        assert e.value.code == 2, field


LLAMA_PPL = """perplexity: calculating perplexity over 3 chunks, n_ctx=512, batch_size=512
[1]12.3456,[2]13.0000,[3]14.1000,
Final estimate: PPL = 14.1000 +/- 0.51234
"""
LLAMA_KL = """kl_divergence: computing over 3 chunks, n_ctx=512, batch_size=512, n_seq=1
====== Perplexity statistics ======
Mean PPL(Q)                   :  14.523400 ±   0.520000
Mean PPL(base)                :  14.100000 ±   0.510000
====== KL divergence statistics ======
Mean    KLD:   0.021234 ±   0.000456
====== Token probability statistics ======
Same top p: 93.125 ± 0.523 %
"""


def test_llama_perplexity_output_is_parsed():
    assert parse_perplexity(LLAMA_PPL) == {"perplexity": 14.1, "chunks": 3}
    assert parse_perplexity(LLAMA_KL) == {"perplexity": 14.5234, "chunks": 3,
                                          "mean_kl": 0.021234,
                                          "top1_agreement": pytest.approx(0.93125)}
    with pytest.raises(RuntimeError, match="no perplexity"):
        parse_perplexity("error: failed to load model")
