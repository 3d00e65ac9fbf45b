"""``/v1/responses``' store: the responses created with ``store`` true, kept so that
``previous_response_id`` continues their conversation and ``GET``/``DELETE
/v1/responses/{id}`` find them.

One SQLite database, in memory (``:memory:``, the default) or in a file
(``--responses-store PATH``, which survives a restart): the same code either way. Each entry
belongs to a namespace (the hash of the API key that created it,
:meth:`~kvflow.openai_api.security.KeyGuard.namespace`): a lookup under another namespace
finds nothing. The store is bounded by a count and by bytes (every namespace's entries
together): past either, the least recently used entries (read or written) are evicted, and
counted (:attr:`ResponseStore.evictions`, in ``/metrics``). Pure Python (``sqlite3``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from typing import Any

_SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    namespace TEXT NOT NULL,
    id TEXT NOT NULL,
    record TEXT NOT NULL,
    bytes INTEGER NOT NULL,
    used INTEGER NOT NULL,
    PRIMARY KEY (namespace, id)
);
CREATE INDEX IF NOT EXISTS responses_used ON responses (used);
"""


class ResponseStore:
    """Stored response records (JSON objects) by (namespace, id), LRU-bounded by
    ``max_count`` entries and ``max_bytes`` of JSON. Thread-safe: the routes call it from the
    worker threads."""

    def __init__(self, path: str, max_count: int, max_bytes: int) -> None:
        self.path, self.max_count, self.max_bytes = path, max_count, max_bytes
        self.evictions = 0  # since this process started
        self._lock = threading.Lock()
        # NOTE: one connection for every thread, serialized by the lock (an in-memory
        # database exists only within its connection).
        self._db = sqlite3.connect(path, check_same_thread=False, isolation_level=None)
        self._db.executescript(_SCHEMA)
        row = self._db.execute("SELECT COALESCE(MAX(used), 0) FROM responses").fetchone()
        self._clock = int(row[0])

    def put(self, namespace: str, response_id: str, record: dict[str, Any]) -> None:
        """Keep ``record`` (its JSON) under ``response_id``, evicting the least recently used
        entries past the bounds. A record larger than ``max_bytes`` alone is not kept."""
        text = json.dumps(record, ensure_ascii=False, separators=(",", ":"))
        size = len(text.encode("utf-8", "surrogatepass"))
        with self._lock:
            if size > self.max_bytes:
                self.evictions += 1
                return
            self._clock += 1
            self._db.execute("INSERT OR REPLACE INTO responses VALUES (?, ?, ?, ?, ?)",
                             (namespace, response_id, text, size, self._clock))
            self._evict()

    def get(self, namespace: str, response_id: str) -> dict[str, Any] | None:
        """The record stored under ``response_id`` by ``namespace``'s key (None: none, or
        another key's); a read makes it the most recently used."""
        with self._lock:
            row = self._db.execute("SELECT record FROM responses WHERE namespace = ? AND id = ?",
                                   (namespace, response_id)).fetchone()
            if row is None:
                return None
            self._clock += 1
            self._db.execute("UPDATE responses SET used = ? WHERE namespace = ? AND id = ?",
                             (self._clock, namespace, response_id))
        record: dict[str, Any] = json.loads(row[0])
        return record

    def delete(self, namespace: str, response_id: str) -> bool:
        """Forget ``response_id`` (False: ``namespace`` holds no such response)."""
        with self._lock:
            cursor = self._db.execute("DELETE FROM responses WHERE namespace = ? AND id = ?",
                                      (namespace, response_id))
            return cursor.rowcount > 0

    def totals(self) -> tuple[int, int]:
        """(entries, bytes) held now."""
        with self._lock:
            count, size = self._db.execute(
                "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses").fetchone()
        return int(count), int(size)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _evict(self) -> None:
        """Drop the least recently used entries until both bounds hold (under the lock)."""
        count, size = self._db.execute(
            "SELECT COUNT(*), COALESCE(SUM(bytes), 0) FROM responses").fetchone()
        if count <= self.max_count and size <= self.max_bytes:
            return
        doomed = []
        for namespace, response_id, nbytes in self._db.execute(
                "SELECT namespace, id, bytes FROM responses ORDER BY used"):
            if count <= self.max_count and size <= self.max_bytes:
                break
            doomed.append((namespace, response_id))
            count, size = count - 1, size - nbytes
        self._db.executemany("DELETE FROM responses WHERE namespace = ? AND id = ?", doomed)
        self.evictions += len(doomed)
