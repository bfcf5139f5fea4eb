"""ThrottledBackend over a real FileBackend in a real directory: the reads are the store's
own, held to the given rate (a lower bound on their time, shared across threads)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np
import pytest

from fastdeploy_kvcache.storage import Status
from fastdeploy_kvcache.storage.config import StorageConfig
from fastdeploy_kvcache.storage.throttle import ThrottledBackend

from .conftest import HostArena
from .test_file_backend import get, key, make, put


def test_reads_keep_their_bytes_and_take_at_least_bytes_over_rate(tmp_path: Path, arena: HostArena) -> None:
    inner = make(tmp_path, arena)
    data = [arena.fill(i, seed=i) for i in range(4)]
    assert put(inner, arena, [0, 1, 2, 3], [0, 1, 2, 3]) == [Status.OK] * 4
    rate = 8 * arena.slot_bytes  # 8 objects a second
    backend = ThrottledBackend(inner, rate)
    assert backend.name == "file-throttled" and backend.batch_exists([key(0), key(3)]) == 2
    t0 = time.monotonic()
    assert get(backend, arena, [0, 1, 2, 3], [8, 9, 10, 11]) == [arena.slot_bytes] * 4
    assert time.monotonic() - t0 >= 4 / 8 - 0.01
    for slot, i in zip([8, 9, 10, 11], [0, 1, 2, 3]):
        np.testing.assert_array_equal(arena.slot(slot), data[i])
    # A miss reads nothing and waits for nothing.
    t0 = time.monotonic()
    assert get(backend, arena, [9], [12]) == [Status.MISSING]
    assert time.monotonic() - t0 < 0.1
    stats = backend.stats()
    assert stats["throttle_read_bytes_per_s"] == rate and stats["throttled_seconds"] > 0.3
    backend.close()


def test_concurrent_reads_share_one_rate(tmp_path: Path, arena: HostArena) -> None:
    inner = make(tmp_path, arena)
    for i in range(4):
        arena.fill(i, seed=i)
    put(inner, arena, [0, 1, 2, 3], [0, 1, 2, 3])
    backend = ThrottledBackend(inner, 8 * arena.slot_bytes)
    threads = [threading.Thread(target=get, args=(backend, arena, [i, i + 1], [8 + i, 9 + i])) for i in (0, 2)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert time.monotonic() - t0 >= 4 / 8 - 0.01  # two threads, one store: 4 objects at 8/s
    fut = backend.submit_get_into([key(0)], [arena.slot_ptr(12)], [arena.slot_bytes])
    assert fut.result(timeout=10) == [arena.slot_bytes]
    backend.close()


def test_storage_config_wraps_the_backend_it_makes(tmp_path: Path) -> None:
    config = StorageConfig(backend="file", path=str(tmp_path), min_free=0,
                           backend_wrapper=ThrottledBackend.at(1e6))
    backend = config.make_backend()
    try:
        assert isinstance(backend, ThrottledBackend) and backend.available()
    finally:
        backend.close()
    with pytest.raises(ValueError, match="read_bytes_per_s"):
        ThrottledBackend(backend.inner, 0)
