"""Storage jobs: what the scheduler asks the worker to move, and what comes back.

The scheduler side never touches KV bytes.  For the storage tier it emits
:class:`StorageJob` objects (plain ints, strings and an enum: they pickle and cross
processes inside a ``BatchRequest``); the worker hands them to a :class:`StorageJobRunner`,
and each step collects :class:`StorageJobResult` objects to hand back, as it does for swap
metadata.  A job's host blocks belong to the job until its result is collected:

* ``BACKUP``: host blocks -> storage objects (write_through / write_back).  A key counts as
  stored only if its result is ``Status.OK``.
* ``PREFETCH``: storage objects -> host blocks.  Only :attr:`StorageJobResult.arrived_prefix`
  leading blocks may be used; the rest of the request is recomputed.

Every job gets exactly one result, failures included (``error`` names the StorageError kind
when the job failed as a whole: ``unreachable``, ``timeout``, ``busy``...), so no host block
is ever leaked waiting for a result that never comes.
"""

from __future__ import annotations

import enum
import logging
import queue
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Optional, Sequence

from fastdeploy_kvcache.storage.base import Status, StorageError
from fastdeploy_kvcache.storage.transfer import StorageTransfer

logger = logging.getLogger(__name__)

__all__ = ["StorageJobKind", "StorageJob", "StorageJobResult", "StorageJobRunner"]


class StorageJobKind(enum.IntEnum):
    BACKUP = 0
    """Host blocks to storage objects."""
    PREFETCH = 1
    """Storage objects to host blocks."""


@dataclass(frozen=True)
class StorageJob:
    """Move ``keys[i]`` <-> host block ``host_block_ids[i]``, in the direction of ``kind``."""

    job_id: int
    kind: StorageJobKind
    keys: tuple[str, ...]
    host_block_ids: tuple[int, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.kind, StorageJobKind):
            raise TypeError(f"StorageJob.kind must be a StorageJobKind, got {self.kind!r}")
        if len(self.keys) != len(self.host_block_ids) or not self.keys:
            raise ValueError(
                f"StorageJob {self.job_id}: {len(self.keys)} keys and {len(self.host_block_ids)} host "
                "block ids; need the same, non-zero number"
            )
        object.__setattr__(self, "keys", tuple(str(k) for k in self.keys))
        object.__setattr__(self, "host_block_ids", tuple(int(b) for b in self.host_block_ids))


@dataclass(frozen=True)
class StorageJobResult:
    """The outcome of one job.  ``results[i]`` is the per-key result of the transfer."""

    job: StorageJob
    results: tuple[int, ...]
    error: Optional[str] = None
    elapsed_s: float = 0.0
    detail: str = field(default="", compare=False)

    @property
    def job_id(self) -> int:
        return self.job.job_id

    @property
    def success(self) -> bool:
        """Every key moved."""
        return self.error is None and all(self._moved(r) for r in self.results)

    def _moved(self, r: int) -> bool:
        return r == Status.OK if self.job.kind is StorageJobKind.BACKUP else r > 0

    @property
    def stored_keys(self) -> list[str]:
        """BACKUP: the keys whose put returned OK (now on storage)."""
        if self.job.kind is not StorageJobKind.BACKUP:
            return []
        return [k for k, r in zip(self.job.keys, self.results) if r == Status.OK]

    @property
    def arrived_prefix(self) -> int:
        """PREFETCH: how many leading blocks arrived whole (a hole ends the usable prefix)."""
        if self.job.kind is not StorageJobKind.PREFETCH:
            return 0
        count = 0
        for r in self.results:
            if r <= 0:
                break
            count += 1
        return count


class StorageJobRunner:
    """Runs storage jobs on a :class:`StorageTransfer`'s threads; results are polled.

    ``submit`` never blocks on the store and never raises for the store's state: a job that
    cannot start (queue full, tier off) gets a failed result at once.  ``collect_finished``
    returns the results of finished jobs, like ``CacheController.collect_finished``.
    """

    def __init__(self, transfer: StorageTransfer) -> None:
        self.transfer = transfer
        self._done: "queue.SimpleQueue[StorageJobResult]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)

    def submit(self, jobs: Sequence[StorageJob]) -> None:
        for job in jobs:
            if not isinstance(job, StorageJob):
                raise TypeError(f"StorageJobRunner.submit takes StorageJob objects, got {type(job).__name__}")
        for job in jobs:
            start = time.perf_counter()
            submit = (
                self.transfer.submit_put_blocks if job.kind is StorageJobKind.BACKUP else self.transfer.submit_get_blocks
            )
            try:
                future = submit(job.keys, job.host_block_ids)
            except StorageError as exc:
                self._done.put(self._failed(job, exc, start))
                continue
            with self._lock:
                self._in_flight += 1
            future.add_done_callback(lambda f, job=job, start=start: self._finish(job, f, start))

    def _failed(self, job: StorageJob, exc: BaseException, start: float) -> StorageJobResult:
        kind = exc.kind if isinstance(exc, StorageError) else "io"
        status = {"unreachable": Status.UNREACHABLE, "timeout": Status.TIMEOUT, "invalid": Status.INVALID,
                  "full": Status.FULL}.get(kind, Status.IO)
        if not isinstance(exc, StorageError):
            logger.error("storage job %d failed: %s", job.job_id, exc, exc_info=exc)
        return StorageJobResult(job, (int(status),) * len(job.keys), kind, time.perf_counter() - start, str(exc))

    def _finish(self, job: StorageJob, future: "Future[list[int]]", start: float) -> None:
        try:
            exc = future.exception()
            if exc is None:
                result = StorageJobResult(job, tuple(int(r) for r in future.result()), None, time.perf_counter() - start)
            else:
                result = self._failed(job, exc, start)
        except BaseException as exc:  # noqa: BLE001 - a cancelled future still yields a result
            result = self._failed(job, exc, start)
        self._done.put(result)
        with self._lock:
            self._in_flight -= 1
            self._idle.notify_all()

    @property
    def in_flight(self) -> int:
        return self._in_flight

    def collect_finished(self, wait: bool = False, timeout_s: Optional[float] = None) -> list[StorageJobResult]:
        """Results of finished jobs; ``wait=True`` first waits for every job in flight."""
        if wait:
            with self._lock:
                if not self._idle.wait_for(lambda: self._in_flight == 0, timeout_s):
                    raise TimeoutError(f"{self._in_flight} storage jobs still in flight after {timeout_s}s")
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out
