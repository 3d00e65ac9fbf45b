"""The KV tiers across a restart: the TTFT of a returning 3,968-token prompt, cold against
restored from the disk tier an earlier process left.

A first engine computes a long prefix (a system prompt, a document) and shuts down, writing
its cached blocks to ``--kv-disk-dir``. Then, each round, a fresh engine (a restarted server)
serves the same prefix with a new question: once without tiers (cold: the whole prompt is
prefilled) and once on the same disk folder (restored: the prefix's blocks are loaded, only the
question is prefilled). Reports each TTFT (the engine's, arrival to first token), the tokens
served from the tier, and the ratio; the issue's target is restored <= 0.2x cold.

    python benchmarks/kv_tiers.py --engine engines/smollm2-135m

Not measured yet: the multi-turn workload whose working set is 10x the pool (hit rate, TTFT
p50/p99 and throughput with and without the tiers).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from kvflow import LLM, SamplingParams
from kvflow.reports.writers import write_report
from kvflow.text.tokenizer import EngineTokenizer

PARAGRAPH = (
    "The archive keeps every contract the company signed since its founding, with the names "
    "of both parties, the dates, the amounts and the clauses that were negotiated. Analysts "
    "read it to answer questions about obligations, renewals and penalties. "
)
QUESTIONS = ["Which contracts renew next year?", "Who signed the largest contract?",
             "What penalties apply to late delivery?", "List the parties of the first one."]
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0.0)


def prefix_ids(tok: EngineTokenizer, n: int) -> list[int]:
    ids = tok.encode(PARAGRAPH * (1 + n // 30), add_special_tokens=False)[:n]
    assert len(ids) == n, f"the paragraph gives only {len(ids)} tokens"
    return ids


def ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    """(TTFT s, cached tokens) of ``prompt`` alone in ``llm``."""
    t0 = time.perf_counter()
    (out,) = llm.generate([prompt], ONE_TOKEN)
    ttft_s = out.metrics.ttft_s if out.metrics.ttft_s is not None else time.perf_counter() - t0
    return ttft_s, out.cached_tokens


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--prefix-tokens", type=int, default=3968)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--kv-disk-dir", default=None, help="default: a temporary folder")
    p.add_argument("--kv-disk-bytes", type=int, default=1 << 30)
    p.add_argument("--out", default="reports/kv_tiers.md")
    args = p.parse_args()
    engine = Path(args.engine)
    tok = EngineTokenizer(engine)
    prefix = prefix_ids(tok, args.prefix_tokens)
    questions = [tok.encode(f"\nQuestion: {q}\nAnswer:", add_special_tokens=False)
                 for q in QUESTIONS]
    tmp = tempfile.TemporaryDirectory(prefix="kvflow-kv-tiers-")
    tiers = {"kv_disk_dir": args.kv_disk_dir or tmp.name, "kv_disk_bytes": args.kv_disk_bytes}
    common = {"max_model_len": 4096}
    warm = tok.encode("Hello there.", add_special_tokens=False)
    print(f"[kv tiers] first process: {len(prefix)}-token prefix to the disk tier", flush=True)
    with LLM(engine, **common, **tiers) as llm:
        llm.generate([prefix + questions[0]], ONE_TOKEN)
    rows = []
    for r in range(args.rounds):
        prompt = prefix + questions[1 + r % (len(questions) - 1)]
        result = {}
        for name, opts in (("cold", {}), ("restored", tiers)):
            with LLM(engine, **common, **opts) as llm:  # a restarted server
                llm.generate([warm], ONE_TOKEN)  # its first step's one-time costs, not timed
                result[name] = ttft(llm, prompt)
            print(f"[kv tiers] round {r}: {name} TTFT {result[name][0]:.3f} s, "
                  f"{result[name][1]} cached tokens", flush=True)
        rows.append((len(prompt), result))
    tmp.cleanup()
    ratios = [res["restored"][0] / res["cold"][0] for _, res in rows]
    lines = [f"# KV tiers: a returning {args.prefix_tokens:,}-token prefix after a restart", "",
             f"Engine `{engine.name}`; each round a fresh engine per row (a restarted server), "
             "one warm-up request, then the prompt alone with one output token.", "",
             "| round | prompt tokens | cold TTFT s | restored TTFT s | tokens from the disk "
             "tier | restored / cold |", "|---|---|---|---|---|---|"]
    for i, (n, res) in enumerate(rows):
        lines.append(f"| {i} | {n} | {res['cold'][0]:.3f} | {res['restored'][0]:.3f} | "
                     f"{res['restored'][1]} | {ratios[i]:.3f} |")
    lines += ["", f"Median restored / cold: {statistics.median(ratios):.3f} (target <= 0.2).",
              "", "Reproduce: `python benchmarks/kv_tiers.py --engine ENGINE`."]
    write_report(args.out, lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
