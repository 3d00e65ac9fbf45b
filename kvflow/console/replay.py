"""The live console on a simulated run: ``kvflow simulate ... --console`` paces the simulation
to the wall clock (``speed`` simulated seconds a second) and serves the console's page with
each engine's snapshot, so that the real scheduler's batching can be watched (the essay's
static-versus-continuous comparison, for one). Pure Python: the standard library's HTTP
server, on loopback.

The page's chat needs a model, which a simulation has none of: ``/v1/models`` names the
simulation, and a chat gets a 400 that says so.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from kvflow.console.assets import CONSOLE_ASSETS, CONSOLE_HEADERS, console_file
from kvflow.console.state import engine_state

if TYPE_CHECKING:
    from kvflow.orchestrator.engine import LLMEngine

ASSETS = {"/": ("index.html", "text/html"),
          **{f"/console/{name}": (name, media) for name, media in CONSOLE_ASSETS.items()}}
SNAPSHOT_PERIOD_S = 0.1  # wall seconds between two snapshots of an engine


class ConsoleReplay:
    """Serves the console for a simulation, and paces it: pass :meth:`on_step` as the
    simulator's ``on_step``. ``speed``: simulated seconds per wall second."""

    def __init__(self, speed: float = 1.0, host: str = "127.0.0.1", port: int = 9000,
                 name: str = "simulation") -> None:
        if not speed > 0:
            raise ValueError(f"--console-speed must be > 0, got {speed}")
        self.speed, self.name = speed, name
        self._lock = threading.Lock()
        self._snapshots: dict[int, dict[str, Any]] = {}
        self._taken: dict[int, float] = {}
        self._start: tuple[float, float] | None = None  # (wall, simulated) at the first step
        self.server = ThreadingHTTPServer((host, port), self._handler())
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                        name="kvflow-console")
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self.server.server_address[:2]
        return f"http://{host!s}:{port}/"

    def on_step(self, index: int, engine: LLMEngine) -> None:
        """Before each step of engine ``index``: wait until the wall clock reaches its
        simulated time, and take its snapshot when one is due."""
        now = engine.clock()
        if self._start is None:
            self._start = (time.monotonic(), now)
        wall0, sim0 = self._start
        delay = wall0 + (now - sim0) / self.speed - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        if time.monotonic() - self._taken.get(index, -1.0) >= SNAPSHOT_PERIOD_S:
            self.publish(index, engine)

    def publish(self, index: int, engine: LLMEngine) -> None:
        """Take engine ``index``'s snapshot now (also once the run is over: its final state)."""
        snapshot = engine_state(engine)
        with self._lock:
            self._snapshots[index] = snapshot
            self._taken[index] = time.monotonic()

    def state(self) -> dict[str, Any]:
        with self._lock:
            return {"object": "kvflow.state", "servers": [
                {"url": f"simulated instance {k}", **s} for k, s in sorted(
                    self._snapshots.items())]}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(timeout=5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        replay = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:  # quiet
                pass

            def _send(self, status: int, body: bytes, media: str) -> None:
                self.send_response(status)
                self.send_header("Content-Type", media)
                self.send_header("Content-Length", str(len(body)))
                for name, value in CONSOLE_HEADERS.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            def _json(self, status: int, value: Any) -> None:
                self._send(status, json.dumps(value).encode(), "application/json")

            def do_GET(self) -> None:  # noqa: N802  (http.server's name)
                path = self.path.split("?")[0]
                if path in ASSETS:
                    name, media = ASSETS[path]
                    self._send(200, console_file(name), media)
                elif path == "/v1/kvflow/state":
                    state = replay.state()
                    if not state["servers"]:  # before the first step: an idle engine
                        state["servers"] = [{"url": "simulation", "error": "not started yet"}]
                    self._json(200, state)
                elif path == "/console/token":  # no API key here: no token
                    self._json(200, {"token": None})
                elif path == "/v1/models":
                    self._json(200, {"object": "list", "data": [{"id": replay.name,
                                                                 "object": "model"}]})
                else:
                    self._json(404, {"error": {"message": f"{path} is not served here"}})

            def do_POST(self) -> None:  # noqa: N802
                self._json(400, {"error": {"message": "this is a simulation: it has no model "
                                           "to chat with", "type": "invalid_request_error",
                                           "param": None, "code": None}})

        return Handler
