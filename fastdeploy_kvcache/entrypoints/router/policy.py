"""Which worker gets a request: ``cache_aware``, ``round_robin`` or ``least_requests``.

``cache_aware`` (the default), per request:

1. **Balance first.**  With ``max`` and ``min`` the most and fewest requests in flight on
   one healthy worker, load is *imbalanced* when ``max - min > balance_abs_threshold``
   *and* ``max > balance_rel_threshold * min``.  Then the workers more than
   ``balance_abs_threshold`` requests above ``min`` are left out for this request: a
   worker with the whole prefix is no use when the request would queue behind many
   others.  (SGLang's router has the same two-threshold test, and then takes the
   least-loaded worker; both conditions must hold, so a fleet at 0 vs 2 requests is not
   "imbalanced".)
2. **Expected reuse.**  Among the workers left, each one's score is the sum, over the
   longest prefix of the prompt's blocks it can supply, of the weight of the best tier
   each block is on (device > host > storage, :class:`~.view.TierWeights`).  The highest
   score wins; ties go to the least-loaded of them.
3. **Nothing cached** on any of them (every score 0): the least-loaded worker.

Requests just sent to a worker count as that worker's device blocks for
``pending_ttl_s`` seconds (its events for them may not have arrived yet), so a burst of
requests sharing a new document lands together instead of scattering.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from fastdeploy_kvcache.entrypoints.router.view import Match, TierWeights, WorkerView

logger = logging.getLogger(__name__)

POLICIES = ("cache_aware", "round_robin", "least_requests")


@dataclass
class Candidate:
    """What a policy may look at of one healthy worker."""

    index: int
    in_flight: int
    view: WorkerView
    pending: dict[int, float]


@dataclass
class Decision:
    index: int
    reason: str  # cache | balance | no_match | round_robin | least_requests
    match: Match


class Policy:
    name = ""

    def choose(self, candidates: Sequence[Candidate], hashes_for: Callable[[WorkerView], Optional[list[int]]],
               now: float) -> Decision:
        raise NotImplementedError


def _least_loaded(candidates: Sequence[Candidate], start: int) -> Candidate:
    """Fewest in flight; among equals, the first from a rotating start (spreads ties)."""
    n = len(candidates)
    order = [candidates[(start + k) % n] for k in range(n)]
    return min(order, key=lambda c: c.in_flight)


class RoundRobinPolicy(Policy):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, candidates: Sequence[Candidate], hashes_for: Callable[[WorkerView], Optional[list[int]]],
               now: float) -> Decision:
        c = candidates[next(self._next) % len(candidates)]
        return Decision(c.index, "round_robin", Match())


class LeastRequestsPolicy(Policy):
    name = "least_requests"

    def __init__(self) -> None:
        self._next = itertools.count()

    def choose(self, candidates: Sequence[Candidate], hashes_for: Callable[[WorkerView], Optional[list[int]]],
               now: float) -> Decision:
        c = _least_loaded(candidates, next(self._next))
        return Decision(c.index, "least_requests", Match())


class CacheAwarePolicy(Policy):
    name = "cache_aware"

    def __init__(self, weights: TierWeights, balance_abs_threshold: int = 4, balance_rel_threshold: float = 1.5,
                 shared_storage: bool = True) -> None:
        if balance_abs_threshold < 0:
            raise ValueError(f"balance_abs_threshold must be >= 0, got {balance_abs_threshold}")
        if balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {balance_rel_threshold}")
        self.weights = weights
        self.balance_abs_threshold = balance_abs_threshold
        self.balance_rel_threshold = balance_rel_threshold
        self.shared_storage = shared_storage
        self._next = itertools.count()

    def imbalanced(self, loads: Sequence[int]) -> bool:
        hi, lo = max(loads), min(loads)
        return hi - lo > self.balance_abs_threshold and hi > self.balance_rel_threshold * lo

    def choose(self, candidates: Sequence[Candidate], hashes_for: Callable[[WorkerView], Optional[list[int]]],
               now: float) -> Decision:
        start = next(self._next)
        loads = [c.in_flight for c in candidates]
        pool: Sequence[Candidate] = candidates
        if self.imbalanced(loads):
            ceiling = min(loads) + self.balance_abs_threshold
            pool = [c for c in candidates if c.in_flight <= ceiling]
        matches = [self._match(c, candidates, hashes_for, now) for c in pool]
        best = max(m.score for m in matches)
        balanced = pool is candidates
        if best <= 0.0:
            c = _least_loaded(pool, start)
            return Decision(c.index, "no_match" if balanced else "balance", Match())
        tied = [c for c, m in zip(pool, matches) if m.score >= best - 1e-9]
        c = _least_loaded(tied, start)
        return Decision(c.index, "cache" if balanced else "balance", matches[pool.index(c)])

    def _match(self, c: Candidate, candidates: Sequence[Candidate],
               hashes_for: Callable[[WorkerView], Optional[list[int]]], now: float) -> Match:
        hashes = hashes_for(c.view)
        if not hashes:
            return Match()
        shared = [o.view for o in candidates if o is not c] if self.shared_storage else ()
        return c.view.match(hashes, self.weights, shared, c.pending, now)


def make_policy(name: str, weights: TierWeights, balance_abs_threshold: int, balance_rel_threshold: float,
                shared_storage: bool) -> Policy:
    if name == "cache_aware":
        return CacheAwarePolicy(weights, balance_abs_threshold, balance_rel_threshold, shared_storage)
    if name == "round_robin":
        return RoundRobinPolicy()
    if name == "least_requests":
        return LeastRequestsPolicy()
    raise ValueError(f"policy: {name!r} is not one of {', '.join(POLICIES)}")
