"""Secrets stay out of other local users' reach (issue 29, item 4): no key on any command line
(every local user can read /proc/<pid>/cmdline), no key in tritonserver's environment, and the
Python backend's /dev/shm regions (request text) private to the server's user. Checked on the
real `kvflow serve` CLI and on every process it starts."""

from __future__ import annotations

import base64
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from kvflow.triton_backend import preload
from kvflow.triton_backend.launcher import shm_regions_of
from kvflow.utils.procs import free_port, spawn

API_KEY = "t0p-s3cret-api-key"
NOBODY = 65534
DEADLINE_S = 300.0


def request(url: str, body: dict | None = None,
            headers: dict[str, str] | None = None) -> tuple[int, str]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers=headers or {},
                                 method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=DEADLINE_S) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (tritonserver and the frontend run in sessions of
    their own, so the tree is walked by parent, not by process group)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue  # gone meanwhile
        parents[int(stat.parent.name)] = int(text.rsplit(")", 1)[1].split()[1])
    tree, frontier = [pid], [pid]
    while frontier:
        children = [p for p, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def name_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()


def as_nobody(path: Path) -> subprocess.CompletedProcess:
    """``cat path`` as another local user (needs root to switch user)."""
    return subprocess.run(["cat", str(path)], user=NOBODY, group=NOBODY, extra_groups=[],
                          capture_output=True)


def wait_until(predicate, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"kvflow serve exited with {proc.returncode}"
        if predicate():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture(scope="module")
def served(tiny_engines, tmp_path_factory):
    """`kvflow serve` (the CLI, as a subprocess) with an API key from KVFLOW_API_KEY, the way
    a key stays off its own command line, with the OpenAI frontend."""
    pytest.importorskip("tritonclient.grpc")
    ports = {name: free_port() for name in ("http", "grpc", "metrics", "openai")}
    log = tmp_path_factory.mktemp("secrets") / "serve.log"
    env = dict(os.environ, KVFLOW_API_KEY=API_KEY)
    cmd = [sys.executable, "-m", "kvflow.cli", "serve",
           "--engine", str(tiny_engines["llama-gqa4", "onnxruntime"]),
           *(f"--{name}-port={port}" for name, port in ports.items())]
    with open(log, "wb") as out:
        proc = spawn(subprocess.Popen, cmd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        wait_until(lambda: f"OpenAI API http://127.0.0.1:{ports['openai']}" in log.read_text(),
                   "kvflow serve to be ready", proc)
        yield proc, ports
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.mark.slow
def test_no_process_shows_a_key_on_its_command_line(served):
    proc, _ = served
    tree = descendants(proc.pid)
    names = [Path(name_of(pid)).name for pid in tree]
    assert "tritonserver" in names and "triton_python_backend_stub" in names, names
    for pid in tree:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
        if os.geteuid() == 0:  # what another local user reads
            assert as_nobody(Path(f"/proc/{pid}/cmdline")).stdout.decode().split("\0") == argv
        assert not any(API_KEY in arg for arg in argv), f"{names[tree.index(pid)]}: {argv}"
        # The admin key is random and never told; the arguments that carry keys are
        # placeholders on the command line.
        assert not any(arg.startswith(("--http-restricted-api", "--grpc-restricted-protocol"))
                       for arg in argv), argv
    triton = tree[names.index("tritonserver")]
    argv = Path(f"/proc/{triton}/cmdline").read_bytes().decode().split("\0")
    assert argv.count(preload.PLACEHOLDER) == 4  # admin and API key, HTTP and gRPC each


@pytest.mark.slow
def test_the_key_is_in_no_environment_but_those_that_need_it(served):
    """kvflow serve was given the key in its environment and hands it to the frontend the same
    way; tritonserver gets it through a pipe, so neither it nor its stubs hold it there. Every
    /proc/<pid>/environ is its owner's alone."""
    proc, _ = served
    holders = []
    for pid in descendants(proc.pid):
        environ = Path(f"/proc/{pid}/environ")
        if API_KEY.encode() in environ.read_bytes():
            holders.append(Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0"))
        assert environ.stat().st_mode & 0o077 == 0
        if os.geteuid() == 0:
            denied = as_nobody(environ)
            assert denied.returncode != 0 and b"Permission denied" in denied.stderr
    assert sorted(argv[3] for argv in holders) == ["openai", "serve"], holders


@pytest.mark.slow
def test_the_backends_shared_memory_is_private(served):
    """The regions hold request text: mode 0600 from creation (Triton's Python backend makes
    them 0644 whatever the umask; the preload library keeps the umask)."""
    proc, _ = served
    triton = next(pid for pid in descendants(proc.pid)
                  if Path(name_of(pid)).name == "tritonserver")
    regions = shm_regions_of(triton)  # tritonserver leads its own process group
    assert regions
    for region in regions:
        assert region.stat().st_mode & 0o777 == 0o600, oct(region.stat().st_mode)
        if os.geteuid() == 0:
            denied = as_nobody(region)
            assert denied.returncode != 0 and b"Permission denied" in denied.stderr


@pytest.mark.slow
def test_the_keys_still_guard_the_server(served):
    """The secrets that reached tritonserver through the pipe are in force: the API key over
    HTTP and through the OpenAI frontend, the admin key on the endpoints kvflow never uses."""
    _, ports = served
    generate = f"http://127.0.0.1:{ports['http']}/v2/models/kvflow/generate"
    body = {"text_input": "Hi", "max_tokens": 2,
            "sampling_parameters": json.dumps({"ignore_eos": True, "temperature": 0.0})}
    status, text = request(generate, body)
    assert status == 403 and "x-api-key" in text
    assert request(generate, body, {"x-api-key": "wrong"})[0] == 403
    status, text = request(generate, body, {"x-api-key": API_KEY})
    assert status == 200 and json.loads(text)["num_output_tokens"] == 2
    status, text = request(f"http://127.0.0.1:{ports['http']}/v2/systemsharedmemory/status",
                           headers={"x-api-key": API_KEY})
    assert status == 403 and "kvflow-admin-key" in text
    models = f"http://127.0.0.1:{ports['openai']}/v1/models"
    assert request(models)[0] == 401
    assert request(models, headers={"Authorization": f"Bearer {API_KEY}"})[0] == 200


@pytest.mark.slow
def test_basic_credentials_open_the_console_and_no_api_route(served):
    """A browser sends its Basic login with any request to the site, a cross-site form's POST
    too: it opens the console's GET routes alone. The API takes the key as Bearer or
    x-api-key, or the console's token, which only a Basic login can read (issue 43)."""
    _, ports = served
    base = f"http://127.0.0.1:{ports['openai']}"
    as_json = {"Content-Type": "application/json"}
    basic = {"Authorization": "Basic " + base64.b64encode(f"me:{API_KEY}".encode()).decode()}
    bearer = {"Authorization": f"Bearer {API_KEY}"}
    completion = {"prompt": "Hi", "max_tokens": 1}
    for path, body in (("/v1/completions", completion), ("/tokenize", {"prompt": "Hi"}),
                       ("/v1/models", None), ("/v1/kvflow/state", None)):
        status, text = request(base + path, body, {**basic, **as_json})
        assert status == 401 and "Bearer" in json.loads(text)["error"]["message"], (path, text)
    assert request(base + "/v1/completions", completion, {**bearer, **as_json})[0] == 200
    assert request(base + "/v1/completions", completion, {"x-api-key": API_KEY,
                                                          **as_json})[0] == 200
    wrong = {"Authorization": f"Bearer {API_KEY}x", **as_json}
    assert request(base + "/v1/completions", completion, wrong)[0] == 401
    # The console: its page and assets behind Basic, then its token for the API routes.
    status, _ = request(base + "/")
    assert status == 401
    assert request(base + "/", headers=basic)[0] == 200
    assert request(base + "/console/console.js", headers=basic)[0] == 200
    assert request(base + "/console/token")[0] == 401
    status, text = request(base + "/console/token", headers=basic)
    token = json.loads(text)["token"]
    assert status == 200 and token and API_KEY not in token
    console = {"Authorization": f"Bearer {token}"}
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    assert request(base + "/v1/chat/completions", chat, {**console, **as_json})[0] == 200
    assert request(base + "/v1/kvflow/state", headers=console)[0] == 200
    assert request(base + "/v1/models", headers=console)[0] == 200


def test_the_preload_library_hands_over_secrets_before_main(tmp_path):
    """The mechanism on its own: the program reads the real argument, /proc shows the
    placeholder; and a placeholder without its secret stops the program before main()."""
    script = "import sys, time; print(sys.argv[1], flush=True); time.sleep(60)"
    proc = preload.popen([sys.executable, "-c", script, "--key=s3cret"], ["s3cret"],
                         env=dict(os.environ), stdout=subprocess.PIPE)
    try:
        assert proc.stdout.readline().decode().strip() == "--key=s3cret"
        argv = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")
        assert argv[3] == preload.PLACEHOLDER and "s3cret" not in "".join(argv)
        assert b"s3cret" not in Path(f"/proc/{proc.pid}/environ").read_bytes()
    finally:
        proc.kill()
        proc.wait()
    read_end, write_end = os.pipe()
    os.close(write_end)  # no secret arguments at all
    env = dict(os.environ, LD_PRELOAD=str(preload.library()),
               **{preload.FD_VARIABLE: str(read_end)})
    refused = subprocess.run([sys.executable, "-c", "print('main ran')", preload.PLACEHOLDER],
                             env=env, pass_fds=(read_end,), capture_output=True)
    os.close(read_end)
    assert refused.returncode != 0 and b"main ran" not in refused.stdout
    assert b"more placeholders than secret arguments" in refused.stderr


def test_the_key_guard_takes_basic_only_where_told_and_its_console_token_elsewhere():
    from kvflow.openai_api.errors import OpenAIError
    from kvflow.openai_api.security import KeyGuard

    guard = KeyGuard(API_KEY)
    basic = "Basic " + base64.b64encode(f"me:{API_KEY}".encode()).decode()
    token = guard.console_token
    assert token and token == KeyGuard(API_KEY).console_token  # every frontend of the key
    guard.check({"authorization": f"Bearer {API_KEY}"})
    guard.check({"x-api-key": API_KEY})
    guard.check({"authorization": f"Bearer {token}"})
    guard.check({"authorization": basic}, console_get=True)
    for headers, console_get in (({"authorization": basic}, False),
                                 ({"authorization": f"Bearer {token}"}, True),
                                 ({"authorization": "Bearer h\u00e9"}, False),
                                 ({}, False), ({"x-api-key": API_KEY[:-1]}, False)):
        with pytest.raises(OpenAIError) as refused:
            guard.check(headers, console_get)
        assert refused.value.status == 401
    KeyGuard(None).check({})  # no key: no authentication
