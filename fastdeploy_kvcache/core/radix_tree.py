"""Prefix tree over chained block hashes, with per-tier LRU eviction of leaves.

One node per full block.  Because a block hash already chains its whole prefix,
each edge is a single hash and lookups are dict hits; there is no token-level
radix splitting to do.

The tree owns the *structure* (parent/children, per-tier child counts) and the
eviction order.  It does not decide policy: the cache manager says which copies
exist, and tells the tree through :meth:`set_device` / :meth:`clear_device` /
:meth:`set_host` / :meth:`clear_host`, which keep the counts right and re-offer the
node and its parent to the eviction heaps.

Eviction candidates of a tier are its *leaves*: nodes whose children hold no copy
on that tier.  Only those are ever offered, so interior nodes are never evicted
and a subtree is never cut off from the root.  Each tier keeps a min-heap keyed by
last access with lazy deletion (a node carries the key of its current entry per tier;
an entry whose key differs is skipped when popped).  Push and pop are O(log n); stale
entries are compacted away once they outnumber live ones, which keeps it amortized
O(log n) with no scan per eviction.
"""

from __future__ import annotations

import heapq
import itertools
import logging
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Sequence

from fastdeploy_kvcache.core.hashing import ROOT_HASH
from fastdeploy_kvcache.core.metadata import BlockNode, CacheLevel, TransferKind

if TYPE_CHECKING:  # msgspec is imported only when events are on
    from fastdeploy_kvcache.core.kv_event_recorder import KVEventRecorder

logger = logging.getLogger(__name__)

_DEVICE = int(CacheLevel.DEVICE)
_HOST = int(CacheLevel.HOST)


_SEQ_BITS = 32
_SEQ_MASK = (1 << _SEQ_BITS) - 1


class LRULeafHeap:
    """Min-heap over the evictable leaves of one tier, least recently used first.

    An entry is ``(key, node)`` with ``key = last_access << 32 | push_seq``: one int,
    unique per push, so heap comparisons never reach the node, and "is this entry
    current" is ``node.<key attribute> == key`` (no separate version field).  The key
    lives in a plain slot (``dev_heap_key`` / ``host_heap_key``), not a list, so a node
    is one GC-tracked object fewer: with 100k+ nodes, full GC passes are what the
    scheduler's tail latency is made of.
    """

    # NOTE: a heap rather than an intrusive LRU list because a node can become a
    # leaf long after its last access (its last child was evicted); a list would
    # have to insert it in the middle, the heap just pushes it with its old key.
    # Entries are 2-tuples of (int, node) to keep the heap small and the compares
    # cheap: at 100k entries memory traffic, not the log n, is what costs.

    def __init__(self, tier: int, eligible: Callable[[BlockNode], bool]) -> None:
        self.tier = tier
        self.eligible = eligible
        self._attr = "dev_heap_key" if tier == _DEVICE else "host_heap_key"
        self._entries: list[tuple[int, BlockNode]] = []
        self._seq = 0
        self._live = 0  # nodes whose key attribute is set (one current entry each)

    def __len__(self) -> int:
        return len(self._entries)

    def offer(self, node: BlockNode) -> None:
        """Push ``node`` if it is evictable now and not already in with its current key."""
        attr = self._attr
        current = getattr(node, attr)
        if current is not None and current >> _SEQ_BITS == node.last_access:
            return  # already in with this access time
        if not self.eligible(node):
            return
        if current is None:
            self._live += 1
        self._seq = (self._seq + 1) & _SEQ_MASK
        key = node.last_access << _SEQ_BITS | self._seq
        setattr(node, attr, key)
        heapq.heappush(self._entries, (key, node))
        if len(self._entries) > 2 * self._live + 64:
            self._compact()

    def forget(self, node: BlockNode) -> None:
        """Invalidate ``node``'s entry (the node left the tree or lost its copy)."""
        attr = self._attr
        if getattr(node, attr) is not None:
            setattr(node, attr, None)
            self._live -= 1

    def peek(self) -> Optional[BlockNode]:
        """The node ``pop`` would return, left in the heap (stale entries on top are dropped)."""
        attr = self._attr
        entries = self._entries
        while entries:
            key, node = entries[0]
            if getattr(node, attr) == key and self.eligible(node):
                return node
            heapq.heappop(entries)
            if getattr(node, attr) == key:
                setattr(node, attr, None)  # current but no longer evictable: as pop() would
                self._live -= 1
        return None

    def pop(self) -> Optional[BlockNode]:
        """Remove and return the least recently used evictable leaf, or None."""
        attr = self._attr
        entries = self._entries
        pop = heapq.heappop
        while entries:
            key, node = pop(entries)
            if getattr(node, attr) != key:
                continue  # superseded or forgotten entry
            setattr(node, attr, None)
            self._live -= 1
            if self.eligible(node):
                return node
        return None

    def _compact(self) -> None:
        attr = self._attr
        kept = []
        for entry in self._entries:
            node = entry[1]
            if getattr(node, attr) != entry[0]:
                continue
            if not self.eligible(node):
                setattr(node, attr, None)
                self._live -= 1
                continue
            kept.append(entry)
        heapq.heapify(kept)
        self._entries = kept

    def clear(self) -> None:
        attr = self._attr
        for key, node in self._entries:
            if getattr(node, attr) == key:
                setattr(node, attr, None)
        self._entries = []
        self._live = 0


class RadixTree:
    """The prefix tree of cached blocks, shared by all tiers.

    Every device leaf that nobody references and no copy pins is offered for device
    eviction, whatever its other copies: that is what keeps every cached block
    reclaimable (the liveness rule in docs/architecture.md).  A device leaf with no
    host copy can still have children only under write_back (they live on host);
    the cache manager then copies it to host, or drops it together with the host
    subtree that nothing could reach without it.
    """

    def __init__(self) -> None:
        self.root = BlockNode(ROOT_HASH, None, depth=-1)
        self.root.ref_count = 1  # never evicted
        self.num_nodes = 0
        self._clock = 0
        self.device_heap = LRULeafHeap(_DEVICE, self._device_evictable)
        self.host_heap = LRULeafHeap(_HOST, self._host_evictable)
        # KV cache events (core/kv_event_recorder.py): told of every copy gained or lost.
        # None when events are off, so each hook below costs one attribute test.
        self.events: Optional["KVEventRecorder"] = None

    # ------------------------------------------------------------------ eligibility
    def _device_evictable(self, node: BlockNode) -> bool:
        return (
            node.device_block_id is not None
            and node.ref_count == 0
            and node.pending is None
            and not node.detached
            and node.num_device_children == 0
        )

    @staticmethod
    def _host_evictable(node: BlockNode) -> bool:
        return (
            node.host_block_id is not None
            and node.pending is None
            and not node.detached
            and node.num_host_children == 0
            # Dropping the only copy removes the node, so it must have no children;
            # a host-only node referenced by a request is about to be loaded.
            and (node.device_block_id is not None or (not node.children and node.ref_count == 0))
        )

    def offer(self, node: BlockNode) -> None:
        """Re-offer ``node`` to both heaps after any change that may make it evictable."""
        if node is self.root:
            return
        # Cheap pre-filters: most nodes offered are interior ones (a finishing request
        # releases its whole path), and those are never leaves.
        if node.device_block_id is not None and not node.num_device_children:
            self.device_heap.offer(node)
        if node.host_block_id is not None and not node.num_host_children:
            self.host_heap.offer(node)

    # ------------------------------------------------------------------ structure
    def tick(self) -> int:
        self._clock += 1
        return self._clock

    def touch(self, node: BlockNode) -> None:
        node.last_access = self.tick()

    def add_child(self, parent: BlockNode, hash_value: int) -> BlockNode:
        if hash_value in parent.children:
            raise ValueError(f"node {hash_value:#x} already exists under {parent!r}")
        node = BlockNode(hash_value, parent, parent.depth + 1)
        node.last_access = self.tick()
        parent.children[hash_value] = node
        self.num_nodes += 1
        return node

    def remove(self, node: BlockNode) -> None:
        """Unlink a node that holds no copy and has no children."""
        if node.children or node.device_block_id is not None or node.host_block_id is not None:
            raise AssertionError(f"refusing to remove {node!r}: it still has children or data")
        if node.ref_count:
            raise AssertionError(f"refusing to remove {node!r}: it is referenced")
        self.device_heap.forget(node)
        self.host_heap.forget(node)
        parent = node.parent
        if parent is not None and not node.detached:
            del parent.children[node.hash_value]
            self.num_nodes -= 1
            node.detached = True
            self.offer(parent)
        node.parent = None

    def detach_subtree(self, node: BlockNode) -> list[BlockNode]:
        """Cut ``node`` and its descendants out of the tree; return them (pre-order).

        The caller releases their blocks (or leaves in-flight ones to complete).  Used
        when a node's only copy is lost (a failed write_back eviction): its
        descendants can no longer be reached, so they go too rather than be orphaned.
        """
        out: list[BlockNode] = []
        stack = [node]
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        if self.events is not None:
            self.events.nodes_detached(out)
        parent = node.parent
        if parent is not None and not node.detached:
            del parent.children[node.hash_value]
            if node.device_block_id is not None:
                parent.num_device_children -= 1
            if node.host_block_id is not None:
                parent.num_host_children -= 1
            self.offer(parent)
        for n in out:
            self.device_heap.forget(n)
            self.host_heap.forget(n)
            n.detached = True
            self.num_nodes -= 1
        return out

    # ------------------------------------------------------------------ copies
    def set_device(self, node: BlockNode, block_id: int) -> None:
        assert node.device_block_id is None, node
        node.device_block_id = block_id
        if node.parent is not None and not node.detached:
            node.parent.num_device_children += 1
        self.offer(node)
        if self.events is not None:
            self.events.node_stored(node, _DEVICE)

    def clear_device(self, node: BlockNode) -> int:
        block_id = node.device_block_id
        assert block_id is not None, node
        node.device_block_id = None
        self.device_heap.forget(node)
        if self.events is not None:
            self.events.node_removed(node, _DEVICE)
        parent = node.parent
        if parent is not None and not node.detached:
            parent.num_device_children -= 1
            self.offer(parent)
        self.offer(node)
        return block_id

    def set_host(self, node: BlockNode, block_id: int) -> None:
        assert node.host_block_id is None, node
        node.host_block_id = block_id
        if node.parent is not None and not node.detached:
            node.parent.num_host_children += 1
        self.offer(node)
        if self.events is not None:
            self.events.node_stored(node, _HOST)

    def clear_host(self, node: BlockNode) -> int:
        block_id = node.host_block_id
        assert block_id is not None, node
        node.host_block_id = None
        self.host_heap.forget(node)
        if self.events is not None:
            self.events.node_removed(node, _HOST)
        parent = node.parent
        if parent is not None and not node.detached:
            parent.num_host_children -= 1
            self.offer(parent)
        self.offer(node)
        return block_id

    # ------------------------------------------------------------------ lookup
    def match(
        self, hashes: Sequence[int], max_blocks: int, loads_in_flight: bool = True,
        visible: Optional[Callable[[int], bool]] = None,
    ) -> tuple[list[BlockNode], list[CacheLevel]]:
        """Walk ``hashes`` from the root; stop at the first block with no usable copy.

        A block is usable on device if it has a device copy: a valid one, or one a load
        is bringing in (the cache manager lets a request share a load in flight, with a
        standby block in case it fails; ``loads_in_flight=False`` leaves those out), and
        on host if its host copy is valid and not the destination of a copy in flight.
        ``visible``: a filter on block hashes (k-anonymity: the blocks this request's tenant
        may see); a block it rejects ends the match as a missing one would.  Nothing is
        changed.
        """
        nodes: list[BlockNode] = []
        tiers: list[CacheLevel] = []
        node = self.root
        for h in itertools.islice(hashes, max_blocks):
            node = node.children.get(h)  # type: ignore[assignment]
            if node is None or (visible is not None and not visible(h)):
                break
            if node.device_block_id is not None and (loads_in_flight or node.pending is not TransferKind.SWAP_IN):
                tiers.append(CacheLevel.DEVICE)
            elif node.host_block_id is not None and node.pending is None:
                tiers.append(CacheLevel.HOST)
            else:
                break
            nodes.append(node)
        return nodes, tiers

    def iter_nodes(self) -> Iterator[BlockNode]:
        """Every node but the root, pre-order (O(n): tests, stats and reset only)."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def reset(self) -> None:
        if self.events is not None:
            self.events.cleared()
        self.device_heap.clear()
        self.host_heap.clear()
        for node in list(self.iter_nodes()):
            node.detached = True
        self.root.children.clear()
        self.root.num_device_children = 0
        self.root.num_host_children = 0
        self.num_nodes = 0
