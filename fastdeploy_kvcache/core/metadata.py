"""Plain data that crosses the scheduler/worker boundary.

Everything here pickles and holds only ints, strings and enums, because a
``BatchRequest`` carrying it is sent from the scheduler process to worker processes.
Tree nodes (``BlockNode``) are scheduler-private and never travel.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Optional


class CacheLevel(enum.IntEnum):
    """A tier that can hold a block's KV bytes."""

    DEVICE = 0
    HOST = 1
    STORAGE = 2


class TransferKind(enum.IntEnum):
    """What a ``CacheSwapMetadata`` asks the worker to do."""

    SWAP_IN = 0  # host -> device (load for a request; per layer on the input stream)
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
    """One batch of block copies between two tiers.

    ``src_block_ids[i]`` is copied to ``dst_block_ids[i]``.  The worker fills
    ``success`` / ``error_message`` and hands the object back to the scheduler
    (``CacheManager.complete_swap``), matched by ``task_id``.  Until then the blocks
    involved are "in flight": not evictable and not served as valid KV.
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

    def __post_init__(self) -> None:
        if len(self.src_block_ids) != len(self.dst_block_ids):
            raise ValueError(
                f"CacheSwapMetadata: src_block_ids has {len(self.src_block_ids)} ids but "
                f"dst_block_ids has {len(self.dst_block_ids)}"
            )

    def __len__(self) -> int:
        return len(self.src_block_ids)

    @property
    def is_empty(self) -> bool:
        return not self.src_block_ids

    def mark_done(self, success: bool, error_message: Optional[str] = None) -> None:
        """Worker-side: record the outcome of the copy."""
        self.success = success
        self.error_message = None if success else (error_message or "unknown transfer error")


@dataclass
class StorageMetadata:
    """A storage-tier job: keys to load or save and the host/device blocks they map to."""

    keys: list[str] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    level: CacheLevel = CacheLevel.HOST
    kind: TransferKind = TransferKind.STORAGE_LOAD
    task_id: int = field(default_factory=next_task_id)
    success: bool = False
    error_message: Optional[str] = None


@dataclass
class TransferResult:
    """Worker-side accounting of one finished transfer task."""

    task_id: int
    kind: TransferKind
    success: bool
    num_blocks: int = 0
    nbytes: int = 0
    seconds: float = 0.0
    error_message: Optional[str] = None
