"""``kvflow openai`` as a child process: what ``kvflow serve`` and the tests start."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Self

from kvflow import envs
from kvflow.openai_api.config import FrontendConfig
from kvflow.utils.procs import ManagedProcess, url_host


class FrontendProcess(ManagedProcess):
    """``kvflow openai`` as a child process (what ``kvflow serve`` and the tests start); a
    context manager that always stops it."""

    def __init__(self, cfg: FrontendConfig, log_path: Path | None = None) -> None:
        super().__init__("the OpenAI frontend", log_path=log_path, port=cfg.port,
                         stop_timeout_s=15.0)
        self.cfg = cfg
        self.ready_timeout_s = 120.0
        self.require_backend = True

    @property
    def url(self) -> str:
        return f"http://{url_host(self.cfg.host)}:{self.cfg.port}"

    def start(self, ready_timeout_s: float = 120.0, require_backend: bool = True) -> Self:
        """Start, and wait until ``/health`` says a tritonserver is ready (or, without
        ``require_backend``, until the frontend answers at all). Raises ServeError (and
        stops the process) if it exits or is not ready in time."""
        self.ready_timeout_s, self.require_backend = ready_timeout_s, require_backend
        self.cmd = [sys.executable, "-m", "kvflow.cli", "openai",
                    "--triton-url", ",".join(self.cfg.triton_urls), "--host", self.cfg.host,
                    "--port", str(self.cfg.port),
                    "--metrics-url", ",".join(self.cfg.metrics_urls)]
        if self.cfg.served_model_name:
            self.cmd += ["--served-model-name", self.cfg.served_model_name]
        self.cmd += ["--tool-call-parser", self.cfg.tool_call_parser]
        self.cmd += ["--reasoning-parser", self.cfg.reasoning_parser or "none"]
        if self.cfg.console_show_tenants:
            self.cmd += ["--console-show-tenants"]
        if self.cfg.responses_store:
            self.cmd += ["--responses-store", self.cfg.responses_store]
        self.cmd += ["--responses-store-max-count", str(self.cfg.responses_store_max_count),
                     "--responses-store-max-bytes", str(self.cfg.responses_store_max_bytes)]
        env = dict(os.environ)
        env.pop(envs.API_KEY, None)
        if self.cfg.api_key:  # NOTE: in the environment, never on a command line (ps shows it)
            env[envs.API_KEY] = self.cfg.api_key
        self.env = env
        return super().start()

    def wait_ready(self) -> None:
        self.wait_for_http(self.url + "/health", self.ready_timeout_s, "its /health endpoint",
                           any_status=not self.require_backend)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM (uvicorn's graceful shutdown), then SIGKILL after ``timeout_s`` (default
        15 s). Returns 0 after a graceful shutdown: uvicorn ends by re-raising the SIGTERM it
        handled."""
        code = super().stop(timeout_s)
        return 0 if code == -signal.SIGTERM else code
