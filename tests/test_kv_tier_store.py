"""The secondary KV tiers' stores, by example: LRU by bytes, a disk tier that survives a restart,
corrupt files dropped and counted, private files named by hash (the property test of the LRU
budget is tests/test_kv_tier_store_lru.py)."""

from __future__ import annotations

import array
import hashlib
import os
import re
import shutil
import stat
import threading
from pathlib import Path

import pytest

from kvflow.kv_manager.tier_disk import HEADER, DiskBlockStore
from kvflow.kv_manager.tier_store import (
    TIER_MEDIA,
    BlockStore,
    HostBlockStore,
    TierStats,
    tier_namespace,
)

NS = tier_namespace({"model": "m1", "build": "b1", "kv_dtype": "float32", "block_size": "16"})


def block_hash(i: int) -> bytes:
    return hashlib.sha256(f"block {i}".encode()).digest()


def payload(i: int, nbytes: int = 100) -> bytes:
    """A payload that names its block, so that a swapped one cannot pass for another."""
    seed = block_hash(i)
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def make_disk(tmp_path: Path, capacity_bytes: int = 10_000, namespace: bytes = NS,
              ) -> DiskBlockStore:
    return DiskBlockStore(tmp_path / "kv", capacity_bytes, namespace)


def block_files(store: DiskBlockStore) -> dict[bytes, int]:
    """The block files in the store's namespace folder: hash -> size."""
    return {bytes.fromhex(p.stem): p.stat().st_size for p in store.folder.glob("*/*.kvb")}


def test_media_are_named_as_in_the_kv_events():
    assert TIER_MEDIA == ("cpu", "disk")
    assert HostBlockStore.medium == "cpu" and DiskBlockStore.medium == "disk"


@pytest.mark.parametrize("capacity, message", [
    (0, "kv_offload_bytes must be > 0"), (-5, "kv_offload_bytes must be > 0"),
    (True, "kv_offload_bytes must be an integer"), (1.5, "kv_offload_bytes must be an integer"),
])
def test_host_capacity_is_refused_naming_the_option(capacity, message):
    with pytest.raises(ValueError, match=message):
        HostBlockStore(capacity)


def test_disk_capacity_and_namespace_are_refused_by_name(tmp_path):
    with pytest.raises(ValueError, match="kv_disk_bytes must be > 0"):
        make_disk(tmp_path, 0)
    with pytest.raises(ValueError, match="namespace must be 1 to 64 bytes"):
        make_disk(tmp_path, namespace=b"")
    assert not (tmp_path / "kv").exists()  # refused before anything is created


def make_store(medium: str, tmp_path: Path, capacity_bytes: int) -> BlockStore:
    if medium == "cpu":
        return HostBlockStore(capacity_bytes)
    return make_disk(tmp_path, capacity_bytes)


def file_overhead(medium: str) -> int:
    """What a block costs beyond its payload: the disk tier counts its file's header."""
    return 0 if medium == "cpu" else HEADER.size + len(NS) + 32


@pytest.mark.parametrize("medium", TIER_MEDIA)
def test_lru_by_bytes_and_get_makes_newest(tmp_path, medium):
    size = 300 + file_overhead(medium)
    store = make_store(medium, tmp_path, 3 * size + size // 2)
    evicted: list[bytes] = []
    store.on_evict = evicted.append
    assert store.block_bytes(block_hash(0), 300) == size
    for i in range(3):
        assert store.put(block_hash(i), payload(i, 300))
    assert store.get(block_hash(0)) == payload(0, 300)  # 0 is now the newest
    assert store.put(block_hash(3), payload(3, 300))
    assert evicted == [block_hash(1)]
    assert store.hashes() == [block_hash(2), block_hash(0), block_hash(3)]
    assert store.get(block_hash(1)) is None
    assert store.stats == TierStats(hits=1, misses=1, stores=4, evictions=1, corrupt=0,
                                    bytes=3 * size, blocks=3,
                                    load_s=store.stats.load_s, store_s=store.stats.store_s)
    # A block twice as large evicts the two oldest.
    assert store.put(block_hash(4), payload(4, 2 * size - file_overhead(medium)))
    assert evicted == [block_hash(1), block_hash(2), block_hash(0)]
    assert store.stats.bytes == 3 * size <= store.capacity_bytes


@pytest.mark.parametrize("medium", TIER_MEDIA)
def test_a_block_larger_than_the_budget_is_refused_and_evicts_nothing(tmp_path, medium):
    store = make_store(medium, tmp_path, 500)
    assert store.put(block_hash(0), payload(0, 100))
    assert not store.put(block_hash(1), payload(1, 501 - file_overhead(medium)))
    assert store.hashes() == [block_hash(0)] and store.stats.evictions == 0


@pytest.mark.parametrize("medium", TIER_MEDIA)
def test_payload_by_its_bytes_copied_and_discard_tells_on_evict(tmp_path, medium):
    store = make_store(medium, tmp_path, 10_000)
    floats = array.array("f", [1.5, -2.0, 3.25])  # items of 4 bytes: stored as 12 bytes
    staging = bytearray(b"abcdef")
    assert store.put(block_hash(0), memoryview(floats))
    assert store.put(block_hash(1), memoryview(staging))
    staging[:] = b"zzzzzz"  # the caller reuses its buffer
    assert store.get(block_hash(0)) == floats.tobytes()
    assert store.get(block_hash(1)) == b"abcdef"
    told: list[bytes] = []
    store.on_evict = told.append
    store.discard(block_hash(0))
    store.discard(block_hash(5))  # not held: nothing to tell
    assert told == [block_hash(0)] and not store.contains(block_hash(0))
    with pytest.raises(ValueError, match="block_hash must be 1 to 64 bytes"):
        store.put(b"", b"x")
    store.close()
    store.close()
    with pytest.raises(RuntimeError, match="tier store is closed"):
        store.get(block_hash(1))


def test_disk_tier_survives_a_restart_in_lru_order_and_only_in_its_namespace(tmp_path):
    store = make_disk(tmp_path)
    for i in range(4):
        assert store.put(block_hash(i), payload(i))
    assert store.get(block_hash(1)) == payload(1)
    order = store.hashes()
    store.close()

    again = make_disk(tmp_path)
    assert again.hashes() == order == [block_hash(i) for i in (0, 2, 3, 1)]
    assert again.stats.blocks == 4 and again.stats.bytes == sum(block_files(again).values())
    assert all(again.get(block_hash(i)) == payload(i) for i in range(4))

    other_ns = tier_namespace({"model": "m1", "build": "b2", "kv_dtype": "float32",
                               "block_size": "16"})
    other = make_disk(tmp_path, namespace=other_ns)
    assert other.hashes() == [] and other.get(block_hash(0)) is None
    assert other.stats.corrupt == 0 and len(block_files(again)) == 4


def test_a_smaller_budget_after_a_restart_drops_the_oldest(tmp_path):
    store = make_disk(tmp_path)
    for i in range(4):
        store.put(block_hash(i), payload(i))
    small = make_disk(tmp_path, capacity_bytes=2 * store.block_bytes(block_hash(0), 100))
    assert small.hashes() == [block_hash(2), block_hash(3)]
    assert set(block_files(small)) == {block_hash(2), block_hash(3)}


def flip_payload_byte(path: Path, store: DiskBlockStore) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated": lambda path, store: path.write_bytes(path.read_bytes()[:-10]),
    "truncated_header": lambda path, store: path.write_bytes(path.read_bytes()[:20]),
    "empty": lambda path, store: path.write_bytes(b""),
    "flipped_payload": flip_payload_byte,
    "wrong_magic": lambda path, store: path.write_bytes(b"X" + path.read_bytes()[1:]),
    "wrong_version": lambda path, store: path.write_bytes(
        path.read_bytes()[:8] + b"\x63\x00" + path.read_bytes()[10:]),
    "another_blocks_file": lambda path, store: shutil.copyfile(store.path(block_hash(1)), path),
    "longer": lambda path, store: path.write_bytes(path.read_bytes() + b"extra"),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_a_corrupt_file_is_dropped_counted_and_never_returned(tmp_path, kind):
    store = make_disk(tmp_path)
    store.put(block_hash(0), payload(0))
    store.put(block_hash(1), payload(1))
    told: list[bytes] = []
    store.close()
    store = make_disk(tmp_path)  # also across a restart: the scan reads no file's bytes
    store.on_evict = told.append
    path = store.path(block_hash(0))
    CORRUPTIONS[kind](path, store)
    assert store.contains(block_hash(0))
    assert store.get(block_hash(0)) is None
    assert store.stats.corrupt == 1 and store.stats.misses == 1 and told == [block_hash(0)]
    assert not path.exists() and store.hashes() == [block_hash(1)]
    assert store.stats.bytes == sum(block_files(store).values())
    assert store.get(block_hash(1)) == payload(1)  # its neighbour is untouched


def test_another_namespaces_file_under_our_name_is_corrupt(tmp_path):
    mine, theirs = make_disk(tmp_path), make_disk(tmp_path, namespace=b"another namespace")
    theirs.put(block_hash(0), payload(0))
    mine.put(block_hash(0), payload(0))
    shutil.copyfile(theirs.path(block_hash(0)), mine.path(block_hash(0)))
    assert mine.get(block_hash(0)) is None and mine.stats.corrupt == 1
    assert theirs.get(block_hash(0)) == payload(0)


def test_a_missing_file_is_a_miss_not_corruption(tmp_path):
    store = make_disk(tmp_path)
    store.put(block_hash(0), payload(0))
    store.path(block_hash(0)).unlink()
    assert store.get(block_hash(0)) is None
    assert store.stats.corrupt == 0 and store.hashes() == [] and store.stats.bytes == 0


def test_a_crash_mid_write_leaves_no_readable_block(tmp_path):
    store = make_disk(tmp_path)
    store.put(block_hash(0), payload(0))
    full = store.path(block_hash(0)).read_bytes()
    # What a process killed mid-write leaves: a temp file beside the finished ones.
    temp = store.path(block_hash(1)).parent / f".{block_hash(1).hex()}.999.0.tmp"
    temp.parent.mkdir(mode=0o700, exist_ok=True)
    temp.write_bytes(full[: len(full) // 2])
    again = make_disk(tmp_path)
    assert again.hashes() == [block_hash(0)] and not temp.exists()


def test_files_are_private_and_named_by_hash_only(tmp_path):
    old_umask = os.umask(0)  # the modes must not depend on the umask
    try:
        store = make_disk(tmp_path)
        for i in range(20):
            store.put(block_hash(i), payload(i))
    finally:
        os.umask(old_umask)
    folders = [store.directory, store.folder, *store.folder.iterdir()]
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o700 for p in folders)
    assert store.folder.name == NS.hex()[:32]
    files = [p for p in store.folder.rglob("*") if p.is_file()]
    assert len(files) == 20
    for p in files:
        assert stat.S_IMODE(p.stat().st_mode) == 0o600
        assert re.fullmatch(r"[0-9a-f]{64}\.kvb", p.name) and p.parent.name == p.name[:2]


def test_an_existing_directory_is_made_private_and_a_strangers_is_refused(tmp_path):
    loose = tmp_path / "loose"
    loose.mkdir(mode=0o755)
    os.chmod(loose, 0o755)
    DiskBlockStore(loose, 1000, NS)
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700

    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(ValueError, match="kv_disk_dir .* is not a directory"):
        DiskBlockStore(not_a_dir, 1000, NS)

    if os.getuid() == 0:
        strangers = tmp_path / "strangers"
        strangers.mkdir(mode=0o755)
        os.chown(strangers, 65534, 65534)
    else:
        strangers = Path("/")
    with pytest.raises(ValueError, match="kv_disk_dir .* belongs to uid .* refused"):
        DiskBlockStore(strangers, 1000, NS)
    assert stat.S_IMODE(strangers.stat().st_mode) == 0o755


def test_tier_namespace_names_every_part():
    parts = {"model": "sha256:ab", "build": "1", "kv_dtype": "float16", "layout": "nhd"}
    ns = tier_namespace(parts)
    assert len(ns) == 32 and ns == tier_namespace(dict(reversed(list(parts.items()))))
    for key in parts:
        assert tier_namespace({**parts, key: parts[key] + "x"}) != ns
    assert tier_namespace({"a": "b=c"}) != tier_namespace({"a=b": "c"})
    with pytest.raises(ValueError, match="at least one part"):
        tier_namespace({})
    with pytest.raises(ValueError, match="str keys to str values"):
        tier_namespace({"block_size": 16})  # type: ignore[dict-item]


@pytest.mark.parametrize("medium", TIER_MEDIA)
def test_put_and_get_from_two_threads_keep_the_store_whole(tmp_path, medium):
    store = make_store(medium, tmp_path, 5_000)
    wrong: list[int] = []

    def writer() -> None:
        for i in range(300):
            store.put(block_hash(i % 40), payload(i % 40, 200 + (i % 40) * 10))

    def reader() -> None:
        for i in range(300):
            got = store.get(block_hash(i % 40))
            if got is not None and got != payload(i % 40, 200 + (i % 40) * 10):
                wrong.append(i)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and store.stats.corrupt == 0
    assert store.stats.bytes <= store.capacity_bytes
    assert store.stats.blocks == len(store.hashes())
    if isinstance(store, DiskBlockStore):
        files = block_files(store)
        assert set(files) == set(store.hashes()) and sum(files.values()) == store.stats.bytes


def test_a_write_the_disk_refuses_is_not_stored(tmp_path):
    store = make_disk(tmp_path)
    blocker = store.path(block_hash(0)).parent
    blocker.write_text("not a folder")  # what a full or broken disk looks like to os.open
    assert not store.put(block_hash(0), payload(0))
    assert store.hashes() == [] and store.stats.bytes == 0 and store.stats.stores == 0
    assert store.put(block_hash(1), payload(1)) and store.get(block_hash(1)) == payload(1)
