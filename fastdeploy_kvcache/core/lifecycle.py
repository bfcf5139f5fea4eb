"""The request lifecycle: finish, preempt, commit, and the request side of a completed load.

:class:`RequestLifecycle` is the manager's part for what happens to a running request's
blocks after its allocation: they become cached nodes when it finishes or is preempted
(or, for computed prompt blocks, while it runs), and a load it reads that fails makes it
recompute into blocks of its own.  The running requests' table is the ``Allocator``'s;
this part takes requests out of it and edits their records.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

from fastdeploy_kvcache.core.allocation import Allocator
from fastdeploy_kvcache.core.block_pool import BlockPool, NoFreeBlocksError
from fastdeploy_kvcache.core.copies import CopyTracker
from fastdeploy_kvcache.core.eviction import Evictor
from fastdeploy_kvcache.core.k_anonymity import KAnonymityIndex
from fastdeploy_kvcache.core.manager_state import DEV, HOST, InFlight, InFlightCopies, RequestState
from fastdeploy_kvcache.core.metadata import BlockNode, CacheLevel, CacheSwapMetadata, TransferKind
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.stats import CacheStats
from fastdeploy_kvcache.core.write_policy import WritePolicy

if TYPE_CHECKING:  # pragma: no cover
    from fastdeploy_kvcache.config import CacheConfig
    from fastdeploy_kvcache.core.tier_port import RevealListener

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class RequestLifecycle:
    """The manager's part that ends requests and handles their side of completed loads.

    It owns no table of its own: it works on the ``Allocator``'s running requests, and
    calls the ``Evictor`` (refs, room, deferred evictions) and the ``CopyTracker``
    (backups on insert, host copies doomed by a cancelled load).
    """

    tree: RadixTree
    device_pool: BlockPool
    enable_prefix_caching: bool
    config: "CacheConfig"  # read when a request ends (enable_output_caching), and the block size
    policy: WritePolicy
    stats: CacheStats
    inflight: InFlightCopies
    allocator: Allocator
    evictor: Evictor
    copies: CopyTracker
    # Who computed which block, under k-anonymity (None: off).  A request's computed blocks
    # are recorded as its tenant's when they become cached (commit, finish, preempt),
    # whether its copy enters the tree or is a duplicate of a copy already there.
    k_anonymity: Optional[KAnonymityIndex] = None
    # Told of cached blocks with a host copy that a computation revealed (the storage tier
    # writes them now: before, they were private and not written).  None: nobody listens.
    reveal_listener: Optional["RevealListener"] = None

    def set_reveal_listener(self, listener: Optional["RevealListener"]) -> None:
        self.reveal_listener = listener

    def _backup_inserted(self, node: BlockNode, st: Optional[RequestState] = None) -> None:
        """The write policy's backup of a block just inserted by ``st``'s request.

        Under k-anonymity a running request's blocks are backed up when it leaves, not as
        its chunks commit: a tenant's block is a fresh node (backed up) or a duplicate of
        another tenant's private one (freed, no copy), and copies made while the request
        still computes would slow it in the first case only, so its own time to first token
        would tell its tenant whether another tenant had sent the prompt.  Nothing is lost:
        the request holds the blocks until then, so none can be evicted unbacked."""
        if not self.policy.backup_on_insert:
            return
        if st is not None and self.k_anonymity is not None:
            st.backup_pending.append(node)
            return
        self.copies.queue_backup(node)

    def _announce_revealed(self, hashes: list[int], revealed: list[int]) -> None:
        """The tree nodes of ``revealed`` (hashes along the chain ``hashes``) are shared now:
        KV events announce their copies (they were withheld while private), and the listener
        gets those with a valid host copy."""
        events = self.tree.events
        if not revealed or (self.reveal_listener is None and events is None):
            return
        want = set(revealed)
        node = self.tree.root
        out = []
        for h in hashes:
            node = node.children.get(h)
            if node is None:
                break
            if h not in want:
                continue
            if events is not None:  # parents first, as the chain goes
                if node.device_block_id is not None:
                    events.node_stored(node, int(CacheLevel.DEVICE))
                if node.host_block_id is not None:
                    events.node_stored(node, int(CacheLevel.HOST))
            if node.host_block_id is not None and node.pending is None:
                out.append(node)
        if out and self.reveal_listener is not None:
            self.reveal_listener.on_revealed(out)

    @property
    def block_size(self) -> int:
        """Tokens per block, read from the config (not a copy of it)."""
        return self.config.block_size

    def finish(self, request: Request) -> None:
        """``CacheManager.request_finish``: insert what it computed, drop its refs."""
        st = self.allocator.lookup(request)
        self._release(st, insert=True)
        request.block_tables = []
        request.match_result = None

    def commit(self, request: Request) -> int:
        """``CacheManager.commit_computed_blocks``: its computed full prompt blocks become
        tree nodes it owns; returns how many leading blocks are tree nodes."""
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
        revealed = self.k_anonymity.record_computed(request.tenant, hashes[i:num_full]) \
            if self.k_anonymity is not None else []
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
            self._backup_inserted(node, st)
            parent = node
            st.committed = i + 1
        # Announced (KV events, storage puts) when the request leaves: a reveal's
        # side effects must not slow the revealing request itself, or its own timing would
        # tell its tenant that another tenant had computed the block.
        st.revealed_pending.extend(revealed)
        return st.committed

    def preempt(self, request: Request) -> None:
        """``CacheManager.preempt_request``: like :meth:`finish`, and its cache fields are reset."""
        st = self.allocator.lookup(request)
        self._release(st, insert=True)
        request.block_tables = []
        request.num_cached_tokens = 0
        request.num_computed_tokens = 0
        request.match_result = None

    def _release(self, st: RequestState, insert: bool) -> None:
        """Take ``st`` out of the running table and give back what it holds: loads it issued
        but never handed to a batch are cancelled (or handed over to a sharer), evictions it
        carried wait for the next step, and with ``insert`` its computed full blocks become
        cached nodes (a duplicate's block goes back to the pool)."""
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
        revealed: list[int] = []
        if insert and self.enable_prefix_caching:
            limit = req.num_total_tokens if self.config.enable_output_caching else req.num_prompt_tokens
            num_full = min(req.num_computed_tokens, limit) // bs
            if num_full:
                hashes = req.block_hashes(bs, num_full * bs)
                if self.k_anonymity is not None:
                    # Before the inserts: a copy that is a duplicate of another tenant's
                    # private block still counts (this tenant computed it, as a miss).
                    revealed = self.k_anonymity.record_computed(req.tenant, hashes[:num_full])
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
                self._backup_inserted(child)
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
        for node in st.backup_pending:  # k-anonymity: the backups its commits left for now
            self.copies.queue_backup(node)
        st.backup_pending = []
        if st.revealed_pending:
            revealed = st.revealed_pending + revealed
            st.revealed_pending = []
            if len(hashes) < st.committed:  # released without inserting: the committed chain
                hashes = req.block_hashes(bs, st.committed * bs)
                num_full = st.committed
        self._announce_revealed(hashes[:num_full], revealed)

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

    def recompute_privately(self, affected: set[str]) -> None:
        """After failed loads: each ``affected`` request recomputes from its first block not
        computed, into private blocks (:meth:`_privatize_tail`)."""
        requests = self.allocator.requests
        for rid in affected:
            st = requests[rid]
            self._privatize_tail(st, st.request.num_computed_tokens // self.block_size)

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

    def load_failed(self, inf: InFlight, affected: set[str]) -> None:
        """The request side of a failed load: each request that was to read the block owns
        a block there and recomputes from it (its id goes into ``affected``)."""
        node = inf.node
        node.pending = None  # the load is over
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

    def load_landed(self, inf: InFlight) -> None:
        """A shared load landed: its sharers' standby blocks go back to the pool."""
        inf.node.pending = None  # the load is over
        requests = self.allocator.requests
        for rid, b in inf.sharers.items():
            st = requests[rid]
            st.standby = {i: x for i, x in st.standby.items() if x != b}
            self.device_pool.free_one(b)
        inf.sharers = {}
