"""The state the cache manager's parts share, declared in one place.

``CacheManager`` is assembled from one class per job (``matching``, ``allocation``,
``eviction``, ``copies``), each in its own module and each small enough to read in
one sitting; they all work on the attributes declared here, which only
``CacheManager.__init__`` creates.  The per-request record (``RequestState``) and the
record of one block of a copy in flight (``InFlight``) live here too.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from fastdeploy_kvcache.core.errors import CacheManagerError
from fastdeploy_kvcache.core.metadata import BlockNode, CacheLevel, CacheSwapMetadata, MatchResult, TransferKind
from fastdeploy_kvcache.core.request import Request

if TYPE_CHECKING:  # pragma: no cover
    from fastdeploy_kvcache.config import CacheConfig
    from fastdeploy_kvcache.core.block_pool import BlockPool
    from fastdeploy_kvcache.core.matching import PrefixMatcher
    from fastdeploy_kvcache.core.radix_tree import RadixTree
    from fastdeploy_kvcache.core.stats import CacheStats
    from fastdeploy_kvcache.core.write_policy import WritePolicy

DEV = CacheLevel.DEVICE
HOST = CacheLevel.HOST


@dataclass
class RequestState:
    """What the manager remembers of a running request.

    ``nodes[i]`` is the tree node whose device copy is ``block_ids[i]`` (the request
    holds a ref on it), or None for a private block that only this request uses.
    ``block_ids`` is the manager's own copy of the block table, so a block table an
    engine edited by mistake is caught instead of freeing foreign ids.  ``match`` is
    the match as the first allocation applied it (exactly once).  ``committed``: how many
    leading blocks are tree nodes chained from the root (the match, then computed prompt
    blocks ``commit_computed_blocks`` made matchable while the request runs).
    """

    request: Request
    nodes: list[Optional[BlockNode]] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    match: Optional[MatchResult] = None
    committed: int = 0
    # Loads in flight that this request shares with the request that issued them: block
    # index -> a standby device block it recomputes into if that load fails.
    standby: dict[int, int] = field(default_factory=dict)


@dataclass
class InFlight:
    """One block of an emitted, not yet confirmed copy."""

    node: BlockNode
    kind: TransferKind
    src: int
    dst: int
    request_id: Optional[str] = None  # loads: the request that will read the block
    # Loads: other running requests that read the block too (id -> their standby block).
    sharers: dict[str, int] = field(default_factory=dict)


class ManagerState:
    """Attributes shared by the manager's parts (created by ``CacheManager.__init__``)."""

    config: "CacheConfig"
    block_size: int
    enable_prefix_caching: bool
    # Whether a request may read a block another request's host -> device load is still
    # bringing in (with a standby block in case the load fails); off: it computes the block.
    share_loads: bool
    bytes_per_block: int
    write_policy: str  # the policy's name, for stats and logs
    write_through_threshold: int
    policy: "WritePolicy"
    device_pool: "BlockPool"
    host_pool: "BlockPool"
    # The storage tier (core.storage_tier.StorageTier) when one is attached, else None.
    storage: Optional[Any]
    tree: "RadixTree"
    stats: "CacheStats"
    # Running requests, by id.
    _requests: dict[str, RequestState]
    # The matches of requests not allocated yet (core.matching.PrefixMatcher).
    matcher: "PrefixMatcher"
    # Every block of every copy in flight, by (src tier, dst tier, dst block id).
    _inflight: dict[tuple[int, int, int], InFlight]
    # Write-through backups to issue with the next step.
    _backup_queue: "deque[BlockNode]"
    # Device -> host evictions not yet handed to a request or batch.
    _pending_evictions: list[CacheSwapMetadata]
    # Evictions made during the current allocation: (device, host, hash, node).
    _call_evictions: list[tuple[int, int, int, BlockNode]]
    # Nodes cut out of the tree that still hold blocks (a copy in flight, or refs).
    _detached: set[BlockNode]
    # Nodes whose host copy goes as soon as the copy in flight on them completes
    # (their parent's host copy was lost: see CopiesMixin._lose_host_copy).
    _host_doomed: set[BlockNode]

    @staticmethod
    def _check_request(request: Request) -> None:
        if not isinstance(request, Request):
            raise CacheManagerError(f"expected a Request, got {type(request).__name__}")
