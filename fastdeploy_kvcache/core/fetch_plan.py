"""Fetch or recompute: how much of a stored prefix to read, planned against the recompute it replaces.

A prefix's KV does not depend on how its earlier blocks were obtained, so a storage hit of
``N`` blocks may be served by any mix of reading and recomputing.  A store slower than the
runner's prefill makes a hit slower than a miss; this module predicts both and picks the mix
that finishes first.  Pure Python, no I/O: the tier feeds it what it measures and asks it for
a :class:`FetchPlan` per request.

Two shapes of mix, each a pure function over two cost curves:

* :func:`choose_split` -- *recompute the head, fetch the tail, both at once*: recompute
  blocks ``0..k-1`` on the device while blocks ``k..N-1`` are read; finish =
  ``max(recompute(0, k), fetch(N - k))``.  What the storage tier applies (``concurrent=True``;
  how the tail waits for its head: ``core/storage_tier.py``, *Splits*).
* :func:`choose_leading` -- *fetch the head, then recompute the tail*: the request waits for
  blocks ``0..m-1`` and recomputes ``m..N-1`` after them; finish =
  ``fetch(m) + recompute(m, N)``.  For callers that cannot compute while they fetch.

:class:`FetchCostModel` holds the online estimates the curves come from:

* read bytes/s of the store (one estimate per backend name), from completed fetch jobs;
* the host -> device link's bytes/s (a prior until a runner reports measured loads);
* the runner's prefill tokens/s, by chunk size and context length (power-of-two buckets),
  from the engine's timed steps.

Each is an exponentially weighted mean (weight :data:`EWMA_WEIGHT` for the newest sample).
Priors: the link starts at :data:`LINK_PRIOR_BYTES_PER_S`; the read and prefill rates have
none.  **While either is unknown the plan is to fetch everything** (``reason="unknown"``):
that is the behaviour without a model, and the only way to measure the store at all.  A
store judged too slow to use is re-measured by a one-block fetch (``reason="probe"``) at most
every ``probe_interval_s``, so a store that got faster is noticed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from fastdeploy_kvcache import envs

__all__ = [
    "EWMA_WEIGHT",
    "LINK_PRIOR_BYTES_PER_S",
    "FetchCostModel",
    "FetchPlan",
    "Rate",
    "choose_leading",
    "choose_split",
]

EWMA_WEIGHT = 0.3
# Host -> device bytes/s before a runner reports a measured load: a PCIe 4.0 x16 link's
# practical rate.  It is rarely the bottleneck (a store or the prefill is slower), so a rough
# prior changes little.
LINK_PRIOR_BYTES_PER_S = 20e9


@dataclass(frozen=True)
class FetchPlan:
    """What to do with a stored prefix of ``fetch_blocks + recompute_blocks`` blocks.

    ``fetch_first``: index (within the stored prefix) of the first block to fetch; the
    fetched blocks are ``fetch_first .. fetch_first + fetch_blocks - 1`` and every other
    block is recomputed.  ``predicted_s``: the predicted finish time of the chosen mix;
    ``fetch_s``/``recompute_s``: its two parts; ``all_fetch_s``/``all_recompute_s``: the two
    pure choices, for comparison.  ``reason``: ``model`` (the cost curves chose), ``unknown``
    (a rate is not measured yet: fetch all), ``probe`` (a one-block fetch to re-measure a store
    judged too slow), ``off`` (planning is off: fetch all), ``forced`` (a benchmark's fixed split,
    ``FDKV_STORAGE_FORCE_FETCH_BLOCKS``).
    """

    fetch_first: int
    fetch_blocks: int
    recompute_blocks: int
    predicted_s: float
    fetch_s: float
    recompute_s: float
    all_fetch_s: float
    all_recompute_s: float
    reason: str = "model"

    @property
    def num_blocks(self) -> int:
        return self.fetch_blocks + self.recompute_blocks

    @property
    def kind(self) -> str:
        """``fetch_all``, ``recompute_all`` or ``partial``."""
        if self.recompute_blocks == 0:
            return "fetch_all"
        if self.fetch_blocks == 0:
            return "recompute_all"
        return "partial"


FetchCurve = Callable[[int], float]  # seconds to fetch n blocks
RecomputeCurve = Callable[[int, int], float]  # seconds to recompute blocks [a, b) of the prefix


def choose_split(num_blocks: int, fetch_s: FetchCurve, recompute_s: RecomputeCurve) -> FetchPlan:
    """Recompute blocks ``0..k-1`` while fetching ``k..N-1``: the ``k`` with the earliest finish.

    ``k = 0`` fetches all, ``k = N`` recomputes all.  Ties go to the smaller ``k`` (fetching
    costs the device nothing).  ``O(N)`` curve evaluations.
    """
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    best_k, best = 0, math.inf
    for k in range(num_blocks + 1):
        t = max(recompute_s(0, k) if k else 0.0, fetch_s(num_blocks - k) if k < num_blocks else 0.0)
        if t < best:
            best_k, best = k, t
    f = fetch_s(num_blocks - best_k) if best_k < num_blocks else 0.0
    r = recompute_s(0, best_k) if best_k else 0.0
    return FetchPlan(best_k, num_blocks - best_k, best_k, best, f, r, fetch_s(num_blocks) if num_blocks else 0.0,
                     recompute_s(0, num_blocks) if num_blocks else 0.0)


def choose_leading(num_blocks: int, fetch_s: FetchCurve, recompute_s: RecomputeCurve) -> FetchPlan:
    """Fetch blocks ``0..m-1``, then recompute ``m..N-1``: the ``m`` with the earliest finish.

    ``m = N`` fetches all, ``m = 0`` recomputes all.  Ties go to the larger ``m``.
    """
    if num_blocks < 0:
        raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
    best_m, best = num_blocks, math.inf
    for m in range(num_blocks, -1, -1):
        t = (fetch_s(m) if m else 0.0) + (recompute_s(m, num_blocks) if m < num_blocks else 0.0)
        if t < best:
            best_m, best = m, t
    f = fetch_s(best_m) if best_m else 0.0
    r = recompute_s(best_m, num_blocks) if best_m < num_blocks else 0.0
    return FetchPlan(0, best_m, num_blocks - best_m, best, f, r, fetch_s(num_blocks) if num_blocks else 0.0,
                     recompute_s(0, num_blocks) if num_blocks else 0.0)


class Rate:
    """An exponentially weighted mean of ``amount / seconds`` samples (None until the first)."""

    def __init__(self, prior: Optional[float] = None, weight: float = EWMA_WEIGHT) -> None:
        if not 0.0 < weight <= 1.0:
            raise ValueError(f"EWMA weight must be in (0, 1], got {weight}")
        self.value = prior
        self.weight = weight
        self.samples = 0
        self.last_sample_at = -math.inf

    def observe(self, amount: float, seconds: float, now: float = 0.0) -> None:
        """One measurement; samples with no amount or no time are ignored."""
        if amount <= 0 or seconds <= 0:
            return
        r = amount / seconds
        self.value = r if self.samples == 0 else (1.0 - self.weight) * self.value + self.weight * r  # type: ignore[operator]
        self.samples += 1
        self.last_sample_at = now


def _bucket(x: int) -> int:
    """Power-of-two bucket of a positive count (1, 2, 4, ...)."""
    return 1 << max(0, int(x) - 1).bit_length()


class FetchCostModel:
    """Online rates and the per-request plan (see the module docstring).

    Args:
        block_size: tokens per block.
        chunk_tokens: the prefill chunk a recompute is predicted at (tokens a step computes
            for one request); raised to the largest prefill chunk a step was seen computing.
        probe_interval_s: a store judged too slow to use is read again (one block) after
            this long without a read of it.
        clock: monotonic seconds (the tier's clock).
    """

    def __init__(self, block_size: int, chunk_tokens: int = 1, probe_interval_s: float = 30.0,
                 clock: Callable[[], float] = lambda: 0.0) -> None:
        if block_size <= 0:
            raise ValueError(f"block_size must be > 0, got {block_size}")
        self.block_size = block_size
        self.chunk_tokens = max(1, int(chunk_tokens))
        self.probe_interval_s = probe_interval_s
        self.clock = clock
        self.read: dict[str, Rate] = {}
        self.link = Rate(prior=LINK_PRIOR_BYTES_PER_S)
        self.prefill: dict[tuple[int, int], Rate] = {}  # (chunk bucket, context bucket) -> tokens/s
        self.block_bytes = 0  # bytes of one stored block, learnt from the fetches

    # ------------------------------------------------------------------ measurements
    def observe_read(self, backend: str, nbytes: int, seconds: float, blocks: int) -> None:
        """A fetch job of ``blocks`` blocks read ``nbytes`` in ``seconds``."""
        if blocks > 0 and nbytes > 0:
            self.block_bytes = nbytes // blocks
        self.read.setdefault(backend, Rate()).observe(nbytes, seconds, self.clock())

    def observe_link(self, nbytes: int, seconds: float) -> None:
        """A host -> device load of ``nbytes`` took ``seconds`` (a runner that measures its loads)."""
        self.link.observe(nbytes, seconds, self.clock())

    def observe_prefill(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """One step's forward pass: ``chunks`` = (tokens, context before them) per request.

        Steps that mostly decode (fewer than half their tokens in chunks of more than one
        token) say little about prefill and are skipped.  The step's rate is filed under its
        largest chunk and that chunk's context end.
        """
        total = sum(n for n, _ in chunks)
        prefill = [(n, c) for n, c in chunks if n > 1]
        if not prefill or 2 * sum(n for n, _ in prefill) < total:
            return
        n, c = max(prefill)
        self.chunk_tokens = max(self.chunk_tokens, n)
        self.prefill.setdefault((_bucket(n), _bucket(c + n)), Rate()).observe(total, seconds, self.clock())

    # ------------------------------------------------------------------ estimates
    def read_rate(self, backend: str) -> Optional[float]:
        r = self.read.get(backend)
        return r.value if r is not None and r.samples else None

    def prefill_rate(self, chunk: int, context_end: int) -> Optional[float]:
        """Tokens/s for a chunk of ``chunk`` tokens ending at ``context_end`` (the nearest
        measured bucket, chunk size first; None before any prefill was measured)."""
        if not self.prefill:
            return None
        want = (_bucket(chunk), _bucket(context_end))
        r = self.prefill.get(want)
        if r is None:
            lc, lx = math.log2(want[0]), math.log2(want[1])
            key = min(self.prefill, key=lambda k: (abs(math.log2(k[0]) - lc), abs(math.log2(k[1]) - lx)))
            r = self.prefill[key]
        return r.value

    def rates(self, backend: str) -> dict[str, Optional[float]]:
        """The current estimates (for stats): read and link bytes/s, prefill tokens/s at one chunk."""
        return {"read_bytes_per_s": self.read_rate(backend), "link_bytes_per_s": self.link.value,
                "prefill_tokens_per_s": self.prefill_rate(self.chunk_tokens, self.chunk_tokens),
                "block_bytes": self.block_bytes}

    def curves(self, backend: str, start_block: int, num_blocks: int) -> Optional[tuple[FetchCurve, RecomputeCurve]]:
        """The fetch and recompute cost curves of a stored prefix of ``num_blocks`` blocks that
        starts at block ``start_block`` of the request (None while a rate is unknown).

        Recompute: each block costs ``block_size / prefill_rate(chunk, its context end)``;
        the sum over a range comes from prefix sums, so a curve call is O(1).  Fetch: read,
        then the host -> device load, serially (NOTE: conservative; the load is pipelined
        per layer with the prefill, and a job's fixed latency is folded into the read rate
        measured from whole jobs).
        """
        read = self.read_rate(backend)
        if read is None or not self.block_bytes or not self.prefill:
            return None
        bs = self.block_size
        cum = [0.0]
        chunk = min(self.chunk_tokens, max(1, num_blocks * bs))
        per_bucket: dict[int, float] = {}  # context bucket -> seconds per block
        for j in range(num_blocks):
            b = _bucket((start_block + j + 1) * bs)
            s = per_bucket.get(b)
            if s is None:
                s = per_bucket[b] = bs / max(1e-9, self.prefill_rate(chunk, b) or 1e-9)
            cum.append(cum[-1] + s)
        per_block = self.block_bytes / read + self.block_bytes / max(1.0, self.link.value or LINK_PRIOR_BYTES_PER_S)

        def fetch_s(n: int) -> float:
            return n * per_block

        def recompute_s(a: int, b: int) -> float:
            return cum[b] - cum[a]

        return fetch_s, recompute_s

    # ------------------------------------------------------------------ the decision
    def plan(self, backend: str, start_block: int, num_blocks: int, concurrent: bool = False) -> FetchPlan:
        """How to serve a stored prefix of ``num_blocks`` blocks starting at ``start_block``.

        ``concurrent``: the caller can recompute a head while fetching the tail
        (:func:`choose_split`); otherwise it fetches a leading run and recomputes after it
        (:func:`choose_leading`).  ``FDKV_STORAGE_FORCE_FETCH_BLOCKS`` (benchmarks only: the
        offline sweep of the split) replaces the choice with that many fetched blocks
        (``reason="forced"``; the tail with ``concurrent``, else the head).
        """
        curves = self.curves(backend, start_block, num_blocks)
        forced = envs.storage_force_fetch_blocks()
        if forced is not None:
            n = min(forced, num_blocks)
            k = num_blocks - n
            f_s, r_s = curves if curves is not None else (lambda _n: 0.0, lambda _a, _b: 0.0)
            f = f_s(n) if n else 0.0
            r = (r_s(0, k) if concurrent else r_s(n, num_blocks)) if k else 0.0
            return FetchPlan(k if concurrent else 0, n, k, max(f, r) if concurrent else f + r, f, r,
                             f_s(num_blocks) if num_blocks else 0.0, r_s(0, num_blocks) if num_blocks else 0.0,
                             reason="forced")
        if curves is None:
            return FetchPlan(0, num_blocks, 0, 0.0, 0.0, 0.0, 0.0, 0.0, reason="unknown")
        fetch_s, recompute_s = curves
        plan = (choose_split if concurrent else choose_leading)(num_blocks, fetch_s, recompute_s)
        r = self.read.get(backend)
        if (plan.fetch_blocks == 0 and num_blocks > 0 and r is not None
                and self.clock() - r.last_sample_at >= self.probe_interval_s):
            first = num_blocks - 1 if concurrent else 0
            rest = recompute_s(0, first) if concurrent else recompute_s(1, num_blocks)
            finish = max(fetch_s(1), rest) if concurrent else fetch_s(1) + rest
            return FetchPlan(first, 1, num_blocks - 1, finish, fetch_s(1), rest, plan.all_fetch_s,
                             plan.all_recompute_s, reason="probe")
        return plan
