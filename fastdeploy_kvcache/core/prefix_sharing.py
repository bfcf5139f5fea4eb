"""In-batch prefix sharing: one request computes a prefix that is not cached yet, the
requests that share it wait for its blocks instead of computing them again.

A scheduler asks :meth:`PrefixSharing.should_hold` for each waiting request before it
admits it.  A running request that is computing prompt blocks (a *leader*) registers
their chained hashes (:meth:`PrefixSharing.leader_admitted`); as its chunks complete and
the cache manager makes its full blocks matchable (``commit_computed_blocks``) they are
dropped from the index (:meth:`PrefixSharing.leader_progress`).  A waiting request is
held while the first block it would compute is one a leader is still computing: once the
leader's committed blocks cover the shared part, the request's match reaches past it and
the request is admitted (chunked prefill included: a follower starts as soon as the
chunks that cover its prefix are in, not when the leader finishes).

Under k-anonymity (``core/k_anonymity.py``) a request is held only for a block its own
tenant computes, or one that is revealed: waiting for another tenant's private block would
change its time to first token (and then miss anyway), which is what k-anonymity hides.

The hold is bounded: a request held for ``max_hold_s`` seconds in total is never held
again, and a leader that finishes, aborts or is preempted (:meth:`PrefixSharing.leader_gone`)
releases its followers at once.  Pure Python, no I/O: the scheduler owns the clock.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Optional

from fastdeploy_kvcache.core.k_anonymity import KAnonymityIndex
from fastdeploy_kvcache.core.request import Request

logger = logging.getLogger(__name__)

__all__ = ["PrefixSharing", "SharingStats"]


@dataclass
class SharingStats:
    """Counters of the hold (reported under ``prefix_sharing`` in the engine stats)."""

    held_requests: int = 0  # requests held at least once
    held_reused_tokens: int = 0  # cached tokens those requests had when they were admitted
    hold_expired: int = 0  # holds that ran out of time (the request computed on its own)
    held_now: int = 0  # gauge: requests held in the last scheduling pass

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


@dataclass
class _Leader:
    hashes: list[int]
    start: int  # hashes[:start] are committed (matchable) already
    end: int
    tenant: Optional[str] = None


@dataclass
class _Hold:
    since: float
    expired: bool = False


class PrefixSharing:
    """Who computes which uncached prompt block, and which waiting requests wait for it.

    Args:
        block_size: tokens per block (hashes are the cache manager's chained block hashes).
        max_hold_s: the most seconds one request is held in total; 0 turns holding off.
        clock: monotonic seconds (tests pass their own).
        k_anonymity: the cache manager's index under k-anonymity (None: any request may wait
            for any other).
    """

    def __init__(self, block_size: int, max_hold_s: float, clock: Callable[[], float] = time.monotonic,
                 k_anonymity: Optional[KAnonymityIndex] = None) -> None:
        if max_hold_s < 0:
            raise ValueError(f"max_hold_s: must be >= 0, got {max_hold_s!r}")
        self.block_size = block_size
        self.k_anonymity = k_anonymity
        self.max_hold_s = float(max_hold_s)
        self.clock = clock
        self._owner: dict[int, str] = {}  # hash of a block being computed -> leader id
        self._leaders: dict[str, _Leader] = {}
        self._holds: dict[str, _Hold] = {}
        self.stats = SharingStats()
        self._held_pass: set[str] = set()

    @property
    def enabled(self) -> bool:
        return self.max_hold_s > 0

    def _prompt_hashes(self, request: Request) -> list[int]:
        bs = self.block_size
        n = (request.num_total_tokens - 1) // bs  # the last token is always computed
        return request.block_hashes(bs, request.num_prompt_tokens)[: min(n, request.num_prompt_tokens // bs)]

    # ------------------------------------------------------------------ leaders
    def leader_admitted(self, request: Request, cached_tokens: int) -> None:
        """``request`` was admitted with ``cached_tokens`` matched: it computes the rest."""
        if not self.enabled:
            return
        self.leader_gone(request.request_id)
        hashes = self._prompt_hashes(request)
        start = cached_tokens // self.block_size
        if start >= len(hashes):
            return
        rid = request.request_id
        for h in hashes[start:]:
            self._owner.setdefault(h, rid)
        self._leaders[rid] = _Leader(hashes, start, len(hashes), request.tenant)

    def leader_progress(self, request_id: str, committed_blocks: int) -> None:
        """The leader's first ``committed_blocks`` blocks are matchable now."""
        ld = self._leaders.get(request_id)
        if ld is None or committed_blocks <= ld.start:
            return
        upto = min(committed_blocks, ld.end)
        self._drop(request_id, ld.hashes[ld.start : upto])
        ld.start = upto
        if ld.start >= ld.end:
            del self._leaders[request_id]

    def leader_gone(self, request_id: str) -> None:
        """The request finished, aborted or was preempted: nobody waits for it any more."""
        ld = self._leaders.pop(request_id, None)
        if ld is not None:
            self._drop(request_id, ld.hashes[ld.start : ld.end])

    def _drop(self, request_id: str, hashes: list[int]) -> None:
        for h in hashes:
            if self._owner.get(h) == request_id:
                del self._owner[h]

    # ------------------------------------------------------------------ followers
    def begin_pass(self) -> None:
        """Start of a scheduling pass (the ``held_now`` gauge counts this pass's holds)."""
        self._held_pass = set()

    def end_pass(self) -> None:
        self.stats.held_now = len(self._held_pass)

    def should_hold(self, request: Request, cached_tokens: int) -> bool:
        """Whether to keep ``request`` waiting: the next block it would compute (after its
        ``cached_tokens`` matched) is being computed by another running request."""
        if not self.enabled:
            return False
        rid = request.request_id
        hold = self._holds.get(rid)
        if hold is not None and hold.expired:
            return False
        hashes = self._prompt_hashes(request)
        k = cached_tokens // self.block_size
        owner = self._owner.get(hashes[k]) if k < len(hashes) else None
        if owner is None or owner == rid:
            return False
        kanon = self.k_anonymity
        if kanon is not None and not kanon.is_revealed(hashes[k]):
            ld = self._leaders.get(owner)
            if ld is None or kanon.tenant_key(ld.tenant) != kanon.tenant_key(request.tenant):
                return False  # another tenant's private block: computed as a miss, no wait
        now = self.clock()
        if hold is None:
            hold = self._holds[rid] = _Hold(now)
            self.stats.held_requests += 1
            logger.debug("holding %s: block %d is being computed by %s", rid, k, owner)
        elif now - hold.since >= self.max_hold_s:
            hold.expired = True
            self.stats.hold_expired += 1
            logger.debug("hold of %s expired after %.3f s", rid, now - hold.since)
            return False
        self._held_pass.add(rid)
        return True

    def admitted(self, request: Request, cached_tokens: int) -> None:
        """``request`` was admitted: count what a held one reused, and make it a leader of
        whatever it computes itself."""
        hold = self._holds.pop(request.request_id, None)
        if hold is not None:
            self.stats.held_reused_tokens += cached_tokens
        self.leader_admitted(request, cached_tokens)

    def forget(self, request_id: str) -> None:
        """The request is gone (finished or aborted) whether it ran or waited."""
        self._holds.pop(request_id, None)
        self.leader_gone(request_id)

    @property
    def num_blocks_being_computed(self) -> int:
        return len(self._owner)
