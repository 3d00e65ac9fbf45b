"""The measurements of benchmarks/model_sizes.py: a child process's peak RSS (its whole tree,
polled), the kvflow worker (load, decode, prefill), llama.cpp's batched-bench under the same
poller, and the served comparison (kvflow's server against llama-server)."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

POLL_S = 0.05
WARMUP_PROMPT = 16  # llama-batched-bench's first case, dropped
TAIL = 1500


def tree_rss(proc: psutil.Process) -> int:
    """Resident bytes of ``proc`` and its descendants (0 for any that ended)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            total += p.memory_info().rss
    return total


@dataclass
class RssPoller:
    """Polls a process tree's RSS in a thread: ``peak`` since start (or :meth:`reset`), and
    kills the tree when it passes ``limit`` bytes (a shared machine must not reach the OOM
    killer), recording why in ``killed``."""

    pid: int
    limit: int | None = None
    peak: int = 0
    last: int = 0
    killed: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.proc = psutil.Process(self.pid)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.last = tree_rss(self.proc)
            except psutil.Error:
                return
            self.peak = max(self.peak, self.last)
            if self.limit and self.last > self.limit and not self.killed:
                self.killed = (f"killed by the benchmark at {self.last / 2**30:.2f} GiB RSS "
                               f"(--max-rss-gb {self.limit / 2**30:g})")
                kill_tree(self.proc)
            time.sleep(POLL_S)

    def reset(self) -> None:
        self.peak = self.last

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(timeout=2)


def kill_tree(proc: psutil.Process) -> None:
    """SIGKILL ``proc`` and every descendant (the processes this benchmark started)."""
    with contextlib.suppress(psutil.Error):
        for p in [*proc.children(recursive=True), proc]:
            with contextlib.suppress(psutil.Error):
                p.kill()


def run_measured(cmd: list[str], log_path: Path, limit: int | None, timeout_s: float,
                 env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd`` to its end under the poller: rc, wall time, peak RSS of its tree, the
    output's tail (all of it in ``log_path``), and why it was killed, if it was."""
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        poller = RssPoller(proc.pid, limit)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            poller.killed = f"timed out after {timeout_s:.0f} s"
            kill_tree(poller.proc)
            rc = proc.wait()
        poller.stop()
    text = log_path.read_text(errors="replace")
    out = {"rc": rc, "wall_s": time.perf_counter() - t0, "peak_rss_bytes": poller.peak,
           "tail": text[-TAIL:]}
    if poller.killed or rc != 0:
        out["error"] = poller.killed or f"exited with {rc}"
    return out


# --- the kvflow worker: LLM(engine) in a process of its own --------------------------------------
def worker_main(engine_dir: str, options: dict[str, Any]) -> int:
    """Load the engine (``LOADED {load_s}``), then answer job lines (JSON: prompt ids,
    max_tokens) with ``RESULT {json}``: wall time, decode tok/s after the first token, TTFT."""
    from kvflow.orchestrator.llm import LLM
    from kvflow.orchestrator.sampling.params import SamplingParams

    t0 = time.perf_counter()
    llm = LLM(engine_dir, **options)
    print("LOADED " + json.dumps({"load_s": time.perf_counter() - t0}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        n = job["max_tokens"]
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        t = time.perf_counter()
        out = llm.generate([job["prompt"]], params)[0]
        wall = time.perf_counter() - t
        if out.error or out.num_output_tokens != n:
            print("RESULT " + json.dumps({"error": f"{out.error or out.num_output_tokens}"}),
                  flush=True)
            continue
        m = out.metrics
        decode_s = (m.last_token_time or 0.0) - (m.first_token_time or 0.0)
        print("RESULT " + json.dumps({
            "wall_s": wall, "decode_tok_s": (n - 1) / decode_s if n > 1 and decode_s > 0
            else None, "finite": bool(out.token_ids)}), flush=True)
    return 0


class KvflowWorker:
    """The parent's handle on a worker: RSS polled all along (peak while loading, RSS after
    load), jobs sent one at a time."""

    def __init__(self, script: Path, engine_dir: Path, options: dict[str, Any], threads: int,
                 log_path: Path, limit: int | None, timeout_s: float = 900.0) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
        cmd = [sys.executable, str(script), "--worker", str(engine_dir),
               "--worker-options", json.dumps(options)]
        self.log = open(log_path, "w")  # noqa: SIM115 (closed in close())
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.log, text=True, env=env,
                                     start_new_session=True)
        self.poller = RssPoller(self.proc.pid, limit)
        line = self._read("LOADED ", timeout_s)
        self.load = {"load_s": json.loads(line)["load_s"],
                     "load_wall_s": time.perf_counter() - t0,
                     "peak_rss_loading_bytes": self.poller.peak}
        time.sleep(1.0)  # let the last pages of the load settle
        self.load["rss_after_load_bytes"] = tree_rss(self.poller.proc)
        self.poller.reset()

    def _read(self, prefix: str, timeout_s: float) -> str:
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(prefix):
                return line[len(prefix):]
        self.close()
        self.log.flush()
        reason = self.poller.killed or f"the worker ended (rc {self.proc.poll()})"
        tail = Path(self.log.name).read_text(errors="replace")[-TAIL:]
        raise RuntimeError(f"{reason}; log tail: {tail}")

    def run(self, prompt: list[int], max_tokens: int) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        result = json.loads(self._read("RESULT ", 1800.0))
        if "error" in result:
            raise RuntimeError(f"kvflow generated {result['error']} tokens, not {max_tokens}")
        result["peak_rss_bytes"] = self.poller.peak
        return result

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(self.poller.proc)
            self.proc.wait()
        self.poller.stop()
        self.log.close()


def random_prompt(n: int, seed: int, vocab: int = 49152) -> list[int]:
    """``n`` token ids of the tokenizer's real vocabulary (past the special tokens)."""
    return np.random.default_rng(seed).integers(100, vocab, n).tolist()


# --- llama.cpp ---------------------------------------------------------------------------------
def llama_bench(build: Any, gguf: Path, threads: int, prefill: int, decode_prompt: int,
                decode_tokens: int, ctx: int, log_path: Path, limit: int | None,
                ) -> dict[str, Any]:
    """``llama-batched-bench`` at B=1 on prompts of ``decode_prompt`` and ``prefill`` tokens
    (``decode_tokens`` generated after each), under the RSS poller: S_TG of the short prompt,
    T_PP of the long one, the peak RSS with a KV cache of ``ctx`` tokens (f16). A first case
    of :data:`WARMUP_PROMPT` tokens is run and dropped: the first case pays for the weights'
    first touch (on 1B, 2.2 tok/s against 9.3 in the same run)."""
    from kvflow.bench.peers import NO_REPACK, parse_batched_bench

    ctx = max(ctx, prefill + decode_tokens)
    cmd = [str(build.tool("llama-batched-bench")), "-m", str(gguf), "-c", str(ctx),
           "-npp", f"{WARMUP_PROMPT},{decode_prompt},{prefill}", "-ntg", str(decode_tokens),
           "-npl", "1", "-t", str(threads), "-tb", str(threads), *NO_REPACK]
    out = run_measured(cmd, log_path, limit, 1800.0)
    if "error" in out:
        return out
    rows = {int(r["pp"]): r for r in parse_batched_bench(log_path.read_text())}
    if set(rows) != {WARMUP_PROMPT, decode_prompt, prefill}:
        return {**out, "error": f"batched-bench reported prompts {sorted(rows)}"}
    return {"decode_tok_s": rows[decode_prompt]["s_tg_tok_s"],
            "prefill_s": rows[prefill]["t_pp_s"], "peak_rss_bytes": out["peak_rss_bytes"],
            "rows": [r for pp, r in rows.items() if pp != WARMUP_PROMPT]}


def served(engine_dir: Path | None, build: Any, gguf: Path | None, tokenizer_dir: Path,
           options: dict[str, Any], threads: int, conc: int, n: int, in_tok: int,
           out_tok: int, rounds: int, out: Path) -> dict[str, Any]:
    """kvflow's server (tritonserver + the OpenAI frontend: what ``kvflow serve`` starts)
    against ``llama-server -np conc`` on ``/v1/completions``, closed loop at ``conc``, rounds
    alternated; best output tok/s of each, and every round's."""
    from kvflow.bench.peers import LlamaServer, LlamaServerClient
    from kvflow.loadgen.clients import OpenAIClient
    from kvflow.loadgen.sender import run_load
    from kvflow.openai_api import FrontendConfig, FrontendProcess
    from kvflow.reports.summary import summarize
    from kvflow.triton_backend.launcher import ServerConfig, TritonServer
    from kvflow.utils.procs import free_port
    from kvflow.workloads.prompts import make_prompts
    from kvflow.workloads.synthetic import random_workload

    specs = random_workload(n, in_tok, out_tok, float("inf"), 1.0, 0)
    texts = make_prompts(specs, str(tokenizer_dir), 0)
    os.environ["OMP_NUM_THREADS"] = str(threads)
    results: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        clients: list[Any] = []
        if engine_dir is not None:
            try:
                cfg = ServerConfig.on_free_ports(str(engine_dir), options)
                server = stack.enter_context(TritonServer(cfg, log_path=out / "tritonserver.log"))
                frontend = stack.enter_context(FrontendProcess(
                    FrontendConfig((server.grpc_url,), port=free_port()),
                    log_path=out / "frontend.log"))
                client = OpenAIClient(frontend.url)
                client.name = "kvflow"
                clients.append(client)
            except Exception as e:  # noqa: BLE001 (recorded, the run goes on)
                results["kvflow"] = {"error": f"{type(e).__name__}: {e}"[:TAIL]}
        if gguf is not None:
            ctx_per_slot = -(-(in_tok + out_tok + 64) // 256) * 256
            llama = stack.enter_context(LlamaServer(build, gguf, conc, ctx_per_slot, threads,
                                                    log_path=out / "llama_server.log"))
            client = LlamaServerClient(llama.url)
            client.name = "llama.cpp"
            clients.append(client)
        for client in clients:  # warm-up
            run_load(client, specs[:conc], texts[:conc], conc, progress=False)
        for r in range(rounds):
            for client in clients:
                timings, duration = run_load(client, specs, texts, conc, progress=False)
                s = summarize(timings, duration)
                entry = results.setdefault(client.name, {"rounds_tok_s": []})
                if s["failed"]:
                    entry["error"] = f"{s['failed']} of {n} requests failed"
                    continue
                entry["rounds_tok_s"].append(s["output_token_throughput"])
                print(f"[served] round {r} {client.name}: {s['output_token_throughput']:.1f} "
                      f"tok/s, mean TTFT {s['ttft_ms']['mean']:.0f} ms", flush=True)
    for entry in results.values():
        if entry.get("rounds_tok_s"):
            entry["tok_s"] = max(entry["rounds_tok_s"])
    return results
