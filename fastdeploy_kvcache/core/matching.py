"""Matching: the longest cached prefix of a request, over every tier.

:class:`PrefixMatcher` is the manager's part that owns the matches not applied yet:
``match`` walks the tree and records the result; the request's first allocation walks
it again (``rewalk``: the tree may have changed since) and then ``forget``\\ s it.
"""

from __future__ import annotations

import logging
import weakref
from typing import TYPE_CHECKING, Callable, Optional

from fastdeploy_kvcache.core.errors import CacheManagerError
from fastdeploy_kvcache.core.k_anonymity import KAnonymityIndex
from fastdeploy_kvcache.core.metadata import BlockNode, CacheLevel, MatchResult
from fastdeploy_kvcache.core.radix_tree import RadixTree
from fastdeploy_kvcache.core.request import Request

if TYPE_CHECKING:
    from fastdeploy_kvcache.core.storage_tier import StorageTier

logger = logging.getLogger(__name__)


class PrefixMatcher:
    """The matches of requests not allocated yet, over the manager's tree (and storage tier).

    Matches are held with weak keys: a request matched and then dropped by the engine
    leaves nothing behind.
    """

    def __init__(self, tree: RadixTree, block_size: int, enable_prefix_caching: bool,
                 storage: Optional["StorageTier"], k_anonymity: Optional[KAnonymityIndex] = None) -> None:
        self.tree = tree
        # Which tenants may see which blocks (None: every block is shared).
        self.k_anonymity = k_anonymity
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.storage = storage
        # Whether a host copy another request is loading matches too (the matching request
        # then reads it after the load, with a standby block in case the load fails); off,
        # it computes those blocks.
        self.share_loads = True
        self._pending: "weakref.WeakKeyDictionary[Request, MatchResult]" = weakref.WeakKeyDictionary()

    def match(self, request: Request) -> MatchResult:
        """Longest cached prefix of ``request`` over all tiers; stored on the request.

        Takes no refs and changes nothing: the first allocation re-checks the match when
        it applies it (:meth:`rewalk`), so a block evicted in between is simply not reused.
        At least the last token is always left to compute (the forward pass needs one
        token to produce logits), so at most ``(num_tokens - 1) // block_size`` blocks
        match.
        """
        bs = self.block_size
        num_tokens = request.num_total_tokens
        max_blocks = (num_tokens - 1) // bs
        hashes = request.block_hashes(bs, num_tokens)
        if self.enable_prefix_caching:
            nodes, tiers = self.tree.match(hashes, max_blocks, self.share_loads, self.visible_filter(request))
        else:
            nodes, tiers = [], []
        result = MatchResult(block_size=bs, nodes=nodes, tiers=tiers)
        result.storage_hashes = self._match_storage(hashes[len(nodes) : max_blocks])
        try:
            self._pending[request] = result
        except TypeError as e:  # a subclass that defines __eq__ without __hash__
            raise CacheManagerError(
                f"request {request.request_id}: {type(request).__name__} must be hashable by identity "
                "(keep object.__hash__ when defining __eq__)"
            ) from e
        request.match_result = result
        return result

    def rewalk(self, request: Request) -> tuple[list[BlockNode], list[CacheLevel]]:
        """The request's match from :meth:`match`, walked again: the tree may have changed
        since (anything evicted meanwhile is simply not reused)."""
        match = self._pending.get(request)
        if match is None or not match.nodes or not self.enable_prefix_caching:
            return [], []
        bs = self.block_size
        hashes = request.block_hashes(bs, request.num_total_tokens)
        return self.tree.match(hashes, min(len(match.nodes), (request.num_total_tokens - 1) // bs), self.share_loads,
                               self.visible_filter(request))

    def visible_filter(self, request: Request) -> Optional[Callable[[int], bool]]:
        """The blocks ``request``'s tenant may reuse, as a filter on hashes (None: all).

        Under k-anonymity a block another tenant computed and k distinct tenants have not
        is a miss for this request on every tier (``core/k_anonymity.py``)."""
        kanon = self.k_anonymity
        return None if kanon is None else kanon.visible_to(request.tenant)

    def forget(self, request: Request) -> None:
        """Drop ``request``'s match (it was applied)."""
        self._pending.pop(request, None)

    def _match_storage(self, hashes: list[int]) -> list[int]:
        """The leading ``hashes`` that the storage tier holds.

        NOTE: the storage tier (core/storage_tier.py) answers from what it knows
        locally (puts that returned OK, prefetches), with no I/O: its one existence
        round trip per request is made when the request is queued (prefetch on arrival)
        or admitted, and its hits come back as host nodes (prefetch into host), so they
        match as HOST here.
        """
        storage = self.storage
        return storage.known_prefix(hashes) if storage is not None else []
