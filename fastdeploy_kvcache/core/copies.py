"""Copies in flight: write-through backups out, and every copy's completion back in.

A copy is in flight from the moment its metadata is emitted until ``complete_swap``
sees it come back; each block is resolved on its own, in any grouping.  Backups keep
the host tier prefix-closed under the through policies (ancestors first, never at a
parent's expense, and a failed one takes the host copies below it).  What a failed
load means for the requests that read it is the facade's part
(``CacheManager._fail_swap_in``).
"""

from __future__ import annotations

import logging
from typing import Optional

from fastdeploy_kvcache.core.errors import CacheManagerError
from fastdeploy_kvcache.core.manager_state import DEV, HOST, InFlight, ManagerState
from fastdeploy_kvcache.core.metadata import BlockNode, CacheLevel, CacheSwapMetadata, TransferKind

logger = logging.getLogger(__name__)


class CopiesMixin(ManagerState):
    """Backups out, completions in (uses ``EvictionMixin`` for host blocks and releases)."""

    def _maybe_queue_backup(self, node: BlockNode, retry: bool = False) -> None:
        """Queue a backup if the write policy wants one for ``node`` (after a hit, or a
        ``retry`` of a backup that failed or was cancelled)."""
        if self.policy.wants_backup(node, retry):
            self._queue_backup(node)

    def _queue_backup(self, node: BlockNode) -> None:
        if not node.backup_queued and self.host_pool.num_blocks and self._needs_backup(node):
            node.backup_queued = True
            self._backup_queue.append(node)

    def queue_backups(self, nodes: list[BlockNode]) -> int:
        """Queue device-only ``nodes`` for a device -> host backup whatever the write policy
        says (the storage tier's flush at shutdown); returns how many were queued.  They are
        issued, ancestors first, by :meth:`issue_pending_backup_to_batch_request`."""
        before = len(self._backup_queue)
        for node in nodes:
            self._queue_backup(node)
        return len(self._backup_queue) - before

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
        hosts = self.allocate_host_blocks(len(todo), keep)  # type: ignore[arg-type]
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
            self._inflight[(DEV, HOST, h)] = InFlight(node, TransferKind.BACKUP, d, h)
            src.append(d)
            dst.append(h)
            hv.append(node.hash_value)
        if src:
            metas.append(CacheSwapMetadata(src, dst, DEV, HOST, hv, kind=TransferKind.BACKUP))
            self.stats.backup_blocks_issued += len(src)
        return CacheSwapMetadata.merged(metas)

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
        entries: list[InFlight] = []
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

    def _complete_swap_in(self, inf: InFlight, ok: bool, affected: set[str]) -> None:
        node = inf.node
        node.pending = None
        if not ok:
            self._fail_swap_in(inf, affected)
            if node in self._host_doomed and not node.detached:
                self._lose_host_copy(node)  # the source of the failed load goes too
            self._host_doomed.discard(node)
            return
        self.stats.swap_in_blocks += 1
        self._drop_standby(inf)
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

    def _drop_standby(self, inf: InFlight) -> None:
        """A shared load landed: its sharers' standby blocks go back to the pool."""
        for rid, b in inf.sharers.items():
            st = self._requests[rid]
            st.standby = {i: x for i, x in st.standby.items() if x != b}
            self.device_pool.free_one(b)
        inf.sharers = {}

    def _complete_evict(self, inf: InFlight, ok: bool) -> None:
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

    def _complete_backup(self, inf: InFlight, ok: bool) -> None:
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
