"""Eviction: make device blocks free by evicting LRU leaves under the write policy.

Feasibility first: ``Evictor.plan`` peels leaves off a virtual copy of the tree and
only a plan that covers the request is carried out, so an infeasible request evicts
and queues nothing.  Every planned leaf can be evicted (the liveness rule in
docs/architecture.md): with a host copy it is just dropped; under write_back it is
copied to host (a host leaf is evicted for the block if needed); otherwise it is
dropped, with the host-only subtree below it if it has one.  References and the
release of detached nodes live here too, since they decide what is evictable.
"""

from __future__ import annotations

import heapq
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from fastdeploy_kvcache.core.block_pool import BlockPool, NoFreeBlocksError
from fastdeploy_kvcache.core.errors import InvariantViolation
from fastdeploy_kvcache.core.manager_state import DEV, HOST, InFlight, InFlightCopies
from fastdeploy_kvcache.core.metadata import BlockNode, CacheSwapMetadata, TransferKind
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.stats import CacheStats
from fastdeploy_kvcache.core.write_policy import WritePolicy

if TYPE_CHECKING:  # pragma: no cover
    from fastdeploy_kvcache.core.tier_port import HostEvictionListener

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Evictor:
    """The manager's part that frees blocks: device (and host) eviction, references, and
    the release of detached nodes.

    It owns the detached nodes (cut out of the tree, still holding blocks) and the
    write_back evictions not handed to a batch yet: those made by the current allocation
    call, and those pending for the next step.  It calls no other part; a storage tier
    learns of host evictions through the listener it registered
    (``tier_port.HostEvictionListener``), which the evictor knows only by that protocol.
    """

    tree: RadixTree
    device_pool: BlockPool
    host_pool: BlockPool
    policy: WritePolicy
    stats: CacheStats
    inflight: InFlightCopies
    # Told of each host copy before it is dropped (the storage tier, through its port).
    _host_evict_listener: Optional["HostEvictionListener"] = field(default=None, init=False, repr=False)
    # Nodes cut out of the tree that still hold blocks (a copy in flight, or refs).
    _detached: set[BlockNode] = field(default_factory=set, init=False, repr=False)
    # Device -> host evictions not yet handed to a request or batch.
    _pending_evictions: list[CacheSwapMetadata] = field(default_factory=list, init=False, repr=False)
    # Evictions made during the current allocation call: (device, host, hash, node).
    _call_evictions: list[tuple[int, int, int, BlockNode]] = field(default_factory=list, init=False, repr=False)

    def set_host_evict_listener(self, listener: Optional["HostEvictionListener"]) -> None:
        """Tell ``listener`` of each host copy before it is dropped (one listener; None: none)."""
        self._host_evict_listener = listener

    @property
    def detached(self) -> frozenset[BlockNode]:
        """The detached nodes that still hold blocks (a snapshot, for checks)."""
        return frozenset(self._detached)

    def can_reclaim(self, n: int, exclude: frozenset[BlockNode] = frozenset()) -> bool:
        """Whether ``n`` device blocks can be free after evicting what can be evicted
        (``exclude``: nodes to treat as referenced).  Changes nothing."""
        return self._plan(n, exclude, dry_run=True) is not None

    def _plan(
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
        # What completions alone could make available: cached blocks (some pinned by a
        # copy in flight, or below one) and blocks of detached nodes whose copy is in flight.
        bound = free + self.stats.cached_device - sum(1 for x in exclude if x.ref_count == 0 and x.device_block_id is not None)
        bound += sum(1 for x in self._detached if x.ref_count == 0 and x.device_block_id is not None)
        retryable = bool(self.inflight) and n <= bound
        return NoFreeBlocksError(
            f"need {n} device blocks: {free} free and not enough evictable"
            + (" now (copies in flight pin cached blocks: retry after complete_swap)" if retryable else ""),
            retryable=retryable,
        )

    def reclaim(self, n: int, exclude: frozenset[BlockNode] = frozenset()) -> None:
        """Evict LRU device leaves until ``n`` blocks are free, following the write policy.

        Feasibility is decided first (``_plan``): when ``n`` blocks cannot be
        had, NoFreeBlocksError is raised with nothing evicted and nothing queued.
        """
        plan = self._plan(n, exclude)
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
        lost = self.drop_subtree(node)
        logger.debug("dropped device leaf %#x and %d host-only descendants", node.hash_value, lost - 1)

    def drop_subtree(self, node: BlockNode) -> int:
        """Cut ``node`` and its descendants out of the tree and free what they hold.

        Blocks that a running request references, or that a copy in flight uses, are
        freed when that ends (detached nodes).  Returns the number of nodes cut.
        """
        lost = self.tree.detach_subtree(node)
        for n in lost:
            if n.device_block_id is not None and n.ref_count == 0:
                self._dec_cached_device()
            self.release_detached(n)
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
        self.inflight.add(InFlight(node, TransferKind.EVICT, d, host_block))
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
        # A loop, not an if: with a storage tier a victim's block may stay pinned by its put.
        while pool.num_free == 0:
            victim = self.tree.host_heap.pop()
            if victim is None:
                return None
            if self._host_evict_listener is not None:
                self._host_evict_listener.on_host_evict(victim)  # write_back: store it before it goes
            h = self.tree.clear_host(victim)
            pool.free_one(h)
            self.stats.host_evictions += 1
            if victim.device_block_id is None:
                self.tree.remove(victim)
        return pool.allocate_one()

    def allocate_host_blocks(self, k: int, keep: frozenset[BlockNode] = frozenset()) -> list[int]:
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
            if self._host_evict_listener is not None:
                self._host_evict_listener.on_host_evict(victim)  # write_back: store it before it goes
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
            DEV,
            HOST,
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
            self.inflight.pop(DEV, HOST, h)
        out = []
        for (d, _, hv, node), h in zip(batch, hosts):
            node.host_block_id = h
            self.inflight.add(InFlight(node, TransferKind.EVICT, d, h))
            out.append((d, h, hv, node))
        self._call_evictions[first:] = out

    def _stash_call_evictions(self) -> None:
        meta = self._make_evict_metadata(self._call_evictions)
        self._call_evictions = []
        if meta is not None:
            self._pending_evictions.append(meta)

    def hand_evictions_to(self, request: Request) -> None:
        """Evictions made for this allocation call travel with ``request``; earlier ones that
        no request took yet travel with it too, so they reach this step's batch."""
        if not self._call_evictions and not self._pending_evictions:
            return  # the usual case: a call that evicted nothing
        evict = self._make_evict_metadata(self._call_evictions)
        self._call_evictions = []
        if self._pending_evictions:
            request.cache_evict_metadata.extend(self._pending_evictions)
            self._pending_evictions = []
        if evict is not None:
            request.cache_evict_metadata.append(evict)

    def reclaim_deferred(self, n: int) -> None:
        """:meth:`reclaim` outside an allocation call: the evictions it makes wait for the
        next step (:meth:`take_pending_evictions`) instead of joining the current call's."""
        saved, self._call_evictions = self._call_evictions, []
        try:
            self.reclaim(n)
        finally:
            self._stash_call_evictions()
            self._call_evictions = saved

    def take_pending_evictions(self) -> list[CacheSwapMetadata]:
        """The evictions no request carried, for this step's batch (the list is emptied)."""
        metas, self._pending_evictions = self._pending_evictions, []
        return metas

    def defer_evictions(self, metas: list[CacheSwapMetadata]) -> None:
        """Evictions a request took but never handed to a batch: they wait for the next step."""
        self._pending_evictions.extend(metas)

    def cancel_pending_evictions(self) -> None:
        """Cancel the evictions never handed to a batch (reset): their nodes' copies are off."""
        for meta in self._pending_evictions:
            for h in meta.dst_block_ids:
                inf = self.inflight.pop(DEV, HOST, h)
                inf.node.pending = None
                if inf.node.detached:
                    self.release_detached(inf.node)  # its subtree was dropped already
        self._pending_evictions = []

    def ref(self, node: BlockNode) -> None:
        """A running request uses ``node``'s device copy: it is no longer cached (evictable)."""
        if node.ref_count == 0 and node.device_block_id is not None:
            self._dec_cached_device()
        node.ref_count += 1

    def unref(self, node: BlockNode) -> None:
        """A request stops using ``node``: the last ref makes it cached (or frees a detached one)."""
        node.ref_count -= 1
        assert node.ref_count >= 0, node
        if node.ref_count == 0:
            if node.detached:
                self.release_detached(node)
                return
            if node.device_block_id is not None:
                self.stats.cached_device += 1
        self.tree.offer(node)

    def _dec_cached_device(self) -> None:
        self.stats.cached_device -= 1

    def unref_no_count(self, node: BlockNode) -> None:
        """Drop a ref on a node whose device copy was just cleared (no cached count change)."""
        node.ref_count -= 1
        if node.ref_count == 0 and node.detached:
            self.release_detached(node)
        else:
            self.tree.offer(node)

    def release_detached(self, node: BlockNode) -> None:
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
