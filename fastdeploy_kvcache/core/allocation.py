"""Allocation: give a request its device blocks, applying its match exactly once.

``ensure_resident`` (the engine's one call) and ``allocate_device_blocks`` (the
lower-level call under it).  The first allocation of a request references its device
hits, turns its host hits into loads, and registers it; later ones append fresh
blocks.  Making room is ``eviction.py``'s job; it decides feasibility before it
evicts anything, so a failed allocation changes nothing.
"""

from __future__ import annotations

import logging
from typing import Optional

from fastdeploy_kvcache.core.block_pool import NoFreeBlocksError
from fastdeploy_kvcache.core.errors import CacheManagerError
from fastdeploy_kvcache.core.manager_state import DEV, HOST, InFlight, ManagerState, RequestState
from fastdeploy_kvcache.core.metadata import (
    CacheSwapMetadata,
    MatchResult,
    ResidencyPlan,
    TransferKind,
)
from fastdeploy_kvcache.core.request import Request

logger = logging.getLogger(__name__)


class AllocationMixin(ManagerState):
    """Block allocation for requests (uses ``EvictionMixin`` to make room)."""

    def get_num_free_device_blocks(self) -> int:
        return self.device_pool.num_free

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

    def _running_state(self, request: Request) -> Optional[RequestState]:
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

    def _append_blocks(self, st: RequestState, n: int) -> list[int]:
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
        nodes, tiers = self.matcher.rewalk(request, self.share_loads)
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
            self._ref(node)
        try:
            self._reclaim_device(num_swap + num_fresh + num_shared)
        except NoFreeBlocksError:
            for node in nodes:
                self._unref(node)
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
                self._inflight[(HOST, DEV, d)] = InFlight(node, TransferKind.SWAP_IN, node.host_block_id, d, request.request_id)
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
                    self._inflight[(HOST, DEV, node.device_block_id)].sharers[request.request_id] = b  # type: ignore[index]
                table.append(node.device_block_id)  # type: ignore[arg-type]
            self._maybe_queue_backup(node)
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
