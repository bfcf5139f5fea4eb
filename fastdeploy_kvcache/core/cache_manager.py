"""The scheduler-side cache manager: where every KV block lives, decided in Python.

It owns the device and host ``BlockPool``s and the ``RadixTree`` of cached blocks,
and it turns scheduling events into copy metadata for the worker:

* ``match_prefix``        longest cached prefix over device and host (storage: hook)
* ``allocate_device_blocks``  refs device hits, turns host hits into swap-ins,
  allocates new blocks, evicting LRU device leaves by the write policy
* ``request_finish`` / ``preempt_request``  insert the request's full blocks, drop refs
* ``issue_pending_backup_to_batch_request``  this step's device -> host copies
* ``complete_swap``       the worker's verdict on each copy, block by block

Nothing here touches KV bytes.  A copy is "in flight" from the moment its metadata
is emitted until ``complete_swap`` sees it come back; in flight, the node can be
neither evicted nor served from the copy's destination.

Ownership of a block, per pool (the invariant ``check_invariants`` verifies):
free (in the pool), owned (in a running request's block table, or held by a
detached node whose copy is still in flight) or cached (a tree node's copy with no
running request on it).  free + owned + cached = total.
"""

from __future__ import annotations

import heapq
import logging
import weakref
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.block_pool import BlockPool, NoFreeBlocksError
from fastdeploy_kvcache.core.errors import CacheManagerError, InvariantViolation, UnknownRequestError
from fastdeploy_kvcache.core.invariants import check_invariants
from fastdeploy_kvcache.core.stats import CacheStats
from fastdeploy_kvcache.core.write_policy import make_write_policy
from fastdeploy_kvcache.core.metadata import (
    BlockNode,
    CacheLevel,
    CacheSwapMetadata,
    MatchResult,
    ResidencyPlan,
    TransferKind,
)
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.request import Request

logger = logging.getLogger(__name__)

__all__ = ["CacheManager", "CacheManagerError", "UnknownRequestError", "NoFreeBlocksError", "InvariantViolation"]

_DEV = CacheLevel.DEVICE
_HOST = CacheLevel.HOST


@dataclass
class _RequestState:
    """What the manager remembers of a running request.

    ``nodes[i]`` is the tree node whose device copy is ``block_ids[i]`` (the request
    holds a ref on it), or None for a private block that only this request uses.
    ``block_ids`` is the manager's own copy of the block table, so a block table an
    engine edited by mistake is caught instead of freeing foreign ids.
    """

    request: Request
    nodes: list[Optional[BlockNode]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    match: Optional[MatchResult] = None  # the match as applied by the first allocation


@dataclass
class _InFlight:
    """One block of an emitted, not yet confirmed copy."""

    node: BlockNode
    kind: TransferKind
    src: int
    dst: int
    request_id: Optional[str] = None  # swap-ins: the request that will read the block


class CacheManager:
    """Tiered (device / host; storage later) prefix cache for one model's KV blocks.

    Write policies (``config.write_policy``):

    * ``write_through``: every block is copied to host as soon as it becomes cached
      (``request_finish``).  Host is inclusive of device once backups land; device
      eviction then never copies.
    * ``write_through_selective``: a cached block is copied once it has been hit
      ``write_through_threshold`` times.  Host holds the hot subset (inclusive for
      those blocks); cold blocks are dropped on eviction.
    * ``write_back``: a block is copied to host only when it is evicted from device,
      and its host copy is released once a load back to device is confirmed, so the
      two tiers are (mostly) exclusive.
    """

    def __init__(self, config: CacheConfig) -> None:
        if not isinstance(config, CacheConfig):
            raise CacheManagerError(f"CacheManager needs a CacheConfig, got {type(config).__name__}")
        config.validate()  # fields may have been changed after construction
        if config.num_gpu_blocks <= 0:
            raise CacheManagerError(
                f"CacheConfig.num_gpu_blocks must be > 0 for the cache manager, got {config.num_gpu_blocks}"
            )
        self.config = config
        self.block_size = config.block_size
        self.write_policy = config.write_policy
        self.write_through_threshold = config.write_through_threshold
        self.enable_prefix_caching = config.enable_prefix_caching
        self.bytes_per_block = config.bytes_per_block
        self.device_pool = BlockPool(config.num_gpu_blocks, _DEV)
        self.host_pool = BlockPool(config.host_block_count, _HOST)
        self.policy = make_write_policy(config.write_policy, config.write_through_threshold)
        self.tree = RadixTree()
        self._requests: dict[str, _RequestState] = {}
        # Matches of requests not allocated yet (applied once, by the first allocation).
        # Weak keys: a request matched and then dropped by the engine leaves nothing behind.
        self._matches: "weakref.WeakKeyDictionary[Request, MatchResult]" = weakref.WeakKeyDictionary()
        self._inflight: dict[tuple[int, int, int], _InFlight] = {}
        self._backup_queue: deque[BlockNode] = deque()
        # Device -> host evictions not yet handed to a request or batch.
        self._pending_evictions: list[CacheSwapMetadata] = []
        # Evictions made during the current allocate call.
        self._call_evictions: list[tuple[int, int, int, BlockNode]] = []  # (device, host, hash, node)
        # Nodes cut out of the tree that still hold blocks (a copy in flight, or refs).
        self._detached: set[BlockNode] = set()
        # Nodes whose host copy is to be released as soon as the copy in flight on them
        # completes (their parent's host copy was lost: see _lose_host_copy).
        self._host_doomed: set[BlockNode] = set()
        self.stats = CacheStats()
        logger.info(
            "CacheManager: %d device blocks, %d host blocks, block_size=%d, policy=%s",
            self.device_pool.num_blocks,
            self.host_pool.num_blocks,
            self.block_size,
            self.write_policy,
        )

    # ================================================================== matching
    def match_prefix(self, request: Request) -> MatchResult:
        """Longest cached prefix of ``request`` over all tiers; stored on the request.

        Takes no refs and changes nothing: ``allocate_device_blocks`` re-checks the
        match when it applies it, so a block evicted in between is simply not reused.
        At least the last token is always left to compute (the forward pass needs
        one token to produce logits), so at most ``(num_tokens - 1) // block_size``
        blocks match.
        """
        self._check_request(request)
        if request.request_id in self._requests:
            raise CacheManagerError(
                f"request {request.request_id} is already running (its match was applied); "
                "finish or preempt it before matching again"
            )
        bs = self.block_size
        num_tokens = request.num_total_tokens
        max_blocks = (num_tokens - 1) // bs
        hashes = request.block_hashes(bs, num_tokens)
        if self.enable_prefix_caching:
            nodes, tiers = self.tree.match(hashes, max_blocks)
        else:
            nodes, tiers = [], []
        result = MatchResult(block_size=bs, nodes=nodes, tiers=tiers)
        result.storage_hashes = self._match_storage(hashes[len(nodes) : max_blocks])
        self._matches[request] = result
        request.match_result = result
        return result

    def _match_storage(self, hashes: list[int]) -> list[int]:
        """Hook for the storage tier: the leading ``hashes`` that storage holds.

        NOTE: not implemented in this issue.  A storage connector will answer an
        exists() query here; ``allocate_device_blocks`` will then allocate
        destination blocks for those hashes and emit ``StorageMetadata`` load jobs
        (TransferKind.STORAGE_LOAD), and the nodes will sit in
        NodeState.LOADING_FROM_STORAGE until confirmed, like swap-ins do.
        """
        return []

    # ================================================================== allocation
    def get_num_free_device_blocks(self) -> int:
        return self.device_pool.num_free

    def can_allocate_device_blocks(self, n: int) -> bool:
        """Whether ``n`` new device blocks can be had now, evicting what can be evicted.

        Exact: it runs the same plan ``allocate_device_blocks`` runs first (without
        evicting anything), so for a request without device hits the two agree.  A
        request's own device hits are pinned by the allocation, so its answer can be
        smaller; ``NoFreeBlocksError.retryable`` then says whether to retry.  O(1)
        when enough blocks are free, else O(k log n) for the k evictions it plans.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise CacheManagerError(f"block count must be an int >= 0, got {n!r}")
        return self._plan_reclaim(n, dry_run=True) is not None

    def ensure_resident(self, request: Request, num_tokens: int) -> ResidencyPlan:
        """Make the blocks for the first ``num_tokens`` tokens of ``request`` resident.

        The one call an engine needs per request and step.  Afterwards
        ``request.block_tables`` covers ``ceil(max(num_tokens, matched) / block_size)``
        blocks.  The first call (after ``match_prefix``) applies the match exactly
        once and keeps the WHOLE matched prefix, whatever ``num_tokens`` is: device
        hits are referenced in place, host hits become host -> device loads into
        blocks of the table, in order.  Later calls only append fresh blocks.

        What must happen first is on the request: ``cache_swap_metadata`` (the loads)
        and ``cache_evict_metadata`` (write_back evictions); ``BatchRequest`` picks
        them up, and the worker must run them in this step, before compute writes
        (see "The step contract" in docs/architecture.md).  Compute starts at
        ``ResidencyPlan.num_cached_tokens``.

        Raises NoFreeBlocksError with nothing changed when the blocks cannot be had;
        its ``retryable`` is True when copies in flight pin the missing blocks.
        """
        self._check_request(request)
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise CacheManagerError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        st = self._running_state(request)
        bs = self.block_size
        self._call_evictions = []
        if st is None:
            plan = self._allocate_first(request, num_tokens=num_tokens)
        else:
            need = max(0, -(-num_tokens // bs) - len(st.block_ids))
            ids = self._append_blocks(st, need)
            plan = ResidencyPlan(new_block_ids=ids, num_cached_tokens=request.num_cached_tokens)
        self._hand_evictions_to(request)
        return plan

    def allocate_device_blocks(self, request: Request, n: int) -> list[int]:
        """Give ``request`` ``n`` more device blocks; return the new ids, in table order.

        The lower-level call under ``ensure_resident``.  On the first call for a
        request, its match (from ``match_prefix``) is applied, once: device hits go
        into the block table as they are (ref taken), and the first of the ``n`` new
        blocks become the destinations of host -> device loads for the host hits, in
        order (a load ``CacheSwapMetadata`` is appended to
        ``request.cache_swap_metadata``).  Host hits beyond ``n`` are not used.
        ``num_cached_tokens`` / ``num_computed_tokens`` are set to the matched length.

        When the pool is short, LRU device leaves are evicted by the write policy;
        write_back evictions emit device -> host copies, which go on
        ``request.cache_evict_metadata``.  Raises NoFreeBlocksError, with nothing
        changed, when not enough blocks can be freed.
        """
        self._check_request(request)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise CacheManagerError(f"block count must be an int >= 0, got {n!r}")
        st = self._running_state(request)
        self._call_evictions = []
        if st is None:
            ids = self._allocate_first(request, num_new=n).new_block_ids
        else:
            ids = self._append_blocks(st, n)
        self._hand_evictions_to(request)
        return ids

    def _running_state(self, request: Request) -> Optional[_RequestState]:
        st = self._requests.get(request.request_id)
        if st is None:
            return None
        if st.request is not request:
            raise CacheManagerError(f"another request object with id {request.request_id} is already running")
        self._check_block_table(st)
        return st

    def _hand_evictions_to(self, request: Request) -> None:
        """Evictions made for this call travel with this request; earlier ones that no
        request took yet travel with it too, so they reach this step's batch."""
        evict = self._make_evict_metadata(self._call_evictions)
        self._call_evictions = []
        if self._pending_evictions:
            request.cache_evict_metadata.extend(self._pending_evictions)
            self._pending_evictions = []
        if evict is not None:
            request.cache_evict_metadata.append(evict)

    def _append_blocks(self, st: _RequestState, n: int) -> list[int]:
        """``n`` fresh private blocks at the end of a running request's table."""
        self._reclaim_device(n)
        ids = self.device_pool.allocate(n, contiguous=True)
        st.block_ids.extend(ids)
        st.nodes.extend([None] * n)
        st.request.block_tables.extend(ids)
        return ids

    def _allocate_first(
        self, request: Request, num_new: Optional[int] = None, num_tokens: Optional[int] = None
    ) -> ResidencyPlan:
        """Apply the request's match (once) and give it its first blocks.

        Either ``num_new`` (allocate_device_blocks: that many new blocks, host hits cut
        where they run out) or ``num_tokens`` (ensure_resident: the whole match, plus
        fresh blocks up to ``num_tokens``).
        """
        bs = self.block_size
        match = self._matches.get(request)
        nodes: list[BlockNode] = []
        tiers: list[CacheLevel] = []
        if match is not None and match.nodes and self.enable_prefix_caching:
            # Re-walk: the tree may have changed since match_prefix.
            hashes = request.block_hashes(bs, request.num_total_tokens)
            nodes, tiers = self.tree.match(hashes, min(len(match.nodes), (request.num_total_tokens - 1) // bs))
            if num_new is not None:
                # Host hits need one of the n new blocks each; cut where they run out.
                used = 0
                for i, tier in enumerate(tiers):
                    if tier is _HOST:
                        if used == num_new:
                            del nodes[i:], tiers[i:]
                            break
                        used += 1
        num_swap = sum(1 for t in tiers if t is _HOST)
        if num_new is not None:
            num_fresh = num_new - num_swap
        else:
            assert num_tokens is not None
            num_fresh = max(0, -(-max(num_tokens, len(nodes) * bs) // bs) - len(nodes))
        # Refs first: they keep the matched copies from being evicted to make room.
        for node in nodes:
            self._ref(node)
        try:
            self._reclaim_device(num_swap + num_fresh)
        except NoFreeBlocksError:
            for node in nodes:
                self._unref(node)
            raise
        self._matches.pop(request, None)
        # Load destinations as one run if possible: the load is then one DMA run
        # per layer where the host side is consecutive too.  Fresh blocks as runs
        # too: they are copied together later (backups, evictions).
        swap_dst = self.device_pool.allocate(num_swap, contiguous=True, longest_runs=True)
        fresh = self.device_pool.allocate(num_fresh, contiguous=True)
        table: list[int] = []
        src: list[int] = []
        hv: list[int] = []
        k = 0
        for node, tier in zip(nodes, tiers):
            node.hit_count += 1
            self.tree.touch(node)
            if tier is _HOST:
                d = swap_dst[k]
                k += 1
                node.pending = TransferKind.SWAP_IN
                self.tree.set_device(node, d)
                assert node.host_block_id is not None
                self._inflight[(_HOST, _DEV, d)] = _InFlight(node, TransferKind.SWAP_IN, node.host_block_id, d, request.request_id)
                src.append(node.host_block_id)
                hv.append(node.hash_value)
                table.append(d)
            else:
                table.append(node.device_block_id)  # type: ignore[arg-type]
            self._maybe_queue_backup(node)
        table.extend(fresh)
        applied = MatchResult(block_size=bs, nodes=list(nodes), tiers=list(tiers))
        st = _RequestState(request, list(nodes) + [None] * len(fresh), list(table), applied)
        self._requests[request.request_id] = st
        request.block_tables = list(table)
        request.num_cached_tokens = len(nodes) * bs
        request.num_computed_tokens = len(nodes) * bs
        request.match_result = applied
        if src:
            request.cache_swap_metadata.append(
                CacheSwapMetadata(src, list(swap_dst), _HOST, _DEV, hv, kind=TransferKind.SWAP_IN)
            )
        s = self.stats
        s.num_requests += 1
        s.query_tokens += request.num_total_tokens
        s.matched_tokens_device += (len(nodes) - num_swap) * bs
        s.matched_tokens_host += num_swap * bs
        s.swap_in_blocks_issued += num_swap
        # Only what is returned is "new": device hits were already the request's data.
        return ResidencyPlan(
            new_block_ids=list(swap_dst) + list(fresh),
            num_cached_tokens=len(nodes) * bs,
            num_device_hit_tokens=(len(nodes) - num_swap) * bs,
            num_host_hit_tokens=num_swap * bs,
        )

    def _plan_reclaim(
        self, n: int, exclude: frozenset[BlockNode] = frozenset(), dry_run: bool = False
    ) -> Optional[list[BlockNode]]:
        """The device leaves to evict, in eviction order, so that ``n`` blocks are free.

        None when that is impossible now.  Changes no state: it peels leaves off a
        virtual copy of the tree (a parent joins the candidates once all its device
        children are planned), and what it takes out of the tree's heap goes back
        unless it is planned.  ``exclude`` are nodes to treat as referenced (the
        device hits of a request about to take refs on them).

        NOTE: every planned node is evictable when its turn comes (the liveness rule:
        every unreferenced, unpinned device leaf can be evicted under every policy),
        so planning first is what keeps an infeasible request from evicting anything.
        Cost: O(k log n) for k planned nodes, like the eviction itself.
        """
        short = n - self.device_pool.num_free
        if short <= 0:
            return []
        heap = self.tree.device_heap
        root = self.tree.root
        plan: list[BlockNode] = []
        popped: list[BlockNode] = []
        left: dict[BlockNode, int] = {}  # device children of a node not planned yet
        local: list[tuple[int, int, BlockNode]] = []  # parents that became virtual leaves
        seq = 0
        while len(plan) < short:
            top = heap.peek()
            if top is not None and top in exclude:
                heap.pop()
                popped.append(top)
                continue
            if local and (top is None or local[0][0] < top.last_access):
                node = heapq.heappop(local)[2]
            elif top is not None:
                node = heap.pop()  # type: ignore[assignment]
                popped.append(node)
            else:
                break
            plan.append(node)
            parent = node.parent
            if parent is None or parent is root:
                continue
            k = left.get(parent, parent.num_device_children) - 1
            left[parent] = k
            if (
                k == 0
                and parent.device_block_id is not None
                and parent.ref_count == 0
                and parent.pending is None
                and not parent.detached
                and parent not in exclude
            ):
                seq += 1
                heapq.heappush(local, (parent.last_access, seq, parent))
        ok = len(plan) >= short
        planned = set(plan) if ok and not dry_run else set()
        for node in popped:
            if node not in planned:
                self.tree.offer(node)
        return plan if ok else None

    def _no_free_blocks(self, n: int, exclude: frozenset[BlockNode] = frozenset()) -> NoFreeBlocksError:
        """The error for an infeasible ``n``: retryable when copies in flight pin the difference."""
        free = self.device_pool.num_free
        bound = free + self.stats.cached_device - sum(1 for x in exclude if x.ref_count == 0 and x.device_block_id is not None)
        retryable = bool(self._inflight) and n <= bound
        return NoFreeBlocksError(
            f"need {n} device blocks: {free} free and not enough evictable"
            + (" now (copies in flight pin cached blocks: retry after complete_swap)" if retryable else ""),
            retryable=retryable,
        )

    def _reclaim_device(self, n: int, exclude: frozenset[BlockNode] = frozenset()) -> None:
        """Evict LRU device leaves until ``n`` blocks are free, following the write policy.

        Feasibility is decided first (``_plan_reclaim``): when ``n`` blocks cannot be
        had, NoFreeBlocksError is raised with nothing evicted and nothing queued.
        """
        plan = self._plan_reclaim(n, exclude)
        if plan is None:
            raise self._no_free_blocks(n, exclude)
        first = len(self._call_evictions)
        try:
            for node in plan:
                if node.detached or node.device_block_id is None:
                    continue  # its block went with a subtree an earlier eviction dropped
                self._evict_device(node)
                self.stats.device_evictions += 1
        finally:
            self._pair_evictions_ascending(first)
        if self.device_pool.num_free < n:  # pragma: no cover - the plan guarantees it
            raise InvariantViolation(f"reclaim planned {len(plan)} evictions but only {self.device_pool.num_free} of {n} blocks are free")

    def _evict_device(self, node: BlockNode) -> None:
        """Release one unreferenced device leaf's block, following the write policy."""
        if node.host_block_id is not None and node.pending is None:
            # Already on host (backed up, or loaded under a through policy):
            # dropping the device copy costs nothing.
            self._drop_device(node)
            return
        if self.policy.copies_on_eviction and self.host_pool.num_blocks:
            h = self._allocate_host_block()
            if h is not None:
                self._evict_to_host(node, h)
                return
        if node.children:
            # No host copy to keep its (host-only) subtree reachable: the subtree goes too.
            # Through policies never get here (the host tier is prefix-closed).
            self._drop_with_subtree(node)
        else:
            self._drop_device(node)

    def _drop_with_subtree(self, node: BlockNode) -> None:
        """Drop ``node``'s device copy, its only copy, and every node below it."""
        d = self.tree.clear_device(node)
        self._dec_cached_device()
        self.device_pool.free_one(d)
        lost = self._drop_subtree(node)
        logger.debug("dropped device leaf %#x and %d host-only descendants", node.hash_value, lost - 1)

    def _drop_subtree(self, node: BlockNode) -> int:
        """Cut ``node`` and its descendants out of the tree and free what they hold.

        Blocks that a running request references, or that a copy in flight uses, are
        freed when that ends (detached nodes).  Returns the number of nodes cut.
        """
        lost = self.tree.detach_subtree(node)
        for n in lost:
            if n.device_block_id is not None and n.ref_count == 0:
                self._dec_cached_device()
            self._release_detached(n)
        return len(lost)

    def _evict_to_host(self, node: BlockNode, host_block: int) -> None:
        """write_back: copy a device leaf to a host block and release the device block now.

        The device block may be reused in this very step: the worker runs the step's
        device -> host copies before its compute, so the copy reads the old bytes first.
        """
        d = node.device_block_id
        assert d is not None
        node.pending = TransferKind.EVICT
        self.tree.clear_device(node)
        self._dec_cached_device()
        self.device_pool.free_one(d)
        self.tree.set_host(node, host_block)
        self._inflight[(_DEV, _HOST, host_block)] = _InFlight(node, TransferKind.EVICT, d, host_block)
        self._call_evictions.append((d, host_block, node.hash_value, node))
        self.stats.write_back_blocks_issued += 1

    def _drop_device(self, node: BlockNode) -> None:
        """Release a cached node's device copy (no copy); remove the node if it is now empty."""
        d = self.tree.clear_device(node)
        self._dec_cached_device()
        self.device_pool.free_one(d)
        if node.host_block_id is None and not node.children:
            self.tree.remove(node)

    def _allocate_host_block(self) -> Optional[int]:
        """One host block, evicting the LRU host leaf if the pool is full; None if impossible."""
        pool = self.host_pool
        if pool.num_free == 0:
            victim = self.tree.host_heap.pop()
            if victim is None:
                return None
            h = self.tree.clear_host(victim)
            pool.free_one(h)
            self.stats.host_evictions += 1
            if victim.device_block_id is None:
                self.tree.remove(victim)
        return pool.allocate_one()

    def _allocate_host_blocks(self, k: int, keep: frozenset[BlockNode] = frozenset()) -> list[int]:
        """Up to ``k`` host blocks, ascending and as runs, evicting host LRU leaves as needed.

        ``keep`` are host copies that must survive (the parents of the nodes being
        backed up: taking one would break the host tier's prefix closure).
        """
        pool = self.host_pool
        aside: list[BlockNode] = []
        while pool.num_free < k:
            victim = self.tree.host_heap.pop()
            if victim is None:
                break
            if victim in keep:
                aside.append(victim)
                continue
            pool.free_one(self.tree.clear_host(victim))
            self.stats.host_evictions += 1
            if victim.device_block_id is None:
                self.tree.remove(victim)
        for victim in aside:
            self.tree.offer(victim)
        return sorted(pool.allocate(min(k, pool.num_free), contiguous=True, longest_runs=True))

    def _make_evict_metadata(self, items: list[tuple[int, int, int, BlockNode]]) -> Optional[CacheSwapMetadata]:
        if not items:
            return None
        return CacheSwapMetadata(
            [d for d, _, _, _ in items],
            [h for _, h, _, _ in items],
            _DEV,
            _HOST,
            [hv for _, _, hv, _ in items],
            kind=TransferKind.EVICT,
        )

    def _pair_evictions_ascending(self, first: int) -> None:
        """Re-pair this reclaim's evictions so device and host ids ascend together.

        LRU leaves come out deepest first, so a chain's device ids are evicted in
        descending order while host ids are handed out ascending: every pair would
        start a new copy run, and the later load back (root to leaf) too.  The host
        blocks of this batch are just relabelled among its nodes (sorted by device
        id), so both sides become consecutive where the device ids are.  Nothing has
        been emitted yet, and the relabelling changes no counts.
        """
        batch = self._call_evictions[first:]
        if len(batch) < 2:
            return
        # Swap the batch's host blocks for a run, if the pool has one.
        pool = self.host_pool
        pool.free([h for _, h, _, _ in batch])
        hosts = sorted(pool.allocate(len(batch), contiguous=True, longest_runs=True))
        batch.sort(key=lambda e: e[0])
        for _, h, _, _ in batch:
            del self._inflight[(_DEV, _HOST, h)]
        out = []
        for (d, _, hv, node), h in zip(batch, hosts):
            node.host_block_id = h
            self._inflight[(_DEV, _HOST, h)] = _InFlight(node, TransferKind.EVICT, d, h)
            out.append((d, h, hv, node))
        self._call_evictions[first:] = out

    def _stash_call_evictions(self) -> None:
        meta = self._make_evict_metadata(self._call_evictions)
        self._call_evictions = []
        if meta is not None:
            self._pending_evictions.append(meta)

    # ================================================================== refs
    def _ref(self, node: BlockNode) -> None:
        if node.ref_count == 0 and node.device_block_id is not None:
            self._dec_cached_device()
        node.ref_count += 1

    def _unref(self, node: BlockNode) -> None:
        node.ref_count -= 1
        assert node.ref_count >= 0, node
        if node.ref_count == 0:
            if node.detached:
                self._release_detached(node)
                return
            if node.device_block_id is not None:
                self.stats.cached_device += 1
        self.tree.offer(node)

    def _dec_cached_device(self) -> None:
        self.stats.cached_device -= 1

    # ================================================================== finish / preempt
    def request_finish(self, request: Request) -> None:
        """Insert the request's computed full blocks into the tree and drop its refs.

        Full blocks up to ``num_computed_tokens`` (prompt and, with
        ``cache_output_tokens``, output) become cached; a block whose hash is
        already cached on device is a duplicate and goes back to the pool, as do the
        partial last block and blocks never computed.  The block table is cleared.
        """
        st = self._lookup(request)
        self._release(st, insert=True)
        request.block_tables = []
        request.match_result = None

    def preempt_request(self, request: Request) -> None:
        """Take a running request off the device, keeping what it computed cached.

        Its computed full blocks are inserted like on finish, so resuming it later
        (``match_prefix`` + ``allocate_device_blocks`` again) reuses them unless they
        were evicted meanwhile.  The request's cache fields are reset.
        """
        st = self._lookup(request)
        self._release(st, insert=True)
        request.block_tables = []
        request.num_cached_tokens = 0
        request.num_computed_tokens = 0
        request.match_result = None

    def _lookup(self, request: Request) -> _RequestState:
        self._check_request(request)
        st = self._requests.get(request.request_id)
        if st is None:
            raise UnknownRequestError(
                f"request {request.request_id} is not running in this cache manager "
                "(never allocated, or already finished/preempted)"
            )
        if st.request is not request:
            raise CacheManagerError(f"request {request.request_id}: a different request object holds this id")
        self._check_block_table(st)
        return st

    def _check_block_table(self, st: _RequestState) -> None:
        if st.request.block_tables != st.block_ids:
            foreign = sorted(set(st.request.block_tables) - set(st.block_ids))
            raise CacheManagerError(
                f"request {st.request.request_id}: block_tables was modified outside the cache manager "
                f"(ids not owned by it: {foreign})"
            )

    def _release(self, st: _RequestState, insert: bool) -> None:
        req = st.request
        del self._requests[req.request_id]
        bs = self.block_size
        # Swap-ins never handed to a batch will never run: take them back.
        cancelled: set[int] = set()
        for meta in req.cache_swap_metadata:
            for d in meta.dst_block_ids:
                inf = self._inflight.pop((_HOST, _DEV, d))
                node = inf.node
                node.pending = None
                i = st.block_ids.index(d)
                st.nodes[i] = None
                self.tree.clear_device(node)
                self._unref_no_count(node)
                cancelled.add(i)
                if node in self._host_doomed and not node.detached:
                    self._lose_host_copy(node)
        req.cache_swap_metadata = []
        # Evictions never handed to a batch must still reach the worker.
        if req.cache_evict_metadata:
            self._pending_evictions.extend(req.cache_evict_metadata)
            req.cache_evict_metadata = []

        num_full = 0
        hashes: list[int] = []
        if insert and self.enable_prefix_caching:
            limit = req.num_total_tokens if self.config.cache_output_tokens else req.num_prompt_tokens
            num_full = min(req.num_computed_tokens, limit) // bs
            if num_full:
                hashes = req.block_hashes(bs, num_full * bs)
        tree = self.tree
        parent = tree.root
        chain = num_full > 0
        to_free: list[int] = []
        for i, blk in enumerate(st.block_ids):
            node = st.nodes[i]
            if node is not None:
                if chain and i < num_full and node.parent is parent and not node.detached:
                    parent = node
                    if node.pending is TransferKind.SWAP_IN:
                        # NOTE: this request's later blocks were computed on top of a
                        # load nobody has confirmed yet; if it failed they hold wrong
                        # KV, so they must not become shared.  Losing them is cheap.
                        chain = False
                else:
                    chain = False
                self._unref(node)
                continue
            if not chain or i >= num_full or i in cancelled:
                chain = False
                to_free.append(blk)
                continue
            h = hashes[i]
            child = parent.children.get(h)
            if child is None:
                child = tree.add_child(parent, h)
                tree.set_device(child, blk)
                self.stats.cached_device += 1
                self.stats.inserted_blocks += 1
                if self.policy.backup_on_insert:
                    self._queue_backup(child)
                parent = child
            elif child.device_block_id is None and child.pending is None and child.ref_count == 0:
                # Host-only (or failed-load) node: this request's copy becomes its device copy.
                tree.set_device(child, blk)
                tree.touch(child)
                tree.offer(child)
                self.stats.cached_device += 1
                self.stats.inserted_blocks += 1
                parent = child
            else:
                to_free.append(blk)  # duplicate: the tree already has (or is getting) it
                self.stats.duplicate_blocks += 1
                if child.device_block_id is None:
                    chain = False  # its only copy is in flight; don't hang device copies below
                else:
                    parent = child
        if to_free:
            self.device_pool.free(to_free)

    def _unref_no_count(self, node: BlockNode) -> None:
        """Drop a ref on a node whose device copy was just cleared (no cached count change)."""
        node.ref_count -= 1
        if node.ref_count == 0 and node.detached:
            self._release_detached(node)
        else:
            self.tree.offer(node)

    # ================================================================== write-through backups
    def _maybe_queue_backup(self, node: BlockNode, retry: bool = False) -> None:
        """Queue a backup if the write policy wants one for ``node`` (after a hit, or a
        ``retry`` of a backup that failed or was cancelled)."""
        if self.policy.wants_backup(node, retry):
            self._queue_backup(node)

    def _queue_backup(self, node: BlockNode) -> None:
        if not node.backup_queued and self.host_pool.num_blocks and self._needs_backup(node):
            node.backup_queued = True
            self._backup_queue.append(node)

    @staticmethod
    def _needs_backup(node: BlockNode) -> bool:
        return not node.detached and node.device_block_id is not None and node.host_block_id is None and node.pending is None

    def issue_pending_backup_to_batch_request(self) -> Optional[CacheSwapMetadata]:
        """This step's device -> host copies as one ``CacheSwapMetadata`` (None if none).

        It holds the queued write-through backups plus any write_back evictions no
        request carried (made by an allocation that then failed, or left by a
        preempted request).  Call it once per step, after the step's last
        allocation, and append the result with ``BatchRequest.append_evict_metadata``.
        Only queued candidates are visited: never a scan of the cache.

        Backups keep the host tier prefix-closed (the liveness rule): a node is backed
        up only together with, or after, every ancestor, so the ancestors of a queued
        node that have no host copy are backed up first, in the same step; and the
        host blocks they need never come from evicting a parent of one of them.
        """
        metas = self._pending_evictions
        self._pending_evictions = []
        queue = self._backup_queue
        root = self.tree.root
        todo: list[BlockNode] = []
        chosen: set[BlockNode] = set()
        wanted: list[BlockNode] = []  # queued nodes, to queue again if not served
        while queue:
            node = queue.popleft()
            node.backup_queued = False
            if node in chosen or not self._needs_backup(node):
                continue
            path: list[BlockNode] = []
            x = node
            while x is not root and x not in chosen and (x.host_block_id is None or x in self._host_doomed):
                if not self._needs_backup(x):
                    path = []  # an ancestor's host copy is being released: try again later
                    break
                path.append(x)
                x = x.parent  # type: ignore[assignment]
            wanted.append(node)
            if path:
                chosen.update(path)
                todo.extend(path)
        todo.sort(key=lambda nd: nd.depth)  # parents first: any prefix of it is closed
        keep = frozenset(nd.parent for nd in todo if nd.parent is not root and nd.parent not in chosen)
        hosts = self._allocate_host_blocks(len(todo), keep)  # type: ignore[arg-type]
        served = todo[: len(hosts)]
        served_set = set(served)
        for node in reversed(wanted):  # host pinned full: try again next step
            if node not in served_set and not node.backup_queued and self._needs_backup(node):
                node.backup_queued = True
                queue.appendleft(node)
        src: list[int] = []
        dst: list[int] = []
        hv: list[int] = []
        served.sort(key=lambda nd: nd.device_block_id)  # type: ignore[arg-type,return-value]
        for node, h in zip(served, hosts):
            node.pending = TransferKind.BACKUP
            self.tree.set_host(node, h)
            d = node.device_block_id
            assert d is not None
            self._inflight[(_DEV, _HOST, h)] = _InFlight(node, TransferKind.BACKUP, d, h)
            src.append(d)
            dst.append(h)
            hv.append(node.hash_value)
        if src:
            metas.append(CacheSwapMetadata(src, dst, _DEV, _HOST, hv, kind=TransferKind.BACKUP))
            self.stats.backup_blocks_issued += len(src)
        return CacheSwapMetadata.merged(metas)

    # ================================================================== completion
    def complete_swap(self, meta: Optional[CacheSwapMetadata]) -> list[str]:
        """Apply the worker's verdict on a returned copy; return the affected request ids.

        ``meta`` may be any grouping of emitted copies (one request's, a merged
        batch's): each block is resolved on its own by (src tier, dst tier, dst
        block id) and checked against its ``src_block_ids`` and ``hash_values``
        entries.  A block that is not in flight raises CacheManagerError before
        anything changes.

        On success the destination copy becomes valid.  On failure the data stays
        where it was: a failed backup frees its host block; a failed load leaves
        the host copy, and each running request that was going to read the block
        now owns it privately and must recompute it -- its ``num_cached_tokens``
        and ``num_computed_tokens`` are lowered to the start of that block, and its
        id is in the returned list.  A failed write_back eviction loses the block
        (its device block was already released), so the node and its subtree leave
        the tree.
        """
        if meta is None:
            return []
        if not isinstance(meta, CacheSwapMetadata):
            raise CacheManagerError(f"complete_swap needs a CacheSwapMetadata, got {type(meta).__name__}")
        n = len(meta.dst_block_ids)
        if len(meta.src_block_ids) != n or (meta.hash_values and len(meta.hash_values) != n):
            raise CacheManagerError(
                f"complete_swap: task {meta.task_id} has {len(meta.src_block_ids)} src ids, {n} dst ids and "
                f"{len(meta.hash_values)} hashes"
            )
        st, dt = CacheLevel(meta.src_type), CacheLevel(meta.dst_type)
        entries: list[_InFlight] = []
        seen: set[int] = set()
        for i, dst in enumerate(meta.dst_block_ids):
            key = (st, dt, dst)
            inf = self._inflight.get(key)
            if inf is None or dst in seen:
                raise CacheManagerError(
                    f"complete_swap: task {meta.task_id} block {i} ({st.name} {meta.src_block_ids[i]} -> "
                    f"{dt.name} {dst}) is not a copy in flight (foreign id, or completed twice)"
                )
            if inf.src != meta.src_block_ids[i] or (meta.hash_values and meta.hash_values[i] != inf.node.hash_value):
                raise CacheManagerError(
                    f"complete_swap: task {meta.task_id} block {i}: in-flight copy to {dt.name} {dst} reads "
                    f"{inf.src} for hash {inf.node.hash_value:#x}, the metadata says {meta.src_block_ids[i]}"
                    + (f" / {meta.hash_values[i]:#x}" if meta.hash_values else "")
                )
            seen.add(dst)
            entries.append(inf)
        ok = bool(meta.success)
        if not ok:
            logger.warning(
                "copy task %d (%s -> %s, %d blocks) failed: %s", meta.task_id, st.name, dt.name, n, meta.error_message
            )
            self.stats.failed_blocks += n
        affected: set[str] = set()
        for inf in entries:
            del self._inflight[(st, dt, inf.dst)]
            if inf.kind is TransferKind.SWAP_IN:
                self._complete_swap_in(inf, ok, affected)
            elif inf.kind is TransferKind.EVICT:
                self._complete_evict(inf, ok)
            else:
                self._complete_backup(inf, ok)
        for rid in affected:
            rst = self._requests[rid]
            self._privatize_tail(rst, rst.request.num_computed_tokens // self.block_size)
        return sorted(affected)

    def _privatize_tail(self, st: _RequestState, start: int) -> None:
        """Give a request that must recompute from block ``start`` private blocks there.

        Its later blocks may be shared cached blocks (device hits, or loads that did
        land).  Recomputing into them would rewrite blocks other requests read and a
        backup may be copying, so each is swapped for a fresh private block, including
        one whose backup is in flight (the node keeps its block until the copy is
        resolved).  The evictions this needs travel with the next step (pending
        evictions).
        """
        idxs = [
            i
            for i in range(start, len(st.nodes))
            if st.nodes[i] is not None and st.nodes[i].pending is not TransferKind.SWAP_IN
        ]
        if not idxs:
            return
        saved, self._call_evictions = self._call_evictions, []
        try:
            self._reclaim_device(len(idxs))
        except NoFreeBlocksError:
            # NOTE: fallback when the pool is exhausted: the request recomputes into
            # the shared blocks; the KV it writes there equals what they hold.
            self.stats.shared_recompute_fallbacks += 1
            logger.warning(
                "request %s: no free blocks to recompute privately; recomputing into %d shared blocks",
                st.request.request_id,
                len(idxs),
            )
            return
        finally:
            self._stash_call_evictions()
            self._call_evictions = saved
        new = self.device_pool.allocate(len(idxs))
        req = st.request
        for i, b in zip(idxs, new):
            node = st.nodes[i]
            assert node is not None
            st.nodes[i] = None
            st.block_ids[i] = b
            req.block_tables[i] = b
            self._unref(node)

    def _complete_swap_in(self, inf: _InFlight, ok: bool, affected: set[str]) -> None:
        node = inf.node
        node.pending = None
        if not ok:
            self._fail_swap_in(inf, affected)
            if node in self._host_doomed and not node.detached:
                self._lose_host_copy(node)  # the source of the failed load goes too
            self._host_doomed.discard(node)
            return
        self.stats.swap_in_blocks += 1
        if node.detached:
            self._host_doomed.discard(node)
            self._release_detached(node)
            return
        if node in self._host_doomed:
            self._lose_host_copy(node)
        elif self.policy.exclusive_tiers and node.host_block_id is not None:
            # Exclusive tiers: the host copy has done its job.
            self.host_pool.free_one(self.tree.clear_host(node))
        self.tree.offer(node)

    def _fail_swap_in(self, inf: _InFlight, affected: set[str]) -> None:
        node = inf.node
        d = inf.dst
        st = self._requests.get(inf.request_id) if inf.request_id is not None else None
        idx = None
        if st is not None:
            for i, (b, nd) in enumerate(zip(st.block_ids, st.nodes)):
                if b == d and nd is node:
                    idx = i
                    break
        self.tree.clear_device(node)
        if st is not None and idx is not None:
            # The request keeps the block as its own and recomputes from it.
            st.nodes[idx] = None
            self._unref_no_count(node)
            req = st.request
            start = idx * self.block_size
            req.num_cached_tokens = min(req.num_cached_tokens, start)
            req.num_computed_tokens = min(req.num_computed_tokens, start)
            affected.add(req.request_id)
        else:
            # Its request is gone; the block was counted as cached (ref 0, in the tree).
            if not node.detached and node.ref_count == 0:
                self._dec_cached_device()
            self.device_pool.free_one(d)
        if node.detached:
            self._release_detached(node)
        else:
            self.tree.offer(node)

    def _complete_evict(self, inf: _InFlight, ok: bool) -> None:
        node = inf.node
        node.pending = None
        if ok:
            self.stats.write_back_blocks += 1
        if node.detached:
            self._release_detached(node)
            return
        if ok:
            self.tree.offer(node)
            return
        # The device block was released when the eviction was issued: the data is gone.
        self.host_pool.free_one(self.tree.clear_host(node))
        lost = self._drop_subtree(node)
        logger.warning("write_back eviction of block %#x failed: dropping it and %d descendants", node.hash_value, lost - 1)

    def _complete_backup(self, inf: _InFlight, ok: bool) -> None:
        node = inf.node
        node.pending = None
        if ok:
            self.stats.backup_blocks += 1
        if node.detached:
            self._host_doomed.discard(node)
            self._release_detached(node)
            return
        if not ok or node in self._host_doomed:
            # A failed backup, or one whose parent's host copy went meanwhile: this
            # host copy goes, and so does every host copy below it (prefix closure).
            self._lose_host_copy(node)
            self._maybe_queue_backup(node, retry=True)
        self.tree.offer(node)

    def _lose_host_copy(self, node: BlockNode) -> None:
        """Release ``node``'s host copy and every host copy in its subtree.

        NOTE: the host tier is prefix-closed, so a host copy whose parent has none is
        unreachable by a match and would pin its parent's device copy as a non-leaf
        for ever.  Copies below that a copy in flight still reads or writes are
        released when it completes (``_host_doomed``); a node left with no copy at all
        leaves the tree with its subtree.
        """
        self._host_doomed.discard(node)
        self.host_pool.free_one(self.tree.clear_host(node))
        stack = [c for c in node.children.values() if c.host_block_id is not None]
        while stack:
            d = stack.pop()
            if d.detached:
                continue  # went with a subtree dropped just now
            stack.extend(c for c in d.children.values() if c.host_block_id is not None)
            if d.pending is not None:
                self._host_doomed.add(d)
                continue
            self._host_doomed.discard(d)
            self.host_pool.free_one(self.tree.clear_host(d))
            self._maybe_queue_backup(d, retry=True)
            if d.device_block_id is None:
                self._drop_subtree(d)
        if node.device_block_id is None:
            self._drop_subtree(node)

    def _release_detached(self, node: BlockNode) -> None:
        """Free what a detached node holds once nobody reads it and no copy is in flight."""
        if node.ref_count or node.pending is not None:
            self._detached.add(node)
            return
        self._detached.discard(node)
        if node.device_block_id is not None:
            self.device_pool.free_one(node.device_block_id)
            node.device_block_id = None
        if node.host_block_id is not None:
            self.host_pool.free_one(node.host_block_id)
            node.host_block_id = None

    # ================================================================== reset / stats
    def reset_cache(self) -> None:
        """Drop every cached block (e.g. after a weight update).  No request may be running.

        Copies still in flight keep their blocks until ``complete_swap`` returns
        them; un-issued evictions are cancelled.
        """
        if self._requests:
            raise CacheManagerError(
                f"reset_cache with {len(self._requests)} running requests; finish or preempt them first"
            )
        for meta in self._pending_evictions:
            for h in meta.dst_block_ids:
                inf = self._inflight.pop((_DEV, _HOST, h))
                inf.node.pending = None
                if inf.node.detached:
                    self._release_detached(inf.node)  # its subtree was dropped already
        self._pending_evictions = []
        nodes = list(self.tree.iter_nodes())
        self.tree.reset()
        for node in nodes:
            node.parent = None
            node.children = {}
            self._release_detached(node)
        self._backup_queue.clear()
        self._host_doomed.clear()
        self.stats.cached_device = 0
        logger.info("cache reset: %d nodes dropped, %d copies still in flight", len(nodes), len(self._inflight))

    def get_stats(self) -> dict[str, Any]:
        """Counters since construction, plus current pool occupancy."""
        s = self.stats.as_dict(self.bytes_per_block)
        dev_total = self.device_pool.num_blocks
        dev_free = self.device_pool.num_free
        dev_cached = self.stats.cached_device
        s.update(
            device_blocks_total=dev_total,
            device_blocks_free=dev_free,
            device_blocks_cached=dev_cached,
            device_blocks_owned=dev_total - dev_free - dev_cached,
            device_usage=self.device_pool.usage(),
            host_blocks_total=self.host_pool.num_blocks,
            host_blocks_free=self.host_pool.num_free,
            host_usage=self.host_pool.usage(),
            num_running_requests=len(self._requests),
            num_cached_nodes=self.tree.num_nodes,
            num_copies_in_flight=len(self._inflight),
            write_policy=self.write_policy,
        )
        return s

    # ================================================================== helpers
    @staticmethod
    def _check_request(request: Request) -> None:
        if not isinstance(request, Request):
            raise CacheManagerError(f"expected a Request, got {type(request).__name__}")

    @property
    def _host_prefix_closed(self) -> bool:
        """Whether the host tier is kept prefix-closed (the through policies)."""
        return self.policy.host_prefix_closed

    def is_running(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_copies_in_flight(self) -> int:
        return len(self._inflight)

    def check_invariants(self) -> dict[str, int]:
        """Verify every bookkeeping invariant (see ``invariants.py``); returns per-pool counts.

        O(cache size), for tests and debugging.  Raises InvariantViolation.
        """
        return check_invariants(self)
