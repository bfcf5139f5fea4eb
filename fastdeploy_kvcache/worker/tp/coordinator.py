"""One scheduler, ``tp_size`` rank processes: the coordinator between them.

The single ``CacheManager`` of a tensor-parallel group emits one ``BatchRequest`` per step.
The coordinator pickles it once and sends the same bytes to every rank; each rank carries
out the copies on its own shard (:mod:`.rank`).  Completion comes back per rank and is
merged here, by ``task_id``, before the scheduler sees it:

* a copy is done only when **every** rank has finished it;
* it succeeded only if every rank's copy succeeded.  One failed rank fails the copy for all:
  the scheduler then treats the blocks as holding nothing, on every rank, and recomputes.
  Ranks whose copy did land are overwritten by that recompute with the same bytes.

Every wait on a rank is bounded.  A rank process that dies, or does not answer within the
limit, breaks the group: every copy still pending is marked failed (so the scheduler can
release its blocks), the call raises :class:`RankFailedError`, and later calls raise at once
(``collect_finished`` still hands back the failed copies).

Per step, the engine does::

    batch = BatchRequest(running); batch.append_evict_metadata(mgr.issue_pending_backup_to_batch_request())
    result = coordinator.step(batch)            # every rank submits, then runs its forward
    for meta in result.finished:                # copies every rank has finished
        mgr.complete_swap(meta)
"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import time
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_any
from typing import Any, Optional, Sequence, Union

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.metadata import CacheSwapMetadata
from fastdeploy_kvcache.worker.layer_done import check_timeout, default_timeout_s
from fastdeploy_kvcache.worker.tp.merge import CompletionMerger
from fastdeploy_kvcache.worker.tp.rank import HookFactory, RankSpec, StepReply, rank_main
from fastdeploy_kvcache.worker.tp.shard import check_divisible, scheduler_config, shard_config

logger = logging.getLogger(__name__)

#: Seconds a rank has to start (spawn, imports, cache allocation) beyond the call limit.
START_TIMEOUT_S = 120.0


class RankFailedError(RuntimeError):
    """A rank process died, reported an error, or did not answer in time.

    ``rank`` is the rank at fault; ``exitcode`` is set when its process has ended.
    """

    def __init__(self, rank: int, message: str, exitcode: Optional[int] = None) -> None:
        super().__init__(message)
        self.rank = rank
        self.exitcode = exitcode


class RankTimeoutError(RankFailedError, TimeoutError):
    """A rank did not answer within the coordinator's limit (it may be hung)."""


@dataclass
class StepResult:
    """One step on every rank: each rank's hook outcome, and the copies all ranks finished."""

    outcomes: list[Any]
    finished: list[CacheSwapMetadata] = field(default_factory=list)


class TPCoordinator:
    """Starts one rank process per device and merges what they report.

    Args:
        config: the full cache shape (``num_kv_heads`` of the model, ``tensor_parallel_size``
            the number of ranks).  Each rank gets :func:`.shard.shard_config` of it.
        devices: the device of each rank (default ``range(tp_size)``).
        backend: each rank's worker backend (``"cpu"``, ``"cupy"``, ``"paddle"``, ``"auto"``).
        mla: every rank holds the whole cache (MLA-style latent cache) instead of a head shard.
        hook: picklable factory of each rank's hook (see :mod:`.rank`).
        timeout_s: limit of every wait on a rank (default FDKV_LAYER_WAIT_TIMEOUT_S).
        start: start the rank processes now (else call :meth:`start`).
    """

    def __init__(
        self,
        config: CacheConfig,
        *,
        devices: Optional[Sequence[int]] = None,
        backend: str = "auto",
        mla: bool = False,
        hook: Optional[HookFactory] = None,
        threaded: bool = True,
        async_launch: Optional[bool] = None,
        d2h_copy_path: Optional[str] = None,
        timeout_s: Optional[float] = None,
        log_level: Optional[int] = None,
        env: Optional[dict[str, str]] = None,
        start: bool = True,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        config.validate()
        tp_size = config.tensor_parallel_size
        if not mla:
            check_divisible(config.num_kv_heads, tp_size)
        devices = list(range(tp_size)) if devices is None else list(devices)
        if len(devices) != tp_size:
            raise ValueError(f"devices names {len(devices)} devices for tensor_parallel_size={tp_size}: {devices}")
        if len(set(devices)) != len(devices):
            raise ValueError(f"devices must be distinct (one rank per device), got {devices}")
        self.config = config
        self.tp_size = tp_size
        self.mla = bool(mla)
        self.devices = devices
        self.timeout_s = default_timeout_s() if timeout_s is None else check_timeout(timeout_s)
        self.specs = [
            RankSpec(
                rank=rank, tp_size=tp_size, device_id=devices[rank], config=shard_config(config, rank, self.mla),
                backend=backend, threaded=threaded, async_launch=async_launch, d2h_copy_path=d2h_copy_path,
                hook=hook, log_level=log_level, env=dict(env or {}),
            )
            for rank in range(tp_size)
        ]
        self.rank_info: list[dict[str, Any]] = []
        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._merger = CompletionMerger(tp_size)
        self._broken: Optional[RankFailedError] = None
        self._closed = False
        if start:
            self.start()

    @property
    def scheduler_config(self) -> CacheConfig:
        """The config to build the group's one ``CacheManager`` with (block counts of every rank)."""
        return scheduler_config(self.config, self.mla)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Spawn the rank processes and wait (bounded) until each has its caches allocated."""
        if self._procs:
            raise RuntimeError("the rank processes are already started")
        ctx = multiprocessing.get_context("spawn")  # CUDA contexts do not survive fork
        try:
            for spec in self.specs:
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=rank_main, args=(child, spec), name=f"fdkv-tp-rank{spec.rank}", daemon=True)
                try:
                    proc.start()  # pickles the spec: an unpicklable hook fails here
                except BaseException:
                    parent.close()
                    raise
                finally:
                    child.close()
                self._procs.append(proc)
                self._conns.append(parent)
            self.rank_info = self._gather(range(self.tp_size), self.timeout_s + START_TIMEOUT_S, "start")
        except BaseException:
            self._terminate()
            raise
        logger.info("tensor-parallel group up: %s", self.rank_info)

    def close(self) -> list[CacheSwapMetadata]:
        """Drain and free every rank, stop the processes; returns the copies that finished.

        Bounded: a rank that does not stop in time is terminated, then killed.
        """
        if self._closed:
            return self._merger.take_ready()
        self._closed = True
        try:
            if self._broken is None and self._procs:
                replies = self._exchange([("close",)] * self.tp_size, "close")
                for rank, finished in enumerate(replies):
                    self._merger.report(rank, finished)
        except RankFailedError:
            logger.warning("a rank failed while closing", exc_info=True)
        finally:
            self._terminate()
        return self._merger.take_ready()

    def __enter__(self) -> "TPCoordinator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _terminate(self) -> None:
        # Closing our ends first lets a rank blocked on its pipe see EOF and exit by itself.
        for conn in self._conns:
            conn.close()
        deadline = time.monotonic() + 10.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self._procs:
            if proc.is_alive():
                logger.warning("rank process %s (pid %s) did not exit: terminating", proc.name, proc.pid)
                proc.terminate()
                proc.join(5.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)

    # ------------------------------------------------------------------ steps
    def step(
        self, batch: Any, payloads: Optional[Sequence[Any]] = None, wait: bool = False
    ) -> StepResult:
        """Carry out ``batch`` on every rank: submit its copies, run the rank's forward.

        ``payloads[r]`` goes to rank ``r``'s hook (e.g. per-rank test faults).  ``wait=True``
        drains every rank's copies before returning.  ``finished`` holds the copies every
        rank has now finished, merged; the others come from later calls.
        """
        self._check_usable()
        if payloads is not None and len(payloads) != self.tp_size:
            raise ValueError(f"payloads must have one entry per rank ({self.tp_size}), got {len(payloads)}")
        # The batch is pickled once; every rank gets the same bytes.
        data = pickle.dumps(batch, protocol=pickle.HIGHEST_PROTOCOL)
        metas = [m for m in (batch.cache_evict_metadata, batch.cache_swap_metadata) if m is not None]
        pending = self._merger.pending()
        for meta in metas:
            if meta.task_id in pending:
                raise ValueError(f"task {meta.task_id} was already submitted and is still pending")
        for meta in metas:
            self._merger.expect(meta)
        messages = [("step", data, None if payloads is None else payloads[r], bool(wait)) for r in range(self.tp_size)]
        replies: list[StepReply] = self._exchange(messages, "step")
        for reply in replies:
            self._merger.report(reply.rank, reply.finished)
        return StepResult([reply.outcome for reply in replies], self._merger.take_ready())

    def collect_finished(self, wait: bool = False, timeout_s: Optional[float] = None) -> list[CacheSwapMetadata]:
        """Copies every rank has finished (merged), for ``CacheManager.complete_swap``.

        After the group broke, returns the copies that were failed because of it, without
        contacting the ranks.
        """
        if self._broken is None and not self._closed:
            limit = None if timeout_s is None else check_timeout(timeout_s)
            replies = self._exchange([("collect", bool(wait), limit)] * self.tp_size, "collect", limit)
            for rank, finished in enumerate(replies):
                self._merger.report(rank, finished)
        return self._merger.take_ready()

    def call(self, name: str, *args: Any, ranks: Optional[Sequence[int]] = None, **kwargs: Any) -> list[Any]:
        """Call method ``name`` of the hook of each rank in ``ranks`` (default all); their results.

        ``"stats"`` returns each rank's ``CacheController.get_stats()``.
        """
        self._check_usable()
        ranks = list(range(self.tp_size)) if ranks is None else list(ranks)
        for rank in ranks:
            if not 0 <= rank < self.tp_size:
                raise ValueError(f"rank {rank} is out of range [0, {self.tp_size})")
        # A hook's error leaves the copies alone: it is raised, and the group stays usable.
        return self._exchange({r: ("call", name, args, kwargs) for r in ranks}, f"call {name!r}", fatal=False)

    def pending_tasks(self) -> dict[int, list[int]]:
        """Task id -> the ranks that have finished it, for copies not yet finished on all."""
        return self._merger.pending()

    @property
    def broken(self) -> Optional[RankFailedError]:
        """The failure that broke the group, or None."""
        return self._broken

    # ------------------------------------------------------------------ failures
    def _break(self, error: RankFailedError) -> RankFailedError:
        """Fail every pending copy (the group cannot finish it) and remember the failure."""
        if self._broken is None:
            self._broken = error
            self._merger.fail_all(error.rank, f"rank failed: {error}")
            logger.error("tensor-parallel group broken: %s", error)
        return error

    def _check_usable(self) -> None:
        if self._closed:
            raise RuntimeError("the TPCoordinator is closed")
        if self._broken is not None:
            raise RankFailedError(self._broken.rank, f"the tensor-parallel group is broken: {self._broken}",
                                  self._broken.exitcode)
        if not self._procs:
            raise RuntimeError("the rank processes are not started; call start()")

    # ------------------------------------------------------------------ messaging
    def _exchange(
        self,
        messages: Union[Sequence[Any], dict[int, Any]],
        what: str,
        timeout_s: Optional[float] = None,
        fatal: bool = True,
    ) -> list[Any]:
        """Send one message to each rank, then gather every reply (bounded)."""
        by_rank = dict(messages) if isinstance(messages, dict) else dict(enumerate(messages))
        for rank, message in by_rank.items():
            try:
                self._conns[rank].send(message)
            except (BrokenPipeError, EOFError, OSError) as exc:
                raise self._break(self._dead(rank, f"{what}: could not send ({exc})")) from None
        limit = self.timeout_s if timeout_s is None else timeout_s + self.timeout_s
        return self._gather(by_rank, limit, what, fatal)

    def _gather(self, ranks: Any, timeout_s: float, what: str, fatal: bool = True) -> list[Any]:
        """Every rank's reply to ``what``, waiting at most ``timeout_s`` in all.

        A rank that dies or runs past the limit breaks the group.  A rank that answers with
        an error breaks it too when ``fatal`` (its copies' state is unknown); otherwise
        (hook calls) the error is raised once every reply is in, so the pipes stay in step.
        """
        ranks = list(ranks)
        replies: dict[int, tuple[str, Any]] = {}
        deadline = time.monotonic() + timeout_s
        while len(replies) < len(ranks):
            waiting = [r for r in ranks if r not in replies]
            objects = [self._conns[r] for r in waiting] + [self._procs[r].sentinel for r in waiting]
            remaining = deadline - time.monotonic()
            ready = wait_any(objects, timeout=remaining) if remaining > 0 else []
            if not ready:
                rank = waiting[0]
                raise self._break(RankTimeoutError(
                    rank, f"rank {rank} (device {self.devices[rank]}) did not answer {what} within {timeout_s:.1f}s"))
            for rank in waiting:
                conn = self._conns[rank]
                if conn in ready or conn.poll():
                    try:
                        replies[rank] = conn.recv()
                    except (EOFError, OSError):
                        raise self._break(self._dead(rank, what)) from None
                elif self._procs[rank].sentinel in ready:
                    raise self._break(self._dead(rank, what))
        for rank in ranks:
            status, value = replies[rank]
            if status != "ok":
                error = RankFailedError(rank, f"{what}: {value}", self._procs[rank].exitcode)
                raise self._break(error) if fatal else error
        return [replies[r][1] for r in ranks]

    def _dead(self, rank: int, what: str) -> RankFailedError:
        proc = self._procs[rank]
        proc.join(1.0)
        return RankFailedError(
            rank, f"rank {rank} (device {self.devices[rank]}, pid {proc.pid}) died during {what} "
            f"(exit code {proc.exitcode})", proc.exitcode,
        )
