"""The scheduler-side cache manager: where every KV block lives, decided in Python.

``CacheManager`` is the facade: the public API, and the request lifecycle (finish,
preempt, the request side of a failed load, reset, stats).  Each other job is one
class in its own module, over the state declared in ``manager_state``:

* ``matching``    ``PrefixMatcher``, a part that owns its state: the matches not applied yet
  (``match_prefix`` delegates to it), the longest cached prefix over every tier
* ``allocation``  ``ensure_resident`` / ``allocate_device_blocks``: the match applied
  once, device hits referenced, host hits turned into loads, fresh blocks
* ``eviction``    feasibility-first reclaim of LRU device leaves by the write policy
  (``write_policy``: a strategy object), references, detached nodes
* ``copies``      ``issue_pending_backup_to_batch_request`` and ``complete_swap``: the
  copies in flight, each block resolved on its own
* ``invariants``  ``check_invariants`` (raises ``InvariantViolation``); ``stats``: typed
  counters behind ``get_stats``

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
from collections import deque
from typing import Any, Optional

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.allocation import AllocationMixin
from fastdeploy_kvcache.core.block_pool import BlockPool, NoFreeBlocksError, PinnableBlockPool
from fastdeploy_kvcache.core.copies import CopiesMixin
from fastdeploy_kvcache.core.errors import CacheManagerError, InvariantViolation, UnknownRequestError
from fastdeploy_kvcache.core.eviction import EvictionMixin
from fastdeploy_kvcache.core.invariants import check_invariants
from fastdeploy_kvcache.core.manager_state import DEV, HOST, InFlight, RequestState
from fastdeploy_kvcache.core.matching import PrefixMatcher
from fastdeploy_kvcache.core.metadata import BlockNode, CacheSwapMetadata, MatchResult, TransferKind
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.stats import CacheStats
from fastdeploy_kvcache.core.storage_tier import StorageTier
from fastdeploy_kvcache.core.write_policy import make_write_policy

logger = logging.getLogger(__name__)

__all__ = ["CacheManager", "CacheManagerError", "UnknownRequestError", "NoFreeBlocksError", "InvariantViolation"]



class CacheManager(AllocationMixin, EvictionMixin, CopiesMixin):
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
        self.share_loads = True
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
            storage.bind(self, self.host_pool)
        self.policy = make_write_policy(config.write_policy, config.write_through_threshold)
        self.tree = RadixTree()
        self._requests: dict[str, RequestState] = {}
        # Matches of requests not allocated yet (applied once, by the first allocation).
        self.matcher = PrefixMatcher(self.tree, self.block_size, self.enable_prefix_caching, storage)
        self._inflight: dict[tuple[int, int, int], InFlight] = {}
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

    def match_prefix(self, request: Request) -> MatchResult:
        """Longest cached prefix of ``request`` over all tiers; stored on the request
        (:meth:`PrefixMatcher.match`: takes no refs, changes nothing, leaves at least the
        last token to compute).  A running request cannot be matched again."""
        self._check_request(request)
        if request.request_id in self._requests:
            raise CacheManagerError(
                f"request {request.request_id} is already running (its match was applied); "
                "finish or preempt it before matching again"
            )
        return self.matcher.match(request, self.share_loads)

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
        st = self._lookup(request)
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
                self._queue_backup(node)
            parent = node
            st.committed = i + 1
        return st.committed

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

    def _lookup(self, request: Request) -> RequestState:
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

    def _check_block_table(self, st: RequestState) -> None:
        if st.request.block_tables != st.block_ids:
            foreign = sorted(set(st.request.block_tables) - set(st.block_ids))
            raise CacheManagerError(
                f"request {st.request.request_id}: block_tables was modified outside the cache manager "
                f"(ids not owned by it: {foreign})"
            )

    def _release(self, st: RequestState, insert: bool) -> None:
        req = st.request
        del self._requests[req.request_id]
        bs = self.block_size
        # Loads never handed to a batch will never run: take them back.
        cancelled: set[int] = set()
        # Loads in flight it shared: its standby blocks go back, the load goes on.
        for i, b in st.standby.items():
            self._inflight[(HOST, DEV, st.block_ids[i])].sharers.pop(req.request_id, None)
            self.device_pool.free_one(b)
        st.standby = {}
        for meta in req.cache_swap_metadata:
            for d in meta.dst_block_ids:
                inf = self._inflight[(HOST, DEV, d)]
                if inf.sharers:
                    self._hand_over_load(inf)
                    continue
                del self._inflight[(HOST, DEV, d)]
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

    def _hand_over_load(self, inf: InFlight) -> None:
        """A request leaves before its load was handed to a batch, and others share the
        load: the first of them issues it instead (and no longer needs its standby block)."""
        rid, b = next(iter(inf.sharers.items()))
        del inf.sharers[rid]
        st = self._requests[rid]
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

    def _fail_swap_in(self, inf: InFlight, affected: set[str]) -> None:
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
            st.committed = min(st.committed, idx)
            self._unref_no_count(node)
            req = st.request
            start = idx * self.block_size
            req.num_cached_tokens = min(req.num_cached_tokens, start)
            req.num_computed_tokens = min(req.num_computed_tokens, start)
            affected.add(req.request_id)
        else:
            # Its request is gone; the block was counted as cached (ref 0, in the tree)
            # unless requests that shared the load still hold it.
            if not node.detached and node.ref_count == 0:
                self._dec_cached_device()
            self.device_pool.free_one(d)
        # Each request that shared the load recomputes into its standby block.
        for rid, b in inf.sharers.items():
            sst = self._requests[rid]
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
            self._release_detached(node)
        else:
            self.tree.offer(node)

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
                inf = self._inflight.pop((DEV, HOST, h))
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

    @property
    def _host_prefix_closed(self) -> bool:
        """Whether the host tier is kept prefix-closed (the through policies)."""
        return self.policy.host_prefix_closed

    def is_running(self, request_id: str) -> bool:
        return request_id in self._requests

    @property
    def num_copies_in_flight(self) -> int:
        return len(self._inflight)

    @property
    def has_idle_backups(self) -> bool:
        """Backups queued while no request runs: no step would issue them (the engine
        issues them itself when it goes idle, ``issue_pending_backup_to_batch_request``)."""
        return not self._requests and bool(self._backup_queue)

    def check_invariants(self) -> dict[str, int]:
        """Verify every bookkeeping invariant (see ``invariants.py``); returns per-pool counts.

        O(cache size), for tests and debugging.  Raises InvariantViolation.
        """
        return check_invariants(self)
