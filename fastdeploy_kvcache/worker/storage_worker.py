"""Worker side of the storage tier: runs the scheduler's StorageJobs, reports them back.

The scheduler (:class:`~fastdeploy_kvcache.core.storage_tier.StorageTier`) emits
:class:`~fastdeploy_kvcache.core.storage_tier.StorageJob`\\ s; this worker hands each to the
:class:`~fastdeploy_kvcache.storage.transfer.StorageTransfer` threads (gets on the reader,
puts on the writer: a slow put never delays a prefetch) and returns finished jobs from
:meth:`StorageWorker.collect_finished`, like ``CacheController.collect_finished`` does for
device <-> host copies.  It decides nothing: every outcome, including a batch that could not
run at all, comes back as per-key results for the scheduler to judge.

A job is "finished" only when its future is done, so the host blocks it reads or writes stay
reserved until then, even after a request stopped waiting for it (an aborted prefetch).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from typing import Any, Optional

from fastdeploy_kvcache.core.metadata import TransferKind
from fastdeploy_kvcache.core.storage_tier import StorageJob

logger = logging.getLogger(__name__)

__all__ = ["StorageWorker"]


class StorageWorker:
    """Runs storage jobs on the transfer's background threads (see the module docstring).

    Args:
        transfer: a ``StorageTransfer`` over this worker's host tier.
    """

    def __init__(self, transfer: Any) -> None:
        self.transfer = transfer
        self.object_bytes = int(transfer.object_bytes)
        self._lock = threading.Lock()
        self._inflight: dict[int, tuple[StorageJob, "Future[list[int]]", float]] = {}
        self._done: list[StorageJob] = []
        self._closed = False

    def submit(self, job: StorageJob) -> None:
        """Start ``job``; a job that cannot start (tier off, queue full) finishes failed at once."""
        if self._closed:
            raise RuntimeError("the storage worker is closed")
        t0 = job.submitted_at = time.monotonic()
        try:
            if job.kind is TransferKind.STORAGE_LOAD:
                fut = self.transfer.submit_get_blocks(job.keys, job.host_block_ids)
            else:
                fut = self.transfer.submit_put_blocks(job.keys, job.host_block_ids)
        except Exception as exc:  # noqa: BLE001 - StorageError (busy, unreachable, invalid) or worse
            self._fail(job, exc, t0)
            with self._lock:
                self._done.append(job)
            return
        # When the transfer thread ends it, not when the engine next collects it: the job's
        # own time, apart from how long it then waited for the engine (request timings).
        fut.add_done_callback(lambda _: setattr(job, "done_at", time.monotonic()))
        with self._lock:
            self._inflight[job.task_id] = (job, fut, t0)

    def run(self, job: StorageJob) -> StorageJob:
        """Run ``job`` on the calling thread and return it finished (results filled in).

        For the engine thread when it would only wait for this job (nothing running, no
        other get in flight): the read then costs no hand-off to the transfer thread and
        back, two thread wake-ups that a loaded machine makes slow.  Same outcomes as
        :meth:`submit`: a batch that cannot run finishes failed.
        """
        if self._closed:
            raise RuntimeError("the storage worker is closed")
        t0 = job.submitted_at = time.monotonic()
        fut: "Future[list[int]]" = Future()
        try:
            if job.kind is TransferKind.STORAGE_LOAD:
                fut.set_result(self.transfer.get_blocks(job.keys, job.host_block_ids))
            else:
                fut.set_result(self.transfer.put_blocks(job.keys, job.host_block_ids))
        except Exception as exc:  # noqa: BLE001 - StorageError or worse: reported per job
            fut.set_exception(exc)
        job.done_at = time.monotonic()
        self._finish(job, fut, t0)
        return job

    def run_many(self, jobs: list[StorageJob]) -> list[StorageJob]:
        """:meth:`run` for several gets at once: one transfer call over all their blocks (one
        native read), each job then finished with its own slice of the results.  A batch
        that cannot run fails every job, as :meth:`submit` would."""
        if len(jobs) == 1 or any(job.kind is not TransferKind.STORAGE_LOAD for job in jobs):
            return [self.run(job) for job in jobs]
        if self._closed:
            raise RuntimeError("the storage worker is closed")
        t0 = time.monotonic()
        for job in jobs:
            job.submitted_at = t0
        results: Optional[list[int]] = None
        error: Optional[BaseException] = None
        try:
            results = list(self.transfer.get_blocks([k for job in jobs for k in job.keys],
                                                    [b for job in jobs for b in job.host_block_ids]))
        except Exception as exc:  # noqa: BLE001 - StorageError or worse: reported per job
            error = exc
        done = time.monotonic()
        at = 0
        for job in jobs:
            fut: "Future[list[int]]" = Future()
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(results[at:at + len(job.keys)])  # type: ignore[index]
            at += len(job.keys)
            job.done_at = done
            self._finish(job, fut, t0)
        return jobs

    @property
    def loads_in_flight(self) -> int:
        """Gets submitted and not collected yet (the transfer's get lane may be busy)."""
        with self._lock:
            return sum(1 for job, _, _ in self._inflight.values() if job.kind is TransferKind.STORAGE_LOAD)

    def _fail(self, job: StorageJob, exc: BaseException, t0: float) -> None:
        job.error_kind = getattr(exc, "kind", None) or "io"
        job.results = [-4] * len(job.keys)  # Status.UNREACHABLE: "not there" for the scheduler
        job.done_at = job.done_at or time.monotonic()
        job.seconds = job.done_at - t0
        logger.warning("storage %s job %d (%d blocks) failed: %s", job.kind.name, job.task_id, len(job.keys), exc)

    def _finish(self, job: StorageJob, fut: "Future[list[int]]", t0: float) -> None:
        try:
            results = [int(r) for r in fut.result()]
        except BaseException as exc:  # noqa: BLE001 - reported per job
            self._fail(job, exc, t0)
            return
        if len(results) != len(job.keys):
            self._fail(job, RuntimeError(f"{len(results)} results for {len(job.keys)} keys"), t0)
            return
        job.results = results
        job.done_at = job.done_at or time.monotonic()
        job.seconds = job.done_at - t0
        if job.kind is TransferKind.STORAGE_LOAD:
            job.nbytes = sum(r for r in results if r > 0)
        else:
            job.nbytes = self.object_bytes * sum(1 for r in results if r == 0)

    def collect_finished(self, wait: bool = False, timeout_s: Optional[float] = None) -> list[StorageJob]:
        """Jobs whose futures are done.  ``wait``: block until at least one is (or ``timeout_s``)."""
        with self._lock:
            live = list(self._inflight.values())
        if wait and live and not self._done:
            wait_futures([f for _, f, _ in live], timeout=timeout_s, return_when="FIRST_COMPLETED")
        out: list[StorageJob] = []
        with self._lock:
            for tid, (job, fut, t0) in list(self._inflight.items()):
                if fut.done():
                    del self._inflight[tid]
                    self._finish(job, fut, t0)
                    out.append(job)
            out = self._done + out
            self._done = []
        return out

    @property
    def num_in_flight(self) -> int:
        with self._lock:
            return len(self._inflight) + len(self._done)

    def close(self, timeout_s: float = 60.0) -> list[StorageJob]:
        """Wait for every job (backend calls are bounded), stop the transfer threads; returns the
        jobs that finished."""
        out: list[StorageJob] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                if not self._inflight:
                    break
            out += self.collect_finished(wait=True, timeout_s=max(0.0, deadline - time.monotonic()))
        out += self.collect_finished()
        self._closed = True
        self.transfer.close()
        return out
