"""``Scheduler``: which requests run in the next step, and how many tokens each computes.

It owns the waiting and running queues and the in-batch prefix hold.  Each step
(:meth:`Scheduler.schedule`), under ``--max-num-batched-tokens``:

1. **Running requests first**, in admission order: a decode, or the next chunk of a prefill.
   Their blocks are made resident (``KVPool.ensure_resident``); when blocks run out, the most
   recently admitted request is preempted (its computed blocks stay cached, so it resumes
   cheaply) and requeued at the front of the waiting queue.  A step that preempted admits
   nobody.
2. **Admissions** while there is budget and fewer than ``--max-num-seqs`` run: ``admit``
   (``match_prefix``) then ``ensure_resident``.  A waiting request whose next uncached block
   another running request is computing is held in place (in-batch prefix sharing,
   ``core/prefix_sharing.py``) and the next one is tried; a storage prefetch policy may hold
   the queue (``KVPool.prefetch_ready``).

After the forward pass the engine calls :meth:`Scheduler.commit_prefill`, which makes the
prompt blocks the step completed reusable so held requests start.  Arrivals' storage lookups
start from :meth:`Scheduler.prefetch_arrivals`, which knows which waiting requests the next
two steps may admit.

The engine keeps the request lifecycle: the scheduler fails a request (no blocks for it, a bad
admission) and drains the pool's copies through the two callables it is given.
"""

from __future__ import annotations

import collections
import itertools
import logging
import time
from typing import Callable, Optional

from fastdeploy_kvcache.core.block_pool import NoFreeBlocksError
from fastdeploy_kvcache.core.prefix_sharing import PrefixSharing
from fastdeploy_kvcache.engine.engine_request import EngineRequest
from fastdeploy_kvcache.engine.kv_pool import KVPool

logger = logging.getLogger(__name__)

__all__ = ["Scheduler", "ScheduledStep"]

# This step's requests with the tokens each computes, in batch order.
ScheduledStep = list[tuple[EngineRequest, int]]


class Scheduler:
    """The waiting and running queues, admission, preemption and the prefix hold."""

    def __init__(
        self, pool: KVPool, *, block_size: int, max_num_batched_tokens: int, max_num_seqs: int,
        prefix_hold_s: float, fail: Callable[[EngineRequest, str], None], drain_copies: Callable[[], None],
        after_admit: Optional[Callable[[EngineRequest], None]] = None,
    ) -> None:
        """``fail(er, error)``: finish ``er`` with an error (the engine's lifecycle; it calls
        :meth:`remove`).  ``drain_copies()``: wait for the pool's copies in flight and hand them
        back (they pin blocks).  ``after_admit(er)``: called as a request joins the running
        queue (PD decode).  ``prefix_hold_s``: the in-batch prefix hold's limit (0: off)."""
        self.pool = pool
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        # Under k-anonymity a request waits only for its own tenant's (or revealed) blocks.
        self.sharing = PrefixSharing(block_size, prefix_hold_s,
                                     k_anonymity=getattr(pool.manager, "k_anonymity", None))
        self._fail = fail
        self._drain_copies = drain_copies
        self._after_admit = after_admit
        self.waiting: collections.deque[EngineRequest] = collections.deque()
        self.running: list[EngineRequest] = []  # in admission order: the last one is preempted first
        # Arrivals whose storage lookup waits until the next two steps may admit them
        # (prefetch_arrivals).
        self._later_arrivals: list[EngineRequest] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ queues
    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_requests(self) -> bool:
        """Whether any request is running or waiting."""
        return bool(self.running or self.waiting)

    def requests(self) -> list[EngineRequest]:
        """The running requests, then the waiting ones (a copy: safe to finish them while iterating)."""
        return list(self.running) + list(self.waiting)

    def running_requests(self) -> list[EngineRequest]:
        """The running requests (a copy)."""
        return list(self.running)

    def add(self, er: EngineRequest) -> None:
        """Queue ``er`` at the back of the waiting queue."""
        self.waiting.append(er)

    def remove(self, er: EngineRequest) -> None:
        """``er`` is finishing: out of either queue and out of the prefix hold."""
        self.sharing.forget(er.request_id)
        if er in self.running:
            self.running.remove(er)
        if er in self.waiting:
            self.waiting.remove(er)

    def sharing_stats(self) -> dict[str, int]:
        return self.sharing.stats.as_dict()

    # ------------------------------------------------------------------ one step
    def schedule(self) -> ScheduledStep:
        """Pick this step's requests and token counts; make their blocks resident."""
        budget = self.max_num_batched_tokens
        block_size = self.block_size
        pool = self.pool
        out: ScheduledStep = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            er = self.running[i]
            r = er.req
            before = r.num_computed_tokens
            limit = pool.compute_limit(r)  # a storage split: its head's end, or a wait for its tail
            if r.num_computed_tokens > before:
                er.cached_storage += r.num_computed_tokens - before  # its fetched tail, loaded now
            n = min(r.num_total_tokens - r.num_computed_tokens, budget)
            if limit is not None:
                n = min(n, limit - r.num_computed_tokens)
            if n <= 0:
                i += 1
                continue
            if len(r.block_tables) * block_size >= r.num_computed_tokens + n:
                # NOTE: most decode steps need no new block: skip the pool's call (it would
                # only check the table and find nothing to do), the one per-request cost of
                # scheduling a running request.  Copies the pool queued meanwhile still go
                # with this step's batch (begin_step issues them).
                out.append((er, n))
                budget -= n
                i += 1
                continue
            try:
                pool.ensure_resident(r, r.num_computed_tokens + n)
            except NoFreeBlocksError as exc:
                if exc.retryable and pool.copies_in_flight:
                    self._drain_copies()
                    continue
                victim = self.running[-1]
                if victim is er and len(self.running) == 1:
                    self._fail(er, f"not enough KV blocks: {exc}")
                    continue
                self._preempt(victim)
                preempted = True
                continue  # retry er (or, if er was the victim, the next one)
            out.append((er, n))
            budget -= n
            i += 1
        if preempted:
            return out
        sharing = self.sharing
        sharing.begin_pass()
        k = 0  # requests held for a prefix another one computes stay in place; the next go first
        while k < len(self.waiting) and budget > 0 and len(self.running) < self.max_num_seqs:
            er = self.waiting[k]
            if er.finished:
                del self.waiting[k]
                continue
            r = er.req
            if not pool.prefetch_ready(r, engine_idle=not self.running and not out):
                break  # the storage prefetch policy holds it until its blocks are on host
            try:
                matched = pool.admit(r)
                if sharing.should_hold(r, matched):
                    k += 1
                    continue
                want = min(r.num_total_tokens, matched + budget)
                limit = pool.compute_limit(r)  # a storage split: compute its head first
                if limit is not None:
                    want = max(matched, min(want, limit))
                plan = pool.ensure_resident(r, want)
            except NoFreeBlocksError as exc:
                if not self.running and not out:
                    if exc.retryable or pool.copies_in_flight:
                        self._drain_copies()
                    else:
                        del self.waiting[k]
                        self._fail(er, f"not enough KV blocks: {exc}")
                break
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                logger.exception("admission of %s failed", er.request_id)
                del self.waiting[k]
                self._fail(er, f"{type(exc).__name__}: {exc}")
                continue
            del self.waiting[k]
            if not er.admitted:
                er.admitted = True
                er.admitted_time = time.monotonic()
                er.fetch = plan.storage_fetch
                er.cached_device = plan.num_device_hit_tokens
                er.cached_host = plan.num_host_hit_tokens
                er.cached_storage = plan.num_storage_hit_tokens
            sharing.admitted(r, r.num_computed_tokens)
            self.running.append(er)
            if self._after_admit is not None:
                self._after_admit(er)  # PD decode: the partial block from the store
            n = min(r.num_total_tokens - r.num_computed_tokens, budget,
                    len(r.block_tables) * block_size - r.num_computed_tokens)
            if n <= 0:
                continue
            out.append((er, n))
            budget -= n
        sharing.end_pass()
        return out

    def _preempt(self, er: EngineRequest) -> None:
        self.running.remove(er)
        self.sharing.leader_gone(er.request_id)
        self.pool.preempt(er.req)
        self.waiting.appendleft(er)
        self.num_preemptions += 1
        logger.debug("preempted %s", er.request_id)

    def commit_prefill(self, scheduled: ScheduledStep) -> None:
        """Make the prompt blocks this step completed reusable now (requests held for them
        start as soon as they are in, chunked prefill included).  Off with the sharing: a
        request's blocks are then reusable once it finishes, as before."""
        if not self.sharing.enabled:
            return
        for er, _ in scheduled:
            r = er.req
            if er.finished or r.num_computed_tokens > r.num_prompt_tokens + 1:
                continue  # decoding: its prompt blocks were committed already
            try:
                committed = self.pool.commit(r)
            except Exception:  # noqa: BLE001 - a missed commit only loses reuse
                logger.exception("committing the blocks of %s failed", er.request_id)
                continue
            self.sharing.leader_progress(er.request_id, committed)

    # ------------------------------------------------------------------ storage arrivals
    def prefetch_arrivals(self, arrived: list[EngineRequest]) -> None:
        """Start the storage lookup and fetch of requests just queued, while they wait.

        NOTE: the engine calls it after its inbox is empty, not per item: a lookup takes a
        millisecond or more, and a burst whose requests keep arriving during their own
        lookups would otherwise keep the engine in the inbox, its first request ready but not
        scheduled.  Requests arriving meanwhile are looked up after the next step.

        Only arrivals among the first ``2 * max_num_seqs`` waiting (those the next two steps
        may admit) are looked up now; the others wait in ``_later_arrivals`` until they are,
        since their lookups (a few tenths of a millisecond each, on this thread) would only
        delay the next step, and their fetches would slow its forward pass on a small machine.
        On an idle engine the fetches of those the next step admits are read here at once, on
        this thread, as one batch; the fetches of the step after
        run on the storage thread during the next step.
        NOTE: measured on a burst of 8 storage hits with ``--max-num-seqs 2`` on 2 cores:
        with every arrival looked up before the first step, that step started 22 ms after
        the burst (a burst of host hits: 5 ms) and its forward took 30 ms instead of 17
        (the other six fetches ran beside it); with only the first fetch read here, the
        second missed the first step and the whole burst ran a step late.
        """
        if not self.pool.prefetches_on_arrival:
            return
        slots = self.max_num_seqs
        position = {id(er): i for i, er in enumerate(itertools.islice(self.waiting, 2 * slots))}
        free = max(0, slots - len(self.running))
        idle = not self.running
        later, self._later_arrivals = self._later_arrivals, []
        ahead: list[tuple[int, EngineRequest]] = []
        for er in later + arrived:
            if er.finished or er.admitted:
                continue  # admitted meanwhile: its lookup ran at admission
            at = position.get(id(er))
            if at is None:
                self._later_arrivals.append(er)
            else:
                ahead.append((at, er))
        ahead.sort(key=lambda item: item[0])
        now = [er.req for at, er in ahead if idle and at < free]  # the next step's, on an idle engine
        rest = [er.req for at, er in ahead if not (idle and at < free)]
        for group, here in ((now, True), (rest, False)):
            if not group:
                continue
            try:
                self.pool.prefetch_on_arrival(group, engine_idle=here)
            except Exception:  # noqa: BLE001 - a prefetch never keeps a request out
                logger.warning("prefetch on arrival of %s failed", [r.request_id for r in group], exc_info=True)
