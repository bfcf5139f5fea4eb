"""Matching: the longest cached prefix of a request, over every tier.

``match_prefix`` walks the tree and records the result in the manager's own
per-request record; the first allocation applies it (``allocation.py``).
"""

from __future__ import annotations

import logging

from fastdeploy_kvcache.core.errors import CacheManagerError
from fastdeploy_kvcache.core.manager_state import ManagerState
from fastdeploy_kvcache.core.metadata import MatchResult
from fastdeploy_kvcache.core.request import Request

logger = logging.getLogger(__name__)


class MatchingMixin(ManagerState):
    """``match_prefix`` and the storage hook."""

    def match_prefix(self, request: Request) -> MatchResult:
        """Longest cached prefix of ``request`` over all tiers; stored on the request.

        Takes no refs and changes nothing: ``allocate_device_blocks`` re-checks the
        match when it applies it, so a block evicted in between is simply not reused.
        At least the last token is always left to compute (the forward pass needs
        one token to produce logits), so at most ``(num_tokens - 1) // block_size``
        blocks match.
        """
        self._check_request(request)
        if request.request_id in self._requests:
            raise CacheManagerError(
                f"request {request.request_id} is already running (its match was applied); "
                "finish or preempt it before matching again"
            )
        bs = self.block_size
        num_tokens = request.num_total_tokens
        max_blocks = (num_tokens - 1) // bs
        hashes = request.block_hashes(bs, num_tokens)
        if self.enable_prefix_caching:
            nodes, tiers = self.tree.match(hashes, max_blocks, self.share_loads)
        else:
            nodes, tiers = [], []
        result = MatchResult(block_size=bs, nodes=nodes, tiers=tiers)
        result.storage_hashes = self._match_storage(hashes[len(nodes) : max_blocks])
        try:
            self._matches[request] = result
        except TypeError as e:  # a subclass that defines __eq__ without __hash__
            raise CacheManagerError(
                f"request {request.request_id}: {type(request).__name__} must be hashable by identity "
                "(keep object.__hash__ when defining __eq__)"
            ) from e
        request.match_result = result
        return result

    def _match_storage(self, hashes: list[int]) -> list[int]:
        """Hook for the storage tier: the leading ``hashes`` that storage holds.

        NOTE: the storage tier (core/storage_tier.py) answers from what it knows
        locally (puts that returned OK, prefetches), with no I/O: its one existence
        round trip per request is made when the request is queued (prefetch on arrival)
        or admitted, and its hits
        come back as host nodes (prefetch into host), so they match as HOST here.
        """
        storage = self.storage
        return storage.known_prefix(hashes) if storage is not None else []
