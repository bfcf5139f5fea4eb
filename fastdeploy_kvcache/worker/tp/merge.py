"""Per-rank completions merged into the one verdict the scheduler sees.

Every rank carries out the same ``CacheSwapMetadata`` on its own shard and reports it back
with its own ``success``.  The scheduler must see each copy once, and only when it is done
everywhere:

* a copy is done when **every** rank has reported it;
* it succeeded only if every rank succeeded; otherwise the error names each failed rank.

:class:`CompletionMerger` is that rule and nothing else: no processes, no pipes.  The
:class:`~fastdeploy_kvcache.worker.tp.coordinator.TPCoordinator` uses it, and so can an
engine whose ranks report through an IPC of its own.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Iterable, Optional

from fastdeploy_kvcache.core.metadata import CacheSwapMetadata

logger = logging.getLogger(__name__)


@dataclass
class _Pending:
    meta: CacheSwapMetadata
    verdicts: dict[int, Optional[str]] = field(default_factory=dict)  # rank -> None (ok) or error


class CompletionMerger:
    """Collects each rank's verdict on each copy; hands a copy back once all ranks gave one.

    The scheduler's own metadata object is registered (:meth:`expect`) and is the one marked
    and handed back: ranks return copies of it (it was pickled to them), matched by
    ``task_id``.
    """

    def __init__(self, tp_size: int) -> None:
        if tp_size < 1:
            raise ValueError(f"tp_size must be >= 1, got {tp_size}")
        self.tp_size = tp_size
        self._pending: dict[int, _Pending] = {}
        self._ready: list[CacheSwapMetadata] = []

    def expect(self, meta: CacheSwapMetadata) -> None:
        """Register a copy sent to every rank (before any rank can report it)."""
        if meta.task_id in self._pending:
            raise ValueError(f"task {meta.task_id} was already submitted and is still pending")
        self._pending[meta.task_id] = _Pending(meta)

    def report(self, rank: int, finished: Iterable[CacheSwapMetadata]) -> None:
        """Rank ``rank`` finished these copies (each with its own success / error)."""
        if not 0 <= rank < self.tp_size:
            raise ValueError(f"rank {rank} is out of range [0, {self.tp_size})")
        for meta in finished:
            pending = self._pending.get(meta.task_id)
            if pending is None:
                logger.warning("rank %d reported task %d, which is not pending", rank, meta.task_id)
                continue
            if rank in pending.verdicts:
                logger.warning("rank %d reported task %d twice; keeping the first verdict", rank, meta.task_id)
                continue
            pending.verdicts[rank] = None if meta.success else (meta.error_message or "unknown transfer error")
            if len(pending.verdicts) == self.tp_size:
                self._resolve(pending)

    def fail_all(self, rank: int, reason: str) -> None:
        """Rank ``rank`` can no longer report: every pending copy fails, naming it."""
        for pending in list(self._pending.values()):
            for other in range(self.tp_size):
                pending.verdicts.setdefault(other, None)
            pending.verdicts[rank] = reason
            self._resolve(pending)

    def take_ready(self) -> list[CacheSwapMetadata]:
        """Copies every rank has reported, marked, in the order they became complete."""
        ready, self._ready = self._ready, []
        return ready

    def pending(self) -> dict[int, list[int]]:
        """Task id -> the ranks that have reported it, for copies not yet complete."""
        return {task_id: sorted(p.verdicts) for task_id, p in self._pending.items()}

    def _resolve(self, pending: _Pending) -> None:
        errors = [f"rank {r}: {err}" for r, err in sorted(pending.verdicts.items()) if err is not None]
        pending.meta.mark_done(not errors, "; ".join(errors) if errors else None)
        if errors:
            logger.warning("task %d failed on %d of %d ranks: %s", pending.meta.task_id, len(errors),
                           self.tp_size, errors[0])
        del self._pending[pending.meta.task_id]
        self._ready.append(pending.meta)
