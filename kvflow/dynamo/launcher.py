"""``kvflow cluster up``: etcd, NATS, N kvflow workers and Dynamo's frontend, on loopback.

:class:`Cluster` starts each server as a :class:`~kvflow.utils.procs.ManagedProcess` (a session
of its own), on free loopback ports, with its log in the cluster's folder, and stops every one
of them (and their children) on :meth:`Cluster.stop`, on Ctrl-C, or when a start fails halfway.
The tests drive the same class.

- **etcd** (Debian's ``etcd-server``): discovery. Workers register their endpoint and model
  there under a lease; a worker that dies loses its lease and the frontend stops routing to it.
- **NATS** (Debian's ``nats-server``): the event plane that carries KV events to the router.
- **Workers**: ``kvflow dynamo-worker`` each, their Dynamo system server (``/metrics``,
  ``/health``) on a port of their own.
- **Frontends**: ``python -m dynamo.frontend``, the OpenAI API, one per router mode asked for
  (by default one, with the KV router); several can serve the same workers at once.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

from kvflow.utils.procs import ManagedProcess, ServeError, free_port, port_open

HOST = "127.0.0.1"
ROUTER_MODES = ("kv", "round-robin", "random", "least-loaded", "power-of-two")
# Every Dynamo listener on loopback (the runtime's defaults bind all interfaces).
LOOPBACK_ENV = {"DYN_TCP_RPC_HOST": HOST, "DYN_TCP_RESPONSE_STREAM_HOST": HOST,
                "DYN_SYSTEM_HOST": HOST, "DYN_EVENT_PLANE_HOST": HOST, "DYN_HTTP_HOST": HOST}


def add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--engine", default="engines/smollm2-135m", help="engine folder")
    p.add_argument("--workers", type=int, default=2, help="kvflow workers (>= 1)")
    p.add_argument("--router-mode", default="kv", choices=ROUTER_MODES,
                   help="the frontend's router: kv (KV-cache aware, from the workers' KV "
                        "events), round-robin, random, ...")
    p.add_argument("--http-port", type=int, default=8000, help="the OpenAI API's port")
    p.add_argument("--model-name", default=None,
                   help="the served model name (default: the engine folder's name)")
    p.add_argument("--dir", default=None,
                   help="folder for the servers' logs and data (default: a temporary one, "
                        "removed at the end)")
    p.add_argument("--migration-limit", type=int, default=3,
                   help="times the frontend moves a request whose worker died to another "
                        "worker, the tokens so far kept (0: the request fails)")
    p.add_argument("--worker-arg", action="append", default=[], metavar="ARG",
                   help="an extra flag for every worker, e.g. --worker-arg=--max-num-seqs=8 "
                        "(repeatable)")


@dataclass
class Cluster:
    """etcd, NATS, ``workers`` kvflow workers and one frontend per entry of ``frontends``
    (router mode -> HTTP port, 0 for a free one) serving ``engine`` under ``model_name``.
    ``worker_args`` go to every worker, ``worker_extra_args[i]`` to worker ``i`` only (a disk
    KV tier's folder is one worker's)."""

    engine: str
    workers: int = 2
    frontends: dict[str, int] = field(default_factory=lambda: {"kv": 0})
    model_name: str | None = None
    worker_args: list[str] = field(default_factory=list)
    worker_extra_args: dict[int, list[str]] = field(default_factory=dict)
    frontend_args: list[str] = field(default_factory=list)
    root: Path | None = None
    namespace: str = "kvflow"
    migration_limit: int = 3
    start_timeout_s: float = 180.0

    def __post_init__(self) -> None:
        if self.migration_limit < 0:
            raise ValueError(f"--migration-limit must be >= 0, got {self.migration_limit}")
        if self.workers < 1:
            raise ValueError(f"--workers must be >= 1, got {self.workers}")
        for mode in self.frontends:
            if mode not in ROUTER_MODES:
                raise ValueError(f"--router-mode must be one of {', '.join(ROUTER_MODES)}, "
                                 f"got {mode!r}")
        if not (Path(self.engine) / "engine_config.json").is_file():
            raise ValueError(f"--engine {self.engine!r} is not an engine folder (no "
                             "engine_config.json): build one with kvflow build-engine")
        for binary, package in (("etcd", "etcd-server"), ("nats-server", "nats-server")):
            if shutil.which(binary) is None:
                raise ValueError(f"{binary} is not installed (Debian's {package}: make dynamo)")
        self.engine = str(Path(self.engine).resolve())  # the servers run in the cluster's folder
        self.model_name = self.model_name or Path(self.engine).name
        self._own_root = self.root is None
        self.root = Path(self.root or tempfile.mkdtemp(prefix="kvflow-cluster-"))
        self.root.mkdir(parents=True, exist_ok=True)
        self.procs: list[ManagedProcess] = []
        self.worker_procs: list[ManagedProcess] = []
        self.frontend_urls: dict[str, str] = {}
        self.env: dict[str, str] = {}

    # --- start ----------------------------------------------------------------------------
    def _spawn(self, name: str, cmd: list[str], port: int | None = None,
               env: dict[str, str] | None = None) -> ManagedProcess:
        """Start ``name`` (not waiting for it), its log ``ROOT/name.log``."""
        assert self.root is not None
        proc = ManagedProcess(name, cmd, log_path=self.root / f"{name}.log", cwd=self.root,
                              env={**os.environ, **LOOPBACK_ENV, **self.env, **(env or {})},
                              port=port)
        self.procs.append(proc)  # NOTE: before start(), so that stop() finds it whatever happens
        return proc.start()

    def start(self) -> Cluster:
        """Start everything: the servers, the workers (until each answers ``/health`` as
        ready, registered), then the frontends (until each lists the model). On failure, stop
        what started and raise ServeError with the failing process's log tail."""
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        assert self.root is not None
        client, peer, nats = free_port(), free_port(), free_port()
        etcd = self._spawn("etcd", [
            "etcd", "--name", "kvflow", "--data-dir", str(self.root / "etcd-data"),
            "--listen-client-urls", f"http://{HOST}:{client}",
            "--advertise-client-urls", f"http://{HOST}:{client}",
            "--listen-peer-urls", f"http://{HOST}:{peer}",
            "--initial-advertise-peer-urls", f"http://{HOST}:{peer}",
            "--initial-cluster", f"kvflow=http://{HOST}:{peer}"], client)
        nats_proc = self._spawn("nats", ["nats-server", "-a", HOST, "-p", str(nats), "-js",
                                         "-sd", str(self.root / "nats-data")], nats)
        self.env = {"ETCD_ENDPOINTS": f"http://{HOST}:{client}",
                    "NATS_SERVER": f"nats://{HOST}:{nats}"}
        etcd.wait_for_http(f"http://{HOST}:{client}/health", 30, "etcd")
        nats_proc.wait_until(lambda: port_open(HOST, nats), 30, f"its port {nats}")
        for i in range(self.workers):
            self.start_worker(i)
        # Every worker registered before a frontend starts: each sees all of them at once.
        self.wait_workers(self.workers)
        for mode, port in self.frontends.items():
            port = port or free_port()
            fe = self._spawn(f"frontend-{mode}", [
                sys.executable, "-m", "dynamo.frontend", "--http-host", HOST,
                "--http-port", str(port), "--router-mode", mode, "--namespace", self.namespace,
                "--discovery-backend", "etcd", "--event-plane", "nats",
                "--migration-limit", str(self.migration_limit), *self.frontend_args], port)
            self.frontend_urls[mode] = f"http://{HOST}:{port}"
            self._wait_model(fe)

    def start_worker(self, i: int) -> ManagedProcess:
        """Start worker ``i`` (again, after :meth:`kill_worker`)."""
        system = low_free_port()  # Dynamo reads DYN_SYSTEM_PORT as an i16
        cmd = [sys.executable, "-m", "kvflow.cli", "dynamo-worker", "--engine", self.engine,
               "--model-name", str(self.model_name), "--namespace", self.namespace,
               "--discovery-backend", "etcd", "--event-plane", "nats", *self.worker_args,
               *self.worker_extra_args.get(i, ())]
        proc = self._spawn(f"worker-{i}", cmd, system,
                           env={"DYN_SYSTEM_PORT": str(system),
                                # Cluster.stop stops the frontends with the workers: Dynamo's
                                # 5 s wait for in-flight requests after unregistering need
                                # not be that long here.
                                "DYN_GRACEFUL_SHUTDOWN_GRACE_PERIOD_SECS": "1"})
        if i < len(self.worker_procs):
            self.worker_procs[i] = proc
        else:
            self.worker_procs.append(proc)
        return proc

    def _wait_model(self, fe: ManagedProcess) -> None:
        """Until frontend ``fe`` lists the model (every worker still alive)."""
        def listed() -> bool:
            with contextlib.suppress(OSError, ValueError):
                models = get_json(f"http://{HOST}:{fe.port}/v1/models")
                return any(m.get("id") == self.model_name for m in models.get("data", []))
            return False

        fe.wait_until(listed, self.start_timeout_s, f"the model {self.model_name}", poll_s=0.5,
                      watch=self.worker_procs)

    def wait_workers(self, n: int, timeout_s: float | None = None) -> None:
        """Wait until ``n`` workers answer ``/health`` as ready."""
        deadline = time.monotonic() + (timeout_s or self.start_timeout_s)
        while time.monotonic() < deadline:
            ready = 0
            for p in self.worker_procs:
                if not p.alive:
                    continue
                with contextlib.suppress(OSError, ValueError):
                    if get_json(f"http://{HOST}:{p.port}/health").get("status") == "ready":
                        ready += 1
            if ready >= n:
                return
            time.sleep(0.5)
        raise ServeError(f"{n} workers were not ready in time:\n"
                         + "\n".join(p.tail(10) for p in self.worker_procs))

    # --- use ------------------------------------------------------------------------------
    def url(self, mode: str | None = None) -> str:
        """The OpenAI base URL (``.../v1``) of the frontend with router ``mode``."""
        return self.frontend_urls[mode or next(iter(self.frontend_urls))] + "/v1"

    def worker_metrics(self, i: int) -> str:
        """Worker ``i``'s Prometheus text: kvflow's series and Dynamo's."""
        port = self.worker_procs[i].port
        with urllib.request.urlopen(f"http://{HOST}:{port}/metrics", timeout=10) as resp:
            return resp.read().decode()

    def kill_worker(self, i: int) -> None:
        """SIGKILL worker ``i`` (its whole session), as a crash would."""
        self.worker_procs[i].kill()

    # --- stop -----------------------------------------------------------------------------
    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every process the cluster started: the frontends and workers first (so that
        the workers can still unregister from etcd), then NATS and etcd. Each gets SIGTERM to
        its session, then SIGKILL after ``timeout_s``; then the temporary folder goes."""
        services = {"etcd", "nats"}
        for group in ([p for p in self.procs if p.name not in services],
                      [p for p in self.procs if p.name in services]):
            for proc in group:  # all at once, then each waited for
                proc.terminate()
            deadline = time.monotonic() + timeout_s
            for proc in group:
                proc.stop(max(0.1, deadline - time.monotonic()))
        self.procs.clear()
        if self._own_root and self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Cluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def low_free_port(low: int = 20000, high: int = 32767) -> int:
    """A free loopback port below 32768."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return port
    raise ServeError(f"no free port in [{low}, {high}]")


def get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as e:
        e.close()
        raise OSError(f"{url}: HTTP {e.code}") from None


def cluster_up(args: argparse.Namespace) -> int:
    """Start the cluster, print its OpenAI URL, wait for Ctrl-C (or SIGTERM), stop it all."""
    cluster = Cluster(args.engine, args.workers, {args.router_mode: args.http_port},
                      args.model_name, list(args.worker_arg),
                      root=Path(args.dir) if args.dir else None,
                      migration_limit=args.migration_limit)
    stop = {"now": False}

    def on_signal(signum: int, frame: object) -> None:
        stop["now"] = True

    # NOTE: SIGINT too, explicitly, as `kvflow serve` does: a process started with SIGINT
    # ignored (a background job of a script, a CI runner) gets no KeyboardInterrupt from Python,
    # and Ctrl-C (or a SIGINT from a supervisor) would then never stop the cluster.
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    code = 0
    try:
        print(f"[cluster] starting etcd, NATS, {args.workers} kvflow workers and Dynamo's "
              f"frontend ({args.router_mode} router); logs in {cluster.root}", flush=True)
        cluster.start()
        print(f"[cluster] OpenAI API: {cluster.url()}  (model {cluster.model_name}); "
              "Ctrl-C stops everything", flush=True)
        reported: set[str] = set()
        while not stop["now"]:
            for p in cluster.worker_procs:
                if not p.alive and p.name not in reported:
                    reported.add(p.name)
                    print(f"[cluster] {p.name} exited ({p.returncode}); see {p.log_path}",
                          flush=True)
            time.sleep(0.5)
            if all(not p.alive for p in cluster.worker_procs):
                print("[cluster] no worker is left", flush=True)
                code = 1
                break
    except KeyboardInterrupt:
        pass
    except ServeError as e:
        print(f"[cluster] failed to start: {e}", file=sys.stderr, flush=True)
        code = 1
    finally:
        print("[cluster] stopping", flush=True)
        cluster.stop()
    return code
