"""The tritonserver that ``kvflow serve`` runs: :class:`TritonServer`, in a private workspace.

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
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from kvflow import envs
from kvflow.orchestrator.options import options_to_parameters
from kvflow.triton_backend import preload
from kvflow.triton_backend.connections import disconnect_clients
from kvflow.triton_backend.lora_control import absolute_lora_paths
from kvflow.triton_backend.protocol import (
    ADMIN_APIS,
    ADMIN_HEADER,
    API_KEY_APIS,
    API_KEY_HEADER,
    ENGINE_FAILED_FILE,
    MODEL_NAME,
    REASONING_PARSER_PARAMETER,
    REASONING_STARTS_OPEN_PARAMETER,
    SERVE_FILE,
    SERVED_MODEL_NAME_PARAMETER,
    TOOL_CALL_PARSER_PARAMETER,
    TRACE_SIGNAL_FILE,
)
from kvflow.utils.procs import ManagedProcess, ServeError, free_port, url_host

REPO_MODEL_DIR = Path(__file__).resolve().parents[2] / "model_repository" / MODEL_NAME


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
    # Clients must send the header `x-api-key: <api_key>` for inference, metadata, the model
    # config and statistics (HTTP and gRPC); None: no authentication (fine on loopback).
    api_key: str | None = None
    # The key of the endpoints kvflow never uses (shared memory, repository, trace, logging):
    # random, never printed, so they are closed to every client. Like the API key, it reaches
    # tritonserver through a pipe, never its command line (kvflow/triton_backend/preload.py).
    admin_key: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)

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
        from kvflow.orchestrator.llm import plan_engine

        if self.engine_args.get("trace_steps"):  # the backend's working directory is not ours
            from kvflow.observability.trace import check_trace_path

            try:
                self.engine_args["trace_steps"] = str(check_trace_path(
                    self.engine_args["trace_steps"]))
            except ValueError as e:
                raise ServeError(f"--trace-steps: {e}") from None
        try:  # bad options are refused before any server starts
            if isinstance(self.engine_args.get("lora_modules"), dict):  # the backend's cwd
                self.engine_args["lora_modules"] = absolute_lora_paths(  # is not ours
                    self.engine_args["lora_modules"])
            plan_engine(self.engine_dir, **self.engine_args)
        except ValueError as e:
            raise ServeError(str(e)) from None
        key = self.api_key
        if key is not None and not (key and key.isprintable() and not set(key) & set(" =,:")):
            raise ServeError("--api-key must be printable, without spaces, '=', ',' or ':'")
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
    env.pop(envs.API_KEY, None)  # the key reaches tritonserver as an argument, never inherited
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
    # NOTE: paths go in a file beside the config, not into it: any client can read the config.
    engine_args = dict(cfg.engine_args)
    trace_steps = engine_args.pop("trace_steps", None)
    (model_dir / SERVE_FILE).write_text(json.dumps(
        {"engine_dir": str(cfg.engine_dir), "python_paths": _environment_paths(),
         "trace_steps": trace_steps, "lora_modules": engine_args.pop("lora_modules", None),
         # Adapters load at run time only behind a key (triton_backend/lora_control.py).
         "lora_updates": bool(cfg.api_key)}))
    # The name the OpenAI frontend serves, then one model parameter per engine option given,
    # generated from EngineOptions.
    parameters = {SERVED_MODEL_NAME_PARAMETER: served_model_name(cfg.engine_dir),
                  **chat_format_parameters(cfg.engine_dir), **options_to_parameters(engine_args)}
    for key, value in parameters.items():
        config += (f'parameters {{ key: "{key}", value: {{ string_value: '
                   f'"{_pbtxt_escape(value)}" }} }}\n')
    (model_dir / "config.pbtxt").write_text(config)
    # INT32 tensors sent for these become INT64 on the way in (preload.c, part 3).
    env[preload.WIDEN_VARIABLE] = ",".join(preload.int64_inputs(config))

    cmd = [
        str(binary), f"--model-repository={models}", f"--backend-directory={backend_dir}",
        f"--http-address={cfg.host}", f"--http-port={cfg.http_port}",
        f"--grpc-address={cfg.host}", f"--grpc-port={cfg.grpc_port}",
        f"--metrics-address={cfg.host}", f"--metrics-port={cfg.metrics_port}",
        "--allow-metrics=true", "--allow-gpu-metrics=false", "--allow-cpu-metrics=true",
        f"--log-verbose={cfg.log_verbose}", "--exit-on-error=true",
        "--disable-auto-complete-config", "--strict-readiness=true",
        f"--exit-timeout-secs={cfg.exit_timeout_s}",
        # kvflow needs none of these: locked behind a header whose value nobody is told (the
        # shared-memory API would let any local client read another request's memory).
        f"--http-restricted-api={ADMIN_APIS}:{ADMIN_HEADER}={cfg.admin_key}",
        f"--grpc-restricted-protocol={ADMIN_APIS}:{ADMIN_HEADER}={cfg.admin_key}",
    ]
    if cfg.api_key:
        cmd += [f"--http-restricted-api={API_KEY_APIS}:{API_KEY_HEADER}={cfg.api_key}",
                f"--grpc-restricted-protocol={API_KEY_APIS}:{API_KEY_HEADER}={cfg.api_key}"]
    return cmd, env


def served_model_name(engine_dir: Path) -> str:
    """The model's name for clients, from the checkpoint the engine was built from:
    ``SmolLM2-135M-Instruct.Q4_1.gguf`` -> ``smollm2-135m-instruct``."""
    from kvflow.build.engine_config import EngineConfig

    name = str(EngineConfig.load(engine_dir).source.get("name") or Path(engine_dir).name)
    name = re.sub(r"\.(gguf|safetensors)$", "", name, flags=re.IGNORECASE)
    name = re.sub(r"[.-](q\d\w*|iq\d\w*|f16|f32|bf16)$", "", name, flags=re.IGNORECASE)
    return name.lower() or MODEL_NAME


def chat_format_parameters(engine_dir: Path) -> dict[str, str]:
    """How the engine's chat template writes tool calls and whether it opens the reasoning
    in the prompt, for the OpenAI frontend (none for an engine without a template)."""
    from kvflow.text.chat_tools import reasoning_format, tool_call_format
    from kvflow.text.tokenizer import ChatTemplateError, EngineTokenizer

    try:
        tokenizer = EngineTokenizer(engine_dir)
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": "x"}])
    except (OSError, ChatTemplateError):
        return {}
    return {TOOL_CALL_PARSER_PARAMETER: tool_call_format(tokenizer.chat_template),
            REASONING_STARTS_OPEN_PARAMETER: str(prompt.rstrip().endswith("<think>")).lower(),
            REASONING_PARSER_PARAMETER: reasoning_format(tokenizer.chat_template) or ""}


def _pbtxt_escape(text: str) -> str:
    return text.replace("\\", "\\\\").replace('"', '\\"')


SHM_REGION_PREFIX = "/dev/shm/triton_python_backend_shm_region_"


def shm_regions_of(pgid: int) -> set[Path]:
    """The Python backend's shared-memory regions that processes of group ``pgid`` (the
    server and its backend stubs) have mapped."""
    regions: set[Path] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if os.getpgid(int(proc.name)) != pgid:
                continue
            for line in (proc / "maps").read_text().splitlines():
                path = line.split(maxsplit=5)[-1] if line.count(" ") >= 5 else ""
                if path.startswith(SHM_REGION_PREFIX):
                    regions.add(Path(path.removesuffix(" (deleted)")))
        except (OSError, ProcessLookupError):
            continue  # gone, or not ours to read
    return regions


class TritonServer(ManagedProcess):
    """A tritonserver process serving one engine, in a workspace of its own; a context manager
    that always cleans up (the process group, the backend's shared memory, the workspace)."""

    # NOTE: should kvflow die without stopping it, SIGTERM, not SIGKILL: tritonserver then
    # unloads the model and removes the backend's shared memory (which nobody else would)
    # within --exit-timeout-secs; its backend stubs exit once it is gone.
    death_signal = signal.SIGTERM

    def __init__(self, cfg: ServerConfig, log_path: Path | None = None) -> None:
        super().__init__("tritonserver", log_path=log_path, port=cfg.http_port,
                         stop_timeout_s=40.0)
        self.cfg = cfg
        self._workspace: tempfile.TemporaryDirectory | None = None
        # The Python backend's shared-memory regions (they hold request text): removed at stop
        # if the backend did not remove them itself (it cannot when it is killed).
        self._shm_regions: set[Path] = set()
        self._cannot_disconnect = False

    @property
    def shm_regions(self) -> frozenset[Path]:
        """The Python backend's shared-memory regions this server has mapped."""
        return frozenset(self._shm_regions)

    @property
    def http_url(self) -> str:
        return f"{url_host(self.cfg.host)}:{self.cfg.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{url_host(self.cfg.host)}:{self.cfg.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{url_host(self.cfg.host)}:{self.cfg.metrics_port}/metrics"

    def start(self) -> Self:
        """Lay out the workspace, start tritonserver and wait until the model is ready."""
        try:
            self._workspace = tempfile.TemporaryDirectory(prefix="kvflow-serve-")
            self.cmd, self.env = prepare_workspace(self.cfg, Path(self._workspace.name))
        except BaseException:
            self.stop()
            raise
        super().start()
        assert self.proc is not None
        self._shm_regions |= shm_regions_of(self.proc.pid)
        return self

    def _popen(self, cmd: list[str], **options: Any) -> subprocess.Popen:
        """With the keys off tritonserver's command line (:mod:`.preload`)."""
        secrets_ = [key for key in (self.cfg.admin_key, self.cfg.api_key) if key]
        env = options.pop("env")
        try:
            return preload.popen(cmd, secrets_, env, **options)
        except preload.PreloadError as e:
            if self.cfg.api_key:
                raise ServeError(
                    "--api-key needs the library that keeps keys off tritonserver's command "
                    f"line, and it could not be built ({e}); install a C compiler (e.g. "
                    "apt-get install gcc) and run `make install`") from None
            print("[kvflow serve] WARNING: the library that keeps keys off tritonserver's "
                  f"command line could not be built ({e}). Every local user can read the "
                  "admin key (ps) and open the backend's /dev/shm regions (mode 0644), and "
                  "with either read other clients' requests, and INT32 tensors for the "
                  "integer inputs are refused. Install a C compiler (e.g. "
                  "apt-get install gcc) and run `make install`.", file=sys.stderr, flush=True)
            return subprocess.Popen(cmd, env=env, **options)

    def wait_ready(self) -> None:
        """Poll the model's readiness endpoint until it answers 200."""
        self.wait_for_http(f"http://{self.http_url}/v2/models/{MODEL_NAME}/ready",
                           self.cfg.ready_timeout_s, "the model")

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM, close the clients' connections, wait (default 40 s), then SIGKILL the whole
        process group; remove the backend's shared memory and the workspace.

        Returns tritonserver's exit code: 0 after a clean unload; 1 when the model did not
        unload within ``exit_timeout_s``. Closing the connections ends gRPC streams and cancels
        their running requests, which would hold the model past that; an HTTP request still
        generating still does (docs/design.md, "Shutdown"). Either way no process is left
        behind: backend stubs ignore SIGTERM and outlive a server that exited uncleanly, so
        the whole group is reaped.
        """
        if self.proc is not None and self.alive:
            self._shm_regions |= shm_regions_of(self.proc.pid)
        code = super().stop(timeout_s)
        for region in self._shm_regions:
            with contextlib.suppress(FileNotFoundError):
                region.unlink()
        self._shm_regions = set()
        if self._workspace is not None:
            self._workspace.cleanup()
            self._workspace = None
        return code

    def while_stopping(self) -> None:
        """Close the clients' connections, every half second while tritonserver stops, so that
        a client that reconnects meanwhile is closed too."""
        if self.proc is None or self._cannot_disconnect:
            return
        try:
            disconnect_clients(self.proc.pid, (self.cfg.http_port, self.cfg.grpc_port))
        except OSError as e:
            self._cannot_disconnect = True
            print(f"[kvflow serve] cannot close tritonserver's client connections ({e}): an "
                  "open gRPC stream or a running request will hold the model until "
                  "--exit-timeout-secs", file=sys.stderr, flush=True)

    def _model_file(self, name: str) -> Path | None:
        """A file the backend writes beside its model (None before start or after stop)."""
        if self._workspace is None:
            return None
        return Path(self._workspace.name) / "models" / MODEL_NAME / name

    def engine_failure(self) -> str | None:
        """What the backend wrote when its engine failed (it then stops tritonserver), or
        None."""
        marker = self._model_file(ENGINE_FAILED_FILE)
        return marker.read_text().strip() if marker is not None and marker.exists() else None

    def write_trace(self) -> int:
        """Ask the backend to write its step timeline now: SIGUSR1 to each stub whose watch is
        live (the pids it wrote beside its model); returns how many were signalled (0 while
        the model is still loading). Needs ``trace_steps``."""
        if not self.cfg.engine_args.get("trace_steps"):
            raise ServeError("the server has no step timeline (start it with --trace-steps)")
        marker = self._model_file(TRACE_SIGNAL_FILE)
        if marker is None:
            return 0
        pids = [int(line) for line in marker.read_text().split()] if marker.exists() else []
        signalled = 0
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
                signalled += 1
        return signalled
