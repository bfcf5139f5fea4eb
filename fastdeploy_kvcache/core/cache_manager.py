"""The scheduler-side cache manager: where every KV block lives, decided in Python.

``CacheManager`` is the facade: the public API, and the request lifecycle (finish,
preempt, the request side of a completed load, reset, stats).  The rest is done by
parts that each own their state, built by ``__init__`` and wired with the parts they
call (calls go one way: allocator -> copies -> evictor; all three share the tree, the
pools and the table of copies in flight, ``manager_state.InFlightCopies``):

* ``matching``    ``PrefixMatcher``: the matches not applied yet (``match_prefix``), the
  longest cached prefix over every tier
* ``allocation``  ``Allocator``: the running requests; ``ensure_resident`` /
  ``allocate_device_blocks`` apply the match once, reference device hits, turn host hits
  into loads, hand out fresh blocks
* ``copies``      ``CopyTracker``: the backup queue and doomed host copies;
  ``issue_pending_backup_to_batch_request`` and the node side of ``complete_swap``
* ``eviction``    ``Evictor``: detached nodes and the evictions not handed to a batch;
  feasibility-first reclaim of LRU device leaves by the write policy (``write_policy``:
  a strategy object), references, host block allocation
* ``invariants``  ``check_invariants`` (raises ``InvariantViolation``), through the parts'
  read-only views; ``stats``: typed counters behind ``get_stats``

Nothing here touches KV bytes.  A copy is "in flight" from the moment its metadata
is emitted until ``complete_swap`` sees it come back; in flight, the node cannot be
evicted, and the copy's destination is served only by a host -> device load, to the
requests that share it (each holds a standby block in case the load fails).

Ownership of a block, per pool (the invariant ``check_invariants`` verifies):
free (in the pool), owned (in a running request's block table or among its standby
blocks, or held by a detached node whose copy is still in flight) or cached (a tree node's copy with no
running request on it).  free + owned + cached = total.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.allocation import Allocator
from fastdeploy_kvcache.core.block_pool import BlockPool, NoFreeBlocksError, PinnableBlockPool
from fastdeploy_kvcache.core.copies import CopyTracker
from fastdeploy_kvcache.core.errors import CacheManagerError, InvariantViolation, UnknownRequestError
from fastdeploy_kvcache.core.eviction import Evictor
from fastdeploy_kvcache.core.invariants import check_invariants
from fastdeploy_kvcache.core.manager_state import DEV, HOST, InFlight, InFlightCopies, RequestState, check_request
from fastdeploy_kvcache.core.matching import PrefixMatcher
from fastdeploy_kvcache.core.metadata import BlockNode, CacheSwapMetadata, MatchResult, ResidencyPlan, TransferKind
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.stats import CacheStats
from fastdeploy_kvcache.core.storage_tier import StorageTier
from fastdeploy_kvcache.core.write_policy import make_write_policy

logger = logging.getLogger(__name__)

__all__ = ["CacheManager", "CacheManagerError", "UnknownRequestError", "NoFreeBlocksError", "InvariantViolation"]



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

    def __init__(self, config: CacheConfig, storage: Optional[StorageTier] = None) -> None:
        """``storage``: the storage tier below the host tier, if any (it needs host blocks to
        stage through); the manager builds a pinnable host pool for it and binds it."""
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
        self.device_pool = BlockPool(config.num_gpu_blocks, DEV)
        self.storage: Optional[StorageTier] = storage
        if storage is None:
            self.host_pool = BlockPool(config.host_block_count, HOST)
        else:
            if not isinstance(storage, StorageTier):
                raise CacheManagerError(f"CacheManager's storage must be a StorageTier, got {type(storage).__name__}")
            # Pinned host blocks (a put still reading them) are not handed out again.
            self.host_pool = PinnableBlockPool(config.host_block_count, HOST)
        self.policy = make_write_policy(config.write_policy, config.write_through_threshold)
        self.tree = RadixTree()
        self.stats = CacheStats()
        self.inflight = InFlightCopies()
        self.matcher = PrefixMatcher(self.tree, self.block_size, self.enable_prefix_caching, storage)
        self.evictor = Evictor(self.tree, self.device_pool, self.host_pool, self.policy, self.stats, self.inflight,
                               storage)
        self.copies = CopyTracker(self.tree, self.host_pool, self.policy, self.stats, self.inflight, self.evictor)
        self.allocator = Allocator(self.tree, self.device_pool, self.block_size, self.stats, self.inflight,
                                   self.matcher, self.evictor, self.copies)
        if storage is not None:
            storage.bind(self, self.host_pool)
        logger.info(
            "CacheManager: %d device blocks, %d host blocks, block_size=%d, policy=%s",
            self.device_pool.num_blocks,
            self.host_pool.num_blocks,
            self.block_size,
            self.write_policy,
        )

    @property
    def share_loads(self) -> bool:
        """Whether a request may read a block another request's host -> device load is still
        bringing in (with a standby block in case the load fails); off: it computes the block."""
        return self.matcher.share_loads

    @share_loads.setter
    def share_loads(self, value: bool) -> None:
        self.matcher.share_loads = bool(value)

    @property
    def host_prefix_closed(self) -> bool:
        """Whether the host tier is kept prefix-closed (the through policies)."""
        return self.policy.host_prefix_closed

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
        check_request(request)
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 0:
            raise CacheManagerError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        return self.allocator.ensure_resident(request, num_tokens)

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
        check_request(request)
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise CacheManagerError(f"block count must be an int >= 0, got {n!r}")
        return self.allocator.allocate_device_blocks(request, n)

    def can_allocate_device_blocks(self, n: int, request: Optional[Request] = None) -> bool:
        """Whether ``n`` new device blocks can be had now, evicting what can be evicted.

        Exact: it runs the plan the allocation runs first, without evicting anything.
        Pass the ``request`` (matched, not allocated yet) to count its own device hits
        as pinned, as its allocation will: the answer then agrees with
        ``allocate_device_blocks(request, n)`` (standby blocks for the loads in flight it
        would share included).  O(1) when enough blocks are free,
        else O(k log n) for the k evictions it plans.
        """
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise CacheManagerError(f"block count must be an int >= 0, got {n!r}")
        if request is not None:
            check_request(request)
        return self.allocator.can_allocate_device_blocks(n, request)

    def allocate_host_blocks(self, k: int, keep: frozenset[BlockNode] = frozenset()) -> list[int]:
        """Up to ``k`` host blocks, ascending and as runs, evicting host LRU leaves as needed
        (the storage tier's prefetch lands in them).

        ``keep`` are host copies that must survive (taking one would break the host tier's
        prefix closure).
        """
        return self.evictor.allocate_host_blocks(k, keep)

    def queue_backups(self, nodes: list[BlockNode]) -> int:
        """Queue device-only ``nodes`` for a device -> host backup whatever the write policy
        says (the storage tier's flush at shutdown); returns how many were queued.  They are
        issued, ancestors first, by :meth:`issue_pending_backup_to_batch_request`."""
        return self.copies.queue_backups(nodes)

    def issue_pending_backup_to_batch_request(self) -> Optional[CacheSwapMetadata]:
        """This step's device -> host copies as one ``CacheSwapMetadata`` (None if none).

        It holds the queued write-through backups plus any write_back evictions no
        request carried (made by an allocation that then failed, or left by a
        preempted request).  Call it once per step, after the step's last
        allocation, and append the result with ``BatchRequest.append_evict_metadata``.
        Only queued candidates are visited: never a scan of the cache.  Backups keep the
        host tier prefix-closed (``CopyTracker.issue_pending_backup_to_batch_request``).
        """
        return self.copies.issue_pending_backup_to_batch_request()

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
        ok = bool(meta.success)
        affected: set[str] = set()
        for inf in self.copies.take_completed(meta):
            if inf.kind is TransferKind.SWAP_IN:
                # The request side first: a failed load's node is offered again (or released)
                # only once the requests that read it own its blocks.
                inf.node.pending = None
                if ok:
                    self._drop_standby(inf)
                else:
                    self._fail_swap_in(inf, affected)
            self.copies.resolve(inf, ok)
        requests = self.allocator.requests
        for rid in affected:
            rst = requests[rid]
            self._privatize_tail(rst, rst.request.num_computed_tokens // self.block_size)
        return sorted(affected)

    def match_prefix(self, request: Request) -> MatchResult:
        """Longest cached prefix of ``request`` over all tiers; stored on the request
        (:meth:`PrefixMatcher.match`: takes no refs, changes nothing, leaves at least the
        last token to compute).  A running request cannot be matched again."""
        check_request(request)
        if request.request_id in self.allocator.requests:
            raise CacheManagerError(
                f"request {request.request_id} is already running (its match was applied); "
                "finish or preempt it before matching again"
            )
        return self.matcher.match(request)

    def request_finish(self, request: Request) -> None:
        """Insert the request's computed full blocks into the tree and drop its refs.

        Full blocks up to ``num_computed_tokens`` (prompt and, with
        ``cache_output_tokens``, output) become cached; a block whose hash is
        already cached on device is a duplicate and goes back to the pool, as do the
        partial last block and blocks never computed.  The block table is cleared.
        """
        st = self.allocator.lookup(request)
        self._release(st, insert=True)
        request.block_tables = []
        request.match_result = None

    def commit_computed_blocks(self, request: Request) -> int:
        """Make a running request's computed full prompt blocks matchable now; returns how many
        leading blocks of its table are tree nodes afterwards.

        Without this a block enters the tree only when its request finishes or is preempted,
        so a request arriving while a long prompt is prefilled in chunks would compute the
        same prefix again.  Call it after a step advanced ``num_computed_tokens``.  Each new
        node is owned by the request (it holds the ref); its KV is final, because a full
        prompt block is never written again.  Nothing is committed on top of a load still
        in flight (if the load failed, the blocks computed over it hold wrong KV), nor past
        a block some other request already put in the tree (that copy stays private).
        """
        st = self.allocator.lookup(request)
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        num_full = min(request.num_computed_tokens, request.num_prompt_tokens) // bs
        i = st.committed
        if i >= num_full:
            return i
        parent = st.nodes[i - 1] if i else self.tree.root
        if parent is None or parent.detached or any(
            nd is not None and nd.pending is TransferKind.SWAP_IN for nd in st.nodes[:i]
        ):
            return i
        hashes = request.block_hashes(bs, num_full * bs)
        tree = self.tree
        if tree.events is not None:
            tree.events.set_token_source(hashes, request)  # committed blocks carry their tokens too
        for i in range(i, num_full):
            node = st.nodes[i]
            if node is not None:
                if node.parent is not parent or node.detached:
                    break
                parent = node
                st.committed = i + 1
                continue
            if hashes[i] in parent.children:
                break  # computed elsewhere too: that copy serves others, this one stays private
            node = tree.add_child(parent, hashes[i])
            node.ref_count = 1  # owned by the request before it is ever offered for eviction
            tree.set_device(node, st.block_ids[i])
            st.nodes[i] = node
            self.stats.inserted_blocks += 1
            self.stats.committed_blocks += 1
            if self.policy.backup_on_insert:
                self.copies.queue_backup(node)
            parent = node
            st.committed = i + 1
        return st.committed

    def preempt_request(self, request: Request) -> None:
        """Take a running request off the device, keeping what it computed cached.

        Its computed full blocks are inserted like on finish, so resuming it later
        (``match_prefix`` + ``allocate_device_blocks`` again) reuses them unless they
        were evicted meanwhile.  The request's cache fields are reset.
        """
        st = self.allocator.lookup(request)
        self._release(st, insert=True)
        request.block_tables = []
        request.num_cached_tokens = 0
        request.num_computed_tokens = 0
        request.match_result = None

    def _release(self, st: RequestState, insert: bool) -> None:
        req = st.request
        self.allocator.remove(req.request_id)
        bs = self.block_size
        # Loads never handed to a batch will never run: take them back.
        cancelled: set[int] = set()
        # Loads in flight it shared: its standby blocks go back, the load goes on.
        for i, b in st.standby.items():
            self.inflight.load_to(st.block_ids[i]).sharers.pop(req.request_id, None)
            self.device_pool.free_one(b)
        st.standby = {}
        for meta in req.cache_swap_metadata:
            for d in meta.dst_block_ids:
                inf = self.inflight.load_to(d)
                if inf.sharers:
                    self._hand_over_load(inf)
                    continue
                self.inflight.pop(HOST, DEV, d)
                node = inf.node
                node.pending = None
                i = st.block_ids.index(d)
                st.nodes[i] = None
                self.tree.clear_device(node)
                self.evictor.unref_no_count(node)
                cancelled.add(i)
                self.copies.on_load_cancelled(node)
        req.cache_swap_metadata = []
        # Evictions never handed to a batch must still reach the worker.
        if req.cache_evict_metadata:
            self.evictor.defer_evictions(req.cache_evict_metadata)
            req.cache_evict_metadata = []

        num_full = 0
        hashes: list[int] = []
        if insert and self.enable_prefix_caching:
            limit = req.num_total_tokens if self.config.cache_output_tokens else req.num_prompt_tokens
            num_full = min(req.num_computed_tokens, limit) // bs
            if num_full:
                hashes = req.block_hashes(bs, num_full * bs)
                if self.tree.events is not None:
                    self.tree.events.set_token_source(hashes, req)  # device inserts carry tokens
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
                self.evictor.unref(node)
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
                    self.copies.queue_backup(child)
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

    def _hand_over_load(self, inf: InFlight) -> None:
        """A request leaves before its load was handed to a batch, and others share the
        load: the first of them issues it instead (and no longer needs its standby block)."""
        rid, b = next(iter(inf.sharers.items()))
        del inf.sharers[rid]
        st = self.allocator.requests[rid]
        st.standby = {i: x for i, x in st.standby.items() if x != b}
        self.device_pool.free_one(b)
        inf.request_id = rid
        node = inf.node
        st.request.cache_swap_metadata.append(
            CacheSwapMetadata([inf.src], [inf.dst], HOST, DEV, [node.hash_value], kind=TransferKind.SWAP_IN)
        )

    def _privatize_tail(self, st: RequestState, start: int) -> None:
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
        st.committed = min(st.committed, start)
        try:
            self.evictor.reclaim_deferred(len(idxs))
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
        new = self.device_pool.allocate(len(idxs))
        req = st.request
        for i, b in zip(idxs, new):
            node = st.nodes[i]
            assert node is not None
            st.nodes[i] = None
            st.block_ids[i] = b
            req.block_tables[i] = b
            self.evictor.unref(node)

    def _fail_swap_in(self, inf: InFlight, affected: set[str]) -> None:
        node = inf.node
        d = inf.dst
        requests = self.allocator.requests
        st = requests.get(inf.request_id) if inf.request_id is not None else None
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
            st.committed = min(st.committed, idx)
            self.evictor.unref_no_count(node)
            req = st.request
            start = idx * self.block_size
            req.num_cached_tokens = min(req.num_cached_tokens, start)
            req.num_computed_tokens = min(req.num_computed_tokens, start)
            affected.add(req.request_id)
        else:
            # Its request is gone; the block was counted as cached (ref 0, in the tree)
            # unless requests that shared the load still hold it.
            if not node.detached and node.ref_count == 0:
                self.stats.cached_device -= 1
            self.device_pool.free_one(d)
        # Each request that shared the load recomputes into its standby block.
        for rid, b in inf.sharers.items():
            sst = requests[rid]
            i = next(k for k, x in sst.standby.items() if x == b)
            del sst.standby[i]
            sst.nodes[i] = None
            sst.block_ids[i] = b
            sst.request.block_tables[i] = b
            sst.committed = min(sst.committed, i)
            node.ref_count -= 1
            start = i * self.block_size
            sst.request.num_cached_tokens = min(sst.request.num_cached_tokens, start)
            sst.request.num_computed_tokens = min(sst.request.num_computed_tokens, start)
            affected.add(rid)
        inf.sharers = {}
        if node.detached:
            self.evictor.release_detached(node)
        else:
            self.tree.offer(node)

    def _drop_standby(self, inf: InFlight) -> None:
        """A shared load landed: its sharers' standby blocks go back to the pool."""
        requests = self.allocator.requests
        for rid, b in inf.sharers.items():
            st = requests[rid]
            st.standby = {i: x for i, x in st.standby.items() if x != b}
            self.device_pool.free_one(b)
        inf.sharers = {}

    def reset_cache(self) -> None:
        """Drop every cached block (e.g. after a weight update).  No request may be running.

        Copies still in flight keep their blocks until ``complete_swap`` returns
        them; un-issued evictions are cancelled.
        """
        running = len(self.allocator.requests)
        if running:
            raise CacheManagerError(
                f"reset_cache with {running} running requests; finish or preempt them first"
            )
        self.evictor.cancel_pending_evictions()
        nodes = list(self.tree.iter_nodes())
        self.tree.reset()
        for node in nodes:
            node.parent = None
            node.children = {}
            self.evictor.release_detached(node)
        self.copies.reset()
        self.stats.cached_device = 0
        logger.info("cache reset: %d nodes dropped, %d copies still in flight", len(nodes), len(self.inflight))

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
            num_running_requests=len(self.allocator.requests),
            num_cached_nodes=self.tree.num_nodes,
            num_copies_in_flight=len(self.inflight),
            write_policy=self.write_policy,
        )
        return s

    def is_running(self, request_id: str) -> bool:
        return request_id in self.allocator.requests

    @property
    def num_copies_in_flight(self) -> int:
        return len(self.inflight)

    @property
    def has_idle_backups(self) -> bool:
        """Backups queued while no request runs: no step would issue them (the engine
        issues them itself when it goes idle, ``issue_pending_backup_to_batch_request``)."""
        return not self.allocator.requests and self.copies.has_queued_backups

    def check_invariants(self) -> dict[str, int]:
        """Verify every bookkeeping invariant (see ``invariants.py``); returns per-pool counts.

        O(cache size), for tests and debugging.  Raises InvariantViolation.
        """
        return check_invariants(self)
