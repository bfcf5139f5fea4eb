"""A bounded single-thread work queue: the writer (and reader) thread of a backend.

Why not ``concurrent.futures.ThreadPoolExecutor``: its queue is unbounded, so a slow disk
would let backups pile up without limit and hold host blocks forever.  Here ``submit``
refuses work when the queue is full (``StorageError("busy")``), so the scheduler skips a
backup instead of blocking, and every queued job's future always completes: with its
result, with its exception, or with ``StorageError("unreachable")`` at close.
"""

from __future__ import annotations

import logging
import queue
import threading
from concurrent.futures import Future
from typing import Any, Callable, Optional

from fastdeploy_kvcache.storage.base import StorageError

logger = logging.getLogger(__name__)

__all__ = ["BoundedExecutor"]

_STOP = object()


class BoundedExecutor:
    """Runs submitted callables in FIFO order on one daemon thread."""

    def __init__(self, name: str, max_pending: int = 64) -> None:
        if max_pending < 1:
            raise ValueError(f"max_pending must be >= 1, got {max_pending}")
        self.name = name
        self._queue: "queue.Queue[Any]" = queue.Queue(maxsize=max_pending)
        self._closed = False
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any) -> "Future[Any]":
        future: "Future[Any]" = Future()
        with self._lock:
            if self._closed:
                raise StorageError("unreachable", f"{self.name}: closed")
            try:
                self._queue.put_nowait((future, fn, args))
            except queue.Full:
                raise StorageError(
                    "busy", f"{self.name}: {self._queue.maxsize} jobs already queued; skip or retry later"
                ) from None
        return future

    def pending(self) -> int:
        return self._queue.qsize()

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            future, fn, args = item
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 - handed to the future, never lost
                future.set_exception(exc)

    def close(self, timeout_s: Optional[float] = 30.0) -> None:
        """Run what is queued (drain), then stop.  Jobs still queued after the timeout fail."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # NOTE: put blocks while the queue is full; the worker is draining it meanwhile.
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            pass
        self._thread.join(timeout_s)
        while True:  # anything left (the thread timed out): fail it rather than leave it hanging
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            if item is not _STOP:
                item[0].set_exception(StorageError("unreachable", f"{self.name}: closed before the job ran"))
