"""The Triton backend's responder thread: Responder.drain returns once everything queued before
it was sent (the engine's failure hook waits on it before it stops tritonserver, so that every
waiter's error leaves first)."""

from __future__ import annotations

import threading

from kvflow.triton_backend.streams import Responder

WAIT_S = 120  # generous: a busy machine; no test compares a duration


class HeldStream:
    """A stream whose sending waits for ``gate`` (a client slow to take its response)."""

    def __init__(self, request_id: str, gate: threading.Event) -> None:
        self.request_id = request_id
        self.gate = gate
        self.sent = threading.Event()
        self.closed = False

    def flush(self) -> None:
        assert self.gate.wait(WAIT_S)
        self.sent.set()
        self.closed = True


def test_drain_returns_once_what_was_queued_before_it_is_sent():
    responder = Responder(abort=lambda _request_id: None)
    gate = threading.Event()
    stream = HeldStream("r1", gate)
    drained: list[bool] = []
    done = threading.Event()

    def drain() -> None:
        drained.append(responder.drain(WAIT_S))
        done.set()

    try:
        responder.ready(stream)  # type: ignore[arg-type]
        waiter = threading.Thread(target=drain)
        waiter.start()
        assert not done.wait(0.2)  # held with the stream (never a false failure)
        gate.set()
        waiter.join(WAIT_S)
        assert drained == [True] and stream.sent.is_set()
    finally:
        gate.set()
        responder.close()


def test_drain_of_a_closed_responder_says_so():
    responder = Responder(abort=lambda _request_id: None)
    responder.close()
    assert responder.drain(1.0) is False
