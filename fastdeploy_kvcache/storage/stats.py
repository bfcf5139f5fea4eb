"""Thread-safe counters every storage backend keeps, exported through ``stats()``.

One class so the metric names are the same for every backend; the server turns them into
Prometheus series (``fastdeploy:storage_*``).
"""

from __future__ import annotations

import threading
from typing import Any

from fastdeploy_kvcache.storage.base import ERROR_KINDS, Status

__all__ = ["StorageStats"]


class StorageStats:
    """Bytes, seconds and keys read and written; hits, misses and errors by kind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.read_bytes = 0
        self.read_seconds = 0.0
        self.read_keys = 0
        self.write_bytes = 0
        self.write_seconds = 0.0
        self.write_keys = 0
        self.hits = 0
        self.misses = 0
        self.exists_calls = 0
        # Objects read straight into a host tier's segments (FileBackend.batch_get_segments).
        self.segment_read_keys = 0
        self.deleted = 0
        self.evicted = 0
        self.corrupt_objects = 0
        self.errors: dict[str, int] = {kind: 0 for kind in ERROR_KINDS}

    def record_reads(self, results: list[int], seconds: float) -> None:
        """Account one batch get: results are bytes read or negative Status values."""
        with self._lock:
            self.read_seconds += seconds
            self.read_keys += len(results)
            if results and min(results) >= 0:  # all hits (the usual prefetch): no loop
                self.hits += len(results)
                self.read_bytes += sum(results)
                return
            for r in results:
                if r >= 0:
                    self.hits += 1
                    self.read_bytes += r
                else:
                    self.misses += 1
                    if r != Status.MISSING:
                        self.errors[Status(r).kind] += 1
                    if r == Status.CORRUPT:
                        self.corrupt_objects += 1

    def record_writes(self, results: list[int], sizes: list[int], seconds: float) -> None:
        with self._lock:
            self.write_seconds += seconds
            self.write_keys += len(results)
            for r, size in zip(results, sizes):
                if r == Status.OK:
                    self.write_bytes += size
                else:
                    self.errors[Status(r).kind] += 1

    def record_error(self, kind: str, count: int = 1) -> None:
        with self._lock:
            self.errors[kind] = self.errors.get(kind, 0) + count

    def add(self, name: str, count: int = 1) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + count)

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {
                "read_bytes": self.read_bytes,
                "read_seconds": self.read_seconds,
                "read_keys": self.read_keys,
                "write_bytes": self.write_bytes,
                "write_seconds": self.write_seconds,
                "write_keys": self.write_keys,
                "hits": self.hits,
                "misses": self.misses,
                "exists_calls": self.exists_calls,
                "segment_read_keys": self.segment_read_keys,
                "deleted": self.deleted,
                "evicted": self.evicted,
                "corrupt_objects": self.corrupt_objects,
                "errors": dict(self.errors),
            }
