"""The multi-LoRA benchmark's pieces (``benchmarks/lora.py``, ``kvflow/bench/lora_*``): how
requests are spread over adapters, the ``/metrics`` counters read, the runs, the report and its
targets, the process-tree RSS; a short served run whose report must be complete; and ``kvflow
bench quality --lora``, kvflow with an adapter against HF + PEFT."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from collections import Counter
from pathlib import Path

import pytest

from kvflow.bench import lora_report, lora_serve
from kvflow.bench.machine import PeakRss, cpu_isa, tree_rss_bytes
from kvflow.cli import main as cli_main

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "lora.py"
TINY = "llama-gqa4"


def _script():
    spec = importlib.util.spec_from_file_location("bench_lora_script", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench_lora_script"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("n", "k"), [(64, 8), (10, 3), (3, 8), (1, 1)])
def test_adapters_are_spread_in_equal_shares_in_a_seeded_order(n, k):
    mix = [f"lora-{i}" for i in range(k)]
    order = lora_serve.assign_adapters(n, mix, seed=3)
    counts = Counter(order)
    assert len(order) == n and set(counts) <= set(mix)
    assert max(counts.values()) - min(counts.get(m, 0) for m in mix) <= 1
    assert order == lora_serve.assign_adapters(n, mix, seed=3)
    assert lora_serve.assign_adapters(n, [], seed=3) == [None] * n


def test_a_mixed_run_is_not_in_adapter_order():
    order = lora_serve.assign_adapters(64, [f"lora-{i}" for i in range(8)], seed=0)
    assert order != sorted(order) and order[:8] != [f"lora-{i}" for i in range(8)]


def test_the_standard_runs_are_the_issues_four():
    names = [f"lora-{i}" for i in range(8)]
    runs = lora_serve.standard_runs(names)
    assert [(r.name, len(r.loaded), r.max_loras, len(r.mix)) for r in runs] == [
        ("base", 0, None, 0), ("1 adapter", 1, 4, 1),
        ("8 adapters, max_loras 4", 8, 4, 8), ("8 adapters, max_loras 8", 8, 8, 8)]
    with pytest.raises(ValueError, match="not loaded"):
        lora_serve.LoraRun("bad", ("a",), 1, ("b",))
    with pytest.raises(ValueError, match="max_loras"):
        lora_serve.LoraRun("bad", ("a",), 0, ("a",))


EXPOSITION = """# HELP kvflow_lora_swaps_total Adapters written into a slot.
# TYPE kvflow_lora_swaps_total counter
kvflow_lora_swaps_total{model="kvflow",version="1"} 12
kvflow_lora_evictions_total{model="kvflow",version="1"} 4
kvflow_lora_resident{model="kvflow",version="1"} 4
kvflow_lora_requests_running{lora_name="lora-1"} 3
kvflow_num_requests_running{model="kvflow",version="1"} 8
"""


def test_lora_counters_are_read_from_the_exposition():
    assert lora_serve.parse_lora_metrics(EXPOSITION) == {"swaps": 12.0, "evictions": 4.0,
                                                          "resident": 4.0}
    assert lora_serve.parse_lora_metrics("kvflow_num_requests_running 1\n") == {
        "swaps": None, "evictions": None, "resident": None}


def _run(name, tok_s, tpot_p50, loaded=(), mix=(), max_loras=None, **extra):
    run = {"name": name, "loaded": list(loaded), "max_loras": max_loras, "mix": list(mix),
           "requests": 16, "completed": 16, "failed": 0, "duration_s": 10.0,
           "output_tokens": 16 * 64, "itl_ms": {"p50": tpot_p50, "p99": 50.0, "mean": 21.0},
           "output_tok_s": tok_s, "ttft_ms": {"p50": 100.0, "p99": 300.0, "mean": 120.0},
           "tpot_ms": {"p50": tpot_p50, "p99": tpot_p50 * 1.5, "mean": tpot_p50},
           "peak_rss_bytes": 900 << 20, "errors": []}
    if loaded:
        run["lora"] = {"swaps": 3.0, "evictions": 1.0, "resident": float(len(loaded))}
    run.update(extra)
    return run


def _report(runs):
    names = [f"lora-{i}" for i in range(8)]
    return {"config": {"engine": "engines/x", "adapters": 8, "rank": 16, "alpha": 32.0,
                       "targets": ["q_proj"], "adapter_bytes": 1 << 20, "num_prompts": 16,
                       "prompt_tokens": 128, "output_tokens": 64, "concurrency": 8},
            "machine": cpu_isa(), "machine_note": "shared.", "command": "python x",
            "runs": runs, "names": names}


def test_the_report_judges_the_targets_and_is_complete(tmp_path, capsys):
    names = [f"lora-{i}" for i in range(8)]
    runs = [_run("base", 100.0, 20.0),
            _run("1 adapter", 90.0, 22.0, names[:1], names[:1], 4),
            _run("8 adapters, max_loras 4", 70.0, 24.0, names, names, 4),
            _run("8 adapters, max_loras 8", 85.0, 26.0, names, names, 8)]
    step = {"batch": 8, "context": 160, "prompt": 128, "repeats": 20, "adapters": 8,
            "rank": 16, "quantized_matmul": "fp32",
            "cases": {name: {k: {"p50_ms": ms * f, "p10_ms": ms * f - 1, "p90_ms": ms * f + 1}
                             for k, f in (("decode", 1), ("prefill", 40))}
                      for name, ms in (("base graph", 50.0), ("8 adapters", 60.0))}}
    report = lora_report.write_lora_report(tmp_path, {**_report(runs), "step": step})
    assert {p.name for p in tmp_path.iterdir()} == {"report.md", "report.json", "lora.png"}
    assert report["missing"] == []
    targets = {t["name"]: t for t in report["targets"]}
    assert "met" not in targets["1 adapter"]  # one adapter is reported, not judged
    assert targets["8 adapters, max_loras 4"]["throughput_ratio"] == pytest.approx(0.7)
    assert targets["8 adapters, max_loras 4"]["met"] is False  # throughput below 0.8x
    assert targets["8 adapters, max_loras 8"]["tpot_p50_ratio"] == pytest.approx(1.3)
    assert targets["8 adapters, max_loras 8"]["met"] is False  # TPOT above 1.25x
    md = (tmp_path / "report.md").read_text()
    assert md in capsys.readouterr().out
    assert "| 8 adapters, max_loras 4 | 8 | 4 | 16 / 0 | 70.0 | 0.70x |" in md
    assert cpu_isa()["widest"] in md and "**not met**" in md
    assert "| 8 adapters | 60.0 (59.0-61.0) | 1.20x | 2400.0 (2399.0-2401.0) | 1.20x |" in md
    assert json.loads((tmp_path / "report.json").read_text())["targets"] == report["targets"]

    runs[3] = _run("8 adapters, max_loras 8", 81.0, 24.9, names, names, 8)
    report = lora_report.write_lora_report(tmp_path, _report(runs), echo=False)
    assert next(t for t in report["targets"] if t["name"] == runs[3]["name"])["met"] is True


def test_rounds_are_combined_by_median_and_ratios_paired_by_round():
    names = ["lora-0", "lora-1"]
    # The machine got twice as fast in round 2: each round's mixed run is 0.9x its base.
    base = [_run("base", 100.0, 20.0), _run("base", 200.0, 10.0), _run("base", 150.0, 14.0)]
    mixed = [_run("mixed", 90.0, 22.0, names, names, 2),
             _run("mixed", 180.0, 11.0, names, names, 2),
             {"name": "mixed", "loaded": names, "max_loras": 2, "mix": names,
              "requests": 16, "error": "ServeError: killed"}]
    runs = lora_report.combine_rounds([[b, m] for b, m in zip(base, mixed, strict=True)])
    assert runs[0]["output_tok_s"] == 150.0 and runs[0]["completed"] == 48
    assert runs[0]["tpot_ms"]["p50"] == 14.0 and runs[0]["peak_rss_bytes"] == 900 << 20
    assert runs[1]["output_tok_s"] == 135.0 and runs[1]["requests"] == 32  # two rounds served
    assert runs[1]["rounds"][2] == {"error": "ServeError: killed"}
    target = lora_report.judge_targets(runs)[0]
    assert target["throughput_ratio"] == pytest.approx(0.9)  # not 135 / 150
    assert target["tpot_p50_ratio"] == pytest.approx(1.1)
    assert lora_report.missing_figures({"machine": {"widest": "AVX2"}, "runs": runs}) == [
        "mixed: 1 of 3 rounds did not run"]


def test_an_incomplete_report_says_what_is_missing(tmp_path):
    names = ["lora-0", "lora-1"]
    runs = [_run("base", 100.0, 20.0),
            {"name": "1 adapter", "loaded": names[:1], "max_loras": 1, "mix": names[:1],
             "requests": 16, "error": "ServeError: unknown option lora_modules"},
            _run("2 adapters, max_loras 1", 50.0, 30.0, names, names, 1, failed=2,
                 lora={"swaps": None, "evictions": 1.0, "resident": 1.0})]
    report = lora_report.write_lora_report(tmp_path, _report(runs), echo=False)
    assert report["missing"] == ["1 adapter: did not run (see Errors)",
                                 "2 adapters, max_loras 1: 2 failed requests",
                                 "2 adapters, max_loras 1: lora.swaps"]
    md = (tmp_path / "report.md").read_text()
    assert "| 1 adapter | 1 | 1 | did not run |" in md and "Incomplete:" in md
    assert "- 1 adapter: ServeError: unknown option lora_modules" in md
    no_base = lora_report.missing_figures({"machine": {"widest": "AVX2"}, "runs": runs[1:2]})
    assert no_base[0] == "base: no run"


def test_the_process_tree_rss_counts_this_process():
    mine = tree_rss_bytes(os.getpid())
    assert mine > 10 << 20  # a Python with pytest and numpy loaded
    with PeakRss(os.getpid(), period_s=0.01) as rss:
        block = bytearray(64 << 20)
        block[::4096] = b"x" * len(block[::4096])  # touched, so resident
    assert rss.peak_bytes >= mine + (32 << 20)
    assert tree_rss_bytes(2**22 + 12345) == 0  # no such process


def test_bad_options_are_refused_by_name():
    script = _script()
    for argv, field in ((["--max-loras", "4,x"], "--max-loras"),
                        (["--max-loras", "0"], "--max-loras"),
                        (["--concurrency", "0"], "--concurrency"),
                        (["--rounds", "0", "--step-repeats", "0"], "--rounds"),
                        (["--rounds", "-1"], "--rounds")):
        with pytest.raises(SystemExit) as e:
            script.parse_args(argv)
        assert e.value.code == 2, field
    with pytest.raises(SystemExit, match="--engine-arg"):
        script.engine_args(["novalue"])
    assert script.engine_args(["max_num_seqs=8", "policy=fcfs"]) == {
        "enable_prefix_caching": False, "max_num_seqs": 8, "policy": "fcfs"}


def test_quality_lora_flag_is_checked_by_name(tmp_path):
    from kvflow.bench.quality_lora import parse_lora

    with pytest.raises(ValueError, match="NAME=PATH"):
        parse_lora("just-a-name")
    with pytest.raises(FileNotFoundError, match="--lora a: "):
        parse_lora(f"a={tmp_path / 'missing'}")
    assert parse_lora(f"a={tmp_path}") == ("a", tmp_path)


@pytest.mark.slow
def test_a_smoke_run_serves_every_run_and_writes_a_complete_report(tiny_models, tiny_engines,
                                                                    tmp_path):
    folder, _hf = tiny_models[TINY]
    engine = tiny_engines[TINY, "onnxruntime"]
    out = tmp_path / "lora"
    code = _script().main(["--smoke", "--engine", str(engine), "--model", str(folder),
                           "--out", str(out)])
    report = json.loads((out / "report.json").read_text())
    assert report["missing"] == [] and code == 0
    assert {p.name for p in out.iterdir()} >= {"report.md", "report.json", "lora.png"}
    runs = {r["name"]: r for r in report["runs"]}
    assert list(runs) == ["base", "1 adapter", "2 adapters, max_loras 1",
                          "2 adapters, max_loras 2"]
    for r in runs.values():
        assert r["completed"] == 8 and r["output_tokens"] == 8 * 4
    # Two adapters, one slot: every change of adapter writes the slot over; two slots hold
    # both from the warm-up on.
    assert runs["2 adapters, max_loras 1"]["lora"]["evictions"] >= 1
    assert runs["2 adapters, max_loras 1"]["lora"]["swaps"] >= 1
    assert runs["2 adapters, max_loras 2"]["lora"] == {"swaps": 0, "evictions": 0,
                                                       "resident": 2}
    assert runs["2 adapters, max_loras 2"]["requests_per_adapter"] == {"lora-0": 2,
                                                                       "lora-1": 2}
    assert all(len(r["rounds"]) == 2 for r in runs.values())
    assert [t["name"] for t in report["targets"]] == list(runs)[1:]
    step = report["step"]["cases"]
    assert list(step) == ["base graph", "LoRA graph, base requests", "1 adapter", "2 adapters"]
    assert all(c[k]["p50_ms"] > 0 for c in step.values() for k in ("decode", "prefill"))


def test_bench_quality_lora_equals_hf_with_peft(tiny_models, tiny_engines, tmp_path):
    from kvflow.lora.synthetic import make_peft_adapter

    folder, _hf = tiny_models[TINY]
    engine = tiny_engines[TINY, "onnxruntime"]
    adapter = make_peft_adapter(folder, tmp_path / "adapter", rank=4, alpha=8, seed=1,
                                scale=0.2)
    text = tmp_path / "text.txt"
    text.write_text("To be, or not to be, that is the question. " * 20)
    out = tmp_path / "report"
    code = cli_main(["bench", "quality", "--engine", str(engine), "--text", str(text),
                     "--context", "48", "--stride", "16", "--max-tokens", "120",
                     "--hf", str(folder), "--llama-cpp", "none", "--lora", f"a={adapter}",
                     "--out", str(out)])
    assert code == 0
    report = json.loads((out / "report.json").read_text())
    by_name = {s["name"]: s for s in report["systems"]}
    ref = by_name[report["reference"]]["full_vocabulary"]
    lora = by_name[f"{engine.name} fp32 + a"]
    base = by_name[f"{engine.name} fp32, no adapter"]["full_vocabulary"]
    assert lora["full_vocabulary"]["mean_kl"] < 1e-6
    assert lora["full_vocabulary"]["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)
    # through the engine (LLM, lora=...) too
    assert lora["prompt_logprobs"]["perplexity"] == pytest.approx(ref["perplexity"], rel=1e-4)
    # the adapter moves the model: the base is far from HF + PEFT
    assert base["mean_kl"] > 1000 * max(lora["full_vocabulary"]["mean_kl"], 1e-9)
    assert "There are no llama.cpp rows" in (out / "summary.md").read_text()
