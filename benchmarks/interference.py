"""No request may freeze the others (issue 43): one normal stream runs while hostile or careless
requests arrive, and the stream's worst gap between tokens is what each of them cost it.

One tritonserver with the default engine, one OpenAI frontend, both on loopback. A streamed
completion (``ignore_eos``, restarted whenever it ends) runs for the whole benchmark; its
chunk arrival times give its gaps between tokens. After a quiet baseline, the probes arrive
one at a time, each with a few seconds of quiet after it:

- ``4k prompt``: a fresh prompt of ``max_model_len - 2`` random token ids, one output token;
- ``prompt_logprobs 4k``: the same with ``prompt_logprobs: 20``;
- ``n=64 x prompt_logprobs 4k``: the same with ``n: 64`` (a 370 MB body before issue 43: now
  refused up front, naming the fields);
- ``3 MB tools``: a chat request whose 128 tools carry 3 MB of descriptions;
- ``4 MB /tokenize``: a 4 MB text to ``/tokenize``;
- ``streamed tool call n=64``: ``tool_choice: required``, ``n: 64``, streamed.

For each probe: its status and wall time, and the stream's worst gap over the probe's window
(its start to two seconds after its answer). The frontend's and the backend's peak RSS are
sampled throughout. The target: every probe's worst gap under 2 x ``--max-step-ms``, and the
frontend's peak RSS under 500 MB.

    python benchmarks/interference.py [--engine engines/smollm2-135m] [--max-step-ms 200]

Writes reports/interference/{report.json,summary.md,gaps.png}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from kvflow.bench.machine import tree_rss_bytes
from kvflow.openai_api import FrontendConfig, FrontendProcess
from kvflow.reports.writers import pyplot, save_figure, write_report
from kvflow.triton_backend.launcher import ServerConfig, TritonServer
from kvflow.utils.procs import free_port

QUIET_S = 3.0  # after each probe, and for the baseline
WINDOW_TAIL_S = 2.0  # a probe's window runs this long past its answer


def cpu_isa() -> str:
    """The widest vector ISA this CPU has, as the native kernels dispatch on it."""
    flags = set()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    for isa in ("avx512_vnni", "avx512f", "avx2"):
        if isa in flags:
            return isa.upper().replace("_", "-")
    return platform.machine()


class Stream:
    """The normal stream: a streamed completion restarted whenever it ends; ``times`` holds
    each run's chunk arrival times (monotonic seconds), one list a run."""

    def __init__(self, url: str, model: str) -> None:
        self.url, self.model = url, model
        self.runs: list[list[float]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _run(self) -> None:
        body = {"model": self.model, "prompt": "Once upon a time, in a quiet village,",
                "max_tokens": 512, "ignore_eos": True, "stream": True, "temperature": 0}
        with httpx.Client(timeout=600) as client:
            while not self._stop.is_set():
                times: list[float] = []
                self.runs.append(times)
                try:
                    with client.stream("POST", self.url + "/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if line.startswith("data: {"):
                                times.append(time.monotonic())
                            if self._stop.is_set():
                                break
                except httpx.HTTPError as e:
                    self.errors.append(repr(e))
                    time.sleep(0.5)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)

    def gaps(self, start: float, end: float) -> list[tuple[float, float]]:
        """(arrival, gap in s) of every chunk whose gap overlaps [start, end]."""
        out = []
        for times in self.runs:
            for a, b in zip(times, times[1:], strict=False):
                if b >= start and a <= end:
                    out.append((b, b - a))
        return out


class RssSampler:
    """Peak resident memory of each named process tree, sampled every 50 ms."""

    def __init__(self, roots: dict[str, int]) -> None:
        self.roots = roots
        self.peak_mb = {name: 0.0 for name in roots}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            for name, pid in self.roots.items():
                self.peak_mb[name] = max(self.peak_mb[name], tree_rss_bytes(pid) / (1 << 20))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join(timeout=5)
        return self.peak_mb


def probes(model: str, max_model_len: int, seed: int) -> list[tuple[str, str, dict[str, Any]]]:
    """(name, path, body) of each probe, each prompt fresh (no prefix-cache hit)."""
    rng = random.Random(seed)

    def long_prompt() -> list[int]:
        return [rng.randrange(1000, 40000) for _ in range(max_model_len - 2)]

    tool_desc = "x" * (3_000_000 // 128)
    tools = [{"type": "function", "function": {
        "name": f"tool_{i}", "description": tool_desc,
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}}}}
        for i in range(128)]
    weather = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    hello = [{"role": "user", "content": "What is the weather in Paris?"}]
    return [
        ("4k prompt", "/v1/completions",
         {"model": model, "prompt": long_prompt(), "max_tokens": 1}),
        ("prompt_logprobs 4k", "/v1/completions",
         {"model": model, "prompt": long_prompt(), "max_tokens": 1, "prompt_logprobs": 20}),
        ("n=64 x prompt_logprobs 4k", "/v1/completions",
         {"model": model, "prompt": long_prompt(), "max_tokens": 1, "prompt_logprobs": 20,
          "n": 64}),
        ("3 MB tools", "/v1/chat/completions",
         {"model": model, "messages": hello, "tools": tools, "max_tokens": 8}),
        ("4 MB /tokenize", "/tokenize", {"model": model, "prompt": "word " * 800_000}),
        ("streamed tool call n=64", "/v1/chat/completions",
         {"model": model, "messages": hello, "tools": weather, "tool_choice": "required",
          "n": 64, "max_tokens": 48, "temperature": 0.8, "seed": seed, "stream": True}),
    ]


def send(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """Send one probe; its status, wall time, answer size and (on an error) message."""
    start = time.monotonic()
    size, message = 0, ""
    with httpx.Client(timeout=900) as client:
        if body.get("stream"):
            with client.stream("POST", url + path, json=body) as r:
                for chunk in r.iter_bytes():
                    size += len(chunk)
                status = r.status_code
        else:
            r = client.post(url + path, json=body)
            status, size = r.status_code, len(r.content)
            if status >= 400:
                message = r.json().get("error", {}).get("message", r.text)[:300]
    return {"status": status, "wall_s": time.monotonic() - start, "bytes": size,
            "start": start, "end": time.monotonic(), "message": message}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--max-step-ms", type=float, default=200.0,
                   help="the engine's target step time (the target is twice it)")
    p.add_argument("--no-engine-option", action="store_true",
                   help="do not pass --max-step-ms to the engine (a kvflow from before it)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", default="", help="comma-separated probe names to run")
    p.add_argument("--out", default="reports/interference")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    engine_args = {} if args.no_engine_option else {"max_step_ms": args.max_step_ms}
    cfg = ServerConfig.on_free_ports(args.engine, engine_args, ready_timeout_s=600)
    max_model_len = json.loads((cfg.engine_dir / "engine_config.json").read_text())[
        "limits"]["max_model_len"]
    results: list[dict[str, Any]] = []
    with TritonServer(cfg, log_path=out / "tritonserver.log") as server:
        frontend = FrontendProcess(FrontendConfig((server.grpc_url,), port=free_port()),
                                   log_path=out / "frontend.log")
        frontend.start()
        try:
            model = httpx.get(frontend.url + "/v1/models").json()["data"][0]["id"]
            rss = RssSampler({"frontend": frontend.proc.pid,  # type: ignore[union-attr]
                              "backend": server.proc.pid})  # type: ignore[union-attr]
            stream = Stream(frontend.url, model)
            stream.start()
            time.sleep(QUIET_S)
            t0 = time.monotonic()
            time.sleep(QUIET_S)
            base = stream.gaps(t0, time.monotonic())
            results.append({"name": "baseline (no probe)", "status": None, "wall_s": QUIET_S,
                            "bytes": 0, "start": t0, "end": time.monotonic(), "message": "",
                            "worst_gap_ms": 1e3 * max((g for _, g in base), default=0.0)})
            only = {s.strip() for s in args.only.split(",") if s.strip()}
            for name, path, body in probes(model, max_model_len, args.seed):
                if only and name not in only:
                    continue
                r = send(frontend.url, path, body) | {"name": name}
                time.sleep(WINDOW_TAIL_S)
                gaps = stream.gaps(r["start"], r["end"] + WINDOW_TAIL_S)
                r["worst_gap_ms"] = 1e3 * max((g for _, g in gaps), default=float("nan"))
                print(f"{name}: HTTP {r['status']} in {r['wall_s']:.2f} s, {r['bytes']} bytes; "
                      f"worst gap {r['worst_gap_ms']:.0f} ms {r['message'][:120]}", flush=True)
                results.append(r)
                time.sleep(QUIET_S - WINDOW_TAIL_S)
            stream.stop()
            peak = rss.stop()
        finally:
            frontend.stop()
    return report(args, out, results, stream, peak, t0)


def report(args: argparse.Namespace, out: Path, results: list[dict[str, Any]], stream: Stream,
           peak: dict[str, float], t0: float) -> int:
    target_ms = 2 * args.max_step_ms
    worst = max(r["worst_gap_ms"] for r in results[1:]) if len(results) > 1 else 0.0
    rep = {"config": vars(args), "isa": cpu_isa(), "cpus": os.cpu_count(),
           "target_gap_ms": target_ms, "worst_gap_ms": worst, "peak_rss_mb": peak,
           "probes": [{k: v for k, v in r.items() if k not in ("start", "end")}
                      for r in results], "stream_errors": stream.errors}
    (out / "report.json").write_text(json.dumps(rep, indent=1))
    lines = ["# Interference: one stream's worst gap between tokens while probes arrive", "",
             f"Default engine, `--max-step-ms {args.max_step_ms:g}`, {cpu_isa()}, "
             f"{os.cpu_count()} CPUs. Target: every worst gap under {target_ms:.0f} ms; "
             "frontend peak RSS under 500 MB.", "",
             "| probe | HTTP | wall (s) | answer bytes | stream's worst gap (ms) | target |",
             "|---|---|---|---|---|---|"]
    for r in results:
        ok = "" if r["status"] is None else ("met" if r["worst_gap_ms"] < target_ms
                                             else "missed")
        lines.append(f"| {r['name']} | {r['status'] or ''} | {r['wall_s']:.2f} | {r['bytes']} "
                     f"| {r['worst_gap_ms']:.0f} | {ok} |")
    lines += ["", f"Peak RSS: frontend {peak['frontend']:.0f} MB "
              f"({'met' if peak['frontend'] < 500 else 'missed'}), backend (tritonserver and "
              f"its Python stub) {peak['backend']:.0f} MB.", "",
              "Refusals:", *(f"- {r['name']}: {r['message']}" for r in results if r["message"]),
              "", "![](gaps.png)"]
    fig, ax = pyplot().subplots(figsize=(9, 3.5))
    points = stream.gaps(t0, float("inf"))
    ax.scatter([x - t0 for x, _ in points], [1e3 * g for _, g in points], s=3, color="k")
    for r in results[1:]:
        ax.axvspan(r["start"] - t0, r["end"] - t0, alpha=0.2)
        ax.text(r["start"] - t0, target_ms * 1.05, r["name"], fontsize=6, rotation=90,
                va="bottom")
    ax.axhline(target_ms, color="r", ls="--", lw=0.8, label=f"target {target_ms:.0f} ms")
    ax.set_xlabel("time (s)")
    ax.set_ylabel("gap between tokens (ms)")
    ax.set_yscale("log")
    ax.legend(loc="upper right", fontsize=7)
    save_figure(fig, out / "gaps.png")
    write_report(out / "summary.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
