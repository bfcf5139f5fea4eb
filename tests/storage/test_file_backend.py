"""The file backend on real directories (and a real 1 MiB tmpfs for the disk-full case)."""

from __future__ import annotations

import logging
import os
import struct
import subprocess
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fastdeploy_kvcache.storage import Status, StorageError
from fastdeploy_kvcache.storage import file_backend
from fastdeploy_kvcache.storage.executor import BoundedExecutor
from fastdeploy_kvcache.storage.file_backend import FileBackend
from fastdeploy_kvcache.storage.file_format import HEADER

from .conftest import READERS, HostArena, use_reader

NS = "fdkv1-test-0123456789abcdef-tp0of1"


def key(i: int) -> str:
    return f"{NS}:{i:032x}"


def make(path: Path, arena: HostArena, **kw) -> FileBackend:
    kw.setdefault("min_free_bytes", 0)
    backend = FileBackend(path, **kw)
    backend.register_buffer(arena.ptr, arena.nbytes)
    return backend


def put(backend: FileBackend, arena: HostArena, ids: list[int], slots: list[int]) -> list[int]:
    return backend.batch_put_from([key(i) for i in ids], [arena.slot_ptr(s) for s in slots], [arena.slot_bytes] * len(ids))


def get(backend: FileBackend, arena: HostArena, ids: list[int], slots: list[int]) -> list[int]:
    return backend.batch_get_into([key(i) for i in ids], [arena.slot_ptr(s) for s in slots], [arena.slot_bytes] * len(ids))


def test_put_get_exists_delete_roundtrip(tmp_path: Path, arena: HostArena) -> None:
    backend = make(tmp_path, arena)
    data = [arena.fill(i, seed=i) for i in range(4)]
    assert put(backend, arena, [0, 1, 2, 3], [0, 1, 2, 3]) == [Status.OK] * 4
    assert backend.batch_exists([key(0), key(1), key(2), key(3)]) == 4
    assert backend.batch_exists([key(0), key(9), key(2)]) == 1  # stops at the first miss
    assert backend.batch_exists([key(9), key(0)]) == 0
    assert get(backend, arena, [2, 0, 3, 1], [8, 9, 10, 11]) == [arena.slot_bytes] * 4
    for slot, i in zip([8, 9, 10, 11], [2, 0, 3, 1]):
        np.testing.assert_array_equal(arena.slot(slot), data[i])
    # numpy integers (block tables are often numpy arrays) are accepted as ptrs and sizes.
    assert backend.batch_get_into([key(3)], [np.int64(arena.slot_ptr(14))], [np.int64(arena.slot_bytes)]) == [arena.slot_bytes]
    assert backend.delete([key(1), key(7)]) == 1
    assert get(backend, arena, [0, 1], [12, 13]) == [arena.slot_bytes, Status.MISSING]
    stats = backend.stats()
    assert stats["write_bytes"] == 4 * arena.slot_bytes and stats["read_bytes"] == 6 * arena.slot_bytes
    assert stats["hits"] == 6 and stats["misses"] == 1 and stats["errors"]["missing"] == 0
    assert backend.used_bytes == 3 * (arena.slot_bytes + HEADER.size)
    backend.close()


def test_partial_batch_reports_each_key(tmp_path: Path, arena: HostArena) -> None:
    """A hit, a miss and a too-small buffer in one batch: one result per key."""
    backend = make(tmp_path, arena)
    arena.fill(0, seed=5)
    assert put(backend, arena, [0], [0]) == [Status.OK]
    results = backend.batch_get_into(
        [key(0), key(1)],
        [arena.slot_ptr(1), arena.slot_ptr(2)], [arena.slot_bytes, arena.slot_bytes],
    )
    assert results == [arena.slot_bytes, Status.MISSING]
    # Buffer smaller than the object: INVALID for that key, nothing written past it
    # (the 100 bytes it was given are unspecified after a failed get).
    arena.slot(3)[:] = 7
    small = backend.batch_get_into([key(0)], [arena.slot_ptr(3)], [100])
    assert small == [Status.INVALID]
    assert (arena.slot(3)[100:] == 7).all()
    assert backend.stats()["errors"]["invalid"] == 1
    backend.close()


def test_object_larger_than_the_buffer_is_deleted_so_a_put_rewrites_it(tmp_path: Path, arena: HostArena) -> None:
    """A key's objects all have one size; a larger one fails every read, so it goes."""
    backend = make(tmp_path, arena)
    lost: list[str] = []
    backend.set_loss_listener(lost.extend)
    arena.fill(0, seed=5)
    assert put(backend, arena, [0], [0]) == [Status.OK]
    assert backend.batch_get_into([key(0)], [arena.slot_ptr(3)], [100]) == [Status.INVALID]
    assert backend.batch_exists([key(0)]) == 0 and len(backend) == 0 and lost == [key(0)]
    assert put(backend, arena, [0], [0]) == [Status.OK]
    assert get(backend, arena, [0], [1]) == [arena.slot_bytes]
    backend.close()


@pytest.mark.parametrize("reader", READERS)
def test_directory_at_an_object_path_is_reported_once_and_skipped(
        tmp_path: Path, arena: HostArena, reader: str, caplog: pytest.LogCaptureFixture) -> None:
    backend = make(tmp_path, arena)
    use_reader(backend, reader)
    arena.fill(0, seed=5)
    arena.fill(1, seed=6)
    squat = tmp_path / (key(0).replace(":", "=") + ".kv")
    squat.mkdir()
    (squat / "inside").write_bytes(b"not ours")
    with caplog.at_level(logging.WARNING, logger="fastdeploy_kvcache.storage.file_backend"):
        for _ in range(5):
            assert put(backend, arena, [0, 1], [0, 1]) == [Status.IO, Status.OK]
            assert backend.batch_exists([key(0)]) == 0
            assert get(backend, arena, [0, 1], [2, 3]) == [Status.MISSING, arena.slot_bytes]
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "not a regular file" in lines[0], lines
    assert (squat / "inside").read_bytes() == b"not ours"  # not ours to delete
    # Gone: the key works again.
    (squat / "inside").unlink()
    squat.rmdir()
    assert put(backend, arena, [0], [0]) == [Status.OK]
    assert get(backend, arena, [0], [2]) == [arena.slot_bytes]
    backend.close()


def test_bad_input_raises_and_writes_nothing(tmp_path: Path, arena: HostArena) -> None:
    backend = make(tmp_path, arena)
    outside = np.zeros(1024, dtype=np.uint8)
    with pytest.raises(StorageError, match=r"ptrs\[0\].*not inside a registered buffer") as info:
        backend.batch_put_from([key(0)], [int(outside.ctypes.data)], [1024])
    assert info.value.kind == "invalid"
    with pytest.raises(StorageError, match=r"keys\[1\].*twice"):
        put(backend, arena, [3, 3], [0, 1])
    with pytest.raises(StorageError, match=r"keys\[0\]"):
        backend.batch_put_from(["bad/key"], [arena.ptr], [16])
    with pytest.raises(StorageError, match="differ in length"):
        backend.batch_put_from([key(0)], [arena.ptr, arena.ptr], [16])
    with pytest.raises(StorageError, match=r"ptrs\[0\].*\+"):
        backend.batch_put_from([key(0)], [arena.ptr + arena.nbytes - 8], [16])  # runs past the end
    assert list(tmp_path.iterdir()) == []
    backend.close()


def test_writes_are_atomic_and_stale_temp_files_are_removed(tmp_path: Path, arena: HostArena) -> None:
    backend = make(tmp_path, arena)
    arena.fill(0, seed=1)
    assert put(backend, arena, [0], [0]) == [Status.OK]
    names = sorted(p.name for p in tmp_path.iterdir())
    assert len(names) == 1 and names[0].endswith(".kv")  # no temp file left behind
    backend.close()
    # A crash mid-write leaves only a temp file: it is never visible under its key, and the
    # next start removes it.
    stale = tmp_path / f".tmp-{key(1).replace(':', '=')}-999-0"
    stale.write_bytes(b"half an object")
    backend = make(tmp_path, arena)
    assert not stale.exists()
    assert backend.batch_exists([key(1)]) == 0
    assert len(backend) == 1
    backend.close()


def test_lru_cap_evicts_least_recently_used(tmp_path: Path, arena: HostArena) -> None:
    obj = arena.slot_bytes + HEADER.size
    backend = make(tmp_path, arena, capacity_bytes=3 * obj)
    for i in range(3):
        arena.fill(i, seed=i)
    assert put(backend, arena, [0, 1, 2], [0, 1, 2]) == [Status.OK] * 3
    assert get(backend, arena, [0], [5]) == [arena.slot_bytes]  # 0 becomes most recent
    assert put(backend, arena, [3], [3]) == [Status.OK]  # evicts 1, the least recent
    assert backend.lru_keys() == [key(2), key(0), key(3)]
    assert backend.batch_exists([key(1)]) == 0 and not (tmp_path / (key(1).replace(":", "=") + ".kv")).exists()
    assert backend.used_bytes == 3 * obj
    assert backend.stats()["evicted"] == 1
    # An object larger than the whole cap never fits: FULL, nothing evicted.
    tiny = make(tmp_path / "tiny", arena, capacity_bytes=obj - 1)
    assert put(tiny, arena, [0], [0]) == [Status.FULL]
    assert tiny.stats()["errors"]["full"] == 1
    tiny.close()
    backend.close()


def test_seeding_from_existing_directory_and_restart(tmp_path: Path, arena: HostArena) -> None:
    obj = arena.slot_bytes + HEADER.size
    first = make(tmp_path, arena)
    data = [arena.fill(i, seed=100 + i) for i in range(4)]
    assert put(first, arena, [0, 1, 2, 3], [0, 1, 2, 3]) == [Status.OK] * 4
    first.close()
    # Last use, oldest first: 2, 0, 3, 1 (set explicitly: file times are the LRU's memory).
    now = time.time()
    for age, i in zip([40, 30, 20, 10], [2, 0, 3, 1]):
        p = tmp_path / (key(i).replace(":", "=") + ".kv")
        os.utime(p, (now - age, now - age))
    # A restarted backend finds every object, in that order ...
    second = make(tmp_path, arena)
    assert second.lru_keys() == [key(2), key(0), key(3), key(1)]
    assert get(second, arena, [0, 1, 2, 3], [4, 5, 6, 7]) == [arena.slot_bytes] * 4
    for slot, i in zip([4, 5, 6, 7], range(4)):
        np.testing.assert_array_equal(arena.slot(slot), data[i])
    second.close()
    for age, i in zip([40, 30, 20, 10], [2, 0, 3, 1]):
        p = tmp_path / (key(i).replace(":", "=") + ".kv")
        os.utime(p, (now - age, now - age))
    # ... and a smaller cap at start evicts the oldest to fit.
    third = make(tmp_path, arena, capacity_bytes=2 * obj)
    assert third.lru_keys() == [key(3), key(1)]
    assert third.batch_exists([key(2)]) == 0 and third.batch_exists([key(0)]) == 0
    third.close()


@pytest.mark.parametrize("reader", READERS + ["chunked"])
@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "bad_magic", "appended", "header_only",
                                    "claims_larger_payload"])
def test_corrupt_object_is_a_miss_deleted_and_counted(tmp_path: Path, arena: HostArena, damage: str, reader: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reader (the C ABI's read that hashes as it reads, its plain batch read, the
    Python one used where it is not built, and the chunked read-and-hash of large objects)
    gives the same verdicts."""
    if reader == "hashed":  # steps that do not divide the 512 KiB piece or the 64 KiB object
        monkeypatch.setattr(file_backend, "_HASHED_READ_STEP", 3000)
    backend = make(tmp_path, arena)
    if reader == "chunked":  # as for objects of 1 MiB and more: these are 64 KiB, in 4 KiB chunks
        monkeypatch.setattr(file_backend, "_CHUNKED_READ_MIN_BYTES", 1)
        monkeypatch.setattr(file_backend, "_HASH_CHUNK", 4096)
        use_reader(backend, "python")
    else:
        use_reader(backend, reader)
    arena.fill(0, seed=3)
    arena.fill(1, seed=4)
    assert put(backend, arena, [0, 1], [0, 1]) == [Status.OK] * 2
    path = tmp_path / (key(0).replace(":", "=") + ".kv")
    raw = bytearray(path.read_bytes())
    if damage == "flip_payload":
        raw[HEADER.size + 1234] ^= 0x40
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "appended":
        raw += b"tail"
    elif damage == "header_only":
        raw = raw[: HEADER.size - 3]
    elif damage == "claims_larger_payload":  # the header says more than the buffer (and the file) holds
        raw[8:16] = struct.pack("<Q", 10 * arena.slot_bytes)
    else:
        raw[0:4] = b"XXXX"
    path.write_bytes(bytes(raw))
    assert get(backend, arena, [0, 1], [5, 6]) == [Status.CORRUPT, arena.slot_bytes]
    assert not path.exists()
    assert backend.batch_exists([key(0)]) == 0
    stats = backend.stats()
    assert stats["corrupt_objects"] == 1 and stats["errors"]["corrupt"] == 1 and stats["misses"] == 1
    assert len(backend) == 1
    backend.close()


def test_async_put_completes_before_counting_as_stored(tmp_path: Path, arena: HostArena) -> None:
    backend = make(tmp_path, arena)
    arena.fill(0, seed=8)
    future = backend.submit_put_from([key(0)], [arena.slot_ptr(0)], [arena.slot_bytes])
    assert future.result(timeout=10) == [Status.OK]
    assert backend.batch_exists([key(0)]) == 1
    # Bad input fails at submit time, not later in the future.
    with pytest.raises(StorageError):
        backend.submit_put_from([key(0)], [1], [arena.slot_bytes])
    # close() drains what is queued.
    futures = [backend.submit_put_from([key(10 + i)], [arena.slot_ptr(0)], [arena.slot_bytes]) for i in range(5)]
    backend.close()
    assert [f.result(timeout=0) for f in futures] == [[Status.OK]] * 5
    with pytest.raises(StorageError) as info:
        put(backend, arena, [1], [1])
    assert info.value.kind == "unreachable"


def test_bounded_executor_refuses_when_full() -> None:
    gate = threading.Event()
    ex = BoundedExecutor("test", max_pending=2)
    first = ex.submit(gate.wait, 10)  # the thread takes it and blocks
    time.sleep(0.05)
    queued = [ex.submit(lambda: 1), ex.submit(lambda: 2)]
    with pytest.raises(StorageError) as info:
        ex.submit(lambda: 3)
    assert info.value.kind == "busy"
    gate.set()
    assert first.result(5) is True and [f.result(5) for f in queued] == [1, 2]
    failing = ex.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        failing.result(5)
    ex.close()


def test_free_space_floor_refuses_put(tmp_path: Path, arena: HostArena) -> None:
    """A floor above the free space: a put is FULL and leaves nothing (no root needed)."""
    st = os.statvfs(tmp_path)
    free = st.f_bavail * st.f_frsize
    backend = make(tmp_path, arena, min_free_bytes=free + (1 << 30))
    assert put(backend, arena, [0], [0]) == [Status.FULL]
    assert list(tmp_path.iterdir()) == []
    backend.close()


@pytest.fixture
def tiny_tmpfs(tmp_path: Path):
    """A real 1 MiB tmpfs, so a write runs into ENOSPC."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    try:
        proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)],
                              capture_output=True, text=True, timeout=30)
        why = proc.stderr.strip()[:200] if proc.returncode != 0 else ""
    except (OSError, subprocess.TimeoutExpired) as exc:  # no mount(8) in the image
        why = f"{type(exc).__name__}: {exc}"
    if why:
        pytest.skip(
            "mounting a 1 MiB tmpfs needs mount(8) and root with CAP_SYS_ADMIN (run the tests as "
            f"root in a privileged container); mount said: {why}. "
            "test_free_space_floor_refuses_put covers the floor without it"
        )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def test_disk_full_evicts_lru_down_to_the_floor_and_leaves_no_partial_object(tiny_tmpfs: Path) -> None:
    """ENOSPC with no floor (min-free 0): the put evicts our least recently used object and
    retries, so a full disk keeps turning over instead of freezing the store."""
    arena = HostArena(4, 300 << 10)  # 300 KiB objects: the fourth cannot fit in 1 MiB beside three
    backend = FileBackend(tiny_tmpfs, capacity_bytes=0, min_free_bytes=0, io_threads=1)
    lost: list[str] = []
    backend.set_loss_listener(lost.extend)
    backend.register_buffer(arena.ptr, arena.nbytes)
    data = [arena.fill(i, seed=20 + i) for i in range(4)]
    results = [backend.batch_put_from([key(i)], [arena.slot_ptr(i)], [arena.slot_bytes])[0] for i in range(4)]
    assert results == [Status.OK] * 4
    assert lost == [key(0)], lost  # the oldest went, and the listener heard of it
    names = sorted(p.name for p in tiny_tmpfs.iterdir())
    assert len(names) == 3 and not any(n.startswith(".tmp") for n in names)
    assert backend.batch_exists([key(0)]) == 0 and backend.batch_exists([key(1), key(2), key(3)]) == 3
    assert backend.stats()["evicted"] == 1
    # What was stored is intact.
    arena.array[:] = 0
    for i in (1, 3):
        assert backend.batch_get_into([key(i)], [arena.slot_ptr(0)], [arena.slot_bytes]) == [arena.slot_bytes]
        np.testing.assert_array_equal(arena.slot(0), data[i])
    backend.close()


def test_disk_full_of_foreign_data_is_full_and_logged_once_per_interval(
        tiny_tmpfs: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A disk filled by someone else: nothing of ours to evict, every put is FULL, no temp
    file is left, and the log gets one line for the lot (with a count), not one per put."""
    (tiny_tmpfs / "foreign.bin").write_bytes(b"x" * (900 << 10))
    arena = HostArena(1, 300 << 10)
    backend = FileBackend(tiny_tmpfs, capacity_bytes=0, min_free_bytes=0, io_threads=1)
    backend.register_buffer(arena.ptr, arena.nbytes)
    arena.fill(0, seed=1)
    with caplog.at_level(logging.WARNING, logger="fastdeploy_kvcache.storage.file_backend"):
        results = [backend.batch_put_from([key(i)], [arena.slot_ptr(0)], [arena.slot_bytes])[0]
                   for i in range(50)]
    assert results == [Status.FULL] * 50
    assert backend.stats()["errors"]["full"] == 50
    assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["foreign.bin"]
    full_lines = [r for r in caplog.records if "disk full" in r.getMessage()]
    assert len(full_lines) == 1, [r.getMessage() for r in full_lines]
    backend.close()


def test_free_space_floor_evicts_own_objects_first(tiny_tmpfs: Path) -> None:
    """With a floor, a put makes room by evicting our LRU objects instead of failing."""
    arena = HostArena(4, 200 << 10)
    backend = FileBackend(tiny_tmpfs, capacity_bytes=0, min_free_bytes=256 << 10, io_threads=1)
    backend.register_buffer(arena.ptr, arena.nbytes)
    for i in range(4):
        arena.fill(i, seed=i)
    results = [backend.batch_put_from([key(i)], [arena.slot_ptr(i)], [arena.slot_bytes])[0] for i in range(4)]
    assert results == [Status.OK] * 4  # 1 MiB - 256 KiB floor holds 3; the fourth evicts key 0
    assert backend.batch_exists([key(0)]) == 0 and backend.batch_exists([key(1), key(2), key(3)]) == 3
    assert backend.stats()["evicted"] >= 1
    backend.close()


def test_concurrent_puts_gets_deletes_keep_the_books_straight(tmp_path: Path) -> None:
    """Threads racing puts, gets and deletes under a tiny cap: afterwards the LRU's bytes and
    keys match the files on disk exactly, and the cap holds."""
    import random

    arena = HostArena(8, 16 << 10)
    for i in range(8):
        arena.fill(i, seed=i)
    obj = arena.slot_bytes + HEADER.size
    backend = FileBackend(tmp_path, capacity_bytes=5 * obj, min_free_bytes=0, io_threads=4)
    backend.register_buffer(arena.ptr, arena.nbytes)
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for _ in range(150):
                ids = rng.sample(range(12), 3)
                op = rng.random()
                if op < 0.5:
                    backend.batch_put_from([key(i) for i in ids], [arena.slot_ptr(i % 4) for i in ids], [arena.slot_bytes] * 3)
                elif op < 0.9:
                    out = backend.batch_get_into([key(i) for i in ids[:1]], [arena.slot_ptr(4 + seed)], [arena.slot_bytes])
                    assert out[0] in (arena.slot_bytes, Status.MISSING), out
                else:
                    backend.delete([key(ids[0])])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    files = {p.name: p.stat().st_size for p in tmp_path.iterdir()}
    assert not any(n.startswith(".tmp") for n in files)
    assert sorted(k.replace(":", "=") + ".kv" for k in backend.lru_keys()) == sorted(files)
    assert backend.used_bytes == sum(files.values()) <= 5 * obj
    assert backend.stats()["errors"]["corrupt"] == 0
    backend.close()


def test_a_put_batch_never_evicts_its_own_objects(tmp_path: Path, arena: HostArena) -> None:
    """A batch larger than the cap stores its head and answers FULL for the rest, rather
    than storing its tail by evicting its head (each eviction a loss to write again)."""
    obj = arena.slot_bytes + HEADER.size
    backend = make(tmp_path, arena, capacity_bytes=3 * obj)
    for i in range(5):
        arena.fill(i, seed=i)
    assert put(backend, arena, [0, 1, 2, 3, 4], [0, 1, 2, 3, 4]) == [Status.OK] * 3 + [Status.FULL] * 2
    assert backend.lru_keys() == [key(0), key(1), key(2)]
    assert backend.stats()["evicted"] == 0
    assert put(backend, arena, [3], [3]) == [Status.OK]  # a later batch evicts the oldest as usual
    assert backend.lru_keys() == [key(1), key(2), key(3)]
    assert backend.stats()["evicted"] == 1
    backend.close()


def test_keep_new_objects_fills_the_store_once_and_then_answers_full(tmp_path: Path, arena: HostArena) -> None:
    obj = arena.slot_bytes + HEADER.size
    backend = make(tmp_path, arena, capacity_bytes=3 * obj)
    lost: list[str] = []
    backend.set_loss_listener(lost.extend)
    for i in range(8):
        arena.fill(i, seed=i)
    assert put(backend, arena, [0, 1], [0, 1]) == [Status.OK] * 2
    backend.keep_new_objects(True)
    # Older objects make room; what was put since keep_new_objects is never evicted.
    results = [put(backend, arena, [i], [i])[0] for i in range(2, 8)]
    assert results == [Status.OK] * 3 + [Status.FULL] * 3
    assert sorted(lost) == sorted([key(0), key(1)])
    assert sorted(backend.lru_keys()) == sorted([key(2), key(3), key(4)])
    backend.keep_new_objects(False)
    assert put(backend, arena, [5], [5]) == [Status.OK]  # ordinary LRU again: 2 goes
    assert backend.lru_keys() == [key(3), key(4), key(5)]
    assert backend.used_bytes == 3 * obj
    backend.close()


def test_keep_new_objects_on_a_full_disk_answers_full_without_evicting_them(tiny_tmpfs: Path) -> None:
    arena = HostArena(6, 300 << 10)  # 300 KiB objects: 1 MiB holds three
    backend = FileBackend(path=str(tiny_tmpfs), min_free_bytes=0, io_threads=1)
    backend.register_buffer(arena.ptr, arena.nbytes)
    for i in range(6):
        arena.fill(i, seed=i)
    backend.keep_new_objects(True)
    results = [put(backend, arena, [i], [i])[0] for i in range(6)]
    ok = results.count(Status.OK)
    assert 1 <= ok <= 3 and results == [Status.OK] * ok + [Status.FULL] * (6 - ok), results
    assert backend.stats()["evicted"] == 0
    assert get(backend, arena, list(range(ok)), list(range(ok))) == [arena.slot_bytes] * ok
    assert not [p for p in os.listdir(tiny_tmpfs) if p.startswith(".tmp-")]
    backend.close()


def test_a_put_that_cannot_fit_beside_held_objects_evicts_nothing(tmp_path: Path, arena: HostArena) -> None:
    """Small LRU objects beside held ones: a large put that could not fit even with them gone
    must not evict them on the way to FULL."""
    small = arena.slot_bytes // 4
    backend = make(tmp_path, arena, capacity_bytes=2 * (arena.slot_bytes + HEADER.size))
    for i in range(4):
        arena.fill(i, seed=i)
    assert backend.batch_put_from([key(9)], [arena.slot_ptr(3)], [small]) == [Status.OK]
    backend.keep_new_objects(True)
    assert put(backend, arena, [0], [0]) == [Status.OK]
    assert backend.batch_put_from([key(1)], [arena.slot_ptr(1)], [arena.slot_bytes + small]) == [Status.FULL]
    assert backend.stats()["evicted"] == 0 and backend.batch_exists([key(9)]) == 1
    backend.keep_new_objects(False)
    assert backend.lru_keys() == [key(9), key(0)]
    backend.close()


def test_a_read_that_misses_while_a_put_lands_never_forgets_the_object_put(tmp_path: Path) -> None:
    """A reader that found no file, then a put of the same key that lands before the reader
    files its miss: the object stays in the index (a file the index forgot escapes the cap and
    is never evicted).  After each put the putter checks file and index agree."""
    arena = HostArena(4, 4 << 10)
    arena.fill(0, seed=3)
    backend = FileBackend(tmp_path, capacity_bytes=0, min_free_bytes=0, io_threads=1)
    backend.register_buffer(arena.ptr, arena.nbytes)
    stop = threading.Event()
    disagreements: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            backend.batch_get_into([key(1)], [arena.slot_ptr(1)], [arena.slot_bytes])

    thread = threading.Thread(target=reader)
    thread.start()
    try:
        for _ in range(3000):
            backend.delete([key(1)])
            assert backend.batch_put_from([key(1)], [arena.slot_ptr(0)], [arena.slot_bytes]) == [Status.OK]
            on_disk = os.path.exists(backend.file_path(key(1)))
            if on_disk and key(1) not in backend.lru_keys():
                disagreements.append("file on disk, key forgotten")
    finally:
        stop.set()
        thread.join()
    assert on_disk and key(1) in backend.lru_keys()
    assert not disagreements, disagreements[:3]
