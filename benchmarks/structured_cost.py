"""The per-step cost of constrained decoding (structured outputs) on the CPU, and compile times.

A batch of 32 rows over the real vocabulary (49152 for SmolLM2), of which 1, 8 or 32 rows are
constrained by JSON-schema grammars caught mid-generation (each advanced a random number of
tokens first, so that the rows sit in different states: inside strings, at keys, in numbers).
Each step: random logits, then the three costs the engine adds for those rows, timed apart:
``fill_bitmasks`` (llguidance's parallel mask computation), ``apply_bitmask`` on those rows of
the [32, vocab] logits, and ``accept`` of the greedy token of each row. A grammar that finishes
is replaced by a fresh one, outside the timings. Also: llguidance's own NumPy
``apply_token_bitmask_inplace`` on the same rows, for reference, and the compile time of a
schema cold (a miss) and cached (a hit, a deep copy). Writes ``report.json``, ``summary.md``
and ``structured_cost.png``.

    python benchmarks/structured_cost.py --engine engines/smollm2-135m
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import numpy as np
from llguidance.numpy import apply_token_bitmask_inplace

from kvflow.build.engine_config import EngineConfig
from kvflow.orchestrator.sampling.structured import (
    Grammar,
    GrammarCompiler,
    StructuredOutput,
    allocate_bitmask,
    apply_bitmask,
    fill_bitmasks,
)
from kvflow.reports.writers import pyplot, save_figure, write_report

SCHEMAS = [
    {"type": "object", "additionalProperties": False,
     "required": ["name", "age", "email", "tags"],
     "properties": {"name": {"type": "string", "maxLength": 40},
                    "age": {"type": "integer", "minimum": 0, "maximum": 150},
                    "email": {"type": "string", "format": "email"},
                    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                             "maxItems": 5}}},
    {"type": "object", "additionalProperties": False, "required": ["order_id", "items", "status"],
     "properties": {"order_id": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{6}$"},
                    "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
                    "items": {"type": "array", "maxItems": 4, "items": {
                        "type": "object", "additionalProperties": False,
                        "required": ["sku", "quantity", "price"],
                        "properties": {"sku": {"type": "string", "maxLength": 16},
                                       "quantity": {"type": "integer", "minimum": 1},
                                       "price": {"type": "number"}}}}}},
    {"type": "object", "additionalProperties": False, "required": ["title", "when", "where"],
     "properties": {"title": {"type": "string", "maxLength": 60},
                    "when": {"type": "string", "format": "date-time"},
                    "where": {"type": "object", "additionalProperties": False,
                              "required": ["city", "country"],
                              "properties": {"city": {"type": "string", "maxLength": 30},
                                             "country": {"type": "string", "maxLength": 30},
                                             "lat": {"type": "number"},
                                             "lon": {"type": "number"}}},
                    "attendees": {"type": "array", "items": {"type": "string"}, "maxItems": 8}}},
    {"type": "object", "additionalProperties": False, "required": ["answer", "confidence"],
     "properties": {"answer": {"type": "string", "maxLength": 200},
                    "confidence": {"type": "number", "minimum": 0, "maximum": 1},
                    "sources": {"type": "array", "maxItems": 3,
                                "items": {"type": "object", "additionalProperties": False,
                                          "required": ["url"],
                                          "properties": {"url": {"type": "string"},
                                                         "quote": {"type": "string",
                                                                   "maxLength": 80}}}}}},
]


def stats_ms(xs: list[float]) -> dict[str, float]:
    ms = np.asarray(xs) * 1e3
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)),
            "p99": float(np.percentile(ms, 99))}


def advance(grammar: Grammar, steps: int, vocab: int, rng: np.random.Generator) -> Grammar:
    """Greedy decoding of random logits for up to ``steps`` tokens (a grammar mid-generation)."""
    bitmask = allocate_bitmask(1, vocab)
    for _ in range(steps):
        if grammar.is_stopped:
            break
        fill_bitmasks([grammar], bitmask)
        logits = rng.standard_normal((1, vocab)).astype(np.float32)
        apply_bitmask(logits, bitmask)
        assert grammar.accept(int(np.argmax(logits))), grammar.error
    return grammar


def fresh(compiler: GrammarCompiler, k: int, rng: np.random.Generator) -> Grammar:
    so = StructuredOutput.from_guided(guided_json=SCHEMAS[k % len(SCHEMAS)])
    assert so is not None
    grammar = compiler.compile(so)
    return advance(grammar, int(rng.integers(3, 30)), compiler.vocab_size, rng)


def time_steps(compiler: GrammarCompiler, batch: int, constrained: int, steps: int,
               seed: int) -> dict:
    vocab = compiler.vocab_size
    rng = np.random.default_rng(seed)
    grammars = [fresh(compiler, k, rng) for k in range(constrained)]
    rows = np.linspace(0, batch - 1, constrained).round().astype(np.intp)  # spread in the batch
    pool = rng.standard_normal((4, batch, vocab)).astype(np.float32)
    logits = np.empty((batch, vocab), np.float32)
    bitmask = allocate_bitmask(constrained, vocab)
    fill, apply, accept, total, reference, replaced = [], [], [], [], [], 0
    masks = []
    for step in range(steps + 5):  # the first 5 warm up
        np.copyto(logits, pool[step % len(pool)])
        t0 = time.perf_counter()
        fill_bitmasks(grammars, bitmask)
        t1 = time.perf_counter()
        apply_bitmask(logits, bitmask, rows=rows)
        t2 = time.perf_counter()
        tokens = np.argmax(logits[rows], axis=1)  # the sampler's work, not timed below
        t3 = time.perf_counter()
        for grammar, token in zip(grammars, tokens.tolist(), strict=True):
            assert grammar.accept(token), grammar.error
        t4 = time.perf_counter()
        same = pool[step % len(pool)][rows]
        t5 = time.perf_counter()
        apply_token_bitmask_inplace(same, bitmask)
        t6 = time.perf_counter()
        assert np.array_equal(same, logits[rows])
        if step >= 5:
            masks.append(bitmask.copy())
            fill.append(t1 - t0)
            apply.append(t2 - t1)
            accept.append(t4 - t3)
            total.append((t2 - t0) + (t4 - t3))
            reference.append(t6 - t5)
        for i, grammar in enumerate(grammars):
            if grammar.is_stopped:
                grammars[i] = fresh(compiler, i + step, rng)
                replaced += 1
    return {"batch": batch, "constrained_rows": constrained, "steps": steps,
            "grammars_finished": replaced, "fill_bitmasks_ms": stats_ms(fill),
            "apply_bitmask_ms": stats_ms(apply), "accept_ms": stats_ms(accept),
            "total_ms": stats_ms(total), "llguidance_numpy_apply_ms": stats_ms(reference),
            "masks": masks}


def time_apply_alone(masks: list[np.ndarray], vocab: int, seed: int) -> dict:
    """apply_bitmask vs llguidance.numpy on a contiguous [rows, vocab] array, warm in cache,
    over the masks of a real run."""
    rng = np.random.default_rng(seed)
    logits = rng.standard_normal((masks[0].shape[0], vocab), dtype=np.float32)
    ours: list[float] = []
    theirs: list[float] = []
    for mask in masks:
        work = logits.copy()
        t0 = time.perf_counter()
        apply_bitmask(work, mask)
        ours.append(time.perf_counter() - t0)
        work = logits.copy()
        t0 = time.perf_counter()
        apply_token_bitmask_inplace(work, mask)
        theirs.append(time.perf_counter() - t0)
    return {"rows": masks[0].shape[0], "vocab": vocab, "apply_bitmask_ms": stats_ms(ours),
            "llguidance_numpy_apply_ms": stats_ms(theirs)}


def time_compile(engine_dir: Path, repeats: int) -> dict:
    model = EngineConfig.load(engine_dir).model
    text = (engine_dir / "tokenizer.json").read_text()
    cold = GrammarCompiler(text, model.vocab_size, model.eos_token_ids, cache_size=0)
    t0 = time.perf_counter()
    cold.compile(StructuredOutput("regex", "[0-9]+"))  # builds the llguidance tokenizer
    tokenizer_s = time.perf_counter() - t0
    cached = GrammarCompiler(text, model.vocab_size, model.eos_token_ids)
    out: dict = {"tokenizer_build_ms": tokenizer_s * 1e3, "schemas": []}
    for k, schema in enumerate(SCHEMAS):
        so = StructuredOutput.from_guided(guided_json=schema)
        assert so is not None
        misses, hits = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            cold.compile(so)
            misses.append(time.perf_counter() - t0)
        cached.compile(so)
        for _ in range(repeats * 10):
            t0 = time.perf_counter()
            cached.compile(so)
            hits.append(time.perf_counter() - t0)
        out["schemas"].append({"schema": k, "spec_bytes": len(so.spec),
                               "cold_ms": stats_ms(misses), "cached_ms": stats_ms(hits)})
    return out


LONG_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["items"],
               "properties": {"items": {"type": "array", "minItems": 40, "items": {
                   "type": "object", "additionalProperties": False, "required": ["id", "ok"],
                   "properties": {"id": {"type": "integer"}, "ok": {"type": "boolean"}}}}}}


def time_engine_steps(engine_dir: Path, batch: int, constrained: int,
                      max_tokens: int) -> dict[str, float]:
    """The real engine: ``batch`` requests decoding together, ``constrained`` of them under a
    JSON schema too long to finish; the mean per decode step of the engine's sampling and
    postprocessing stages (where the grammar work is) and of the model."""
    from kvflow import LLM, SamplingParams

    with LLM(str(engine_dir)) as llm:
        so = StructuredOutput("json", json.dumps(LONG_SCHEMA))
        plain = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, ignore_eos=True)
        tight = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1, structured=so)
        llm.generate(["warm up"], tight)
        llm.engine.step_stats.clear()
        llm.generate([f"Item list number {i}:" for i in range(batch)],
                     [tight] * constrained + [plain] * (batch - constrained))
        steps = [s for s in llm.engine.step_stats
                 if s.num_decode_tokens == batch and not s.num_prefill_tokens]
    ms = 1e3 / max(len(steps), 1)
    return {"constrained_rows": constrained, "decode_steps": len(steps),
            "sample_ms": sum(s.sample_time_s for s in steps) * ms,
            "postprocess_ms": sum(s.postprocess_time_s for s in steps) * ms,
            "model_ms": sum(s.model_time_s for s in steps) * ms}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-135m",
                   help="engine folder (only its config and tokenizer.json are read)")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--rows", default="1,8,32", help="constrained rows per step, comma-separated")
    p.add_argument("--steps", type=int, default=300, help="timed steps per case")
    p.add_argument("--compile-repeats", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-tokens", type=int, default=48,
                   help="tokens per request in the engine-step measurement")
    p.add_argument("--out", default="reports/structured_cost")
    args = p.parse_args()
    engine_dir = Path(args.engine)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = EngineConfig.load(engine_dir).model
    compiler = GrammarCompiler((engine_dir / "tokenizer.json").read_text(), model.vocab_size,
                               model.eos_token_ids)
    compile_times = time_compile(engine_dir, args.compile_repeats)
    cases = []
    for constrained in (int(x) for x in args.rows.split(",")):
        print(f"timing {constrained} constrained rows of {args.batch}", flush=True)
        cases.append(time_steps(compiler, args.batch, constrained, args.steps, args.seed))
    print("timing the engine's own steps", flush=True)
    engine_steps = [time_engine_steps(engine_dir, args.batch, k, args.engine_tokens)
                    for k in (0, 8)]
    mid = min(cases, key=lambda c: abs(c["constrained_rows"] - 8))
    alone = time_apply_alone(mid["masks"], model.vocab_size, args.seed)
    for c in cases:
        del c["masks"]
    report = {"vocab_size": model.vocab_size, "cpus": os.cpu_count(), "cases": cases,
              "apply_alone": alone, "compile": compile_times, "engine_steps": engine_steps}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n")

    def fmt(s: dict[str, float]) -> str:
        return f"{s['mean']:.3f} / {s['p50']:.3f} / {s['p99']:.3f}"

    lines = [f"# Constrained decoding cost per step (batch {args.batch}, vocab "
             f"{model.vocab_size}, {os.cpu_count()} CPUs, {args.steps} steps)", "",
             "JSON-schema grammars mid-generation; ms per step, mean / p50 / p99.", "",
             "| constrained rows | fill_bitmasks | apply_bitmask | accept | total | "
             "llguidance.numpy apply (reference) |", "|---|---|---|---|---|---|"]
    for c in cases:
        lines.append(f"| {c['constrained_rows']} | {fmt(c['fill_bitmasks_ms'])} | "
                     f"{fmt(c['apply_bitmask_ms'])} | {fmt(c['accept_ms'])} | "
                     f"{fmt(c['total_ms'])} | {fmt(c['llguidance_numpy_apply_ms'])} |")
    lines += ["", f"apply_bitmask alone on a contiguous [{alone['rows']}, {alone['vocab']}] "
              f"float32 array, warm in cache, the masks of that run: "
              f"{fmt(alone['apply_bitmask_ms'])} ms (llguidance.numpy: "
              f"{fmt(alone['llguidance_numpy_apply_ms'])} ms)."]
    lines += ["", f"The engine itself ({args.batch} requests decoding, the engine's default "
              "options), mean ms per decode step:", "",
              "| constrained rows | sampling | postprocess | model | decode steps |",
              "|---|---|---|---|---|"]
    lines += [f"| {e['constrained_rows']} | {e['sample_ms']:.2f} | {e['postprocess_ms']:.2f} "
              f"| {e['model_ms']:.1f} | {e['decode_steps']} |" for e in engine_steps]
    lines += ["", f"Compile (llguidance tokenizer, once per engine: "
              f"{compile_times['tokenizer_build_ms']:.0f} ms); ms, mean / p50 / p99:", "",
              "| schema | spec bytes | cold (miss) | cached (hit) |", "|---|---|---|---|"]
    for s in compile_times["schemas"]:
        lines.append(f"| {s['schema']} | {s['spec_bytes']} | {fmt(s['cold_ms'])} | "
                     f"{fmt(s['cached_ms'])} |")
    write_report(out / "summary.md", lines)

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 4.2))
    parts = ["fill_bitmasks_ms", "apply_bitmask_ms", "accept_ms"]
    x = np.arange(len(cases))
    width = 0.38
    for offset, quantile in ((-width / 2, "p50"), (width / 2, "p99")):
        bottom = np.zeros(len(cases))
        for k, part in enumerate(parts):
            ys = np.array([c[part][quantile] for c in cases])
            ax.bar(x + offset, ys, width, bottom=bottom, color=f"C{k}",
                   alpha=1.0 if quantile == "p50" else 0.55,
                   label=f"{part.removesuffix('_ms')} ({quantile})")
            bottom += ys
    ax.set_xticks(x, [f"{c['constrained_rows']} of {c['batch']}" for c in cases])
    ax.set_xlabel("constrained rows in the batch")
    ax.set_ylabel("ms per step")
    ax.set_title(f"Constrained decoding cost per step (vocab {model.vocab_size}; "
                 "left p50, right p99)")
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, out / "structured_cost.png")
    print("median total: " + ", ".join(
        f"{c['constrained_rows']} rows {c['total_ms']['p50']:.3f} ms" for c in cases))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
