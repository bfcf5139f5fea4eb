"""Scheduler side of the storage tier: which blocks are stored, prefetches and backups in flight.

Pure Python (no Paddle, no CuPy): it decides, the worker moves bytes.  It sits beside the
:class:`~fastdeploy_kvcache.core.cache_manager.CacheManager` and works through the host tier:

* **Matching.**  :meth:`StorageTier.query` asks the backend once per request
  (``batch_exists``: one round trip) how many of the blocks past the tree match it holds.
  Skipped while the backend says it is unavailable (set-up pending, breaker open).
* **Prefetch.**  Storage hits get host blocks (evicting host LRU leaves, as a backup
  would) and a :class:`StorageJob` ``STORAGE_LOAD``.  When the job comes back, the
  *leading run* of blocks that arrived whole becomes host-only tree nodes under the
  request's matched prefix; the request then matches them as host hits and loads them to
  the device layer by layer, like any host hit.  Blocks after a hole are freed and
  recomputed.  How much of a hit is fetched at all is planned per request against the
  recompute it replaces (:mod:`~fastdeploy_kvcache.core.fetch_plan`, :attr:`StorageTier.planner`),
  see *Splits* below.  The policy decides how long the request waits: ``best_effort`` not at
  all, ``wait_complete`` until the job is back, ``timeout`` at most
  ``StorageConfig.prefetch_timeout_s(tokens)``.  A prefetch the request stopped waiting
  for is *aborted* for that request, but it keeps its host blocks until the job is back
  (a late get could still write them) and still inserts what arrived.  The engine starts a
  request's prefetch when it is queued (:meth:`StorageTier.prefetch_on_arrival`, within a
  host-block budget); the policy's wait is then counted from admission.
* **Splits.**  The plan recomputes the head ``0..k-1`` of a stored run while it reads the
  tail ``k..N-1`` (``choose_split``).  The tail's hashes chain from the head's, so it cannot
  hang in the tree before the head is there: its host blocks stay the tier's (in flight,
  then *held*) and the request is admitted at once.  The engine computes the head
  (:meth:`split_head_end` caps its chunks), commits it, and asks :meth:`attach_split_tail`
  to hang the tail below it (``None`` while a prefix-closed host tier needs the head's host
  copy first); the manager's ``extend_match`` then loads it like host hits and
  :meth:`end_split` counts it.  *Late tails:* a request whose head is done waits for its
  tail until the plan's predicted finish plus the longer of the tail's predicted recompute
  and half its predicted fetch (:meth:`split_tail_status` says ``late`` after that); a tail
  that arrived waits for its head (a host copy, a load under it) at most as long as
  recomputing it is predicted to take, or its read took (:meth:`wait_for_head`).  A late
  or failed tail, and the tail of a request that is gone, is dropped (:meth:`drop_split`):
  held blocks are freed at once, blocks in flight when their job is back; the request
  recomputes.
* **Backup.**  ``write_through``: a block is put when its device -> host copy succeeded
  (:meth:`on_host_copies`); ``write_back``: when the host tier evicts it
  (:meth:`on_host_evict`).  Hashes already stored, or being stored, are skipped.  A hash
  counts as stored only once its put returned ``Status.OK``.  The host block a put reads
  is *pinned* in the host pool (:class:`PinnableBlockPool`): the tree may drop its copy
  meanwhile, but the block is not reallocated (so not overwritten) until the put is back.

Every failure ends in "not on storage": a failed or partial get frees the host blocks it
had and the request recomputes those tokens; a failed put just leaves the hash unstored.

**The stored-set heals.**  What the tier believes is stored (``_stored``: puts that returned
OK, blocks a prefetch read) only saves puts; storage is the truth.  So it forgets a hash
when storage says otherwise: a miss in an existence check, a get that failed or read a
corrupt object, an object the backend removed on its own (byte cap, free-space floor, full
disk, corrupt: the backend's loss listener), and everything at once when the backend's
``generation`` changes (a restarted Mooncake master, a departed holder).  A forgotten block
is put again the next time it is computed.  The set is bounded (``stored_memory`` hashes,
least recently used forgotten first), so it never grows with the life of the process.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

from fastdeploy_kvcache.core.block_pool import PinnableBlockPool
from fastdeploy_kvcache.core.fetch_plan import FetchCostModel, FetchPlan
from fastdeploy_kvcache.core.metadata import BlockNode, CacheLevel, TransferKind, next_task_id
from fastdeploy_kvcache.core.storage_status import Status
from fastdeploy_kvcache.core.tier_port import StoragePort

logger = logging.getLogger(__name__)

__all__ = ["StorageJob", "StorageTier", "PinnableBlockPool", "PREFETCH_WAITING", "PREFETCH_READY"]

PREFETCH_WAITING = "waiting"
PREFETCH_READY = "ready"


@dataclass
class StorageJob:
    """One batch for the worker: load ``keys`` into, or store them from, ``host_block_ids``.

    Plain ints and strings (it crosses to the worker).  The worker fills ``results`` (per
    key: bytes read / ``0`` for a stored put, or a negative ``storage.Status``),
    ``error_kind`` when the whole batch failed (``StorageError.kind``), ``nbytes``,
    ``submitted_at`` and ``done_at`` (``time.monotonic()`` when the worker started it and when
    its backend call and copy ended) and ``seconds`` (the difference: the job alone, not the
    time it then waited to be collected).
    """

    kind: TransferKind
    keys: list[str]
    host_block_ids: list[int]
    hashes: list[int] = field(default_factory=list)
    task_id: int = field(default_factory=next_task_id)
    results: list[int] = field(default_factory=list)
    error_kind: Optional[str] = None
    nbytes: int = 0
    seconds: float = 0.0
    submitted_at: float = 0.0
    done_at: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in (TransferKind.STORAGE_LOAD, TransferKind.STORAGE_SAVE):
            raise ValueError(f"StorageJob.kind must be STORAGE_LOAD or STORAGE_SAVE, got {self.kind!r}")
        if len(self.keys) != len(self.host_block_ids):
            raise ValueError(f"StorageJob: {len(self.keys)} keys but {len(self.host_block_ids)} host blocks")

    def ok(self, i: int) -> bool:
        """Whether block ``i`` made it (a get read bytes; a put returned OK)."""
        if self.error_kind is not None or i >= len(self.results):
            return False
        r = self.results[i]
        return r > 0 if self.kind is TransferKind.STORAGE_LOAD else r == 0

    def leading_ok(self) -> int:
        """How many blocks from the first made it (:meth:`ok` for each, in one pass)."""
        if self.error_kind is not None:
            return 0
        load = self.kind is TransferKind.STORAGE_LOAD
        for i, r in enumerate(self.results):
            if (r <= 0) if load else (r != 0):
                return i
        return len(self.results)


@dataclass
class _Prefetch:
    """A prefetch for one request (scheduler-private)."""

    request_id: str
    start: int  # block index of the first fetched block in the request
    hashes: list[int]  # the request's chain up to the end of the fetch
    job: StorageJob
    started: float
    deadline: float  # when the request stops waiting (inf: wait_complete; start: best_effort)
    done: bool = False
    aborted: bool = False
    inserted: list[BlockNode] = field(default_factory=list)
    on_arrival: bool = False  # started when the request was queued (its deadline starts at admission)
    completed: float = 0.0  # clock() when the scheduler inserted what arrived
    plan: Optional[FetchPlan] = None  # the fetch-or-recompute choice that sized the job
    # A split (recompute the head while the tail is read): blocks ``start - head .. start - 1``
    # of the request are recomputed by it; the fetched tail waits outside the tree (held by
    # this record) until they are in the tree, then hangs below them.
    head: int = 0
    arrived: int = 0  # split: leading tail blocks that arrived whole (held until attached)
    tail_deadline: float = math.inf  # split: the request stops waiting for its tail then
    head_wait: bool = False  # split: the arrived tail waits for its head (wait_for_head)
    record: dict[str, Any] = field(default_factory=dict)  # the request's plan record (timings)


class StorageTier:
    """Scheduler-side storage state for one CacheManager (see the module docstring).

    The tier is handed to ``CacheManager(config, storage=tier)``, which builds a
    :class:`PinnableBlockPool` as host pool and binds the tier (:meth:`bind`) to a
    :class:`~fastdeploy_kvcache.core.tier_port.StoragePort` it owns: every read of the tree,
    every node the tier adds and every host block it takes, frees or pins goes through that
    port, so a tier serves one manager, from its first request on.

    Args:
        backend: anything with ``batch_exists(keys) -> int`` and ``health().available``.
        namespace: a ``storage.keys.KeyNamespace`` (keys are formed only by it).
        config: a ``storage.config.StorageConfig`` (policies, prefetch timeout).
        clock: monotonic seconds (tests pass a fake one).
        max_put_batch: blocks per put job.
        stored_memory: most hashes remembered as stored (about 130 bytes each); past it the
            least recently used are forgotten (merely put again if computed again).
        on_miss: called with the hashes of a query whose first block the store lacks (the
            engine looks there for the same blocks in another KV format, to say why they
            miss); it must be cheap and never raise.
    """

    def __init__(
        self,
        backend: Any,
        namespace: Any,
        config: Any,
        clock: Callable[[], float] = time.monotonic,
        max_put_batch: int = 64,
        stored_memory: int = 1 << 18,
        on_miss: Optional[Callable[[Sequence[int]], None]] = None,
    ) -> None:
        self.on_miss = on_miss
        self.port: Optional[StoragePort] = None  # set by bind(), which the CacheManager calls
        # Fetch or recompute, per request; built by bind() (it needs the block size).  The
        # engine feeds it prefill timings (observe_prefill), the tier its fetch jobs.
        self.planner: Optional[FetchCostModel] = None
        self.backend_name = str(getattr(backend, "name", "store"))
        self.backend = backend
        self.ns = namespace
        self.config = config
        self.clock = clock
        self.max_put_batch = max_put_batch
        # Hashes whose put returned OK, most recent last (bounded memory: a hash forgotten
        # here is merely put again, and a stored key the backend evicted is a miss later).
        self._stored: "collections.OrderedDict[int, None]" = collections.OrderedDict()
        self._stored_memory = stored_memory
        # Keys the backend lost on its own (any of its threads appends; the scheduler drains).
        self._lost: "collections.deque[str]" = collections.deque()
        if hasattr(backend, "set_loss_listener"):
            backend.set_loss_listener(self._lost.extend)
        # Hashes reported lost while their own put was in flight (a later key of the same
        # batch evicted them): their OK must not count as stored.
        self._lost_while_putting: set[int] = set()
        self._generation = self._backend_generation()
        self._put_queue: "collections.deque[tuple[int, int]]" = collections.deque()  # (hash, host block)
        self._putting: dict[int, int] = {}  # hash -> host block (queued or in flight)
        self._jobs: dict[int, Any] = {}  # task id -> _Prefetch or StorageJob (puts)
        self._prefetch: dict[str, _Prefetch] = {}
        # Concurrent splits by request: the head is recomputed while the tail is fetched; the
        # tail's host blocks are the tier's (in flight, then held) until attached or dropped.
        self._splits: dict[str, _Prefetch] = {}
        self._no_prefetch: set[str] = set()  # requests checked, nothing to fetch (until admitted)
        # Requests waiting on another request's prefetch: id -> (that prefetch, own deadline).
        self._followers: dict[str, tuple[_Prefetch, float]] = {}
        self._prefetch_blocks: set[int] = set()  # host blocks owned by gets in flight
        # Requests whose prefetch started on arrival: their wait starts at admission.
        self._arrived: set[str] = set()
        self._outbox: list[StorageJob] = []
        # Shutdown flush (flush_candidates): every policy puts backups; hashes whose put
        # failed during it are not tried again.
        self._flushing = False
        self._flush_failed: set[int] = set()
        # Hashes the flush stored: one the store then loses is not written again (a store that
        # evicts on its own would otherwise take every put of the flush in turn, forever).
        self._flush_written: set[int] = set()
        self._flush_full = 0  # flush puts the store refused as full: the flush stops
        self.stats: dict[str, float] = collections.defaultdict(float)  # type: ignore[assignment]
        for k in ("exists_calls", "query_blocks", "hit_blocks", "prefetch_jobs", "prefetch_blocks_issued",
                  "prefetch_blocks_loaded", "prefetch_blocks_failed", "prefetch_blocks_inserted",
                  "prefetch_blocks_unused", "aborted_prefetches", "put_blocks_issued", "put_blocks_ok",
                  "put_blocks_failed", "put_skipped_stored", "storage_hit_tokens", "read_bytes",
                  "read_seconds", "write_bytes", "write_seconds", "unavailable_skips", "query_errors",
                  "prefetch_blocks_shared", "arrival_prefetch_jobs", "arrival_prefetch_blocks",
                  "arrival_prefetch_over_budget", "prefetch_jobs_inline",
                  "stored_forgotten", "store_generation_changes",
                  # fetch or recompute: plans by outcome, blocks by choice, predicted and actual time
                  "plan_fetch_all", "plan_recompute_all", "plan_partial", "plan_unknown", "plan_probes",
                  "plan_blocks_fetched", "plan_blocks_recomputed", "plan_predicted_s",
                  "plan_fetch_predicted_s", "plan_fetch_actual_s", "plan_recompute_predicted_s",
                  # per-request actual finish (plan to stored prefix ready), over the requests measured
                  "plan_actual_s", "plan_actual_requests",
                  # concurrent splits: tails attached, late (recomputed instead), failed (nothing arrived)
                  "plan_splits", "plan_tails_attached", "plan_tails_late", "plan_tails_failed",
                  "plan_tail_blocks_attached"):
            self.stats[k] = 0
        self.errors: dict[str, int] = collections.defaultdict(int)

    @property
    def block_size(self) -> int:
        """Tokens per block: the port's (the manager's), 0 until :meth:`bind`."""
        return self.port.block_size if self.port is not None else 0

    def bind(self, port: StoragePort) -> None:
        """Serve the cache manager that owns ``port``; called once, by ``CacheManager``.

        Registers the tier as the port's host-eviction listener (write_back stores a host
        copy before the evictor drops it).  Raises ``ValueError`` when the tier already
        serves a manager, or there is no host tier to stage blocks through.
        """
        if self.port is not None:
            raise ValueError("this storage tier already serves a cache manager; make one tier per manager")
        if port.num_host_blocks == 0:
            raise ValueError("the storage tier needs a host tier (--swap-space > 0, or CacheConfig.num_host_blocks > 0)")
        self.port = port
        self.planner = FetchCostModel(port.block_size, clock=self.clock)
        port.listen_host_evictions(self)

    @property
    def _port(self) -> StoragePort:
        if self.port is None:
            raise ValueError("this storage tier serves no cache manager yet (CacheManager(config, storage=tier) binds it)")
        return self.port

    def attach_events(self, recorder: Any) -> None:
        """Report every hash that becomes stored or is forgotten to ``recorder`` (a
        ``core.kv_event_recorder.KVEventRecorder``): KV cache events of the storage tier."""
        from fastdeploy_kvcache.core.kv_event_recorder import StoredHashes

        self._stored = StoredHashes(recorder, self._stored)

    def stored_hashes(self) -> list[int]:
        """The hashes known to be stored (puts that returned OK), oldest first."""
        return list(self._stored)

    # ------------------------------------------------------------------ queries
    @property
    def write_back(self) -> bool:
        return self.config.put_policy == "write_back"

    def is_stored(self, block_hash: int) -> bool:
        self._heal()
        return block_hash in self._stored

    def mark_stored(self, hashes: Iterable[int]) -> None:
        """Hashes another writer of this process stored (a put that returned OK: the PD
        hand-off, engine/pd.py), so the backups skip them."""
        for h in hashes:
            self._remember(h)

    def _remember(self, h: int) -> None:
        self._stored[h] = None
        self._stored.move_to_end(h)
        while len(self._stored) > self._stored_memory:
            self._stored.popitem(last=False)

    def _forget(self, hashes: Iterable[int]) -> None:
        for h in hashes:
            if h in self._stored:
                del self._stored[h]
                self.stats["stored_forgotten"] += 1

    def _backend_generation(self) -> int:
        return int(getattr(self.backend, "generation", 0) or 0)

    def _heal(self) -> None:
        """Forget what the backend lost since the last call (see the module docstring)."""
        gen = self._backend_generation()
        if gen != self._generation:
            self._generation = gen
            self.stats["store_generation_changes"] += 1
            self.stats["stored_forgotten"] += len(self._stored)
            logger.info("storage generation changed (%d): forgetting %d stored blocks", gen, len(self._stored))
            self._stored.clear()
            self._lost.clear()
            return
        if not self._lost:
            return
        parse = self.ns.block_hash_of
        lost = []
        while self._lost:
            h = parse(self._lost.popleft())
            if h is None:
                continue
            if h in self._putting and h not in self._lost_while_putting:
                self._lost_while_putting.add(h)
                self.stats["stored_forgotten"] += 1
            lost.append(h)
        self._forget(lost)

    def known_prefix(self, hashes: Sequence[int]) -> list[int]:
        """The leading ``hashes`` known to be stored (puts that returned OK), no I/O."""
        self._heal()
        out: list[int] = []
        for h in hashes:
            if h not in self._stored:
                break
            out.append(h)
        return out

    def available(self) -> bool:
        self._heal()
        try:
            return bool(self.backend.available())
        except Exception:  # noqa: BLE001 - a broken available() means "off"
            logger.warning("storage available() raised; treating the tier as off", exc_info=True)
            return False

    def query(self, hashes: Sequence[int], keys: Optional[Sequence[str]] = None) -> int:
        """How many leading ``hashes`` storage holds, as one ``batch_exists`` round trip
        tells (0 when off); ``keys``: their keys, where the caller formed them already.

        A run of three or more blocks is probed at its first and last block only: both
        there reads as the whole run, because a run is written and hit together, so the
        store keeps or evicts it whole nearly always (a hole is found by the fetch, which
        inserts the leading run that arrived and frees the rest).  The first there but not
        the last: a second round trip asks for the whole run.  On the engine's thread this
        is two existence checks per request instead of one per block.
        """
        if not hashes:
            return 0
        if not self.available():
            self.stats["unavailable_skips"] += 1
            return 0
        if keys is None:
            keys = self.ns.keys(hashes)
        self.stats["exists_calls"] += 1
        self.stats["query_blocks"] += len(hashes)
        try:
            if len(keys) > 2:
                n = int(self.backend.batch_exists([keys[0], keys[-1]]))
                if n == 2:
                    n = len(keys)
                elif n == 1:
                    self.stats["exists_calls"] += 1
                    n = int(self.backend.batch_exists(keys))
            else:
                n = int(self.backend.batch_exists(keys))
        except Exception as exc:  # noqa: BLE001 - StorageError or anything: a miss
            kind = getattr(exc, "kind", "io")
            self.errors[kind] += 1
            self.stats["query_errors"] += 1
            logger.debug("storage exists failed (%s): treating as a miss", exc)
            return 0
        n = max(0, min(n, len(hashes)))
        if n == 0 and self.on_miss is not None:
            try:
                self.on_miss(hashes)
            except Exception:  # noqa: BLE001 - a diagnostic must not fail the lookup
                logger.debug("storage on_miss raised", exc_info=True)
        self.stats["hit_blocks"] += n
        if n < len(hashes):
            # NOTE: storage lacks block n, and the probe says nothing about the blocks after
            # it; the run was written together, so it was most likely lost together.  Forget
            # them all: the next computation stores every one again (an object still there
            # is merely overwritten), where forgetting block n alone healed one block per
            # recompute.
            self._forget(hashes[n:])
        return n

    # ------------------------------------------------------------------ prefetch
    def prefetch_state(self, request: Any) -> str:
        """Start (once) or check the request's prefetch; READY means: admit it now.

        Call before ``match_prefix`` + ``ensure_resident`` at admission.  The first call
        matches the request, asks storage about the blocks past the tree match and, for
        hits, allocates host blocks and queues a load job.
        """
        rid = request.request_id
        split = self._splits.get(rid)
        if split is not None:
            # A split never holds admission: the request recomputes its head meanwhile.
            if rid in self._arrived:
                self._arrived.discard(rid)
                split.tail_deadline = self._tail_deadline(split, self.clock())
            return PREFETCH_READY
        pf = self._prefetch.get(rid)
        if rid in self._arrived:
            # Started on arrival: the policy's wait is counted from the first admission try.
            self._arrived.discard(rid)
            if pf is not None and not pf.done:
                pf.deadline = self._deadline(self.clock(), len(pf.job.hashes) * self.block_size)
            elif rid in self._followers:
                leader, _ = self._followers[rid]
                self._followers[rid] = (leader, self._deadline(self.clock(), len(leader.job.hashes) * self.block_size))
        if pf is None:
            if rid in self._no_prefetch:
                return PREFETCH_READY  # asked already (admission was retried): no new round trip
            if rid not in self._followers:
                pf = self._start_prefetch(request)
                if pf is not None and pf.head:
                    return PREFETCH_READY  # a split: admitted now, it recomputes its head
            if rid in self._followers:
                # Its blocks are being fetched for another request: wait for that job.
                leader, deadline = self._followers[rid]
                return PREFETCH_READY if leader.done or self.clock() >= deadline else PREFETCH_WAITING
            if pf is None:
                self._no_prefetch.add(rid)
                return PREFETCH_READY
        if pf.done:
            return PREFETCH_READY
        if self.clock() >= pf.deadline:
            if not pf.aborted:
                pf.aborted = True
                self.stats["aborted_prefetches"] += 1
                logger.debug("prefetch for %s aborted after %.3f s", rid, self.clock() - pf.started)
            return PREFETCH_READY
        return PREFETCH_WAITING

    def prefetch_on_arrival(self, request: Any, budget_blocks: int) -> None:
        """Start the request's lookup and prefetch now, while it waits in the queue.

        At most ``budget_blocks`` host blocks are held by arrival prefetches in flight; a
        request over the budget simply prefetches at admission, as without this.  Never
        refuses anything: the request is queued whatever happens here.
        """
        rid = request.request_id
        if rid in self._prefetch or rid in self._followers or rid in self._no_prefetch or rid in self._splits:
            return
        held = sum(len(pf.job.host_block_ids) for pf in (*self._prefetch.values(), *self._splits.values())
                   if pf.on_arrival and not pf.done)
        room = budget_blocks - held
        pf = self._start_prefetch(request, limit=room)
        if pf is not None:
            pf.on_arrival = True
            self.stats["arrival_prefetch_jobs"] += 1
            self.stats["arrival_prefetch_blocks"] += len(pf.job.hashes)
        elif room <= 0 and rid not in self._followers:
            self.stats["arrival_prefetch_over_budget"] += 1
            return  # asked again at admission
        elif rid not in self._followers:
            self._no_prefetch.add(rid)
        self._arrived.add(rid)

    def next_deadline(self) -> Optional[float]:
        """The earliest time a waiting request stops waiting (None if none waits)."""
        ds = [pf.deadline for pf in self._prefetch.values() if not pf.done and not pf.aborted]
        ds += [d for leader, d in self._followers.values() if not leader.done]
        ds += [pf.tail_deadline for pf in self._splits.values() if not pf.done and not pf.aborted]
        return min(ds) if ds else None

    def _deadline(self, now: float, num_tokens: int) -> float:
        policy = self.config.prefetch_policy
        if policy == "wait_complete":
            return float("inf")
        if policy == "timeout":
            return now + self.config.prefetch_timeout_s(num_tokens)
        return now  # best_effort: never waits

    def _start_prefetch(self, request: Any, limit: Optional[int] = None) -> Optional[_Prefetch]:
        port = self._port
        bs = self.block_size
        max_blocks = (request.num_total_tokens - 1) // bs
        if max_blocks <= 0 or not port.prefix_caching:
            return None
        hashes = request.block_hashes(bs, request.num_total_tokens)[:max_blocks]
        nodes = port.match(hashes, max_blocks)
        start = len(nodes)
        rest = hashes[start:]
        if not rest:
            return None
        # NOTE: a prefetch in flight already brings the next block (another request with
        # the same prefix): follow it instead of asking storage again; its blocks become
        # host hits for this request too.
        for other in self._prefetch.values():
            if not other.done and rest[0] in other.job.hashes:
                self._followers[request.request_id] = (other, self._deadline(self.clock(), len(rest) * bs))
                fetched = set(other.job.hashes)
                self.stats["prefetch_blocks_shared"] += next(
                    (i for i, h in enumerate(rest) if h not in fetched), len(rest))
                return None
        parent = nodes[-1] if nodes else None
        if not port.can_hang_host_nodes(parent) or (limit is not None and limit <= 0):
            return None
        rest_keys = self.ns.keys(rest)
        n = self.query(rest, rest_keys)
        if n < self.config.prefetch_min_blocks:
            return None
        # A block another request's prefetch is bringing in will be a host hit: stop there.
        inflight = {h for pf in self._prefetch.values() if not pf.done for h in pf.job.hashes}
        want: list[int] = []
        for h in rest[:n]:
            if h in inflight:
                break
            want.append(h)
        if limit is not None:
            want = want[: max(0, limit)]
        if not want:
            return None
        plan = self._plan(start, len(want))
        head = plan.fetch_first  # > 0: a concurrent split (the request recomputes the head)
        want = want[head: head + plan.fetch_blocks]
        if not want:
            return None
        # The matched prefix keeps its host copies: the fetched blocks hang below it (a split's
        # tail hangs below the head, once the request has recomputed it).
        host = port.allocate_host_blocks(len(want), frozenset(nodes))
        if not host:
            return None
        want = want[: len(host)]
        job = StorageJob(TransferKind.STORAGE_LOAD, list(rest_keys[head: head + len(want)]), list(host), list(want))
        now = self.clock()
        first = start + head
        record = {"choice": plan.kind, "reason": plan.reason, "fetched": plan.fetch_blocks,
                  "recomputed": plan.recompute_blocks, "head": head, "predicted_s": plan.predicted_s,
                  "actual_s": None} if plan.reason != "off" else {}
        if head:
            pf = _Prefetch(request.request_id, first, list(hashes[: first + len(want)]), job, now, now, plan=plan,
                           head=head, record=record)
            pf.tail_deadline = self._tail_deadline(pf, now)
            self._splits[request.request_id] = pf
            self.stats["plan_splits"] += 1
        else:
            deadline = self._deadline(now, len(want) * bs)
            pf = _Prefetch(request.request_id, start, list(hashes[: start + len(want)]), job, now, deadline,
                           plan=plan, record=record)
            self._prefetch[request.request_id] = pf
        self._prefetch_blocks.update(host)
        self._jobs[job.task_id] = pf
        self._outbox.append(job)
        self.stats["prefetch_jobs"] += 1
        self.stats["prefetch_blocks_issued"] += len(want)
        return pf

    def _tail_deadline(self, pf: _Prefetch, now: float) -> float:
        """When a split's request stops waiting for its tail (see "Late tails" in the module
        docstring): the plan's predicted finish, plus the longer of the tail's predicted
        recompute and half its predicted fetch (a fetch up to 1.5x its prediction is noise
        in a measured rate, not late).  A split with no prediction (a benchmark's forced split
        before the rates are measured) waits for its tail."""
        plan = pf.plan
        assert plan is not None
        if plan.predicted_s <= 0:
            return math.inf
        return now + plan.predicted_s + max(plan.all_recompute_s - plan.recompute_s, 0.5 * plan.fetch_s, 0.0)

    def _plan(self, start: int, num_blocks: int) -> FetchPlan:
        """Fetch or recompute for a stored run of ``num_blocks`` blocks at block ``start`` of
        its request; counts the choice.  The head ``0..k-1`` is recomputed while the tail is
        fetched (``choose_split``, ``concurrent=True``): the tail is held outside the tree
        until the request's head is in it (:meth:`attach_split_tail`)."""
        planner = self.planner
        assert planner is not None, "bind() builds the planner"
        if self.config.fetch_plan != "on":  # "off", or "auto" not resolved to on (the CPU): not counted
            return FetchPlan(0, num_blocks, 0, 0.0, 0.0, 0.0, 0.0, 0.0, reason="off")
        plan = planner.plan(self.backend_name, start, num_blocks, concurrent=True)
        st = self.stats
        st["plan_unknown" if plan.reason == "unknown" else "plan_" + plan.kind] += 1
        if plan.reason == "probe":
            st["plan_probes"] += 1
        st["plan_blocks_fetched"] += plan.fetch_blocks
        st["plan_blocks_recomputed"] += plan.recompute_blocks
        st["plan_predicted_s"] += plan.predicted_s
        st["plan_fetch_predicted_s"] += plan.fetch_s
        st["plan_recompute_predicted_s"] += plan.recompute_s
        if plan.reason != "unknown":
            logger.debug("fetch plan for %d stored blocks at block %d: fetch %d, recompute %d (%s); "
                         "predicted %.4f s (all fetched %.4f s, all recomputed %.4f s)", num_blocks, start,
                         plan.fetch_blocks, plan.recompute_blocks, plan.reason, plan.predicted_s,
                         plan.all_fetch_s, plan.all_recompute_s)
        return plan

    def observe_prefill(self, chunks: Sequence[tuple[int, int]], seconds: float) -> None:
        """One engine step's forward pass: (tokens, context before them) per request, and its
        seconds; the planner's recompute rate comes from these."""
        if self.planner is not None:
            self.planner.observe_prefill(chunks, seconds)

    def storage_hit_tokens(self, request: Any) -> int:
        """Tokens of the request's applied match that its own prefetch brought in (usage)."""
        pf = self._prefetch.get(request.request_id)
        if pf is None and request.request_id in self._followers:
            pf = self._followers[request.request_id][0]
        match = getattr(request, "match_result", None)
        if pf is None or not pf.inserted or match is None:
            return 0
        mine = {id(n) for n in pf.inserted}
        n = sum(1 for node, tier in zip(match.nodes, match.tiers) if tier is CacheLevel.HOST and id(node) in mine)
        return n * self.block_size

    def fetch_timing(self, request: Any) -> Optional[dict[str, Any]]:
        """Where the request's storage fetch stood, for its per-request timings (None: no
        fetch of its own or followed).  Call before :meth:`admitted`, which forgets it.

        Times are this tier's clock: ``started`` (the job was planned), ``landed`` (its
        backend call and copy ended; 0 if not yet), ``completed`` (its blocks joined the tree;
        0 if not yet); ``shared`` says the job was another request's.
        """
        rid = request.request_id
        pf = self._prefetch.get(rid) or self._splits.get(rid)
        shared = pf is None and rid in self._followers
        if shared:
            pf = self._followers[rid][0]
        if pf is None:
            return None
        job = pf.job
        # "plan": the request's own choice (the same dict is completed when a split's tail
        # is attached: its actual_s), absent for a followed job or with planning off.
        return {"shared": shared, "on_arrival": pf.on_arrival, "blocks": len(job.keys), "bytes": job.nbytes,
                "started": pf.started, "landed": job.done_at, "completed": pf.completed,
                "job_s": job.seconds if pf.done else 0.0, "plan": None if shared else (pf.record or None)}

    def forget_request(self, request_id: str) -> None:
        """The request finished, was aborted or preempted: stop tracking its prefetch, and
        drop its split (a held tail's host blocks go back now; one in flight, when its job
        is back)."""
        self._forget_prefetch(request_id)
        self.drop_split(request_id, "gone")

    # ------------------------------------------------------------------ concurrent splits
    def split_head_end(self, request_id: str) -> Optional[int]:
        """Token where the request's recomputed head ends and its fetched tail starts (None:
        no split).  The request must not compute past it while the split stands."""
        pf = self._splits.get(request_id)
        return None if pf is None else pf.start * self.block_size

    def split_tail_status(self, request_id: str) -> Optional[str]:
        """``waiting`` (its fetch is in flight and not late), ``ready`` (blocks arrived, held),
        ``late`` (in flight past its deadline), ``failed`` (back, nothing arrived); None: no split."""
        pf = self._splits.get(request_id)
        if pf is None:
            return None
        if not pf.done:
            return "waiting" if self.clock() < pf.tail_deadline else "late"
        return "ready" if pf.arrived else "failed"

    def wait_for_head(self, request_id: str) -> bool:
        """The request's tail arrived but its head cannot take it yet (the head needs a host
        copy first, or a load under it is not confirmed): whether to wait.  The wait is
        allowed for as long as recomputing the tail is predicted to take, or as its read
        took if longer, counted from the first call (then it is dropped as late)."""
        pf = self._splits.get(request_id)
        if pf is None:
            return False
        now = self.clock()
        if not pf.head_wait:
            pf.head_wait = True
            plan = pf.plan
            assert plan is not None
            pf.tail_deadline = now + max(plan.all_recompute_s - plan.recompute_s, pf.job.seconds, 0.0)
        return now < pf.tail_deadline

    def is_split_job(self, job: StorageJob) -> bool:
        """Whether ``job`` reads a split's tail (its request computes meanwhile: never run it
        inline on the engine's thread)."""
        entry = self._jobs.get(job.task_id)
        return isinstance(entry, _Prefetch) and entry.head > 0

    def attach_split_tail(self, request_id: str) -> Optional[int]:
        """Hang the request's arrived tail below its head, now in the tree, as host-only nodes
        (they are then host hits of the request: ``CacheManager.extend_match``; then call
        :meth:`end_split` with what it loaded).  Returns the blocks hung (duplicates of nodes
        already there count: the request reads those), or None when the head's last block
        may not have host-only children yet (a policy that keeps the host tier prefix-closed:
        the head needs its host copy first)."""
        pf = self._splits.get(request_id)
        if pf is None or not pf.done or not pf.arrived:
            return 0
        port = self._port
        prefix = pf.hashes[: pf.start]
        nodes = port.match(prefix, len(prefix))
        if len(nodes) < len(prefix):
            self.drop_split(request_id, "failed")  # the head did not make it into the tree
            return 0
        if not port.can_hang_host_nodes(nodes[-1] if nodes else None):
            return None
        n = pf.arrived
        blocks = pf.job.host_block_ids[:n]
        pf.arrived = 0  # no longer held: hung in the tree, or freed as duplicates
        inserted, used = port.insert_fetched_run(prefix, pf.job.hashes[:n], blocks)
        for node in inserted:
            self._remember(node.hash_value)
        pf.inserted.extend(inserted)
        self.stats["prefetch_blocks_inserted"] += len(inserted)
        self.stats["prefetch_blocks_unused"] += len(blocks) - used
        return used

    def end_split(self, request_id: str, loaded: int) -> None:
        """The request's tail was attached and ``loaded`` of its blocks are being loaded for it
        (``CacheManager.extend_match``): the split is over; its storage hit and actual finish
        (plan to now) are counted."""
        pf = self._splits.pop(request_id, None)
        if pf is None:
            return
        assert not pf.arrived, "end_split before attach_split_tail"
        st = self.stats
        st["plan_tails_attached"] += 1
        st["plan_tail_blocks_attached"] += loaded
        st["storage_hit_tokens"] += loaded * self.block_size
        actual = self.clock() - pf.started
        st["plan_actual_s"] += actual
        st["plan_actual_requests"] += 1
        if pf.record:
            pf.record["actual_s"] = actual
            pf.record["attached"] = loaded

    def drop_split(self, request_id: str, why: str) -> None:
        """End the request's split without attaching its tail (``late``, ``failed``: it
        recomputes the rest; ``gone``: finished, aborted or preempted).  Held blocks go back
        to the host pool now; a job still in flight frees its blocks when it is back."""
        pf = self._splits.pop(request_id, None)
        if pf is None:
            return
        if why == "late":
            self.stats["plan_tails_late"] += 1
        elif why == "failed":
            self.stats["plan_tails_failed"] += 1
        if pf.record:
            pf.record["dropped"] = why
        if not pf.done:
            pf.aborted = True  # _complete_prefetch frees its blocks
            return
        blocks = pf.job.host_block_ids[: pf.arrived]
        self._port.free_host_blocks(blocks)
        self.stats["prefetch_blocks_unused"] += len(blocks)

    def _forget_prefetch(self, request_id: str) -> None:
        """Stop tracking the request's prefetch (not its split: admission keeps that).

        A job still in flight keeps its host blocks and still inserts what arrives.
        """
        self._no_prefetch.discard(request_id)
        self._arrived.discard(request_id)
        self._followers.pop(request_id, None)
        pf = self._prefetch.get(request_id)
        if pf is None:
            return
        if pf.done:
            del self._prefetch[request_id]
        elif not pf.aborted:
            pf.aborted = True
            self.stats["aborted_prefetches"] += 1

    def admitted(self, request: Any) -> int:
        """Bookkeeping after the request's first ``ensure_resident``: its storage-hit tokens."""
        tokens = self.storage_hit_tokens(request)
        self.stats["storage_hit_tokens"] += tokens
        self._forget_prefetch(request.request_id)
        return tokens

    # ------------------------------------------------------------------ backup
    def on_host_copies(self, hashes: Sequence[int], host_block_ids: Sequence[int], success: bool) -> None:
        """write_through: device -> host copies came back; put the ones that succeeded.

        Call BEFORE the manager resolves them (``complete_swap``), so the host blocks are
        pinned while they are surely still allocated.
        """
        if not success or (self.write_back and not self._flushing):
            return
        self._heal()
        for h, b in zip(hashes, host_block_ids):
            self._queue_put(h, b)

    def on_host_evict(self, node: BlockNode) -> None:
        """write_back: the host tier is evicting ``node``'s copy; store it first (pinned)."""
        if self.write_back and node.host_block_id is not None and node.pending is None:
            self._heal()
            self._queue_put(node.hash_value, node.host_block_id)

    def _queue_put(self, h: int, b: int) -> None:
        if h in self._stored:
            self._stored.move_to_end(h)
            self.stats["put_skipped_stored"] += 1
            return
        if h in self._putting:
            return
        self._port.pin_host_blocks((b,))
        self._putting[h] = b
        self._put_queue.append((h, b))

    # ------------------------------------------------------------------ flush at shutdown
    def begin_flush(self) -> None:
        """From now on every device -> host copy is put (write_back too): the engine is
        stopping and writes what the store lacks (``StorageKVPool.flush_to_storage``).

        First the store is asked about every cached block the stored-set counts as stored
        (:meth:`vouch_cached`): what it lacks (deleted behind the server's back, say) is
        forgotten, so the flush writes it."""
        self._flushing = True
        self.vouch_cached()

    def vouch_cached(self) -> int:
        """Check every tree block believed stored against the store; forget the ones it
        lacks.  Returns how many were forgotten (0 when the store cannot answer: then the
        flush's puts fail anyway).  Existence checks in chunks: about one round trip per
        chunk plus one per missing block."""
        self._heal()
        hashes: list[int] = []
        for node in self._port.cached_nodes():
            if not node.detached and node.hash_value in self._stored:
                hashes.append(node.hash_value)
        missing = self._missing(hashes)
        self._forget(missing)
        if missing:
            logger.info("storage: %d of %d cached blocks counted as stored are missing from the store; "
                        "they are written again", len(missing), len(hashes))
        return len(missing)

    def _missing(self, hashes: Sequence[int], chunk: int = 256) -> list[int]:
        """The ``hashes`` whose objects the store lacks (``batch_exists`` counts present
        keys from the start, so each call skips past one missing key)."""
        missing: list[int] = []
        try:
            for lo in range(0, len(hashes), chunk):
                part = list(hashes[lo:lo + chunk])
                keys = self.ns.keys(part)
                i = 0
                while i < len(part):
                    i += max(0, int(self.backend.batch_exists(keys[i:])))
                    self.stats["exists_calls"] += 1
                    if i < len(part):
                        missing.append(part[i])
                        i += 1
        except Exception as exc:  # noqa: BLE001 - StorageError or anything: cannot vouch, keep what we knew
            self.errors[getattr(exc, "kind", "io")] += 1
            logger.debug("storage exists failed during a check (%s)", exc)
            return []
        return missing

    def flush_candidates(self) -> tuple[list[BlockNode], list[BlockNode]]:
        """Cached blocks the store lacks, parents first: (with a host copy, device-only).

        Parents first because a block is found only after every block before it (one
        existence check counts consecutive keys).  Blocks with a copy in flight, puts
        queued or in flight, and puts that failed during the flush are left out.
        """
        self._heal()
        host: list[BlockNode] = []
        device: list[BlockNode] = []
        for node in self._port.cached_nodes():
            h = node.hash_value
            if node.detached or node.pending is not None or h in self._stored or h in self._putting \
                    or h in self._flush_failed or h in self._flush_written:
                continue
            if node.host_block_id is not None:
                host.append(node)
            elif node.device_block_id is not None:
                device.append(node)
        return host, device

    @property
    def flush_failed_blocks(self) -> int:
        """Puts that failed during the flush (not tried again)."""
        return len(self._flush_failed)

    @property
    def flush_store_full(self) -> int:
        """Flush puts the store refused as full (``Status.FULL``): the flush stops at the first."""
        return self._flush_full

    @property
    def flush_lost_blocks(self) -> int:
        """Blocks the flush stored that the store has lost since (evicted by its own policy)."""
        return sum(1 for h in self._flush_written if h not in self._stored and h not in self._putting)

    def queue_flush_puts(self, nodes: Iterable[BlockNode]) -> int:
        """Queue puts of ``nodes``' host copies (the flush); returns how many were queued."""
        before = len(self._putting)
        for node in nodes:
            if node.host_block_id is not None and node.pending is None:
                self._queue_put(node.hash_value, node.host_block_id)
        return len(self._putting) - before

    def take_jobs(self) -> list[StorageJob]:
        """This step's jobs for the worker: prefetches started since, then queued puts."""
        out, self._outbox = self._outbox, []
        if self._put_queue and self.available():
            while self._put_queue:
                batch = [self._put_queue.popleft() for _ in range(min(self.max_put_batch, len(self._put_queue)))]
                hashes = [h for h, _ in batch]
                job = StorageJob(TransferKind.STORAGE_SAVE, self.ns.keys(hashes), [b for _, b in batch], hashes)
                self._jobs[job.task_id] = job
                self.stats["put_blocks_issued"] += len(batch)
                out.append(job)
        elif self._put_queue:
            # Tier off: drop the backups now rather than pin host blocks for an outage.
            self.errors["unreachable"] += len(self._put_queue)
            self.stats["put_blocks_failed"] += len(self._put_queue)
            while self._put_queue:
                h, b = self._put_queue.popleft()
                del self._putting[h]
                self._port.unpin_host_blocks((b,))
        return out

    # ------------------------------------------------------------------ completion
    def complete(self, job: StorageJob) -> None:
        """The worker's verdict on a job (any order).  Raises ValueError for an unknown job."""
        entry = self._jobs.pop(job.task_id, None)
        if entry is None:
            raise ValueError(f"storage job {job.task_id} is not in flight (foreign, or completed twice)")
        if job.error_kind is not None:
            self.errors[job.error_kind] += len(job.keys)
        if job.results and min(job.results) < 0:
            for r in job.results:
                if r < 0:
                    self.errors[_status_kind(r)] += 1
        if job.kind is TransferKind.STORAGE_LOAD:
            self.stats["read_bytes"] += job.nbytes
            self.stats["read_seconds"] += job.seconds
            self._complete_prefetch(entry, job)
        else:
            self.stats["write_bytes"] += job.nbytes
            self.stats["write_seconds"] += job.seconds
            self._complete_put(job)

    def _complete_put(self, job: StorageJob) -> None:
        self._heal()  # losses reported while the job ran (see _lost_while_putting)
        for i, (h, b) in enumerate(zip(job.hashes, job.host_block_ids)):
            self._putting.pop(h, None)
            lost = h in self._lost_while_putting
            self._lost_while_putting.discard(h)
            if job.ok(i):
                if not lost:  # else a later key of its own batch evicted it
                    self._remember(h)
                if self._flushing:
                    self._flush_written.add(h)
                self.stats["put_blocks_ok"] += 1
            else:
                self._forget((h,))
                self.stats["put_blocks_failed"] += 1
                if self._flushing:
                    self._flush_failed.add(h)
                    if i < len(job.results) and job.results[i] == Status.FULL:
                        self._flush_full += 1
            self._port.unpin_host_blocks((b,))

    def _complete_prefetch(self, pf: _Prefetch, job: StorageJob) -> None:
        """Insert the leading run that arrived as host-only nodes; free the rest.  A split's
        tail is held instead (its head is not in the tree yet), or freed when its request
        is gone."""
        pf.done = True
        pf.completed = self.clock()
        blocks = job.host_block_ids
        self._prefetch_blocks.difference_update(blocks)
        arrived = min(job.leading_ok(), len(blocks))
        if arrived and job.nbytes > 0 and self.planner is not None:
            read = sum(1 for r in job.results if r > 0)  # job.nbytes counts every block read
            self.planner.observe_read(self.backend_name, job.nbytes, job.seconds, read)
        if pf.plan is not None and pf.plan.reason not in ("unknown", "off"):
            self.stats["plan_fetch_actual_s"] += job.seconds
        self.stats["prefetch_blocks_loaded"] += arrived
        self.stats["prefetch_blocks_failed"] += len(blocks) - arrived
        # A block that did not arrive (miss, corrupt, error) is not known to be stored.
        if arrived < len(job.hashes):
            self._forget(h for i, h in enumerate(job.hashes) if not job.ok(i))
        if pf.head:
            # A split: the tail waits for its head outside the tree (or goes, if its request did).
            if pf.aborted or self._splits.get(pf.request_id) is not pf:
                self._port.free_host_blocks(blocks)
                self.stats["prefetch_blocks_unused"] += len(blocks)
                return
            pf.arrived = arrived  # blocks[:arrived] are held for the head (_held_tail_blocks)
            self._port.free_host_blocks(blocks[arrived:])
            if not arrived:
                self.drop_split(pf.request_id, "failed")
            return
        if pf.record and pf.plan is not None and pf.plan.recompute_blocks == 0:
            pf.record["actual_s"] = pf.completed - pf.started  # fetch-all: ready once in the tree
            self.stats["plan_actual_s"] += pf.record["actual_s"]
            self.stats["plan_actual_requests"] += 1
        # The port walks the request's chain to where the fetched blocks hang (it may have
        # changed), hangs the leading run there and frees every block it did not hang.
        inserted, used = self._port.insert_fetched_run(pf.hashes[: pf.start], job.hashes[:arrived], blocks)
        for node in inserted:
            self._remember(node.hash_value)
        pf.inserted.extend(inserted)
        self.stats["prefetch_blocks_inserted"] += len(inserted)
        self.stats["prefetch_blocks_unused"] += len(blocks) - used
        if pf.aborted:
            self._prefetch.pop(pf.request_id, None)

    # ------------------------------------------------------------------ checks / stats
    def _held_tail_blocks(self) -> list[int]:
        """Arrived tail blocks waiting for their head: each split's record says which."""
        return [b for pf in self._splits.values() if pf.done for b in pf.job.host_block_ids[: pf.arrived]]

    def held_host_blocks(self) -> list[tuple[int, str]]:
        """Host blocks the tier owns outside the tree: gets in flight, frees deferred by a pin."""
        return [(b, "storage get") for b in sorted(self._prefetch_blocks)] + [
            (b, "storage tail held for its head") for b in sorted(self._held_tail_blocks())] + [
            (b, "storage put (freed, pinned)") for b in sorted(self._port.deferred_host_blocks())
        ]

    def check_invariants(self) -> None:
        """The tier's own books (the manager's check_invariants counts held_host_blocks)."""
        port = self._port
        held = port.host_pin_counts()
        for b in self._prefetch_blocks:
            assert not port.host_block_is_free(b), f"prefetch host block {b} is free"
        held_tails = self._held_tail_blocks()
        assert len(set(held_tails)) == len(held_tails), "a host block held by two split tails"
        assert not self._prefetch_blocks.intersection(held_tails), "a host block both in flight and held"
        for b in held_tails:
            assert not port.host_block_is_free(b), f"held tail host block {b} is free"
        for h, b in self._putting.items():
            assert held.get(b, 0) > 0, f"put of {h:#x} reads host block {b}, which is not pinned"
        for b in port.deferred_host_blocks():
            assert held.get(b, 0) > 0, f"deferred host block {b} is not pinned"
        pins = collections.Counter(self._putting.values())
        for b, n in pins.items():
            assert held.get(b, 0) == n, f"host block {b}: {held.get(b, 0)} pins, {n} puts"
        assert sum(pins.values()) == sum(held.values()), "a pin with no put"
        assert self._lost_while_putting <= self._putting.keys(), "a lost-while-putting hash with no put"
        loads = {b for e in self._jobs.values() if isinstance(e, _Prefetch) for b in e.job.host_block_ids}
        assert loads == self._prefetch_blocks, "prefetch host blocks differ from the jobs in flight"

    @property
    def num_jobs_in_flight(self) -> int:
        return len(self._jobs) + len(self._outbox)

    def get_stats(self) -> dict[str, Any]:
        self._heal()  # the stored-set as of now (losses since the last step included)
        s: dict[str, Any] = dict(self.stats)
        s["errors"] = dict(self.errors)
        s["stored_blocks_known"] = len(self._stored)
        s["puts_pending"] = len(self._putting)
        s["prefetch_host_blocks"] = len(self._prefetch_blocks)
        s["held_tail_host_blocks"] = len(self._held_tail_blocks())
        s["splits_pending"] = len(self._splits)
        s["pinned_host_blocks"] = self._port.num_pinned_host_blocks
        s["jobs_in_flight"] = self.num_jobs_in_flight
        s["put_policy"] = self.config.put_policy
        s["prefetch_policy"] = self.config.prefetch_policy
        if self.planner is not None:
            s["plan_rates"] = self.planner.rates(self.backend_name)
        return s


def _status_kind(r: int) -> str:
    try:
        return Status(r).kind
    except ValueError:
        return "io"
