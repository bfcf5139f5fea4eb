"""Allocation: give a request its device blocks, applying its match exactly once.

:class:`Allocator` is the manager's part behind ``ensure_resident`` and
``allocate_device_blocks``.  The first allocation of a request references its device
hits, turns its host hits into loads, and registers the request; later ones append fresh
blocks.  Making room is the ``Evictor``'s job; it decides feasibility before it evicts
anything, so a failed allocation changes nothing.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping, Optional

from fastdeploy_kvcache.core.block_pool import BlockPool, NoFreeBlocksError
from fastdeploy_kvcache.core.copies import CopyTracker
from fastdeploy_kvcache.core.errors import CacheManagerError, UnknownRequestError
from fastdeploy_kvcache.core.eviction import Evictor
from fastdeploy_kvcache.core.manager_state import DEV, HOST, InFlight, InFlightCopies, RequestState, check_request
from fastdeploy_kvcache.core.matching import PrefixMatcher
from fastdeploy_kvcache.core.metadata import (
    BlockNode,
    CacheSwapMetadata,
    MatchResult,
    ResidencyPlan,
    TransferKind,
)
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.stats import CacheStats

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class Allocator:
    """The manager's part that hands out device blocks to requests.

    It owns the table of running requests (one ``RequestState`` each): a request enters
    it on its first allocation and leaves it through :meth:`remove` (finish, preempt).
    It calls the ``PrefixMatcher`` (the match to apply), the ``Evictor`` (room, refs) and
    the ``CopyTracker`` (backups a hit asks for).
    """

    tree: RadixTree
    device_pool: BlockPool
    block_size: int
    stats: CacheStats
    inflight: InFlightCopies
    matcher: PrefixMatcher
    evictor: Evictor
    copies: CopyTracker
    # Running requests, by id.
    _requests: dict[str, RequestState] = field(default_factory=dict, init=False, repr=False)

    @property
    def requests(self) -> Mapping[str, RequestState]:
        """The running requests by id (a read-only view; the records are the live ones)."""
        return MappingProxyType(self._requests)

    def remove(self, request_id: str) -> RequestState:
        """Take a request out of the table (it finished or was preempted); returns its record."""
        return self._requests.pop(request_id)

    def running_state(self, request: Request) -> Optional[RequestState]:
        """The record of ``request`` if it is running, else None; raises CacheManagerError when
        another object holds its id or its block table was edited outside the manager."""
        st = self._requests.get(request.request_id)
        if st is None:
            return None
        if st.request is not request:
            raise CacheManagerError(f"another request object with id {request.request_id} is already running")
        self._check_block_table(st)
        return st

    def lookup(self, request: Request) -> RequestState:
        """The record of a running ``request``; UnknownRequestError when it is not running."""
        check_request(request)
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

    @staticmethod
    def _check_block_table(st: RequestState) -> None:
        if st.request.block_tables != st.block_ids:
            foreign = sorted(set(st.request.block_tables) - set(st.block_ids))
            raise CacheManagerError(
                f"request {st.request.request_id}: block_tables was modified outside the cache manager "
                f"(ids not owned by it: {foreign})"
            )

    def ensure_resident(self, request: Request, num_tokens: int) -> ResidencyPlan:
        """``CacheManager.ensure_resident`` (arguments checked there)."""
        st = self.running_state(request)
        if st is None:
            plan = self._allocate_first(request, num_tokens=num_tokens)
        else:
            need = -(-num_tokens // self.block_size) - len(st.block_ids)
            ids = self._append_blocks(st, need) if need > 0 else []
            plan = ResidencyPlan(new_block_ids=ids, num_cached_tokens=request.num_cached_tokens)
        self.evictor.hand_evictions_to(request)
        return plan

    def allocate_device_blocks(self, request: Request, n: int) -> list[int]:
        """``CacheManager.allocate_device_blocks`` (arguments checked there)."""
        st = self.running_state(request)
        if st is None:
            ids = self._allocate_first(request, num_new=n).new_block_ids
        else:
            ids = self._append_blocks(st, n)
        self.evictor.hand_evictions_to(request)
        return ids

    def can_allocate_device_blocks(self, n: int, request: Optional[Request]) -> bool:
        """``CacheManager.can_allocate_device_blocks`` (arguments checked there)."""
        exclude: frozenset[BlockNode] = frozenset()
        if request is not None and request.request_id not in self._requests:
            nodes, tiers = self.matcher.rewalk(request)
            exclude = frozenset(nd for nd, t in zip(nodes, tiers) if t is DEV)
            # Loads in flight it will share need a standby block each (_allocate_first).
            n += sum(1 for nd in exclude if nd.pending is TransferKind.SWAP_IN)
        return self.evictor.can_reclaim(n, exclude)

    def extend_match(self, request: Request) -> int:
        """``CacheManager.extend_match``: host-only tree nodes right after a running request's
        computed, committed prefix become loads into its table; returns the blocks loaded.

        Only at a block boundary where everything computed is committed (the chain the nodes
        hang from is the request's own), and never the block holding the last prompt token
        (that one is computed, as by a match).  Destinations: the request's private blocks
        there, not computed yet, then fresh ones.  Changes nothing when blocks are short.
        """
        st = self.lookup(request)
        bs = self.block_size
        c = st.committed
        if request.num_computed_tokens != c * bs:
            return 0
        parent = st.nodes[c - 1] if c else self.tree.root
        if parent is None or parent.detached:
            return 0
        limit = (request.num_total_tokens - 1) // bs
        hashes = request.block_hashes(bs, limit * bs)
        nodes: list[BlockNode] = []
        x = parent
        visible = self.matcher.visible_filter(request)
        for j in range(c, limit):
            child = x.children.get(hashes[j])
            if (child is None or child.host_block_id is None or child.device_block_id is not None
                    or child.pending is not None or child.detached
                    or (visible is not None and not visible(hashes[j]))):
                break
            nodes.append(child)
            x = child
        if not nodes or any(nd is not None for nd in st.nodes[c: c + len(nodes)]):
            return 0
        reuse = st.block_ids[c: c + len(nodes)]
        need = len(nodes) - len(reuse)
        for node in nodes:
            self.evictor.ref(node)  # before making room: the nodes' host copies must stay
        try:
            self.evictor.reclaim(need)
        except NoFreeBlocksError:
            for node in nodes:
                self.evictor.unref(node)
            return 0
        fresh = self.device_pool.allocate(need, contiguous=True) if need else []
        st.block_ids.extend(fresh)
        st.nodes.extend([None] * len(fresh))
        request.block_tables.extend(fresh)
        dst = list(reuse) + list(fresh)
        src: list[int] = []
        for j, (node, d) in enumerate(zip(nodes, dst), start=c):
            node.hit_count += 1
            self.tree.touch(node)
            node.pending = TransferKind.SWAP_IN
            self.tree.set_device(node, d)
            assert node.host_block_id is not None
            self.inflight.add(InFlight(node, TransferKind.SWAP_IN, node.host_block_id, d, request.request_id))
            src.append(node.host_block_id)
            st.nodes[j] = node
        st.committed = c + len(nodes)
        request.num_computed_tokens = st.committed * bs
        request.cache_swap_metadata.append(
            CacheSwapMetadata(src, dst, HOST, DEV, [nd.hash_value for nd in nodes], kind=TransferKind.SWAP_IN))
        self.stats.matched_tokens_host += len(nodes) * bs
        self.stats.swap_in_blocks_issued += len(nodes)
        return len(nodes)

    def _append_blocks(self, st: RequestState, n: int) -> list[int]:
        """``n`` fresh private blocks at the end of a running request's table."""
        self.evictor.reclaim(n)
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
        nodes, tiers = self.matcher.rewalk(request)
        if nodes:
            if num_new is not None:
                # Host hits need one of the n new blocks each; cut where they run out.
                used = 0
                for i, tier in enumerate(tiers):
                    if tier is HOST:
                        if used == num_new:
                            del nodes[i:], tiers[i:]
                            break
                        used += 1
        num_swap = sum(1 for t in tiers if t is HOST)
        # Device hits still being loaded for another request: shared, each with a standby block.
        num_shared = sum(1 for nd, t in zip(nodes, tiers) if t is DEV and nd.pending is TransferKind.SWAP_IN)
        if num_new is not None:
            num_fresh = num_new - num_swap
        else:
            assert num_tokens is not None
            num_fresh = max(0, -(-max(num_tokens, len(nodes) * bs) // bs) - len(nodes))
        # Refs first: they keep the matched copies from being evicted to make room.
        for node in nodes:
            self.evictor.ref(node)
        try:
            self.evictor.reclaim(num_swap + num_fresh + num_shared)
        except NoFreeBlocksError:
            for node in nodes:
                self.evictor.unref(node)
            raise
        self.matcher.forget(request)
        # Load destinations as one run if possible: the load is then one DMA run
        # per layer where the host side is consecutive too.  Fresh blocks as runs
        # too: they are copied together later (backups, evictions).
        swap_dst = self.device_pool.allocate(num_swap, contiguous=True, longest_runs=True)
        fresh = self.device_pool.allocate(num_fresh, contiguous=True)
        standby = self.device_pool.allocate(num_shared)
        standby_of: dict[int, int] = {}
        table: list[int] = []
        src: list[int] = []
        hv: list[int] = []
        k = 0
        for node, tier in zip(nodes, tiers):
            node.hit_count += 1
            self.tree.touch(node)
            if tier is HOST:
                d = swap_dst[k]
                k += 1
                node.pending = TransferKind.SWAP_IN
                self.tree.set_device(node, d)
                assert node.host_block_id is not None
                self.inflight.add(InFlight(node, TransferKind.SWAP_IN, node.host_block_id, d, request.request_id))
                src.append(node.host_block_id)
                hv.append(node.hash_value)
                table.append(d)
            else:
                if node.pending is TransferKind.SWAP_IN:
                    # NOTE: the load is issued with the step of the request that asked for it
                    # (this one runs in that step or a later one, so it reads the block after
                    # the per-layer wait); if the load fails this request recomputes into the
                    # standby block, like the issuer does into the destination.
                    b = standby[len(standby_of)]
                    standby_of[len(table)] = b
                    self.inflight.load_to(node.device_block_id).sharers[request.request_id] = b  # type: ignore[arg-type]
                table.append(node.device_block_id)  # type: ignore[arg-type]
            self.copies.maybe_queue_backup(node)
        table.extend(fresh)
        applied = MatchResult(block_size=bs, nodes=list(nodes), tiers=list(tiers))
        st = RequestState(request, list(nodes) + [None] * len(fresh), list(table), applied, committed=len(nodes),
                          standby=standby_of)
        self._requests[request.request_id] = st
        request.block_tables = list(table)
        request.num_cached_tokens = len(nodes) * bs
        request.num_computed_tokens = len(nodes) * bs
        request.match_result = applied
        if src:
            request.cache_swap_metadata.append(
                CacheSwapMetadata(src, list(swap_dst), HOST, DEV, hv, kind=TransferKind.SWAP_IN)
            )
        s = self.stats
        s.num_requests += 1
        s.query_tokens += request.num_total_tokens
        s.matched_tokens_device += (len(nodes) - num_swap - num_shared) * bs
        s.matched_tokens_host += (num_swap + num_shared) * bs
        s.swap_in_blocks_issued += num_swap
        s.shared_load_blocks += num_shared
        # Only what is returned is "new": device hits were already the request's data.
        return ResidencyPlan(
            new_block_ids=list(swap_dst) + list(fresh),
            num_cached_tokens=len(nodes) * bs,
            num_device_hit_tokens=(len(nodes) - num_swap - num_shared) * bs,
            num_host_hit_tokens=(num_swap + num_shared) * bs,
        )
