"""The KV tiers through the real ``kvflow serve`` CLI (tritonserver and the OpenAI frontend),
as a user runs them: the console page, in headless Chromium, shows the host and disk tiers;
the server stopped by SIGTERM leaves its cache in ``--kv-disk-dir``; a second server on the
same folder answers the returning prompt with ``usage.prompt_tokens_details.cached_tokens`` > 0
and the same text, through the ``openai`` package."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.browser_support import needs_browser

pytestmark = pytest.mark.slow  # two kvflow serve starts and a browser

PROMPT = "A long shared system prompt that a returning user sends again after a restart. " * 2


def _health(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url + "/health", timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


class Served:
    """One ``kvflow serve`` process group on free loopback ports, stopped by SIGTERM."""

    def __init__(self, engine: Path, disk: Path, log: Path) -> None:
        from kvflow.utils.procs import free_port, spawn

        ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
        self.url = f"http://127.0.0.1:{ports['openai']}"
        self.log = log
        cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--engine", str(engine),
               "--kv-offload-bytes", str(1 << 20), "--kv-disk-dir", str(disk),
               "--kv-disk-bytes", str(1 << 24),
               *(f"--{name}-port={port}" for name, port in ports.items())]
        with open(log, "wb") as out:
            self.proc = spawn(subprocess.Popen, cmd, stdout=out, stderr=subprocess.STDOUT,
                              start_new_session=True)
        deadline = time.monotonic() + 300
        while _health(self.url) != 200:
            assert self.proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "kvflow serve never became ready"
            time.sleep(0.5)

    def stop(self) -> int:
        """SIGTERM to the group (kvflow serve stops tritonserver, whose engine persists its
        cache); the exit code."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode


def _complete(url: str) -> tuple[tuple[str, list[str]], int]:
    """The greedy reply to PROMPT (its text and its tokens: a tiny random model's bytes may
    decode to no text) and the prompt tokens the server reports cached."""
    from openai import OpenAI

    client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
    model = client.models.list().data[0].id
    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, logprobs=1,
                                      temperature=0.0, extra_body={"ignore_eos": True})
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    choice = reply.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None
    tokens = list(choice.logprobs.tokens)
    assert len(tokens) == reply.usage.completion_tokens == 6, tokens
    return (choice.text, tokens), int(reply.usage.prompt_tokens_details.cached_tokens or 0)


@needs_browser
def test_kvflow_serve_keeps_its_prefix_cache_on_disk_across_a_restart(tiny_engines, browser,
                                                                      tmp_path):
    from selenium.webdriver.common.by import By

    engine = tiny_engines["llama-gqa4", "onnxruntime"]
    disk = tmp_path / "kv"
    first = Served(engine, disk, tmp_path / "first.log")
    try:
        reply, cached = _complete(first.url)
        assert cached == 0
        browser.get(first.url + "/")
        deadline = time.monotonic() + 60
        line = browser.find_element(By.ID, "tiers")
        while not (line.is_displayed() and "disk" in line.text):
            assert time.monotonic() < deadline, "the console never showed the KV tiers"
            time.sleep(0.2)
        assert line.text.startswith("KV tiers: cpu ") and "; disk " in line.text, line.text
    finally:
        assert first.stop() == 0, first.log.read_text()[-3000:]
    # The folder is private to the server's user, and holds the blocks the engine persisted.
    assert stat.S_IMODE(disk.stat().st_mode) == 0o700
    assert any(p.is_file() for p in disk.rglob("*"))

    second = Served(engine, disk, tmp_path / "second.log")
    try:
        again, cached = _complete(second.url)
    finally:
        assert second.stop() == 0, second.log.read_text()[-3000:]
    assert cached > 0 and again == reply
