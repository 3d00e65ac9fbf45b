"""Speculative decoding: output speed with and without it, by workload and concurrency.

Workloads (greedy, so that the speculative outputs must equal the plain ones token for token,
and the report counts that they do):

* ``edit``: rewrite a code file of this repository with one small change; the answer repeats
  most of the prompt (prompt lookup's home ground);
* ``chat``: the Azure conversation trace's prompt and output lengths (scaled to this machine),
  with real English text;
* ``structured``: answers constrained by a JSON schema.

Each configuration (``plain``: no speculation; ``ngram``; any ``--config NAME=KEY=VALUE,...``;
``--configs`` picks which run, the first being the baseline) runs every workload at every
concurrency, alternating configurations round by round, on one engine each, loaded once.
Concurrency is a closed loop: a new request is added as soon as one finishes. Reported per
cell: output tok/s, mean TTFT, mean ITL (decode time over the tokens after the first), the
drafts' acceptance rate and mean acceptance length (tokens per verification), and whether the
outputs equal the baseline's.

    python benchmarks/speculative.py [--engine engines/smollm2-135m] [--rounds 2]
    python benchmarks/speculative.py --workloads chat --concurrency 1 --configs fp32,draft \
        --config fp32=quantized_matmul=fp32 \
        --config draft=quantized_matmul=fp32,speculative=draft,draft_engine=engines/smollm2-135m \
        --out reports/speculative_draft

Writes reports/speculative/{report.json,summary.md,speedup.png}.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import deque
from pathlib import Path
from typing import Any

from kvflow import LLM, SamplingParams
from kvflow.orchestrator.sampling.structured_output import StructuredOutput
from kvflow.reports.writers import pyplot, save_figure, write_report
from kvflow.text.tokenizer import ChatPrompt
from kvflow.workloads.azure import default_trace, load_azure_trace
from kvflow.workloads.prompts import make_prompt_text

ROOT = Path(__file__).resolve().parents[1]
EDIT_FILES = ["kvflow/orchestrator/scheduler/deadlines.py",
              "kvflow/orchestrator/scheduler/registry.py",
              "kvflow/orchestrator/scheduler/preemption.py",
              "kvflow/workloads/specs.py"]
ITEM = {"type": "object",
        "properties": {"name": {"type": "string", "maxLength": 24},
                       "city": {"type": "string", "maxLength": 16},
                       "age": {"type": "integer", "minimum": 0, "maximum": 99},
                       "tags": {"type": "array", "items": {"type": "string", "maxLength": 10},
                                "maxItems": 3}},
        "required": ["name", "city", "age", "tags"], "additionalProperties": False}
SCHEMA = {"type": "object", "properties": {"people": {"type": "array", "items": ITEM,
                                                      "minItems": 3, "maxItems": 3}},
          "required": ["people"], "additionalProperties": False}


def edit_requests(n: int) -> list[tuple[Any, SamplingParams]]:
    """Rewrite a source file with one small change; the answer is mostly the file again."""
    out = []
    for i in range(n):
        code = (ROOT / EDIT_FILES[i % len(EDIT_FILES)]).read_text()[:2400]
        ask = ("Rewrite the following Python file exactly as it is, but replace every "
               "occurrence of the word `request` with `job`. Output only the code.\n\n" + code)
        out.append((ChatPrompt([{"role": "user", "content": ask}]),
                    SamplingParams(max_tokens=256, temperature=0)))
    return out


def chat_requests(n: int, engine: str) -> list[tuple[Any, SamplingParams]]:
    """The trace's lengths (halved, clipped to 512 / 256), real text as the user turn."""
    from kvflow.text.tokenizer import EngineTokenizer

    specs, _ = load_azure_trace(default_trace(), limit=n, max_prompt_tokens=512,
                                max_output_tokens=256, length_scale=0.5)
    tok = EngineTokenizer(engine).tokenizer
    out = []
    for i, spec in enumerate(specs):
        text, _ = make_prompt_text(lambda s: tok.encode(s).ids, tok.decode,
                                   max(spec.prompt_tokens, 16), seed=i)
        out.append((ChatPrompt([{"role": "user", "content": "Summarize this:\n" + text}]),
                    SamplingParams(max_tokens=max(spec.output_tokens, 16), temperature=0)))
    return out


def structured_requests(n: int) -> list[tuple[Any, SamplingParams]]:
    so = StructuredOutput.from_guided(guided_json=SCHEMA)
    cities = ["Paris", "Lima", "Oslo", "Kyoto", "Cairo", "Quito"]
    return [(ChatPrompt([{"role": "user", "content": f"List three people who live in "
                                                     f"{cities[i % len(cities)]} as JSON."}]),
             SamplingParams(max_tokens=200, temperature=0, structured=so)) for i in range(n)]


def closed_loop(llm: LLM, requests: list[tuple[Any, SamplingParams]],
                concurrency: int) -> dict[str, Any]:
    """Keep ``concurrency`` requests in flight until every one has finished."""
    engine = llm.engine
    pending = deque(enumerate(requests))
    finished: dict[int, Any] = {}
    ids: dict[str, int] = {}
    in_flight = 0
    before = engine.counters.copy()
    steps_before = before.steps
    t0 = time.perf_counter()
    while pending or engine.has_unfinished_requests():
        while pending and in_flight < concurrency:
            i, (prompt, params) = pending.popleft()
            request, rejected = engine.add_request(prompt, params, request_id=f"r{i}")
            assert rejected is None, rejected.error
            ids[request.request_id] = i
            in_flight += 1
        for out in engine.step():
            if out.finished:
                finished[ids[out.request_id]] = out
                in_flight -= 1
    wall = time.perf_counter() - t0
    outs = [finished[i] for i in range(len(requests))]
    tokens = sum(o.num_output_tokens for o in outs)
    ttft = [o.metrics.ttft_s for o in outs if o.metrics.ttft_s is not None]
    decode = [(o.metrics.decode_time_s, o.num_output_tokens - 1) for o in outs
              if o.metrics.decode_time_s is not None and o.num_output_tokens > 1]
    c = engine.counters
    drafts = c.spec_draft_tokens - before.spec_draft_tokens
    accepted = c.spec_accepted_tokens - before.spec_accepted_tokens
    ran = c.steps - steps_before  # this run's steps: the last ones kept
    verifications = sum(len(s.acceptance_lengths)
                        for s in list(engine.step_stats)[-ran:]) if ran else 0
    return {"wall_s": wall, "output_tokens": tokens, "tok_s": tokens / wall,
            "ttft_ms": 1000 * sum(ttft) / max(len(ttft), 1),
            "itl_ms": 1000 * sum(d for d, _ in decode) / max(sum(n for _, n in decode), 1),
            "drafts": drafts, "accepted": accepted,
            "acceptance": accepted / drafts if drafts else None,
            "verifications": verifications,
            "tokens": [o.outputs[0].token_ids for o in outs]}


def parse_configs(texts: list[str]) -> dict[str, dict[str, Any]]:
    from kvflow.orchestrator.options import parse_option

    configs: dict[str, dict[str, Any]] = {"plain": {}, "ngram": {"speculative": "ngram"}}
    for text in texts:
        name, _, rest = text.partition("=")
        options = {}
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            options[key] = parse_option(key, value)
        configs[name] = options
    return configs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--config", action="append", default=[],
                   metavar="NAME=KEY=VALUE,...", help="another configuration (engine options)")
    p.add_argument("--configs", default=None,
                   help="the configurations to run, baseline first (default: all)")
    p.add_argument("--workloads", default="edit,chat,structured")
    p.add_argument("--concurrency", default="1,4,16")
    p.add_argument("--requests", default="1:4,4:8,16:32",
                   help="requests per run, by concurrency")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="reports/speculative")
    args = p.parse_args()
    configs = parse_configs(args.config)
    if args.configs:
        configs = {name: configs[name] for name in args.configs.split(",")}
    workloads = args.workloads.split(",")
    levels = [int(c) for c in args.concurrency.split(",")]
    per_level = {int(k): int(v) for k, v in (x.split(":") for x in args.requests.split(","))}
    n_max = max(per_level.values())
    made = {"edit": lambda: edit_requests(n_max), "chat": lambda: chat_requests(n_max,
                                                                                 args.engine),
            "structured": lambda: structured_requests(n_max)}
    requests = {w: made[w]() for w in workloads}
    llms = {name: LLM(args.engine, **options) for name, options in configs.items()}
    for llm in llms.values():  # warm up: threads measured, first steps paid
        llm.generate(["warm up"], SamplingParams(max_tokens=8))
    results: dict[str, dict[str, dict[str, Any]]] = {}
    for r in range(args.rounds):
        for w in workloads:
            for c in levels:
                for name, llm in llms.items():
                    res = closed_loop(llm, requests[w][:per_level.get(c, 4 * c)], c)
                    key = f"{w}/c={c}"
                    best = results.setdefault(key, {}).get(name)
                    if best is None or res["tok_s"] > best["tok_s"]:
                        results[key][name] = res
                    print(f"round {r} {key:16s} {name:8s} {res['tok_s']:7.1f} tok/s  "
                          f"TTFT {res['ttft_ms']:7.1f} ms  ITL {res['itl_ms']:6.1f} ms  "
                          f"acceptance {res['acceptance'] or 0:.2f}", flush=True)
    for llm in llms.values():
        llm.close()
    write(args, configs, workloads, levels, results)


def write(args: argparse.Namespace, configs: dict[str, dict[str, Any]], workloads: list[str],
          levels: list[int], results: dict[str, dict[str, dict[str, Any]]]) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    base = next(iter(configs))
    lines = ["# Speculative decoding: with and without", "",
             f"Engine `{args.engine}`; configurations: "
             + ", ".join(f"`{k}` {v or '(no speculation)'}" for k, v in configs.items())
             + f"; best of {args.rounds} alternating rounds; greedy decoding.", "",
             f"| workload | config | tok/s | x {base} | TTFT ms | ITL ms | acceptance | "
             f"tokens / verification | outputs = {base}'s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for key, by_config in results.items():
        plain = by_config[base]
        for name, res in by_config.items():
            acc = res["acceptance"]
            per = ((res["accepted"] + res["verifications"]) / res["verifications"]
                   if res["verifications"] else None)
            same = sum(a == b for a, b in zip(res["tokens"], plain["tokens"], strict=True))
            lines.append(f"| {key} | {name} | {res['tok_s']:.1f} | "
                         f"{res['tok_s'] / plain['tok_s']:.2f} | {res['ttft_ms']:.0f} | "
                         f"{res['itl_ms']:.1f} | {'-' if acc is None else f'{acc:.2f}'} | "
                         f"{'-' if per is None else f'{per:.2f}'} | "
                         f"{same}/{len(res['tokens'])} |")
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for w in workloads:
        for name in configs:
            if name == base:
                continue
            ys = [results[f"{w}/c={c}"][name]["tok_s"] / results[f"{w}/c={c}"][base]["tok_s"]
                  for c in levels]
            ax.plot(levels, ys, marker="o", label=f"{w}, {name}")
    ax.axhline(1.0, color="gray", lw=0.8, ls="--")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(c) for c in levels])
    ax.set_xlabel("concurrency (requests in flight)")
    ax.set_ylabel("output tok/s / without speculation")
    ax.set_title("Speculative decoding: speedup by concurrency")
    ax.legend(fontsize=8)
    lines += ["", f"![]({save_figure(fig, out / 'speedup.png')})"]
    write_report(out / "summary.md", lines)
    slim = {k: {n: {f: v for f, v in r.items() if f != "tokens"} for n, r in by.items()}
            for k, by in results.items()}
    (out / "report.json").write_text(json.dumps({"engine": args.engine, "configs": configs,
                                                 "results": slim}, indent=1))


if __name__ == "__main__":
    main()
