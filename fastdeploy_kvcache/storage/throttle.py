"""A store held to a given read rate, for tests and benchmarks: :class:`ThrottledBackend`.

It wraps any real backend (a :class:`~fastdeploy_kvcache.storage.file_backend.FileBackend` in a
real directory, a :class:`~fastdeploy_kvcache.storage.mooncake_backend.MooncakeBackend` on a
real master) and, after each read, sleeps until the bytes read so far could have come at
``read_bytes_per_s``: the reads themselves are real, only slower.  Concurrent reads share one
timeline, so the rate holds for the store as a whole, not per thread.  Writes and existence
checks pass through untouched.

It is not a server option: a test or benchmark builds it through
``StorageConfig(backend_wrapper=ThrottledBackend.at(rate))``, which wraps the backend the
config makes.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from fastdeploy_kvcache.storage.base import StorageBackend, StorageHealth

__all__ = ["ThrottledBackend"]


class ThrottledBackend(StorageBackend):
    """``inner``, with its reads held to ``read_bytes_per_s`` (see the module docstring)."""

    def __init__(self, inner: StorageBackend, read_bytes_per_s: float) -> None:
        if not read_bytes_per_s > 0:
            raise ValueError(f"read_bytes_per_s must be > 0, got {read_bytes_per_s!r}")
        self.inner = inner
        self.read_bytes_per_s = float(read_bytes_per_s)
        self.name = f"{inner.name}-throttled"
        self._lock = threading.Lock()
        self._free_at = 0.0  # monotonic time at which the throttled "device" is idle again
        self._pool: Optional[ThreadPoolExecutor] = None
        self.throttled_seconds = 0.0  # slept in all (stats)

    @classmethod
    def at(cls, read_bytes_per_s: float) -> Callable[[StorageBackend], "ThrottledBackend"]:
        """A ``StorageConfig.backend_wrapper`` holding reads to ``read_bytes_per_s``."""
        return lambda inner: cls(inner, read_bytes_per_s)

    def _hold(self, results: Sequence[int], started: float) -> None:
        nbytes = sum(r for r in results if r > 0)
        if nbytes <= 0:
            return
        with self._lock:
            start = max(started, self._free_at)
            self._free_at = start + nbytes / self.read_bytes_per_s
            until = self._free_at
        wait = until - time.monotonic()
        if wait > 0:
            self.throttled_seconds += wait
            time.sleep(wait)

    # ------------------------------------------------------------------ reads (throttled)
    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        t0 = time.monotonic()
        out = self.inner.batch_get_into(keys, ptrs, sizes)
        self._hold(out, t0)
        return out

    @property
    def reads_segments(self) -> bool:
        return self.inner.reads_segments

    def batch_get_segments(self, keys: Sequence[str], seg_ptrs: Sequence[int], seg_bytes: Sequence[int]) -> list[int]:
        t0 = time.monotonic()
        out = self.inner.batch_get_segments(keys, seg_ptrs, seg_bytes)
        self._hold(out, t0)
        return out

    def submit_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> "Future[list[int]]":
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="throttled-get")
            pool = self._pool
        return pool.submit(self.batch_get_into, list(keys), list(ptrs), list(sizes))

    # ------------------------------------------------------------------ everything else (the inner store's)
    def set_loss_listener(self, listener: Any) -> None:
        self.inner.set_loss_listener(listener)

    @property
    def generation(self) -> int:
        return self.inner.generation

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        self.inner.register_buffer(ptr, nbytes)

    def unregister_buffer(self, ptr: int) -> None:
        self.inner.unregister_buffer(ptr)

    def batch_exists(self, keys: Sequence[str]) -> int:
        return self.inner.batch_exists(keys)

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        return self.inner.batch_put_from(keys, ptrs, sizes)

    def submit_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> "Future[list[int]]":
        return self.inner.submit_put_from(keys, ptrs, sizes)

    def delete(self, keys: Sequence[str]) -> int:
        return self.inner.delete(keys)

    def health(self) -> StorageHealth:
        return self.inner.health()

    def available(self) -> bool:
        return self.inner.available()

    def keep_new_objects(self, on: bool) -> None:
        self.inner.keep_new_objects(on)

    def stats(self) -> dict[str, Any]:
        return {**self.inner.stats(), "throttle_read_bytes_per_s": self.read_bytes_per_s,
                "throttled_seconds": self.throttled_seconds}

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self.inner.close()
