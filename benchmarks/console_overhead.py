"""What the live console costs the engine while it is open: ``kvflow bench serve`` through the
OpenAI API with no console, with the requests of one open elsewhere (a poller of
``GET /v1/kvflow/state`` at the page's three a second: all the server sees of a page), and with
the page open in a real headless Chromium (Debian's, driven by Selenium) on this machine,
rounds alternating, on one server.

Each poll is one snapshot taken on the engine thread between steps (a walk of the queues and
the block tables), reused for 100 ms. The browser mode adds the browser's own CPU, which on
this 2-core machine competes with the engine; a user's browser runs on the user's machine.
The issue's target: under 2% of output throughput.

    python benchmarks/console_overhead.py [--engine engines/smollm2-135m] [--rounds 3]

Writes reports/console_overhead/{report.json,summary.md,overhead.png}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from kvflow.openai_api import FrontendConfig, FrontendProcess
from kvflow.reports.writers import pyplot, save_figure, write_report
from kvflow.triton_backend.launcher import ServerConfig, TritonServer
from kvflow.utils.procs import free_port

POLL_S = 0.333  # the page's rate (console.js, POLL_MS)


class Page:
    """The console open in headless Chromium on this machine (``browser``), or what the
    server sees of an open page elsewhere: its requests, a poller at the page's rate
    (``poller``; also the stand-in when Chromium is missing)."""

    def __init__(self, url: str, browser: bool) -> None:
        self.url, self.driver, self.polls = url, None, 0
        self._stop = threading.Event()
        chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
        if browser and chromium and driver:
            from selenium import webdriver
            from selenium.webdriver.chrome.service import Service

            options = webdriver.ChromeOptions()
            options.binary_location = chromium
            for arg in ("--headless=new", "--no-sandbox", "--disable-gpu",
                        "--disable-dev-shm-usage", "--window-size=1400,1000"):
                options.add_argument(arg)
            self.driver = webdriver.Chrome(service=Service(driver), options=options)
            self.driver.get(url)
        else:
            self._thread = threading.Thread(target=self._poll, daemon=True)
            self._thread.start()

    @property
    def kind(self) -> str:
        return "headless Chromium" if self.driver is not None else "a 3 Hz poller"

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            with urllib.request.urlopen(self.url + "v1/kvflow/state", timeout=30) as r:
                r.read()
            self.polls += 1

    def close(self) -> None:
        self._stop.set()
        if self.driver is not None:
            self.driver.quit()


def bench(frontend: FrontendProcess, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    subprocess.run([sys.executable, "-m", "kvflow.cli", "bench", "serve", "--backend", "openai",
                    "--endpoint", "chat", "--url", frontend.url, "--workload", "random",
                    "--num-prompts", str(args.num_prompts), "--max-concurrency",
                    str(args.concurrency), "--input-len", "128", "--output-len", "64",
                    "--seed", "0", "--out", str(out)], check=True, capture_output=True)
    return json.loads((out / "report.json").read_text())["summary"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", default="engines/smollm2-135m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--modes", default="closed,poller,browser",
                   help="which of closed, poller, browser to run (closed first: the baseline)")
    p.add_argument("--out", default="reports/console_overhead")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = ServerConfig.on_free_ports(args.engine, {}, ready_timeout_s=600)
    modes = tuple(args.modes.split(","))
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    kind = ""
    with TritonServer(cfg, log_path=out / "tritonserver.log") as server:
        frontend = FrontendProcess(FrontendConfig((server.grpc_url,), port=free_port()),
                                   log_path=out / "frontend.log")
        frontend.start()
        try:
            bench(frontend, out / "warmup", args)
            for k in range(args.rounds):
                for mode in modes if k % 2 == 0 else modes[::-1]:
                    page = (Page(frontend.url + "/", mode == "browser") if mode != "closed"
                            else None)
                    try:
                        if page is not None:
                            if mode == "browser":
                                kind = page.kind
                            time.sleep(2)  # the page loaded and polling
                        summary = bench(frontend, out / f"{mode}_{k}", args)
                    finally:
                        if page is not None:
                            page.close()
                    runs[mode].append(summary)
                    print(f"round {k} {mode}: {summary['output_token_throughput']:.1f} tok/s",
                          flush=True)
        finally:
            frontend.stop()
    tput = {m: [r["output_token_throughput"] for r in rs] for m, rs in runs.items()}
    itl = {m: [r["itl_ms"]["mean"] for r in rs] for m, rs in runs.items()}
    closed = statistics.median(tput["closed"])
    cost = {m: 1 - statistics.median(tput[m]) / closed for m in modes[1:]}
    report = {"config": vars(args), "browser": kind, "throughput": tput, "itl_mean_ms": itl,
              "median": {m: statistics.median(tput[m]) for m in modes}, "cost": cost}
    label = {"closed": "no console", "poller": "a console open elsewhere (its 3 Hz polls)",
             "browser": f"a console open in {kind} on this machine"}
    lines = ["# The live console's cost to the engine", "",
             f"`kvflow bench serve` (OpenAI chat, {args.num_prompts} requests of 128 prompt and "
             f"64 output tokens, concurrency {args.concurrency}), {args.rounds} rounds, the "
             "modes alternating.", "",
             "| | output tok/s (median) | rounds | mean ITL (ms, median) | cost |",
             "|---|---|---|---|---|",
             *(f"| {label[m]} | {statistics.median(tput[m]):.1f} | "
               f"{', '.join(f'{v:.1f}' for v in tput[m])} | {statistics.median(itl[m]):.2f} | "
               f"{'' if m == 'closed' else f'{100 * cost[m]:.2f}%'} |" for m in modes), "",
             "Target: under 2% of output throughput while a console is open.", "",
             "![](overhead.png)"]
    fig, ax = pyplot().subplots(figsize=(6, 3))
    for i, m in enumerate(modes):
        ax.scatter([i] * len(tput[m]), tput[m])
        ax.hlines(statistics.median(tput[m]), i - 0.2, i + 0.2)
    short = {"closed": "no console", "poller": "polled (open elsewhere)",
             "browser": "browser on this machine"}
    ax.set_xticks(range(len(modes)), [short[m] for m in modes])
    ax.set_ylabel("output tok/s")
    ax.set_title("bench serve with and without the console open")
    ax.grid(alpha=0.3)
    save_figure(fig, out / "overhead.png")
    (out / "report.json").write_text(json.dumps(report, indent=2))
    write_report(out / "summary.md", lines)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
