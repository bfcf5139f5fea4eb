"""Plain data that crosses the scheduler/worker boundary.

Everything here pickles and holds only ints, strings and enums, because a
``BatchRequest`` carrying it is sent from the scheduler process to worker processes.
Tree nodes (``BlockNode``) are scheduler-private and never travel.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any, Optional


class CacheLevel(enum.IntEnum):
    """A tier that can hold a block's KV bytes."""

    DEVICE = 0
    HOST = 1
    STORAGE = 2


class CopyDirection(enum.IntEnum):
    """Which way a device<->host copy goes: the one name for it in every layer.

    The values are the copy ops' ``mode`` argument (0 reads device blocks, 1 writes
    them), so ``int(direction)`` is what the C++ core receives.
    """

    DEVICE_TO_HOST = 0
    HOST_TO_DEVICE = 1

    @property
    def short(self) -> str:
        """``"d2h"`` / ``"h2d"``: the label used in logs, stats and metrics."""
        return "d2h" if self is CopyDirection.DEVICE_TO_HOST else "h2d"

    @classmethod
    def of_tiers(cls, src: "CacheLevel", dst: "CacheLevel") -> "CopyDirection":
        """The direction of a copy from tier ``src`` to tier ``dst`` (device and host only)."""
        if (src, dst) == (CacheLevel.DEVICE, CacheLevel.HOST):
            return cls.DEVICE_TO_HOST
        if (src, dst) == (CacheLevel.HOST, CacheLevel.DEVICE):
            return cls.HOST_TO_DEVICE
        raise ValueError(f"no device<->host copy direction from {CacheLevel(src).name} to {CacheLevel(dst).name}")


class TransferKind(enum.IntEnum):
    """What a ``CacheSwapMetadata`` asks the worker to do."""

    SWAP_IN = 0  # a load: host -> device for a request (per layer on the input stream)
    EVICT = 1  # device -> host because the device block is being reclaimed (write_back)
    BACKUP = 2  # device -> host copy of a block that stays on device (write-through)
    STORAGE_LOAD = 3  # storage -> host/device (later issue)
    STORAGE_SAVE = 4  # host/device -> storage (later issue)


_task_ids = itertools.count(1)


def next_task_id() -> int:
    """Process-unique id so a completed copy can be matched back to its nodes."""
    return next(_task_ids)


@dataclass
class CacheSwapMetadata:
    """One batch of block copies between two tiers, in either direction.

    Vocabulary: a *copy* goes either way; a *load* is host -> device
    (``TransferKind.SWAP_IN``); device -> host copies are *evictions* (write_back,
    ``EVICT``) or *backups* (write-through, ``BACKUP``).  "Swap" survives only in
    names inherited from FastDeploy (``cache_swap_metadata`` for the loads,
    ``complete_swap`` for any copy, the ``swap_cache_*`` ops); ``direction`` says
    which way a copy goes.

    ``src_block_ids[i]`` is copied to ``dst_block_ids[i]``.  The worker fills
    ``success`` / ``error_message`` and hands the object back to the scheduler
    (``CacheManager.complete_swap``), which resolves it block by block.  Until then
    the blocks involved are "in flight": not evictable and not served as valid KV.

    ``frees_device_blocks`` is True when at least one block is a write_back eviction
    whose device block the scheduler has already released (it may be handed out in
    this very step): the worker must then keep this step's compute behind the copy.
    A backup-only copy reads blocks that stay allocated, so it needs no such fence.
    It is set from ``kind`` when not given, and ``extend`` / ``merged`` keep it.
    """

    src_block_ids: list[int] = field(default_factory=list)
    dst_block_ids: list[int] = field(default_factory=list)
    src_type: CacheLevel = CacheLevel.HOST
    dst_type: CacheLevel = CacheLevel.DEVICE
    hash_values: list[int] = field(default_factory=list)
    kind: TransferKind = TransferKind.SWAP_IN
    task_id: int = field(default_factory=next_task_id)
    success: bool = False
    error_message: Optional[str] = None
    frees_device_blocks: Optional[bool] = None

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError(
                f"CacheSwapMetadata: src_block_ids has {len(self.src_block_ids)} ids but "
                f"dst_block_ids has {len(self.dst_block_ids)}"
            )
        if self.frees_device_blocks is None:
            self.frees_device_blocks = self.kind is TransferKind.EVICT and bool(self.src_block_ids)

    @property
    def direction(self) -> CopyDirection:
        """Which way the copy goes (raises ValueError for a storage copy)."""
        return CopyDirection.of_tiers(self.src_type, self.dst_type)

    def __len__(self) -> int:
        return len(self.src_block_ids)

    @property
    def is_empty(self) -> bool:
        return not self.src_block_ids

    def mark_done(self, success: bool, error_message: Optional[str] = None) -> None:
        """Worker-side: record the outcome of the copy."""
        self.success = success
        self.error_message = None if success else (error_message or "unknown transfer error")

    def extend(self, other: "CacheSwapMetadata") -> None:
        """Append ``other``'s copies to this one (same direction required).

        Used by ``BatchRequest`` to merge per-request metadata into one object per
        direction, so the worker launches one copy per step and direction.  The kind
        of a device -> host merge becomes EVICT as soon as one eviction is in it
        (evictions and write-through backups travel together), and
        ``frees_device_blocks`` becomes True with it: that flag, not the kind, is
        what the worker's compute fence reads.  Completion is resolved per block.
        """
        if (other.src_type, other.dst_type) != (self.src_type, self.dst_type):
            raise ValueError(
                f"cannot merge {other.src_type.name}->{other.dst_type.name} metadata into "
                f"{self.src_type.name}->{self.dst_type.name} metadata"
            )
        self.src_block_ids.extend(other.src_block_ids)
        self.dst_block_ids.extend(other.dst_block_ids)
        self.hash_values.extend(other.hash_values)
        if other.kind is TransferKind.EVICT:
            self.kind = TransferKind.EVICT
        self.frees_device_blocks = bool(self.frees_device_blocks or other.frees_device_blocks)

    @classmethod
    def merged(cls, items: "list[CacheSwapMetadata]") -> "Optional[CacheSwapMetadata]":
        """One new metadata object holding all non-empty ``items`` (None if there are none)."""
        items = [m for m in items if m is not None and not m.is_empty]
        if not items:
            return None
        first = items[0]
        out = cls(src_type=first.src_type, dst_type=first.dst_type, kind=first.kind, frees_device_blocks=False)
        for meta in items:
            out.extend(meta)
        return out


@dataclass
class ResidencyPlan:
    """What ``CacheManager.ensure_resident`` did for one request, and where compute starts.

    ``new_block_ids`` are the blocks added to the request's table by this call (load
    destinations first, then fresh blocks), in table order.  ``num_cached_tokens`` is
    the prefix already resident or being loaded: compute starts there.  The hit
    counts describe the match this call applied (a request's first call only; later
    calls report 0).  The loads and evictions themselves are on the request
    (``cache_swap_metadata`` / ``cache_evict_metadata``) for ``BatchRequest`` to
    merge, and must run in this step, before compute writes.
    """

    new_block_ids: list[int] = field(default_factory=list)
    num_cached_tokens: int = 0
    num_device_hit_tokens: int = 0
    num_host_hit_tokens: int = 0
    num_storage_hit_tokens: int = 0  # host hits that the request's storage fetch brought in
    # The storage fetch the request waited for (StorageTier.fetch_timing), for its timings.
    storage_fetch: Optional[dict[str, Any]] = None


# ---------------------------------------------------------------------------
# Scheduler-private structures.  Nothing below is sent to workers: a BlockNode
# links to its parent and children, so pickling one would drag the whole tree.
# ---------------------------------------------------------------------------


class NodeState(enum.Enum):
    """Where a tree node's KV bytes are, derived from its fields (see ``BlockNode.state``).

    The transitions are drawn in ``docs/architecture.md``.  The ``*_TO_*`` and
    ``BACKUP_TO_HOST`` states are "in flight": the copy has been emitted but the
    worker has not confirmed it, so the node may be neither evicted nor read on the
    destination tier.  The storage tier records ``BlockNode.on_storage`` and has no
    state of its own here: a node that holds no device or host copy leaves the tree.
    """

    DEVICE = "device"  # device copy only
    HOST = "host"  # host copy only
    DEVICE_AND_HOST = "device+host"  # both copies valid
    SWAP_TO_DEVICE = "swap_to_device"  # host -> device load in flight (host is the source)
    SWAP_TO_HOST = "swap_to_host"  # write_back eviction in flight; device block already released
    BACKUP_TO_HOST = "backup_to_host"  # write-through backup in flight; device copy stays
    EMPTY = "empty"  # no copy anywhere; only transiently, before the node is removed


class BlockNode:
    """One full KV block in the prefix tree, keyed by its chained block hash.

    A node records which tiers hold its bytes (``device_block_id``,
    ``host_block_id``, ``on_storage``), the copy in flight for it, if any
    (``pending``), how many running requests use its device copy (``ref_count``),
    and how hot it is (``hit_count``, ``last_access``) for the write-through
    threshold and LRU eviction.

    ``num_device_children`` / ``num_host_children`` count children holding a copy on
    that tier, so "is this node a leaf of tier T" is O(1): eviction only ever takes
    tier leaves, which is what keeps subtrees from being orphaned.
    """

    __slots__ = (
        "hash_value",
        "parent",
        "children",
        "depth",
        "device_block_id",
        "host_block_id",
        "on_storage",
        "pending",
        "ref_count",
        "hit_count",
        "last_access",
        "num_device_children",
        "num_host_children",
        "backup_queued",
        "detached",
        "dev_heap_key",
        "host_heap_key",
        "__weakref__",
    )

    def __init__(self, hash_value: int, parent: Optional["BlockNode"] = None, depth: int = 0) -> None:
        self.hash_value = hash_value
        self.parent = parent
        self.children: dict[int, BlockNode] = {}
        self.depth = depth  # block index in the sequence (root: -1)
        self.device_block_id: Optional[int] = None
        self.host_block_id: Optional[int] = None
        self.on_storage = False
        self.pending: Optional[TransferKind] = None
        self.ref_count = 0
        self.hit_count = 0
        self.last_access = 0
        self.num_device_children = 0
        self.num_host_children = 0
        self.backup_queued = False
        self.detached = False  # removed from the tree while a copy was still in flight
        # Key of this node's current entry in each tier's eviction heap, None if it
        # has none; older entries are skipped lazily (see radix_tree.LRULeafHeap).
        self.dev_heap_key: Optional[int] = None
        self.host_heap_key: Optional[int] = None

    # -- derived ----------------------------------------------------------------
    @property
    def state(self) -> NodeState:
        pending = self.pending
        if pending is TransferKind.SWAP_IN:
            return NodeState.SWAP_TO_DEVICE
        if pending is TransferKind.EVICT:
            return NodeState.SWAP_TO_HOST
        if pending is TransferKind.BACKUP:
            return NodeState.BACKUP_TO_HOST
        dev = self.device_block_id is not None
        host = self.host_block_id is not None
        if dev and host:
            return NodeState.DEVICE_AND_HOST
        if dev:
            return NodeState.DEVICE
        if host:
            return NodeState.HOST
        return NodeState.EMPTY

    def __lt__(self, other: "BlockNode") -> bool:
        # NOTE: eviction heap keys are unique per push (last_access << 32 | seq), so
        # nodes are never compared in practice; this only keeps a 2**32-push key
        # wrap-around from raising TypeError inside heapq.
        return id(self) < id(other)

    def __reduce__(self):  # pragma: no cover - defensive
        raise TypeError("BlockNode is scheduler-private and must not be pickled (it links the whole tree)")

    def __repr__(self) -> str:
        return (
            f"BlockNode(hash={self.hash_value:#x}, depth={self.depth}, state={self.state.value}, "
            f"dev={self.device_block_id}, host={self.host_block_id}, ref={self.ref_count}, "
            f"hits={self.hit_count})"
        )


@dataclass
class MatchResult:
    """The longest cached prefix of a request, split by the tier each block is on.

    ``nodes[i]`` is block ``i`` of the request and ``tiers[i]`` the tier it will be
    served from: DEVICE blocks are reused in place, HOST blocks need a host -> device
    load.  Normally all DEVICE blocks come first, but after a failed load a HOST
    block can precede DEVICE ones, so consumers should not assume one split point.

    ``storage_hashes`` are the hashes of the blocks that follow the tree match and
    that the storage tier may hold.  It is the hook for the storage issue: today it
    is always empty, and nothing is prefetched.

    Never pickled: it holds tree nodes.  ``Request.__getstate__`` drops it.
    """

    block_size: int = 0
    nodes: list[BlockNode] = field(default_factory=list)
    tiers: list[CacheLevel] = field(default_factory=list)
    storage_hashes: list[int] = field(default_factory=list)

    @property
    def device_nodes(self) -> list[BlockNode]:
        return [n for n, t in zip(self.nodes, self.tiers) if t is CacheLevel.DEVICE]

    @property
    def host_nodes(self) -> list[BlockNode]:
        return [n for n, t in zip(self.nodes, self.tiers) if t is CacheLevel.HOST]

    @property
    def device_block_ids(self) -> list[int]:
        return [n.device_block_id for n in self.device_nodes]  # type: ignore[misc]

    @property
    def host_block_ids(self) -> list[int]:
        return [n.host_block_id for n in self.host_nodes]  # type: ignore[misc]

    @property
    def num_device_blocks(self) -> int:
        return sum(1 for t in self.tiers if t is CacheLevel.DEVICE)

    @property
    def num_host_blocks(self) -> int:
        return sum(1 for t in self.tiers if t is CacheLevel.HOST)

    @property
    def num_storage_blocks(self) -> int:
        return len(self.storage_hashes)

    @property
    def num_matched_blocks(self) -> int:
        """Blocks served from the tree (device + host); storage hits are not counted yet."""
        return len(self.nodes)

    @property
    def num_matched_tokens(self) -> int:
        return len(self.nodes) * self.block_size

    @property
    def num_device_tokens(self) -> int:
        return self.num_device_blocks * self.block_size

    @property
    def num_host_tokens(self) -> int:
        return self.num_host_blocks * self.block_size

    @property
    def num_storage_tokens(self) -> int:
        return self.num_storage_blocks * self.block_size

    def __reduce__(self):  # pragma: no cover - defensive
        raise TypeError("MatchResult holds tree nodes and must not be pickled")
