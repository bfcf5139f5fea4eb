"""Copies in flight: write-through backups out, and every copy's completion back in.

A copy is in flight from the moment its metadata is emitted until ``complete_swap``
sees it come back; each block is resolved on its own, in any grouping.  Backups keep
the host tier prefix-closed under the through policies (ancestors first, never at a
parent's expense, and a failed one takes the host copies below it).  What a load's
completion means for the requests that read it is the facade's part
(``CacheManager.complete_swap``); what it means for the node is this part's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from collections import deque
from typing import Optional

from fastdeploy_kvcache.core.block_pool import BlockPool
from fastdeploy_kvcache.core.errors import CacheManagerError
from fastdeploy_kvcache.core.eviction import Evictor
from fastdeploy_kvcache.core.manager_state import DEV, HOST, InFlight, InFlightCopies
from fastdeploy_kvcache.core.metadata import BlockNode, CacheLevel, CacheSwapMetadata, TransferKind
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.stats import CacheStats
from fastdeploy_kvcache.core.write_policy import WritePolicy

logger = logging.getLogger(__name__)


@dataclass(eq=False)
class CopyTracker:
    """The manager's part for copies: backups out, completions in (node side).

    It owns the backup queue and the doomed host copies (to be released as soon as the
    copy in flight on them completes, because a parent's host copy was lost).  It calls
    the ``Evictor`` for host blocks, the evictions to emit with the backups, and the
    release of detached nodes; never the other way round.
    """

    tree: RadixTree
    host_pool: BlockPool
    policy: WritePolicy
    stats: CacheStats
    inflight: InFlightCopies
    evictor: Evictor
    # Write-through backups to issue with the next step.
    _backup_queue: deque[BlockNode] = field(default_factory=deque, init=False, repr=False)
    # Nodes whose host copy goes as soon as the copy in flight on them completes
    # (their parent's host copy was lost: see _lose_host_copy).
    _host_doomed: set[BlockNode] = field(default_factory=set, init=False, repr=False)

    @property
    def host_doomed(self) -> frozenset[BlockNode]:
        """The nodes whose host copy goes when their copy in flight completes (a snapshot)."""
        return frozenset(self._host_doomed)

    @property
    def has_queued_backups(self) -> bool:
        return bool(self._backup_queue)

    def reset(self) -> None:
        """Forget queued backups and doomed host copies (the tree was dropped)."""
        self._backup_queue.clear()
        self._host_doomed.clear()

    def on_load_cancelled(self, node: BlockNode) -> None:
        """A load into ``node`` was taken back before it ran: a doomed host copy goes now."""
        if node in self._host_doomed and not node.detached:
            self._lose_host_copy(node)

    def maybe_queue_backup(self, node: BlockNode, retry: bool = False) -> None:
        """Queue a backup if the write policy wants one for ``node`` (after a hit, or a
        ``retry`` of a backup that failed or was cancelled)."""
        if self.policy.wants_backup(node, retry):
            self.queue_backup(node)

    def queue_backup(self, node: BlockNode) -> None:
        if not node.backup_queued and self.host_pool.num_blocks and self._needs_backup(node):
            node.backup_queued = True
            self._backup_queue.append(node)

    def queue_backups(self, nodes: list[BlockNode]) -> int:
        """``CacheManager.queue_backups``: backups whatever the write policy says; returns how
        many were queued."""
        before = len(self._backup_queue)
        for node in nodes:
            self.queue_backup(node)
        return len(self._backup_queue) - before

    @staticmethod
    def _needs_backup(node: BlockNode) -> bool:
        return not node.detached and node.device_block_id is not None and node.host_block_id is None and node.pending is None

    def issue_pending_backup_to_batch_request(self) -> Optional[CacheSwapMetadata]:
        """``CacheManager.issue_pending_backup_to_batch_request``: the queued backups and the
        evictions no request carried, as one ``CacheSwapMetadata`` (None if none).

        Only queued candidates are visited: never a scan of the cache.  Backups keep the
        host tier prefix-closed (the liveness rule): a node is backed up only together
        with, or after, every ancestor, so the ancestors of a queued node that have no host
        copy are backed up first, in the same step; and the host blocks they need never
        come from evicting a parent of one of them.
        """
        metas = self.evictor.take_pending_evictions()
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
        hosts = self.evictor.allocate_host_blocks(len(todo), keep)  # type: ignore[arg-type]
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
            self.inflight.add(InFlight(node, TransferKind.BACKUP, d, h))
            src.append(d)
            dst.append(h)
            hv.append(node.hash_value)
        if src:
            metas.append(CacheSwapMetadata(src, dst, DEV, HOST, hv, kind=TransferKind.BACKUP))
            self.stats.backup_blocks_issued += len(src)
        return CacheSwapMetadata.merged(metas)

    def take_completed(self, meta: CacheSwapMetadata) -> list[InFlight]:
        """Check a returned copy against the copies in flight and take its blocks out of the
        table; the caller resolves each (:meth:`resolve`, after the request side of a load).

        Each block is found by (src tier, dst tier, dst block id) and checked against its
        ``src_block_ids`` and ``hash_values`` entries; a block that is not in flight raises
        CacheManagerError before anything changes.
        """
        n = len(meta.dst_block_ids)
        if len(meta.src_block_ids) != n or (meta.hash_values and len(meta.hash_values) != n):
            raise CacheManagerError(
                f"complete_swap: task {meta.task_id} has {len(meta.src_block_ids)} src ids, {n} dst ids and "
                f"{len(meta.hash_values)} hashes"
            )
        st, dt = CacheLevel(meta.src_type), CacheLevel(meta.dst_type)
        entries: list[InFlight] = []
        seen: set[int] = set()
        for i, dst in enumerate(meta.dst_block_ids):
            inf = self.inflight.get(st, dt, dst)
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
        if not meta.success:
            logger.warning(
                "copy task %d (%s -> %s, %d blocks) failed: %s", meta.task_id, st.name, dt.name, n, meta.error_message
            )
            self.stats.failed_blocks += n
        for inf in entries:
            self.inflight.pop(st, dt, inf.dst)
        return entries

    def resolve(self, inf: InFlight, ok: bool) -> None:
        """Apply a completed copy's verdict to its node (the copy is out of the table)."""
        inf.node.pending = None
        if inf.kind is TransferKind.SWAP_IN:
            self._complete_swap_in(inf, ok)
        elif inf.kind is TransferKind.EVICT:
            self._complete_evict(inf, ok)
        else:
            self._complete_backup(inf, ok)

    def _complete_swap_in(self, inf: InFlight, ok: bool) -> None:
        node = inf.node
        if not ok:
            if node in self._host_doomed and not node.detached:
                self._lose_host_copy(node)  # the source of the failed load goes too
            self._host_doomed.discard(node)
            return
        self.stats.swap_in_blocks += 1
        if node.detached:
            self._host_doomed.discard(node)
            self.evictor.release_detached(node)
            return
        if node in self._host_doomed:
            self._lose_host_copy(node)
        elif self.policy.exclusive_tiers and node.host_block_id is not None:
            # Exclusive tiers: the host copy has done its job.
            self.host_pool.free_one(self.tree.clear_host(node))
        self.tree.offer(node)

    def _complete_evict(self, inf: InFlight, ok: bool) -> None:
        node = inf.node
        if ok:
            self.stats.write_back_blocks += 1
        if node.detached:
            self.evictor.release_detached(node)
            return
        if ok:
            self.tree.offer(node)
            return
        # The device block was released when the eviction was issued: the data is gone.
        self.host_pool.free_one(self.tree.clear_host(node))
        lost = self.evictor.drop_subtree(node)
        logger.warning("write_back eviction of block %#x failed: dropping it and %d descendants", node.hash_value, lost - 1)

    def _complete_backup(self, inf: InFlight, ok: bool) -> None:
        node = inf.node
        if ok:
            self.stats.backup_blocks += 1
        if node.detached:
            self._host_doomed.discard(node)
            self.evictor.release_detached(node)
            return
        if not ok or node in self._host_doomed:
            # A failed backup, or one whose parent's host copy went meanwhile: this
            # host copy goes, and so does every host copy below it (prefix closure).
            self._lose_host_copy(node)
            self.maybe_queue_backup(node, retry=True)
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
            self.maybe_queue_backup(d, retry=True)
            if d.device_block_id is None:
                self.evictor.drop_subtree(d)
        if node.device_block_id is None:
            self.evictor.drop_subtree(node)
