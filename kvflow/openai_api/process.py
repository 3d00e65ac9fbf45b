"""``kvflow openai`` as a child process: what ``kvflow serve`` and the tests start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from typing import Any

from kvflow.openai_api.app import FrontendConfig
from kvflow.triton_backend.server import (
    ServeError,
    stop_process_group,
    url_host,
    wait_for_http,
)


class FrontendProcess:
    """``kvflow openai`` as a child process (what ``kvflow serve`` and the tests start); a
    context manager that always stops it."""

    def __init__(self, cfg: FrontendConfig, log_path: Any = None) -> None:
        self.cfg = cfg
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://{url_host(self.cfg.host)}:{self.cfg.port}"

    def start(self, ready_timeout_s: float = 120.0,
              require_backend: bool = True) -> FrontendProcess:
        """Start, and wait until ``/health`` says a tritonserver is ready (or, without
        ``require_backend``, until the frontend answers at all). Raises ServeError (and
        stops the process) if it exits or is not ready in time."""
        cmd = [sys.executable, "-m", "kvflow.cli", "openai",
               "--triton-url", ",".join(self.cfg.triton_urls), "--host", self.cfg.host,
               "--port", str(self.cfg.port), "--metrics-url", ",".join(self.cfg.metrics_urls)]
        if self.cfg.served_model_name:
            cmd += ["--served-model-name", self.cfg.served_model_name]
        env = dict(os.environ)
        env.pop("KVFLOW_API_KEY", None)
        if self.cfg.api_key:  # NOTE: in the environment, never on a command line (ps shows it)
            env["KVFLOW_API_KEY"] = self.cfg.api_key
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop())
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT if self._log else None,
                                     start_new_session=True)
        try:
            wait_for_http(self.url + "/health", self.proc, ready_timeout_s,
                          "the OpenAI frontend", "its /health endpoint",
                          any_status=not require_backend)
        except ServeError:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 15.0) -> int | None:
        """SIGTERM (uvicorn's graceful shutdown), then SIGKILL after ``timeout_s``. Returns 0
        after a graceful shutdown: uvicorn ends by re-raising the SIGTERM it handled."""
        code = None
        if self.proc is not None:
            code = (stop_process_group(self.proc, timeout_s) if self.proc.poll() is None
                    else self.proc.returncode)
            self.proc = None
            code = 0 if code == -signal.SIGTERM else code
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> FrontendProcess:
        return self if self.proc is not None else self.start()  # started already, or now

    def __exit__(self, *exc: object) -> None:
        self.stop()
