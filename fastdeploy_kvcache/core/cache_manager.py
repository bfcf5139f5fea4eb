"""The scheduler-side cache manager: where every KV block lives, decided in Python.

``CacheManager`` is the facade: the public API (argument checks, then one part's
method), ``complete_swap`` (the node side and the request side of each block, in
order), reset and stats.  The work is done by parts that each own their state, built by
``__init__`` and handed the parts they call, so calls go one way (lifecycle ->
allocator -> copies -> evictor; the allocator also asks the matcher).  All share the
tree, the pools, the counters and ``manager_state.InFlightCopies``, the table of copies
in flight:

* ``matching``    ``PrefixMatcher``: the matches not applied yet; the longest cached
  prefix over every tier
* ``allocation``  ``Allocator``: the running requests' table; ``ensure_resident`` /
  ``allocate_device_blocks`` apply the match once, reference device hits, turn host
  hits into loads, hand out fresh blocks
* ``lifecycle``   ``RequestLifecycle``: finish, preempt, commit, the request side of a
  completed load (standby blocks, recompute after a failed one)
* ``copies``      ``CopyTracker``: the backup queue and the doomed host copies; backups
  out, the node side of each completion
* ``eviction``    ``Evictor``: the detached nodes and the evictions not handed to a
  batch; feasibility-first reclaim of LRU device leaves by the write policy
  (``write_policy``: a strategy object), references, host block allocation
* ``invariants``  ``check_invariants`` (raises ``InvariantViolation``), through the
  parts' read-only views; ``stats``: typed counters behind ``get_stats``

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
from fastdeploy_kvcache.core.k_anonymity import KAnonymityIndex
from fastdeploy_kvcache.core.lifecycle import RequestLifecycle
from fastdeploy_kvcache.core.manager_state import DEV, HOST, InFlightCopies, check_request
from fastdeploy_kvcache.core.matching import PrefixMatcher
from fastdeploy_kvcache.core.metadata import BlockNode, CacheSwapMetadata, MatchResult, ResidencyPlan, TransferKind
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.stats import CacheStats
from fastdeploy_kvcache.core.storage_tier import StorageTier
from fastdeploy_kvcache.core.tier_port import StoragePort
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

    def __init__(self, config: CacheConfig, storage: Optional[StorageTier] = None,
                 host_blocks_ready: Optional[int] = None) -> None:
        """``storage``: the storage tier below the host tier, if any (it needs host blocks to
        stage through); the manager builds a pinnable host pool for it and binds it.
        ``host_blocks_ready``: host blocks whose memory is there now (default: all); the rest
        join through :meth:`add_landed_host_blocks` as the worker pins them."""
        if not isinstance(config, CacheConfig):
            raise CacheManagerError(f"CacheManager needs a CacheConfig, got {type(config).__name__}")
        config.validate()  # fields may have been changed after construction
        if config.num_gpu_blocks <= 0:
            raise CacheManagerError(
                f"CacheConfig.num_gpu_blocks must be > 0 for the cache manager, got {config.num_gpu_blocks}"
            )
        self.config = config
        self.write_policy = config.write_policy
        self.write_through_threshold = config.write_through_threshold
        self.enable_prefix_caching = config.enable_prefix_caching
        self.bytes_per_block = config.bytes_per_block
        self.device_pool = BlockPool(config.num_gpu_blocks, DEV)
        self.storage: Optional[StorageTier] = storage
        if storage is None:
            self.host_pool = BlockPool(config.host_block_count, HOST, host_blocks_ready)
        else:
            if not isinstance(storage, StorageTier):
                raise CacheManagerError(f"CacheManager's storage must be a StorageTier, got {type(storage).__name__}")
            # Pinned host blocks (a put still reading them) are not handed out again.
            self.host_pool = PinnableBlockPool(config.host_block_count, HOST, host_blocks_ready)
        self.policy = make_write_policy(config.write_policy, config.write_through_threshold)
        self.tree = RadixTree()
        self.stats = CacheStats()
        self.inflight = InFlightCopies()
        # k-anonymous sharing across tenants (core/k_anonymity.py); None: every block shared.
        # It remembers a few times as many hashes as both tiers hold, so a block keeps its
        # tenants for a while after it left the cache (a later computation still counts).
        self.k_anonymity: Optional[KAnonymityIndex] = None
        if config.k_anonymity_k:
            capacity = max(1 << 16, 8 * (config.num_gpu_blocks + config.host_block_count))
            self.k_anonymity = KAnonymityIndex(config.k_anonymity_k, capacity)
        self.matcher = PrefixMatcher(self.tree, self.block_size, self.enable_prefix_caching, storage,
                                     self.k_anonymity)
        tree, dev, host, policy, stats, inflight = (self.tree, self.device_pool, self.host_pool, self.policy,
                                                    self.stats, self.inflight)
        self.evictor = Evictor(tree=tree, device_pool=dev, host_pool=host, policy=policy, stats=stats,
                               inflight=inflight)
        self.copies = CopyTracker(tree=tree, host_pool=host, policy=policy, stats=stats, inflight=inflight,
                                  evictor=self.evictor)
        self.allocator = Allocator(tree=tree, device_pool=dev, block_size=self.block_size, stats=stats,
                                   inflight=inflight, matcher=self.matcher, evictor=self.evictor, copies=self.copies)
        self.lifecycle = RequestLifecycle(tree=tree, device_pool=dev, enable_prefix_caching=self.enable_prefix_caching, config=config,
                                          policy=policy, stats=stats, inflight=inflight, allocator=self.allocator,
                                          evictor=self.evictor, copies=self.copies,
                                          k_anonymity=self.k_anonymity)
        # The storage tier reaches the tree and the host pool only through this port.
        self.storage_port: Optional[StoragePort] = None
        if storage is not None:
            assert isinstance(self.host_pool, PinnableBlockPool)
            self.storage_port = StoragePort(tree, self.host_pool, self.evictor, policy, self.block_size,
                                            self.enable_prefix_caching, self.k_anonymity,
                                            self.lifecycle.set_reveal_listener)
            storage.bind(self.storage_port)
        logger.info(
            "CacheManager: %d device blocks, %d host blocks, block_size=%d, policy=%s",
            self.device_pool.num_blocks,
            self.host_pool.num_blocks,
            self.block_size,
            self.write_policy,
        )

    @property
    def block_size(self) -> int:
        """Tokens per block: the config's (one value; the parts given it at construction
        keep what it was then, and the config is validated before any of them is built)."""
        return self.config.block_size

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
                if ok:
                    self.lifecycle.load_landed(inf)
                else:
                    self.lifecycle.load_failed(inf, affected)
            self.copies.resolve(inf, ok)
        self.lifecycle.recompute_privately(affected)
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
        ``enable_output_caching``, output) become cached; a block whose hash is
        already cached on device is a duplicate and goes back to the pool, as do the
        partial last block and blocks never computed.  The block table is cleared.
        """
        self.lifecycle.finish(request)

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
        return self.lifecycle.commit(request)

    def extend_match(self, request: Request) -> int:
        """Load host-only blocks that now follow a running request's computed prefix in the
        tree (a storage tail hung below the head the request recomputed); returns the blocks.

        Like the host hits of a first allocation: each becomes a host -> device load into the
        request's table (``request.cache_swap_metadata``, run with its next step) and
        ``num_computed_tokens`` moves past them; a failed load makes it recompute from there
        (``complete_swap``).  0 when nothing follows, the request is not at a committed block
        boundary, or device blocks are short.
        """
        check_request(request)
        return self.allocator.extend_match(request)

    def loads_in_flight(self, request: Request) -> bool:
        """Whether a host -> device load into one of the running request's blocks is not
        confirmed yet (nothing computed on top of it is committed until it is)."""
        check_request(request)
        st = self.allocator.lookup(request)
        return any(nd is not None and nd.pending is TransferKind.SWAP_IN for nd in st.nodes)

    def back_up_committed(self, request: Request) -> int:
        """Queue device -> host backups of a running request's committed blocks that lack a
        host copy, whatever the write policy (ancestors first, as every backup); returns how
        many were queued.  A storage tail may hang below a block only once it has a host copy
        under the policies that keep the host tier prefix-closed."""
        check_request(request)
        st = self.allocator.lookup(request)
        nodes = [nd for nd in st.nodes[: st.committed] if nd is not None]
        return self.copies.queue_backups(nodes)

    def preempt_request(self, request: Request) -> None:
        """Take a running request off the device, keeping what it computed cached.

        Its computed full blocks are inserted like on finish, so resuming it later
        (``match_prefix`` + ``allocate_device_blocks`` again) reuses them unless they
        were evicted meanwhile.  The request's cache fields are reset.
        """
        self.lifecycle.preempt(request)

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
        if self.k_anonymity is not None:
            self.k_anonymity.clear()  # new weights: nothing computed before counts
        self.stats.cached_device = 0
        logger.info("cache reset: %d nodes dropped, %d copies still in flight", len(nodes), len(self.inflight))

    def add_landed_host_blocks(self, num_ready: int) -> int:
        """Host blocks ``[0, num_ready)`` have memory now: the new ones join the host pool's
        free list.  Returns how many joined.

        The worker pins a large host tier in the background (``CacheController``,
        ``host_blocks_ready``) and the engine relays its count here: until then the pool
        holds only the landed ids, so no eviction, backup or storage fetch is ever given a
        host block whose memory is not there.  Counts only grow; a smaller one is a no-op.
        """
        added = self.host_pool.extend_ready(num_ready)
        if added:
            logger.debug("host pool: %d blocks landed, %d of %d ready", added, self.host_pool.num_ready,
                         self.host_pool.num_blocks)
        return added

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
            host_blocks_ready=self.host_pool.num_ready,
            host_blocks_free=self.host_pool.num_free,
            host_usage=self.host_pool.usage(),
            num_running_requests=len(self.allocator.requests),
            num_cached_nodes=self.tree.num_nodes,
            num_copies_in_flight=len(self.inflight),
            write_policy=self.write_policy,
        )
        if self.k_anonymity is not None:
            s["k_anonymity"] = self.k_anonymity.stats()
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
