"""Free-block pools of one tier (device or host) with ascending, consecutive allocation.

Why ascending: the copy ops merge consecutive block ids into one ``cudaMemcpyAsync``
run, so a swap of ids ``[40, 41, 42, 43]`` is one DMA where ``[40, 7, 93, 12]`` is
four.  A LIFO free list (the classic O(1) choice) hands back whatever was freed last
and scatters ids after a few minutes of traffic.  This pool always hands out the
*lowest* free ids instead, which keeps allocations packed at the bottom of the pool
and makes a multi-block allocation a consecutive run whenever one exists there.

How, in O(1): ids are grouped in buckets of 64; each bucket is a 64-bit mask of its
free ids (a Python int), and the lowest free id of a bucket is one bit trick
(``mask & -mask``).  A small heap orders the non-empty buckets, so switching to the
next bucket costs O(log(num_blocks / 64)) -- 11 levels for 100k blocks -- once per
64 allocations at most.  Freeing sets one bit.

``allocate(n, contiguous=True)`` is for multi-block allocations (a request's blocks,
the destinations of one copy): it prefers runs of consecutive ids over the lowest
ids.  It takes wholly free buckets (a second heap tracks them) and looks for a run
of the remaining length in a bounded number of candidate buckets (a shift-and of
the mask), so it stays O(1) per id; when no run is found it falls back to the lowest
ids.  With ``longest_runs`` (copy destinations), when the free set is small compared
to ``n`` (a full pool, where eviction just released about ``n`` ids), it lists the
free set and takes the longest runs first, which costs about as much as handing out
the ``n`` ids does.  NOTE: only for copy destinations: for ordinary blocks it leaves
short fragments that later single-block allocations scatter over (measured worse).
"""

from __future__ import annotations

import heapq
import logging
from typing import Iterable, Optional

from fastdeploy_kvcache.core.metadata import CacheLevel

logger = logging.getLogger(__name__)

_BUCKET_BITS = 6
_BUCKET = 1 << _BUCKET_BITS
_BUCKET_MASK = _BUCKET - 1
_RUN_SEARCH = 8  # candidate buckets a contiguous allocation looks at (keeps it O(1))
_SMALL_POOL_MIN = 8  # contiguous allocations this big may list a small free set


class BlockPoolError(ValueError):
    """A pool was asked to free an id it never handed out, or to free one twice."""


class NoFreeBlocksError(RuntimeError):
    """Not enough free blocks for an allocation (raised before anything is taken).

    ``retryable`` tells an engine what to do about it: True when enough blocks are
    cached but some are pinned by copies still in flight, so the same call succeeds
    once ``CacheManager.complete_swap`` has seen them back; False when the blocks are
    not there even then (running requests hold them: wait for finishes, or preempt).
    """

    def __init__(self, message: str, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class BlockPool:
    """Free/allocated bookkeeping of ``num_blocks`` ids of one tier.

    The pool knows only whether an id is free.  Who owns an allocated id (a running
    request, a cached tree node, an in-flight copy) is the cache manager's business.

    ``num_ready`` (default: all): only ids below it exist yet.  A host tier whose memory is
    still being pinned starts with the ids that landed and gains the rest through
    :meth:`extend_ready`, in ascending order; an id at or above ``num_ready`` is neither free
    nor allocated, so nothing can be handed out before its memory is there.  Every count
    (``num_free``, ``num_used``, free + owned + cached) is over the ready ids.
    """

    def __init__(self, num_blocks: int, level: CacheLevel = CacheLevel.DEVICE,
                 num_ready: Optional[int] = None) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 0:
            raise ValueError(f"num_blocks must be an int >= 0, got {num_blocks!r}")
        if num_ready is None:
            num_ready = num_blocks
        if not isinstance(num_ready, int) or isinstance(num_ready, bool) or not 0 <= num_ready <= num_blocks:
            raise ValueError(f"num_ready must be an int in [0, {num_blocks}], got {num_ready!r}")
        self.num_blocks = num_blocks
        self.num_ready = num_ready
        self.level = level
        self._masks: list[int] = []
        self._heap: list[int] = []  # bucket indices with at least one free id
        self._in_heap: list[bool] = []
        self._full_heap: list[int] = []  # bucket indices that were wholly free when pushed
        self._in_full: list[bool] = []
        self._full_masks: list[int] = []
        self._num_free = 0
        self.reset()

    def reset(self) -> None:
        """Mark every ready id free."""
        nb = (self.num_blocks + _BUCKET - 1) >> _BUCKET_BITS
        ready = self.num_ready
        full = (1 << _BUCKET) - 1
        whole = ready >> _BUCKET_BITS  # buckets wholly ready
        self._masks = [full] * whole + [0] * (nb - whole)
        if ready & _BUCKET_MASK:
            self._masks[whole] = (1 << (ready & _BUCKET_MASK)) - 1
        live = whole + (1 if ready & _BUCKET_MASK else 0)
        self._heap = list(range(live))  # already a heap (sorted)
        self._in_heap = [True] * live + [False] * (nb - live)
        self._full_masks = list(self._masks)
        self._full_heap = list(range(live))
        self._in_full = [True] * live + [False] * (nb - live)
        self._num_free = ready

    def extend_ready(self, num_ready: int) -> int:
        """Ids ``[self.num_ready, num_ready)`` have landed: they join the free set.

        Returns how many joined (0 when ``num_ready`` is not above the current count: ids
        never leave).  O(new ids / 64 + log buckets).
        """
        if not isinstance(num_ready, int) or isinstance(num_ready, bool) or num_ready > self.num_blocks:
            raise ValueError(f"num_ready must be an int <= {self.num_blocks}, got {num_ready!r}")
        lo, hi = self.num_ready, num_ready
        if hi <= lo:
            return 0
        masks, full_masks = self._masks, self._full_masks
        for b in range(lo >> _BUCKET_BITS, ((hi - 1) >> _BUCKET_BITS) + 1):
            first = max(lo, b << _BUCKET_BITS) & _BUCKET_MASK
            last = min(hi, (b + 1) << _BUCKET_BITS) - (b << _BUCKET_BITS)  # exclusive, 1..64
            bits = ((1 << (last - first)) - 1) << first
            masks[b] |= bits
            full_masks[b] |= bits
            if not self._in_heap[b]:
                heapq.heappush(self._heap, b)
                self._in_heap[b] = True
            if masks[b] == full_masks[b] and not self._in_full[b]:
                heapq.heappush(self._full_heap, b)
                self._in_full[b] = True
        self.num_ready = hi
        self._num_free += hi - lo
        return hi - lo

    # ------------------------------------------------------------------ queries
    @property
    def num_free(self) -> int:
        return self._num_free

    @property
    def num_used(self) -> int:
        return self.num_ready - self._num_free

    def is_free(self, block_id: int) -> bool:
        self._check_range(block_id)
        return bool(self._masks[block_id >> _BUCKET_BITS] >> (block_id & _BUCKET_MASK) & 1)

    def usage(self) -> float:
        return self.num_used / self.num_ready if self.num_ready else 0.0

    # ------------------------------------------------------------------ allocate / free
    def allocate(self, n: int, contiguous: bool = False, longest_runs: bool = False) -> list[int]:
        """Take ``n`` free ids.  Raises NoFreeBlocksError, taking none.

        Default: the ``n`` lowest free ids, ascending.  ``contiguous=True``: prefer
        runs of consecutive ids, see the module docstring.  ``longest_runs=True``
        (with ``contiguous``; for the destinations of one copy): when the free set is
        small, take its longest runs first.
        """
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"cannot allocate {n!r} blocks")
        if n > self._num_free:
            raise NoFreeBlocksError(f"{self.level.name} pool: need {n} blocks, {self._num_free} free")
        if contiguous and n > 1:
            if longest_runs and n >= _SMALL_POOL_MIN and self._num_free <= 2 * n + _BUCKET:
                out = self._take_longest_runs(n)
            else:
                out = self._take_runs(n)
                if len(out) < n:
                    out.extend(self._take_lowest(n - len(out)))
            self._num_free -= n
            return out
        out = self._take_lowest(n)
        self._num_free -= n
        return out

    def _take_lowest(self, n: int) -> list[int]:
        out: list[int] = []
        masks = self._masks
        heap = self._heap
        remaining = n
        while remaining:
            b = heap[0]
            mask = masks[b]
            if not mask:  # stale entry: the bucket emptied after it was pushed
                heapq.heappop(heap)
                self._in_heap[b] = False
                continue
            base = b << _BUCKET_BITS
            while mask and remaining:
                low = mask & -mask
                out.append(base + low.bit_length() - 1)
                mask ^= low
                remaining -= 1
            masks[b] = mask
            if not mask:
                heapq.heappop(heap)
                self._in_heap[b] = False
        return out

    def _take_bits(self, b: int, start: int, length: int) -> list[int]:
        bits = ((1 << length) - 1) << start
        self._masks[b] &= ~bits
        base = (b << _BUCKET_BITS) + start
        return list(range(base, base + length))

    def _take_longest_runs(self, n: int) -> list[int]:
        """``n`` ids from the longest free runs, when the free set is small (steady state).

        Under memory pressure the free set is mostly what eviction just released,
        about ``n`` ids, so listing it costs about what allocating it does
        (O(free + non-empty buckets)).  Taking the longest runs first, instead of
        the lowest ids, keeps a copy's destinations in few runs.
        """
        ids: list[int] = []
        masks = self._masks
        # NOTE: _take_bits empties buckets without popping them; drop those stale entries
        # here so the heap (and this listing) stays proportional to the non-empty buckets.
        live = [b for b in self._heap if masks[b]]
        if len(live) != len(self._heap):
            for b in self._heap:
                if not masks[b]:
                    self._in_heap[b] = False
            live.sort()  # a sorted list is a valid heap
            self._heap = live
        for b in sorted(self._heap):
            mask = masks[b]
            base = b << _BUCKET_BITS
            while mask:
                low = mask & -mask
                ids.append(base + low.bit_length() - 1)
                mask ^= low
        runs: list[tuple[int, int]] = []  # (start, length)
        start = prev = ids[0]
        for i in ids[1:]:
            if i != prev + 1:
                runs.append((start, prev - start + 1))
                start = i
            prev = i
        runs.append((start, prev - start + 1))
        runs.sort(key=lambda r: (-r[1], r[0]))
        chosen: list[tuple[int, int]] = []
        left = n
        for start, length in runs:
            take = min(length, left)
            chosen.append((start, take))
            left -= take
            if not left:
                break
        chosen.sort()
        out: list[int] = []
        for start, take in chosen:
            out.extend(range(start, start + take))
        for bid in out:
            masks[bid >> _BUCKET_BITS] &= ~(1 << (bid & _BUCKET_MASK))
        return out

    def _take_runs(self, n: int) -> list[int]:
        """Up to ``n`` ids as few consecutive runs as cheaply possible (may return fewer)."""
        out: list[int] = []
        masks, full_masks, full_heap = self._masks, self._full_masks, self._full_heap
        # 1. wholly free buckets, lowest first, while at least a bucket's worth is left
        while n - len(out) >= _BUCKET and full_heap:
            b = full_heap[0]
            if masks[b] != full_masks[b] or full_masks[b] != (1 << _BUCKET) - 1:
                heapq.heappop(full_heap)
                self._in_full[b] = False
                continue
            heapq.heappop(full_heap)
            self._in_full[b] = False
            out.extend(self._take_bits(b, 0, _BUCKET))
        rest = n - len(out)
        if rest <= 0:
            return out
        # 2. continue the run into the next bucket, if its low bits are free
        if out:
            b = (out[-1] >> _BUCKET_BITS) + 1
            want = (1 << rest) - 1
            if b < len(masks) and masks[b] & want == want:
                return out + self._take_bits(b, 0, rest)
        # 3. a run of `rest` ids inside one of a few candidate buckets
        if rest < _BUCKET:
            # the top of the bucket heap: low, non-empty (or stale, then skipped) buckets
            candidates = self._heap[:_RUN_SEARCH]
            if full_heap:
                candidates.append(full_heap[0])
            for b in candidates:
                mask = masks[b]
                starts = mask
                span = 1
                while span < rest and starts:  # positions with `rest` free bits above them
                    step = min(span, rest - span)
                    starts &= starts >> step
                    span += step
                if starts:
                    start = (starts & -starts).bit_length() - 1
                    return out + self._take_bits(b, start, rest)
        return out

    def allocate_one(self) -> int:
        return self.allocate(1)[0]

    def free(self, block_ids: Iterable[int]) -> None:
        """Return ids to the pool.  Validates all of them first, so a bad id frees nothing."""
        ids = list(block_ids)
        masks = self._masks
        seen: set[int] = set()
        for bid in ids:
            self._check_range(bid)
            if bid >= self.num_ready:
                raise BlockPoolError(f"{self.level.name} block {bid} has not landed (ids below {self.num_ready} have)")
            if masks[bid >> _BUCKET_BITS] >> (bid & _BUCKET_MASK) & 1 or bid in seen:
                raise BlockPoolError(f"{self.level.name} block {bid} freed twice (it is already free)")
            seen.add(bid)
        for bid in ids:
            b = bid >> _BUCKET_BITS
            masks[b] |= 1 << (bid & _BUCKET_MASK)
            if not self._in_heap[b]:
                heapq.heappush(self._heap, b)
                self._in_heap[b] = True
            if masks[b] == self._full_masks[b] and not self._in_full[b]:
                heapq.heappush(self._full_heap, b)
                self._in_full[b] = True
        self._num_free += len(ids)

    def free_one(self, block_id: int) -> None:
        self.free((block_id,))

    def _check_range(self, block_id: int) -> None:
        if not isinstance(block_id, int) or isinstance(block_id, bool) or not 0 <= block_id < self.num_blocks:
            raise BlockPoolError(
                f"{self.level.name} block id {block_id!r} is not in this pool (0..{self.num_blocks - 1})"
            )

    def free_ids(self) -> list[int]:
        """All free ids, ascending (O(num_blocks); tests and debugging only)."""
        out = []
        for b, mask in enumerate(self._masks):
            while mask:
                low = mask & -mask
                out.append((b << _BUCKET_BITS) + low.bit_length() - 1)
                mask ^= low
        return out


def consecutive_share(ids: list[int]) -> float:
    """Share of ids that continue a run (``ids[i] == ids[i-1] + 1``); 1.0 for <= 1 id.

    The first id of every run is the one a copy op has to start afresh, so this is
    1 - runs / len: the figure the scheduler benchmark reports for swap ids.
    """
    if len(ids) <= 1:
        return 1.0
    cont = sum(1 for a, b in zip(ids, ids[1:]) if b == a + 1)
    return cont / (len(ids) - 1)


class PinnableBlockPool(BlockPool):
    """A host pool whose pinned ids are not handed out again while pinned.

    ``free`` of a pinned id is *deferred*: the id leaves its owner now (the tree may drop a
    host copy whose put is still reading it) but returns to the free set only when the
    last pin goes.  That is what guarantees "a host block being written to storage is not
    reallocated until the write completes" without the tree knowing about storage.
    """

    def reset(self) -> None:
        super().reset()
        self._pins: dict[int, int] = {}
        self._deferred: set[int] = set()

    @property
    def deferred(self) -> frozenset[int]:
        """Ids their owner freed while pinned: allocated, but owned by no one but the pin."""
        return frozenset(self._deferred)

    def is_pinned(self, block_id: int) -> bool:
        return block_id in self._pins

    @property
    def num_pinned(self) -> int:
        return len(self._pins)

    def pin_counts(self) -> dict[int, int]:
        """Pinned id -> how many pins it holds (a copy: for invariant checks)."""
        return dict(self._pins)

    def pin(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        for b in ids:
            self._check_range(b)
            if self.is_free(b) or b in self._deferred:
                raise BlockPoolError(f"{self.level.name} block {b} is free: only an allocated block can be pinned")
        for b in ids:
            self._pins[b] = self._pins.get(b, 0) + 1

    def unpin(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        for b in ids:
            if b not in self._pins:
                raise BlockPoolError(f"{self.level.name} block {b} is not pinned")
        release = []
        for b in ids:
            n = self._pins[b] - 1
            if n:
                self._pins[b] = n
                continue
            del self._pins[b]
            if b in self._deferred:
                self._deferred.discard(b)
                release.append(b)
        if release:
            super().free(release)

    def free(self, block_ids: Iterable[int]) -> None:
        ids = list(block_ids)
        now: list[int] = []
        later: list[int] = []
        for b in ids:
            if b in self._pins:
                if b in self._deferred or b in later:
                    raise BlockPoolError(f"{self.level.name} block {b} freed twice (its free is already deferred)")
                later.append(b)
            else:
                now.append(b)
        super().free(now)  # validates every id before changing anything
        self._deferred.update(later)
