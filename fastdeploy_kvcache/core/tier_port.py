"""The storage tier's one way into the cache manager's tree and host pool.

``StoragePort`` is built and owned by the :class:`~fastdeploy_kvcache.core.cache_manager.CacheManager`
and handed to its :class:`~fastdeploy_kvcache.core.storage_tier.StorageTier` when the manager
binds the tier.  The tier holds the port and nothing else of the manager: it never reads the
manager, never edits the tree, never frees or allocates host blocks itself.  Every operation
it needs is one method here, so what the tier can do to the cache is this file.

The other direction is a listener: the tier registers itself (a :class:`HostEvictionListener`)
through :meth:`StoragePort.listen_host_evictions`, and the manager's ``Evictor`` tells it about
each host copy it is about to drop (write_back stores it first).  The evictor knows only the
protocol, not the tier, so calls run manager -> tier through the listener and tier -> manager
through the port, and neither module imports the other.
"""

from __future__ import annotations

import collections
from typing import TYPE_CHECKING, Callable, Iterator, Optional, Protocol, Sequence

from fastdeploy_kvcache.core.block_pool import PinnableBlockPool
from fastdeploy_kvcache.core.k_anonymity import KAnonymityIndex
from fastdeploy_kvcache.core.metadata import BlockNode
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.write_policy import WritePolicy

if TYPE_CHECKING:  # pragma: no cover
    from fastdeploy_kvcache.core.eviction import Evictor

__all__ = ["HostEvictionListener", "RevealListener", "StoragePort"]


class HostEvictionListener(Protocol):
    """Told of each host copy the evictor is about to drop, while the node still holds it."""

    def on_host_evict(self, node: BlockNode) -> None: ...


class RevealListener(Protocol):
    """Told of cached blocks with a valid host copy that k-anonymity just revealed."""

    def on_revealed(self, nodes: list[BlockNode]) -> None: ...


class StoragePort:
    """What the storage tier may do to the cache: the manager's side of the tier's link.

    Writers of the radix tree, all of them: the manager's own parts (the allocator and the
    lifecycle's matching/commit path, ``CopyTracker`` resolving copies, the ``Evictor``
    dropping copies and nodes, ``reset_cache``) and this port, which hangs the host-only
    nodes a storage fetch brought in (:meth:`insert_fetched_run`).  The tier itself writes
    no tree node and no pool.

    Host blocks: the tier gets them from :meth:`allocate_host_blocks` (evicting host LRU
    leaves, as a backup would), gives them back through :meth:`insert_fetched_run`
    (hung in the tree or freed) or :meth:`free_host_blocks` (a split's tail it dropped), and pins the ones a put reads (:meth:`pin_host_blocks`), so
    a block the tree drops meanwhile is not handed out again until the put is back.
    """

    def __init__(self, tree: RadixTree, host_pool: PinnableBlockPool, evictor: "Evictor", policy: WritePolicy,
                 block_size: int, prefix_caching: bool, k_anonymity: Optional[KAnonymityIndex] = None,
                 set_reveal_listener: Optional[Callable[[Optional[RevealListener]], None]] = None) -> None:
        self._tree = tree
        self._k_anonymity = k_anonymity
        self._set_reveal_listener = set_reveal_listener
        self._host_pool = host_pool
        self._evictor = evictor
        self._policy = policy
        self.block_size = block_size
        self.prefix_caching = prefix_caching

    # ------------------------------------------------------------------ eviction listener
    def listen_host_evictions(self, listener: HostEvictionListener) -> None:
        """Have the evictor tell ``listener`` of each host copy before it drops it."""
        self._evictor.set_host_evict_listener(listener)

    def listen_reveals(self, listener: RevealListener) -> None:
        """Have the manager tell ``listener`` of host copies of blocks k-anonymity revealed
        (a no-op without k-anonymity)."""
        if self._set_reveal_listener is not None:
            self._set_reveal_listener(listener)

    # ------------------------------------------------------------------ tree: reads
    def match(self, hashes: Sequence[int], max_blocks: int, tenant: Optional[str] = None) -> list[BlockNode]:
        """The nodes of the longest cached prefix of ``hashes`` (any tier), at most ``max_blocks``,
        that ``tenant`` may see (under k-anonymity; otherwise every node)."""
        kanon = self._k_anonymity
        return self._tree.match(hashes, max_blocks, visible=None if kanon is None else kanon.visible_to(tenant))[0]

    def may_store(self, block_hash: int) -> bool:
        """Whether the block may be written to storage under its shared key: always, but
        under k-anonymity only once revealed (a store is shared by servers and restarts,
        which know nothing of the block's tenants)."""
        kanon = self._k_anonymity
        return kanon is None or kanon.is_revealed(block_hash)

    def can_hang_host_nodes(self, parent: Optional[BlockNode]) -> bool:
        """Whether host-only nodes may go below ``parent`` (None: the root); the host tier
        stays prefix-closed under the policies that need it."""
        if parent is None or parent is self._tree.root or not self._policy.host_prefix_closed:
            return True
        return parent.host_block_id is not None and parent.pending is None and not parent.detached

    def cached_nodes(self) -> Iterator[BlockNode]:
        """Every node of the tree, parents before children (breadth first)."""
        todo = collections.deque(self._tree.root.children.values())
        while todo:
            node = todo.popleft()
            todo.extend(node.children.values())
            yield node

    # ------------------------------------------------------------------ tree: the one write
    def insert_fetched_run(self, prefix: Sequence[int], hashes: Sequence[int],
                           host_block_ids: Sequence[int]) -> tuple[list[BlockNode], int]:
        """Hang a fetched run as host-only nodes below the chain ``prefix``; free the rest.

        ``hashes[i]`` arrived whole in ``host_block_ids[i]`` (``hashes`` may be shorter: the
        blocks past it did not arrive).  Walks ``prefix`` from the root (it may have changed
        since the fetch started: a missing link inserts nothing); a block whose node exists
        already is a duplicate and is freed; the run stops where a host-only node may not
        hang.  Every host block not hung in the tree goes back to the pool.

        Returns (the new nodes, parents first; how many leading blocks were used: hung or
        freed as duplicates).
        """
        tree = self._tree
        parent = tree.root
        linked = True
        for h in prefix:
            child = parent.children.get(h)
            if child is None:
                linked = False
                break
            parent = child
        inserted: list[BlockNode] = []
        used = 0
        if self._k_anonymity is not None and hashes:
            # The store holds revealed blocks only (may_store), so what it served is revealed.
            self._k_anonymity.mark_revealed(hashes)
        if linked:
            for h, b in zip(hashes, host_block_ids):
                child = parent.children.get(h)
                if child is not None:
                    parent = child  # another copy got there first: ours is a duplicate
                    self._host_pool.free_one(b)
                    used += 1
                    continue
                if not self.can_hang_host_nodes(parent):
                    break
                node = tree.add_child(parent, h)
                tree.set_host(node, b)
                node.on_storage = True
                inserted.append(node)
                parent = node
                used += 1
        if used < len(host_block_ids):
            self._host_pool.free(host_block_ids[used:])
        return inserted, used

    # ------------------------------------------------------------------ host blocks
    @property
    def num_host_blocks(self) -> int:
        return self._host_pool.num_blocks

    def allocate_host_blocks(self, k: int, keep: frozenset[BlockNode] = frozenset()) -> list[int]:
        """Up to ``k`` host blocks for a fetch, evicting host LRU leaves (``keep``: host copies
        that must survive: the prefix the fetched blocks hang below)."""
        return self._evictor.allocate_host_blocks(k, keep)

    def free_host_blocks(self, block_ids: Sequence[int]) -> None:
        """Give back host blocks a fetch took and will not hang in the tree (a split's tail
        that was dropped, or the blocks of it that did not arrive)."""
        if block_ids:
            self._host_pool.free(list(block_ids))

    def pin_host_blocks(self, block_ids: Sequence[int]) -> None:
        """A put reads these blocks: keep them from being handed out until unpinned."""
        self._host_pool.pin(block_ids)

    def unpin_host_blocks(self, block_ids: Sequence[int]) -> None:
        """The put is back: a block freed meanwhile goes back to the pool now."""
        self._host_pool.unpin(block_ids)

    def host_pin_counts(self) -> dict[int, int]:
        return self._host_pool.pin_counts()

    def deferred_host_blocks(self) -> frozenset[int]:
        """Host blocks freed while pinned: they return to the pool at their last unpin."""
        return self._host_pool.deferred

    def host_block_is_free(self, block_id: int) -> bool:
        return self._host_pool.is_free(block_id)

    @property
    def num_pinned_host_blocks(self) -> int:
        return self._host_pool.num_pinned
