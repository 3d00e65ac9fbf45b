"""kvflow's prefix-cache events on a ZMQ socket, in the format Dynamo's KV event relay reads.

The worker hands Dynamo a :class:`~dynamo.common.backend.publisher.ZmqSource`; Dynamo's
``KvEventPublisher`` subscribes to this socket and relays each event onto the event plane, where
the KV router's indexer mirrors every worker's cache. The wire format is vLLM's, which Dynamo's
relay decodes: a multipart message ``[topic, sequence (8 bytes, big-endian), payload]``, the
payload the msgpack array ``[timestamp, [event, ...], data_parallel_rank]``, and each event a
tagged array:

- ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``
- ``["BlockRemoved", block_hashes, medium]``
- ``["AllBlocksCleared"]``

``lora_id`` is the LoRA adapter the block was computed under (the engine's stable 1-based id of
its name; None: the base model): the same tokens under another adapter are another block.
The router hashes the token ids itself to match requests; a block hash is only the block's
identity (so that a removal and a child's parent can name it). kvflow's is a 256-bit digest;
its first 63 bits stand for it here (an integer every reader takes, signed or not).

``medium`` says where the block lives, so that the router can send a returning prompt to the
worker whose host or disk tier holds its prefix (Dynamo credits such a hit less than one in the
pool: ``--router-host-cache-hit-weight``, ``--router-disk-cache-hit-weight``). kvflow's media go
on the wire as vLLM names them (:data:`WIRE_MEDIUM`): the pool ``"GPU"``, the host tier
``"CPU_TIER1"``, the disk tier ``"CPU_TIER2"``. Dynamo's ``StorageTier::from_kv_medium`` maps
these to its device, host-pinned and disk tiers in every release that reads a medium (1.6.1's,
the version kvflow pins, read from its binary: ``GPU``/``DEVICE``; ``CPU``/``CPU_PINNED``/
``CPU_TIER1``; ``CPU_TIER2``/``DISK``/``NVME``/``STORAGE``); older releases know only the vLLM
names. The router indexes a lower tier's blocks by (parent hash, tokens), so a tier's
``BlockStored`` carries the parent the block had in the pool, held there or not.

The socket is an XPUB: it sees the relay subscribe. Events raised before then are held, and the
first subscription gets ``AllBlocksCleared`` ahead of them, so the router starts from an empty
view of this worker whatever it held of an earlier one at this address. A worker with a disk
tier puts a ``BlockStored`` for each block on disk at start (an earlier process's): the relay
gets them first thing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Sequence

import msgspec
import zmq

from kvflow.kv_manager.block_pool import BlockHash, BlockStored, KVEvent

# kvflow's media (the pool's, then the KV tiers' store.medium) -> the wire's (see above).
WIRE_MEDIUM = {"gpu": "GPU", "cpu": "CPU_TIER1", "disk": "CPU_TIER2"}
POOL_WIRE_MEDIUM = WIRE_MEDIUM["gpu"]
MAX_HELD_BATCHES = 10_000  # steps' events held while no relay has subscribed
log = logging.getLogger("kvflow.dynamo")


def block_id(block_hash: BlockHash) -> int:
    """The 63-bit integer that names a kvflow block hash on the wire."""
    return int.from_bytes(block_hash[:8], "little") >> 1


def wire_medium(medium: str) -> str:
    """The wire name of a kvflow medium; ValueError for one that has none."""
    try:
        return WIRE_MEDIUM[medium]
    except KeyError:
        raise ValueError(f"KV event medium {medium!r} has no Dynamo name; "
                         f"known: {sorted(WIRE_MEDIUM)}") from None


def encode_events(events: Sequence[KVEvent], block_size: int) -> list[list]:
    """Wire events of kvflow's. Per medium, consecutive stores of one chain go in one
    ``BlockStored`` and consecutive removals in one ``BlockRemoved``; two media never share a
    wire event. Each medium's events keep their order; the router's view of one medium is
    independent of another's, so their interleaving is not kept.

    Salted blocks (a request's ``cache_salt`` went into their hash) are left out: the router
    would match them against unsalted requests, which can never hit them.
    """
    wire: list[list] = []
    last: dict[str, list] = {}  # each medium's latest wire event
    for ev in events:
        medium = wire_medium(ev.medium)
        prev = last.get(medium)
        if isinstance(ev, BlockStored):
            if ev.salted:
                continue
            h = block_id(ev.block_hash)
            parent = None if ev.parent_hash is None else block_id(ev.parent_hash)
            if (prev is not None and prev[0] == "BlockStored" and parent == prev[1][-1]
                    and prev[5] == ev.lora_id):
                prev[1].append(h)
                prev[3].extend(ev.token_ids)
                continue
            last[medium] = ["BlockStored", [h], parent, list(ev.token_ids), block_size,
                            ev.lora_id, medium]
        else:
            h = block_id(ev.block_hash)
            if prev is not None and prev[0] == "BlockRemoved":
                prev[1].append(h)
                continue
            last[medium] = ["BlockRemoved", [h], medium]
        wire.append(last[medium])
    return wire


class ZmqEventPublisher:
    """Publishes kvflow KV events on an XPUB socket bound to a loopback port, from a thread of
    its own: :meth:`put` is all the engine loop does (no socket call on its thread).

    It keeps the (medium, block) pairs the router was told are stored, so that a removal of a
    block it never saw in that medium (a salted one, one an earlier process held) is not sent.
    Any thread may :meth:`put` (the engine loop, the KV tiers' stores).
    """

    def __init__(self, block_size: int, host: str = "127.0.0.1", topic: str = "") -> None:
        self.block_size = block_size
        self.topic = topic.encode()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.SNDHWM, 0)  # never drop an event for a slow relay
        self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{host}:{self.port}"
        self._queue: queue.SimpleQueue[list[KVEvent] | None] = queue.SimpleQueue()
        self._seq = 0
        self._subscribed = False
        self._held: list[list[KVEvent]] = []
        self._stored: set[tuple[str, int]] = set()
        self._encoder = msgspec.msgpack.Encoder()
        self._thread = threading.Thread(target=self._run, name="kvflow-kv-events", daemon=True)
        self._thread.start()

    def put(self, events: list[KVEvent]) -> None:
        """Hand over events (from any thread; one call's events are published together)."""
        if events:
            self._queue.put(events)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5.0)
        if not self._thread.is_alive():  # never pull the socket from under its thread
            self._sock.close()
            self._ctx.term()

    def _send(self, wire: list[list]) -> None:
        if not wire:
            return
        payload = self._encoder.encode([time.time(), wire, 0])
        self._sock.send_multipart([self.topic, self._seq.to_bytes(8, "big"), payload])
        self._seq += 1

    def _publish(self, events: list[KVEvent]) -> None:
        wire = []
        for ev in encode_events(events, self.block_size):
            medium = ev[-1]
            if ev[0] == "BlockStored":
                if (medium == POOL_WIRE_MEDIUM and ev[2] is not None
                        and (medium, ev[2]) not in self._stored):
                    # Its parent was evicted (a duplicate block kept the prefix computed):
                    # the router's pool tree would refuse a child of a block it no longer
                    # has. A lower tier's index takes a block whatever holds its parent.
                    continue
                self._stored.update((medium, h) for h in ev[1])
            elif ev[0] == "BlockRemoved":
                ev[1] = [h for h in ev[1] if (medium, h) in self._stored]
                self._stored.difference_update((medium, h) for h in ev[1])
                if not ev[1]:
                    continue
            wire.append(ev)
        self._send(wire)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while True:
            try:
                if self._step(poller):
                    return
            except Exception:  # noqa: BLE001  (a bad batch must not end the publishing)
                log.exception("publishing KV events failed; the router's view of this "
                              "worker may miss blocks until they are stored again")

    def _step(self, poller: zmq.Poller) -> bool:
        """One round: subscriptions, then the queued events. True once closed."""
        if dict(poller.poll(timeout=10)).get(self._sock):
            msg = self._sock.recv()
            if msg[:1] == b"\x01" and not self._subscribed:  # the relay subscribed
                self._subscribed = True
                self._stored.clear()
                self._send([["AllBlocksCleared"]])
                for held in self._held:
                    self._publish(held)
                self._held.clear()
            elif msg[:1] == b"\x00":  # it left: the next one starts from a cleared view
                self._subscribed = False
        while True:
            try:
                events = self._queue.get_nowait()
            except queue.Empty:
                return False
            if events is None:
                return True
            if self._subscribed:
                self._publish(events)
            else:
                self._held.append(events)
                if len(self._held) > MAX_HELD_BATCHES:  # nobody listens: keep the latest
                    del self._held[0]
