"""``kvflow serve``: start a real tritonserver on an engine folder.

By default the tritonserver binary shipped in the ``nvidia-pytriton`` wheel is used; a stock
install or an NGC container's binary can be given with ``--tritonserver``. The server gets a
private workspace: the Python backend with the stub built for the running Python, and a copy of
``model_repository/kvflow`` whose ``config.pbtxt`` names the engine folder and the paths of this
Python environment (the stub does not honour PYTHONPATH).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MODEL_NAME = "kvflow"
REPO_MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / MODEL_NAME


class ServeError(RuntimeError):
    """tritonserver could not be prepared or did not become ready."""


@dataclass
class ServerConfig:
    """Where and how to serve. Loopback unless ``host`` says otherwise."""

    engine_dir: Path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int = 8001
    metrics_port: int = 8002
    tritonserver: str | None = None
    engine_args: dict[str, Any] = field(default_factory=dict)
    log_verbose: int = 0
    ready_timeout_s: float = 600.0
    # How long tritonserver waits for the model to unload at shutdown before it exits anyway.
    exit_timeout_s: int = 15

    @classmethod
    def on_free_ports(cls, engine_dir: str | Path, engine_args: dict[str, Any] | None = None,
                      **options: Any) -> ServerConfig:
        """A loopback server on ports nobody uses: benchmarks, calibration, tests."""
        return cls(Path(engine_dir), http_port=free_port(), grpc_port=free_port(),
                   metrics_port=free_port(), engine_args=dict(engine_args or {}), **options)

    def __post_init__(self) -> None:
        self.engine_dir = Path(self.engine_dir).resolve()
        if not (self.engine_dir / "engine_config.json").is_file():
            raise ServeError(f"--engine {self.engine_dir} is not an engine folder "
                             "(build one with `kvflow build-engine`)")
        for name in ("http_port", "grpc_port", "metrics_port"):
            port = getattr(self, name)
            if not 0 < port < 65536:
                raise ServeError(f"--{name.replace('_', '-')} must be in [1, 65535], got {port}")


def _pytriton_dist() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServeError("the nvidia-pytriton wheel is not installed (pip install "
                         "nvidia-pytriton), and no --tritonserver was given")
    return Path(next(iter(spec.submodule_search_locations)))


def _environment_paths() -> list[str]:
    """sys.path entries the backend stub needs to import kvflow and its dependencies."""
    paths = [p for p in sys.path if p and Path(p).is_dir()]
    repo_root = str(REPO_MODEL_DIR.parents[1])
    return list(dict.fromkeys([repo_root, *paths]))


def prepare_workspace(cfg: ServerConfig, workspace: Path) -> tuple[list[str], dict[str, str]]:
    """Lay out backends and the model repository; returns the command line and environment."""
    env = dict(os.environ)
    backends = workspace / "backends"
    if cfg.tritonserver:
        binary = Path(cfg.tritonserver)
        if not binary.is_file():
            raise ServeError(f"--tritonserver {binary}: no such file")
        backend_dir = binary.resolve().parents[1] / "backends"
        libs: list[str] = []
    else:
        dist = _pytriton_dist()
        server_dir = dist / "tritonserver"
        binary = server_dir / "bin" / "tritonserver"
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        stub = server_dir / "python_backend_stubs" / version / "triton_python_backend_stub"
        if not stub.is_file():
            raise ServeError(f"nvidia-pytriton ships no Python backend stub for Python {version}")
        python_backend = backends / "python"
        python_backend.mkdir(parents=True)
        for f in (server_dir / "backends" / "python").iterdir():
            if f.is_file():
                (python_backend / f.name).symlink_to(f)
        shutil.copy2(stub, python_backend / "triton_python_backend_stub")
        backend_dir = backends
        libs = [str(dist.parent / "nvidia_pytriton.libs")]
    # The stub links libpython dynamically: the running interpreter's must be found first.
    libdir = sysconfig.get_config_var("LIBDIR")
    libs.append(libdir or "")
    env["LD_LIBRARY_PATH"] = ":".join([p for p in libs if p] +
                                      [env.get("LD_LIBRARY_PATH", "")]).rstrip(":")
    # The embedded interpreter finds its prefix from the first `python3` on PATH: this venv's.
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    env.setdefault("PYTHONUNBUFFERED", "1")

    models = workspace / "models"
    model_dir = models / MODEL_NAME
    shutil.copytree(REPO_MODEL_DIR, model_dir, ignore=shutil.ignore_patterns("__pycache__"))
    config = (model_dir / "config.pbtxt").read_text()
    for key, value in (("engine_dir", str(cfg.engine_dir)),
                       ("engine_args", json.dumps(cfg.engine_args)),
                       ("python_paths", json.dumps(_environment_paths()))):
        config = config.replace("${" + key + "}", value.replace("\\", "\\\\").replace('"', '\\"'))
    (model_dir / "config.pbtxt").write_text(config)

    cmd = [
        str(binary), f"--model-repository={models}", f"--backend-directory={backend_dir}",
        f"--http-address={cfg.host}", f"--http-port={cfg.http_port}",
        f"--grpc-address={cfg.host}", f"--grpc-port={cfg.grpc_port}",
        f"--metrics-address={cfg.host}", f"--metrics-port={cfg.metrics_port}",
        "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=true",
        f"--log-verbose={cfg.log_verbose}", "--exit-on-error=true",
        "--disable-auto-complete-config", "--strict-readiness=true",
        f"--exit-timeout-secs={cfg.exit_timeout_s}",
    ]
    return cmd, env


def wait_ready(host: str, http_port: int, proc: subprocess.Popen | None,
               timeout_s: float) -> None:
    """Poll the model's readiness endpoint until it answers 200."""
    url = f"http://{_url_host(host)}:{http_port}/v2/models/{MODEL_NAME}/ready"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise ServeError(f"tritonserver exited with code {proc.returncode} before "
                             "the model was ready (see its log above)")
        with (contextlib.suppress(urllib.error.URLError, ConnectionError, TimeoutError),
              urllib.request.urlopen(url, timeout=2) as resp):
            if resp.status == 200:
                return
        time.sleep(0.5)
    raise ServeError(f"the model was not ready within {timeout_s:.0f}s ({url})")


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class TritonServer:
    """A tritonserver process serving one engine; a context manager that always cleans up."""

    def __init__(self, cfg: ServerConfig, log_path: Path | None = None) -> None:
        self.cfg = cfg
        self.log_path = log_path
        self.proc: subprocess.Popen | None = None
        self._workspace: tempfile.TemporaryDirectory | None = None
        self._log_file: Any = None

    @property
    def http_url(self) -> str:
        return f"{_url_host(self.cfg.host)}:{self.cfg.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{_url_host(self.cfg.host)}:{self.cfg.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{_url_host(self.cfg.host)}:{self.cfg.metrics_port}/metrics"

    def start(self) -> TritonServer:
        self._workspace = tempfile.TemporaryDirectory(prefix="kvflow-serve-")
        cmd, env = prepare_workspace(self.cfg, Path(self._workspace.name))
        stdout = None
        if self.log_path is not None:
            self._log_file = open(self.log_path, "ab")  # noqa: SIM115  (closed in stop())
            stdout = self._log_file
        # Own process group: Ctrl-C in a terminal reaches us, and we stop the server in order.
        self.proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        try:
            wait_ready(self.cfg.host, self.cfg.http_port, self.proc, self.cfg.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout_s: float = 40.0) -> int | None:
        """SIGTERM, wait, then SIGKILL the whole process group; remove the workspace.

        Returns tritonserver's exit code: 0 after a clean unload; 1 when the Python backend did
        not finish unloading within ``exit_timeout_s`` (a known, intermittent tritonserver 2.51
        behaviour at shutdown, see docs/design.md). Either way no process is left behind.
        """
        code = None
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                code = self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                code = self.proc.wait(10)
        elif self.proc is not None:
            code = self.proc.returncode
        if self.proc is not None:
            # Backend stubs ignore SIGTERM and outlive a server that exited uncleanly: reap the
            # whole process group so that nothing is left behind.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
                deadline = time.monotonic() + 10
                while time.monotonic() < deadline:  # until the group is gone
                    os.killpg(self.proc.pid, 0)
                    time.sleep(0.05)
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None
        if self._workspace is not None:
            self._workspace.cleanup()
            self._workspace = None
        return code

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def serve_forever(cfg: ServerConfig) -> int:
    """``kvflow serve``: start, print how to query, forward signals, shut down cleanly."""
    server = TritonServer(cfg)
    stop_requested = []

    def on_signal(signum: int, _frame: object) -> None:
        stop_requested.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    print(f"[kvflow serve] starting tritonserver for {cfg.engine_dir} ...", flush=True)
    server.start()
    host = _url_host(cfg.host)
    print(f"""[kvflow serve] ready: model '{MODEL_NAME}'
  HTTP    http://{host}:{cfg.http_port}   gRPC {host}:{cfg.grpc_port}   metrics {server.metrics_url}

  curl -N -X POST http://{host}:{cfg.http_port}/v2/models/{MODEL_NAME}/generate_stream \\
       -d '{{"text_input": "The capital of France is", "max_tokens": 32, "stream": true}}'

  kvflow generate --url {host}:{cfg.grpc_port} --prompt "Tell me about paged attention" --chat
""", flush=True)
    try:
        while not stop_requested and server.proc is not None and server.proc.poll() is None:
            time.sleep(0.5)
    finally:
        print("[kvflow serve] shutting down ...", flush=True)
        code = server.stop()
    return 0 if stop_requested else (code or 0)
