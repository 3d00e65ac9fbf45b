"""The disk tier: one checked file per block, under a private directory, across restarts.
Pure Python.

Layout: ``<directory>/<namespace.hex()[:32]>/<xx>/<block hash hex>.kvb``, ``xx`` the hash's
first byte (so no folder holds more than a 256th of the blocks). File names come from the
block hash alone, never from client input. The directory and its folders are mode 0700, the
files 0600: KV bytes reveal the prompts they came from.

A file is a header (magic, format version, the lengths of the namespace, hash, metadata and
payload, the SHA-256 of metadata and payload), the namespace, the block hash, the metadata, then
the payload. The metadata is the block's KV event (:func:`encode_meta`: parent hash, token ids,
salt flag, LoRA id), empty when the writer recorded no events; with it a restarted Dynamo worker
announces what its disk tier holds (``record_events`` reads every header, not the payloads).
Format 1 had no metadata: the version field sits where it always did, so an old file is
dropped and counted (in ``stats.corrupt``) when read, never misread. It is written to a temp
file and moved into place with ``os.replace``, so its name never points at a half-written
block: a crash leaves at worst a temp file, removed on the next open. There is no fsync: after
a power loss a file may hold anything, and the check on ``get`` catches it like any other
corruption (truncated, flipped bytes, a wrong header, namespace or hash): the file is deleted,
counted in ``stats.corrupt``, and never returned.

Opening a store scans its namespace folder's names and sizes (no file is read) to rebuild the
index, least recently used first by mtime: each store and each hit sets a file's mtime from a
strictly increasing clock, so the LRU order survives a restart. One process per directory and
namespace at a time: opening deletes temp files, which could be another live writer's.
Namespaces share a folder only if their first 16 bytes agree (never for tier_namespace's
digests); even then a file's full namespace is checked, and a stranger's is never served.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import os
import stat
import struct
import time
from array import array
from pathlib import Path
from typing import Any

from kvflow.kv_manager.block_pool import BlockStored
from kvflow.kv_manager.tier_store import MAX_HASH_BYTES, BlockStore, logger

MAGIC = b"KVFTIER\x00"
FORMAT_VERSION = 2
# magic, format version, namespace length, hash length, metadata length, payload length,
# SHA-256 of metadata and payload
HEADER = struct.Struct("<8sHHHIQ32s")
# The metadata's head: flags (1: has a parent, 2: salted, 4: has a LoRA id), parent hash
# length, LoRA id, token count; then the parent hash and the token ids (int64 each).
META = struct.Struct("<BBqI")
SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
_temp_ids = itertools.count()


class CorruptBlockFile(ValueError):
    """A block file's bytes are not a block of this store (the message says what is wrong)."""


def torn(head: bytes) -> CorruptBlockFile:
    return CorruptBlockFile(f"{len(head)} bytes, shorter than its header (torn)")


def encode_meta(meta: BlockStored | None) -> bytes:
    """A block's KV event as the disk tier keeps it beside the payload (empty for None)."""
    if meta is None:
        return b""
    parent = meta.parent_hash or b""
    flags = ((meta.parent_hash is not None) | (meta.salted << 1)
             | ((meta.lora_id is not None) << 2))
    return (META.pack(flags, len(parent), meta.lora_id or 0, len(meta.token_ids)) + parent
            + array("q", meta.token_ids).tobytes())


def meta_size(meta: BlockStored | None) -> int:
    """``len(encode_meta(meta))`` without encoding it."""
    if meta is None:
        return 0
    return META.size + len(meta.parent_hash or b"") + 8 * len(meta.token_ids)


def decode_meta(data: bytes, block_hash: bytes, medium: str) -> BlockStored:
    """The BlockStored (of ``medium``) that :func:`encode_meta` wrote for ``block_hash``;
    CorruptBlockFile when ``data`` is not such an encoding."""
    if len(data) < META.size:
        raise CorruptBlockFile(f"metadata of {len(data)} bytes, shorter than its head")
    flags, parent_len, lora_id, num_tokens = META.unpack_from(data)
    if flags & ~7 or (not flags & 1 and parent_len):
        raise CorruptBlockFile(f"metadata flags {flags:#x} with a parent of {parent_len} bytes")
    if len(data) != META.size + parent_len + 8 * num_tokens:
        raise CorruptBlockFile(f"metadata of {len(data)} bytes, its head says "
                               f"{META.size + parent_len + 8 * num_tokens}")
    parent = data[META.size:META.size + parent_len] if flags & 1 else None
    tokens = array("q")
    tokens.frombytes(data[META.size + parent_len:])
    return BlockStored(block_hash, parent, tuple(tokens), bool(flags & 2),
                       lora_id if flags & 4 else None, medium)


def ensure_private_dir(path: Path, field: str) -> None:
    """Create ``path`` with mode 0700, or make an existing one of ours 0700; refuse a path
    that is not a directory or that another user owns (naming ``field``)."""
    try:
        os.makedirs(path, mode=0o700, exist_ok=True)
    except FileExistsError:
        raise ValueError(f"{field} {str(path)!r} exists and is not a directory") from None
    except OSError as e:
        raise ValueError(f"{field} {str(path)!r} cannot be created: {e.strerror}") from None
    st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise ValueError(f"{field} {str(path)!r} exists and is not a directory")
    if st.st_uid != os.getuid():
        raise ValueError(f"{field} {str(path)!r} belongs to uid {st.st_uid}, not to this "
                         f"process's uid {os.getuid()}: refused, the KV would not be private")
    # makedirs's mode is filtered by the umask, and an existing folder keeps its own: set it.
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(path, 0o700)


class DiskBlockStore(BlockStore):
    """The disk tier (medium ``"disk"``): block files under ``directory`` in ``namespace``'s
    folder, at most ``capacity_bytes`` (``kv_disk_bytes``) of files, headers included. A new
    store on the same directory and namespace finds the blocks an earlier process left;
    another namespace never sees them. See the module docstring for the layout."""

    medium = "disk"

    def __init__(self, directory: str | os.PathLike[str], capacity_bytes: int,
                 namespace: bytes) -> None:
        super().__init__(capacity_bytes, "kv_disk_bytes")
        if not isinstance(namespace, bytes) or not 1 <= len(namespace) <= MAX_HASH_BYTES:
            raise ValueError(f"namespace must be 1 to {MAX_HASH_BYTES} bytes "
                             f"(tier_namespace's digest), got {namespace!r}")
        self.namespace = namespace
        self.directory = Path(directory)
        ensure_private_dir(self.directory, "kv_disk_dir")
        self.folder = self.directory / namespace.hex()[:32]
        ensure_private_dir(self.folder, "kv_disk_dir")
        self._subdirs: set[str] = set()
        self._last_mtime_ns = 0
        self._scan()

    def path(self, block_hash: bytes) -> Path:
        """The file that holds (or would hold) ``block_hash``."""
        name = block_hash.hex()
        return self.folder / name[:2] / (name + SUFFIX)

    def block_bytes(self, block_hash: bytes, payload_bytes: int) -> int:
        return HEADER.size + len(self.namespace) + len(block_hash) + payload_bytes

    def _meta_bytes(self, meta: BlockStored | None) -> int:
        return meta_size(meta)

    def _scan(self) -> None:
        found: list[tuple[int, str, bytes, int]] = []
        for sub in os.scandir(self.folder):
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            ensure_private_dir(Path(sub.path), "kv_disk_dir")
            self._subdirs.add(sub.name)
            for entry in os.scandir(sub.path):
                block_hash = self._hash_of(sub.name, entry)
                if block_hash is not None:
                    st = entry.stat(follow_symlinks=False)
                    found.append((st.st_mtime_ns, entry.name, block_hash, st.st_size))
        for mtime_ns, _, block_hash, size in sorted(found):
            self._index[block_hash] = size
            self.stats.bytes += size
            self.stats.blocks += 1
            self._last_mtime_ns = max(self._last_mtime_ns, mtime_ns)
        # A smaller budget than the last process's: the oldest blocks go.
        while self.stats.bytes > self.capacity_bytes:
            self._drop_oldest()

    def _hash_of(self, subdir: str, entry: os.DirEntry[str]) -> bytes | None:
        """The block hash a folder entry holds, or None for anything else (a crash's temp
        file is removed; a name that is not ours is left alone)."""
        name = entry.name
        if name.endswith(TEMP_SUFFIX) and entry.is_file(follow_symlinks=False):
            remove(entry.path)
            return None
        if not name.endswith(SUFFIX) or not entry.is_file(follow_symlinks=False):
            return None
        hex_name = name[:-len(SUFFIX)]
        try:
            block_hash = bytes.fromhex(hex_name)
        except ValueError:
            return None
        ok = (1 <= len(block_hash) <= MAX_HASH_BYTES and block_hash.hex() == hex_name
              and hex_name[:2] == subdir)
        return block_hash if ok else None

    def _next_mtime_ns(self) -> int:
        # Strictly increasing even when the clock's step is coarser than the calls or goes back.
        self._last_mtime_ns = max(time.time_ns(), self._last_mtime_ns + 1)
        return self._last_mtime_ns

    def _header(self, block_hash: bytes, meta: bytes, payload: memoryview) -> bytes:
        digest = hashlib.sha256(meta)
        digest.update(payload)
        return (HEADER.pack(MAGIC, FORMAT_VERSION, len(self.namespace), len(block_hash),
                            len(meta), payload.nbytes, digest.digest())
                + self.namespace + block_hash + meta)

    def _write(self, block_hash: bytes, payload: memoryview, meta: BlockStored | None) -> None:
        path = self.path(block_hash)
        subdir = path.parent.name
        if subdir not in self._subdirs:
            # OSError, not ensure_private_dir's ValueError: a full disk makes put() say False.
            with contextlib.suppress(FileExistsError):
                os.mkdir(path.parent, 0o700)
            os.chmod(path.parent, 0o700)
            self._subdirs.add(subdir)
        header = self._header(block_hash, encode_meta(meta), payload)
        temp = path.with_name(f".{path.stem}.{os.getpid()}.{next(_temp_ids)}{TEMP_SUFFIX}")
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(header)
                f.write(payload)
                f.flush()
                mtime_ns = self._next_mtime_ns()
                os.utime(f.fileno(), ns=(mtime_ns, mtime_ns))
            os.replace(temp, path)
        except BaseException:
            remove(temp)
            raise

    def _read(self, block_hash: bytes) -> bytes | None:
        path = self.path(block_hash)
        try:
            with open(path, "rb") as f:
                meta_len, payload_len, digest = self._read_head(block_hash, f)
                meta = f.read(meta_len)
                payload = f.read()
                if len(meta) + len(payload) != meta_len + payload_len:
                    raise CorruptBlockFile(f"{len(meta) + len(payload)} bytes after the "
                                           f"header, it says {meta_len + payload_len} (torn)")
                check = hashlib.sha256(meta)
                check.update(payload)
                if check.digest() != digest:
                    raise CorruptBlockFile("metadata and payload fail their SHA-256")
                mtime_ns = self._next_mtime_ns()
                os.utime(f.fileno(), ns=(mtime_ns, mtime_ns))
                return payload
        except FileNotFoundError:
            logger.warning("kv disk tier: block file %s is gone", path)
            return None
        except CorruptBlockFile as e:
            problem = str(e)
        except OSError as e:
            problem = f"unreadable ({e.strerror})"
        self._count_corrupt(path, problem)
        return None

    def _count_corrupt(self, path: Path, problem: str) -> None:
        self.stats.corrupt += 1
        logger.warning("kv disk tier: dropped corrupt block file %s: %s", path, problem)

    def _read_head(self, block_hash: bytes, f: Any) -> tuple[int, int, bytes]:
        """Read a block file's header from ``f``: its metadata and payload lengths and its
        digest; CorruptBlockFile unless it is this store's header for ``block_hash``."""
        head = f.read(HEADER.size + len(self.namespace) + len(block_hash))
        if len(head) < HEADER.size:
            raise torn(head)
        magic, version, ns_len, hash_len, meta_len, payload_len, digest = \
            HEADER.unpack_from(head)
        if magic != MAGIC:
            raise CorruptBlockFile("not a kvflow block file (magic)")
        if version != FORMAT_VERSION:
            # NOTE: before the length check: a format 1 header is shorter.
            raise CorruptBlockFile(f"format version {version}, this kvflow reads "
                                   f"{FORMAT_VERSION}")
        if len(head) < HEADER.size + len(self.namespace) + len(block_hash):
            raise torn(head)
        ns = head[HEADER.size:HEADER.size + ns_len]
        if ns_len != len(self.namespace) or ns != self.namespace:
            raise CorruptBlockFile("another namespace's block")
        if hash_len != len(block_hash) or head[HEADER.size + ns_len:] != block_hash:
            raise CorruptBlockFile("another block's hash")
        return meta_len, payload_len, digest

    def _read_meta(self, block_hash: bytes) -> BlockStored | None:
        """The metadata in ``block_hash``'s file (its header and metadata only: the payload's
        check waits for a ``get``); None when written without. Raises CorruptBlockFile or
        OSError."""
        with open(self.path(block_hash), "rb") as f:
            meta_len, _, _ = self._read_head(block_hash, f)
            data = f.read(meta_len)
        if len(data) != meta_len:
            raise CorruptBlockFile(f"metadata of {len(data)} bytes, the header says "
                                   f"{meta_len} (torn)")
        return decode_meta(data, block_hash, self.medium) if meta_len else None

    def _meta(self, block_hash: bytes) -> BlockStored | None:
        try:
            return self._read_meta(block_hash)
        except (OSError, CorruptBlockFile):
            return None  # the next get drops and counts it

    def _announce(self, dropped: list[bytes]) -> list[BlockStored]:
        held = []
        for block_hash in list(self._index):
            try:
                meta = self._read_meta(block_hash)
            except FileNotFoundError:
                logger.warning("kv disk tier: block file %s is gone", self.path(block_hash))
            except (OSError, CorruptBlockFile) as e:
                problem = e.strerror if isinstance(e, OSError) else str(e)
                self._count_corrupt(self.path(block_hash), problem or repr(e))
            else:
                if meta is not None:
                    held.append(meta)
                continue
            self._forget(block_hash)
            dropped.append(block_hash)
        return held

    def _delete(self, block_hash: bytes) -> None:
        remove(self.path(block_hash))

    def _touch(self, block_hash: bytes) -> None:
        mtime_ns = self._next_mtime_ns()
        # A file gone from under us: the next get finds it missing and drops it.
        with contextlib.suppress(FileNotFoundError):
            os.utime(self.path(block_hash), ns=(mtime_ns, mtime_ns))

    def _close(self) -> None:
        pass  # every block is complete in its file; the next process rescans the folder


def remove(path: str | os.PathLike[str]) -> None:
    """Delete a file if it is there; a failure is logged, not raised, since the index has
    already let the block go."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as e:
        logger.warning("kv disk tier: cannot delete %s: %s", path, e.strerror)
