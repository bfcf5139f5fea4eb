"""The records the cache manager's parts pass between them, and the table of copies in flight.

``CacheManager`` is built from parts that each own their state (``matching``,
``allocation``, ``eviction``, ``copies``); what they share is here: the per-request record
(``RequestState``), the record of one block of a copy in flight (``InFlight``) and
``InFlightCopies``, the one table of those records, which allocation (loads), eviction
(write_back evictions), copies (backups, completions) and the request lifecycle all write
through its methods.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, Optional

from fastdeploy_kvcache.core.errors import CacheManagerError
from fastdeploy_kvcache.core.metadata import BlockNode, CacheLevel, MatchResult, TransferKind
from fastdeploy_kvcache.core.request import Request

DEV = CacheLevel.DEVICE
HOST = CacheLevel.HOST

CopyKey = tuple[CacheLevel, CacheLevel, int]


def check_request(request: Request) -> None:
    """Raise CacheManagerError unless ``request`` is a ``Request`` (the API's first check)."""
    if not isinstance(request, Request):
        raise CacheManagerError(f"expected a Request, got {type(request).__name__}")


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
    # k-anonymity: block hashes this request's commits revealed, and the nodes they inserted
    # whose write-policy backups wait, both until it leaves (core/lifecycle.py).
    revealed_pending: list[int] = field(default_factory=list)
    backup_pending: list[BlockNode] = field(default_factory=list)


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

    @property
    def key(self) -> CopyKey:
        """(src tier, dst tier, dst block id): a load goes host -> device, the rest device -> host."""
        if self.kind is TransferKind.SWAP_IN:
            return (HOST, DEV, self.dst)
        return (DEV, HOST, self.dst)


class InFlightCopies:
    """Every block of every copy in flight, by (src tier, dst tier, dst block id).

    One table because a completion names only tiers and block ids, whichever part
    emitted the copy.
    """

    def __init__(self) -> None:
        self._copies: dict[CopyKey, InFlight] = {}

    def add(self, inf: InFlight) -> None:
        """Record an emitted copy (its destination must not already be in flight)."""
        key = inf.key
        assert key not in self._copies, key
        self._copies[key] = inf

    def get(self, src: CacheLevel, dst: CacheLevel, block_id: int) -> Optional[InFlight]:
        return self._copies.get((src, dst, block_id))

    def pop(self, src: CacheLevel, dst: CacheLevel, block_id: int) -> InFlight:
        """Remove and return the copy into ``block_id`` (KeyError when none is in flight)."""
        return self._copies.pop((src, dst, block_id))

    def load_to(self, block_id: int) -> InFlight:
        """The host -> device load into device block ``block_id`` (KeyError when none)."""
        return self._copies[(HOST, DEV, block_id)]

    def items(self) -> Iterator[tuple[CopyKey, InFlight]]:
        return iter(list(self._copies.items()))

    def __len__(self) -> int:
        return len(self._copies)

    def __bool__(self) -> bool:
        return bool(self._copies)
