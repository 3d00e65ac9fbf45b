"""Child processes that kvflow starts and must always stop: tritonserver, the OpenAI frontend,
llama-server, and the Dynamo cluster's etcd, NATS, workers and frontends.

:class:`ManagedProcess` is the one way they are run: in a process group of their own (Ctrl-C in
a terminal reaches only kvflow, which then stops them in order, and a stop reaches everything
they started), their output in a log file, waited for until ready (a failure quotes the end of
the log), stopped with SIGTERM and then SIGKILL, as a context manager. Beside it, the small
network helpers the launchers share.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future
from pathlib import Path
from queue import SimpleQueue
from typing import Any, Self

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


class ServeError(RuntimeError):
    """A server could not be prepared, exited, or did not become ready in time."""


def url_host(host: str) -> str:
    """The address a local client connects to for a server bound to ``host``."""
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def is_loopback(host: str) -> bool:
    """Whether a server bound to ``host`` is reachable from this machine only."""
    return host in ("localhost", "::1") or host.startswith("127.")


def free_port() -> int:
    """A loopback TCP port that nobody listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_ready(url: str, any_status: bool = False) -> bool:
    """Whether ``url`` answers 200 (with ``any_status``, any HTTP status: the server is up)."""
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except urllib.error.HTTPError as e:
        e.close()
        return any_status
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return False


def port_open(host: str, port: int) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    with contextlib.suppress(OSError), socket.create_connection((host, port), 1):
        return True
    return False


def stop_process_group(proc: subprocess.Popen, timeout_s: float,
                       while_waiting: Callable[[], None] | None = None) -> int:
    """SIGTERM the process group led by ``proc``, wait up to ``timeout_s`` for ``proc`` (calling
    ``while_waiting`` at once, then every half second), then SIGKILL the group; returns
    ``proc``'s exit code."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while True:
        if while_waiting is not None:
            while_waiting()
        try:
            return proc.wait(max(0.0, min(0.5, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                break
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait(10)


def kill_process_group(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGKILL what is left of the process group led by ``proc`` and wait (up to ``timeout_s``)
    until it is gone: children that ignore SIGTERM outlive a leader that exits."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout_s)  # NOTE: reaped first: a zombie leader keeps its group alive
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:  # raises ProcessLookupError once the group is gone
            os.killpg(proc.pid, 0)
            time.sleep(0.05)


def _prctl() -> Callable[..., int] | None:
    """libc's prctl, resolved here: a child between fork and exec must not load libraries."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


_PRCTL = _prctl()


def die_with_parent(signum: int) -> Callable[[], None] | None:
    """A ``preexec_fn`` by which the child gets ``signum`` when the thread that forked it
    ends (Linux's PR_SET_PDEATHSIG; None elsewhere): a parent killed with SIGKILL, which can
    stop nothing itself, still takes its children with it. It survives the exec. Fork only
    from a thread that lives as long as the process: :func:`spawn` does."""
    if _PRCTL is None:
        return None
    prctl, parent = _PRCTL, os.getpid()

    def preexec() -> None:
        if prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
        if os.getppid() != parent:  # the parent died before the prctl: nothing will tell us
            os.kill(os.getpid(), signum)

    return preexec


class _Spawner:
    """One daemon thread, as long-lived as the process, that forks the children asked of it
    from threads that may end sooner (PR_SET_PDEATHSIG fires when the forking *thread* ends).
    The main thread forks its own."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._inbox: SimpleQueue[tuple[Callable[[], Any], Future]] | None = None
        self._pid = -1

    def run(self, fn: Callable[[], subprocess.Popen]) -> subprocess.Popen:
        if threading.current_thread() is threading.main_thread():
            return fn()
        with self._lock:
            if self._inbox is None or self._pid != os.getpid():  # none yet, or we forked
                self._inbox, self._pid = SimpleQueue(), os.getpid()
                threading.Thread(target=self._serve, args=(self._inbox,),
                                 name="kvflow-spawner", daemon=True).start()
            inbox = self._inbox
        done: Future[subprocess.Popen] = Future()
        inbox.put((fn, done))
        return done.result()

    @staticmethod
    def _serve(inbox: SimpleQueue[tuple[Callable[[], Any], Future]]) -> None:
        while True:
            fn, done = inbox.get()
            try:
                done.set_result(fn())
            except BaseException as e:  # noqa: BLE001  raised on the asking thread
                done.set_exception(e)


_spawner = _Spawner()


def spawn(popen: Callable[..., subprocess.Popen], cmd: Sequence[str],
          death_signal: int = signal.SIGKILL, **options: Any) -> subprocess.Popen:
    """``popen(cmd, **options)`` (``subprocess.Popen`` or a wrapper of it), the child to be sent
    ``death_signal`` when this process ends, however it ends (:func:`die_with_parent`)."""
    preexec = die_with_parent(death_signal)
    if preexec is not None:
        options["preexec_fn"] = preexec
    return _spawner.run(lambda: popen(list(cmd), **options))


class ManagedProcess:
    """One child process, in a process group of its own, its output (stdout and stderr) in
    ``log_path`` (none: ours); a context manager that always stops it.

    :meth:`start` spawns ``cmd`` and calls :meth:`wait_ready`, stopping the process if either
    fails. A subclass sets ``cmd`` and ``env`` before calling it, says what ready means by
    overriding :meth:`wait_ready`, and may spawn another way (:meth:`_popen`).

    The child gets ``death_signal`` when this process ends without stopping it (even by
    SIGKILL): no server outlives the one that started it (:func:`spawn`).
    """

    death_signal: int = signal.SIGKILL

    def __init__(self, name: str, cmd: Sequence[str] = (), *, log_path: Path | None = None,
                 env: Mapping[str, str] | None = None, cwd: Path | None = None,
                 port: int | None = None, stop_timeout_s: float = 15.0) -> None:
        self.name = name
        self.cmd = list(cmd)
        self.log_path = Path(log_path) if log_path is not None else None
        self.env = dict(env) if env is not None else None  # None: ours
        self.cwd = cwd
        self.port = port  # where it listens, when the caller chose the port
        self.stop_timeout_s = stop_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc is not None else None

    def start(self) -> Self:
        """Spawn the process and wait until it is ready; ServeError (the process stopped) if
        it exits or is not ready in time."""
        try:
            log = open(self.log_path, "ab") if self.log_path is not None else None  # noqa: SIM115
            try:
                self.proc = spawn(self._popen, self.cmd, self.death_signal, env=self.env,
                                  cwd=self.cwd, stdin=subprocess.DEVNULL, stdout=log,
                                  stderr=subprocess.STDOUT, start_new_session=True)
            finally:
                if log is not None:
                    log.close()  # the child holds its own copy
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def _popen(self, cmd: list[str], **options: Any) -> subprocess.Popen:
        """Create the process (a subclass may keep secrets off its command line)."""
        return subprocess.Popen(cmd, **options)

    def wait_ready(self) -> None:
        """Return once the process serves; by default at once."""

    def wait_until(self, ready: Callable[[], bool], timeout_s: float, what: str,
                   poll_s: float = 0.25, watch: Iterable[ManagedProcess] = (),
                   where: str = "") -> None:
        """Poll ``ready()`` until it holds; ServeError if this process (or one in ``watch``)
        exits first, or ``what`` is not ready within ``timeout_s`` (``where``: the address
        it was asked at, for that message)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for p in (self, *watch):
                if p.proc is not None and not p.alive:
                    raise p.failure(f"{p.name} exited with code {p.returncode} before {what} "
                                    "was ready")
            if ready():
                return
            time.sleep(poll_s)
        raise self.failure(f"{what} was not ready within {timeout_s:.0f}s"
                           + (f" ({where})" if where else ""))

    def wait_for_http(self, url: str, timeout_s: float, what: str,
                      any_status: bool = False) -> None:
        """:meth:`wait_until` ``url`` answers 200 (with ``any_status``, any HTTP status)."""
        self.wait_until(lambda: http_ready(url, any_status), timeout_s, what, where=url)

    def tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the log ("" without one)."""
        if self.log_path is None:
            return ""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def failure(self, message: str) -> ServeError:
        """A ServeError saying ``message``, then the end of the log."""
        tail = self.tail()
        return ServeError(f"{message}; the end of {self.log_path}:\n{tail}" if tail
                          else message)

    def while_stopping(self) -> None:
        """Called at once, then every half second, while the process stops."""

    def terminate(self) -> None:
        """SIGTERM the process group, without waiting (:meth:`stop` waits)."""
        if self.proc is not None and self.alive:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the process group at once, as a crash would."""
        if self.proc is not None:
            kill_process_group(self.proc)

    def stop(self, timeout_s: float | None = None) -> int | None:
        """SIGTERM the process group, wait up to ``timeout_s`` (default ``stop_timeout_s``) for
        the process, then SIGKILL whatever of the group is left. Returns its exit code (None
        if it never started); calling it again returns the same."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            code = stop_process_group(self.proc, self.stop_timeout_s if timeout_s is None
                                      else timeout_s, self.while_stopping)
        else:
            code = self.proc.returncode
        kill_process_group(self.proc)
        return code

    def __enter__(self) -> Self:
        return self if self.alive else self.start()  # started already, or now

    def __exit__(self, *exc: object) -> None:
        self.stop()
