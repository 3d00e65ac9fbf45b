"""Issue 43, item 18: a child that kvflow starts dies with the process that started it, even when
that process is killed with SIGKILL and so can stop nothing itself (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.helpers import wait_for

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="PR_SET_PDEATHSIG is Linux's")


def alive(pid: int) -> bool:
    """Running (a zombie, which an init that does not reap leaves behind, is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid``, walked by parent (kvflow's children run in sessions
    of their own)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError):
            continue  # gone meanwhile
    tree, frontier = [], [pid]
    while frontier:
        frontier = [p for p, parent in parents.items() if parent in frontier]
        tree += frontier
    return [p for p in tree if alive(p)]


def kill_and_wait_for_children(parent: subprocess.Popen, children: list[int]) -> None:
    """SIGKILL ``parent`` alone, then wait (an event, not a duration) until every child is
    gone."""
    assert children and all(alive(p) for p in children)
    parent.kill()
    parent.wait()
    try:
        wait_for(lambda: not any(alive(p) for p in children), timeout_s=120,
                 what="the children of a killed parent to die")
    finally:
        for pid in children:  # whatever the outcome, nothing outlives the test
            if alive(pid):
                os.kill(pid, signal.SIGKILL)


PARENT = textwrap.dedent("""
    import sys, threading, time
    from kvflow.utils.procs import ManagedProcess

    sleep = [sys.executable, "-c", "import time; time.sleep(600)"]
    procs = [ManagedProcess("from main", sleep).start()]
    # Forked for a thread that then ends: the child must outlive that thread (PDEATHSIG
    # follows the forking thread), and still die with the process.
    worker = threading.Thread(target=lambda: procs.append(
        ManagedProcess("from a thread", sleep).start()))
    worker.start()
    worker.join()
    print(" ".join(str(p.proc.pid) for p in procs), flush=True)
    time.sleep(600)
""")


def test_children_die_with_a_parent_killed_by_sigkill():
    from kvflow.utils.procs import spawn

    parent = spawn(subprocess.Popen, [sys.executable, "-c", PARENT], stdout=subprocess.PIPE,
                   text=True, start_new_session=True)
    try:
        assert parent.stdout is not None
        children = [int(p) for p in parent.stdout.readline().split()]
        assert len(children) == 2, children
        assert all(alive(p) for p in children), "a child died with the thread that forked it"
        kill_and_wait_for_children(parent, children)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


def _status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


@pytest.mark.slow
def test_kvflow_serve_killed_by_sigkill_takes_tritonserver_and_the_frontend(tiny_engines,
                                                                            tmp_path):
    """tritonserver (and its backend stubs) and the OpenAI frontend all end; tritonserver,
    sent SIGTERM, removes the backend's shared memory on its way out."""
    pytest.importorskip("tritonclient.grpc")
    from kvflow.triton_backend.launcher import shm_regions_of
    from kvflow.utils.procs import free_port, spawn

    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    with open(tmp_path / "serve.log", "wb") as out:
        serve = spawn(
            subprocess.Popen, [sys.executable, "-m", "kvflow.cli", "serve", "--engine",
             str(tiny_engines["llama-gqa4", "onnxruntime"]),
             *(f"--{name}-port={port}" for name, port in ports.items())],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for(lambda: _status(f"http://127.0.0.1:{ports['openai']}/health") == 200
                 or serve.poll() is not None, what="kvflow serve ready")
        assert serve.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
        children = descendants(serve.pid)
        names = {Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")[0].decode()
                 for p in children}
        assert any(n.endswith("tritonserver") for n in names), names
        assert any(n.endswith("triton_python_backend_stub") for n in names), names
        regions = set().union(*(shm_regions_of(os.getpgid(p)) for p in children))
        assert regions
        kill_and_wait_for_children(serve, children)
        assert not [r for r in regions if r.exists()]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
