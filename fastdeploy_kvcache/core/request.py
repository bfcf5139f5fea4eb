"""The cache fields of a request, and the per-step ``BatchRequest`` sent to workers.

``Request`` carries only what the cache manager needs (an engine subclasses it or
copies these fields into its own request type).  ``BatchRequest`` is the whole
scheduler -> worker contract of one step: the requests, one merged host -> device
``CacheSwapMetadata``, one merged device -> host ``CacheSwapMetadata`` (write_back
evictions and write-through backups together) and the storage jobs.  It pickles and
holds no tree node.
"""

from __future__ import annotations

import logging
from typing import Iterable, Iterator, Optional, Sequence, Union

from fastdeploy_kvcache.core.hashing import BlockHasher, MMItem, pack_array
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, CopyDirection, MatchResult

logger = logging.getLogger(__name__)


class Request:
    """A generation request as the cache manager sees it.

    Engine-maintained fields: ``output_token_ids`` (append-only) and
    ``num_computed_tokens`` (tokens whose KV has been written; advance it after each
    forward).  Manager-maintained: ``block_tables``, ``num_cached_tokens`` (tokens
    served from the cache), the metadata lists, the match result.

    ``cache_swap_metadata`` holds host -> device loads and ``cache_evict_metadata``
    device -> host copies that the manager emitted for this request; both lists are
    emptied when the request is added to a ``BatchRequest``.
    """

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_token_ids: Optional[Sequence[int]] = None,
        *,
        mm_items: Sequence[MMItem] = (),
        lora_id: Optional[Union[int, str]] = None,
        cache_salt: Optional[str] = None,
        tenant: Optional[str] = None,
    ) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str, got {request_id!r}")
        self.request_id = request_id
        # Kept as given (a list, or an int array: then hashing skips the int64 packing).
        self.prompt_token_ids: Sequence[int] = prompt_token_ids if hasattr(prompt_token_ids, "dtype") else list(prompt_token_ids)
        if len(self.prompt_token_ids) == 0:
            raise ValueError(f"request {request_id}: empty prompt")
        self.output_token_ids: list[int] = list(output_token_ids or ())
        # Extra hash keys (see hashing.py): multimodal items, adapter, salt.
        self.mm_items: tuple[MMItem, ...] = tuple(mm_items)
        self.lora_id = lora_id
        self.cache_salt = cache_salt
        # Who sent it (the API key's tenant; None without keys).  Not a hash key: isolation
        # between tenants comes from their salts; this names the tenant for the cache's
        # accounting.
        self.tenant = tenant

        self.block_tables: list[int] = []
        self.num_cached_tokens = 0
        self.num_computed_tokens = 0
        self.cache_swap_metadata: list[CacheSwapMetadata] = []
        self.cache_evict_metadata: list[CacheSwapMetadata] = []
        # The manager's last match for this request, for the engine's information
        # (set by match_prefix, replaced by the match as applied); the manager keeps
        # its own copy and never reads this one back.
        self.match_result: Optional[MatchResult] = None
        self._hasher: Optional[BlockHasher] = None

    # ------------------------------------------------------------------ tokens / hashes
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_total_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return list(self.prompt_token_ids) + list(self.output_token_ids)

    def _get_hasher(self, block_size: int) -> BlockHasher:
        hasher = self._hasher
        if hasher is None or hasher.block_size != block_size:
            hasher = self._hasher = BlockHasher(block_size, self.mm_items, self.lora_id, self.cache_salt)
        return hasher

    def block_hashes(self, block_size: int, num_tokens: Optional[int] = None) -> list[int]:
        """Chained hashes of the full blocks among the first ``num_tokens`` tokens.

        Computed lazily and cached: a decoding request only hashes its new blocks.
        The returned list may be the cache itself; do not mutate it.
        """
        n = self.num_total_tokens if num_tokens is None else min(num_tokens, self.num_total_tokens)
        hasher = self._get_hasher(block_size)
        done = len(hasher.hashes) * block_size
        end = n // block_size * block_size
        if end < done:
            return hasher.hashes[: end // block_size]  # more are cached than were asked for
        if end == done:
            return hasher.hashes
        hasher.extend_packed(pack_array(self.token_slice(done, end)), done)
        return hasher.hashes

    def token_slice(self, start: int, end: int) -> Sequence[int]:
        """Tokens [start, end) of prompt + output, without concatenating the whole sequence."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return list(self.prompt_token_ids[start:]) + list(self.output_token_ids[: end - p])

    @property
    def prompt_hashes(self) -> list[int]:
        """Hashes of the prompt's full blocks (needs a block size: set by the manager)."""
        if self._hasher is None:
            raise RuntimeError(f"request {self.request_id}: no block size yet; call CacheManager.match_prefix first")
        bs = self._hasher.block_size
        return self.block_hashes(bs, len(self.prompt_token_ids))[: len(self.prompt_token_ids) // bs]

    def partial_block_key(self, block_size: int) -> Optional[str]:
        """Storage key of the trailing partial block (``<hash>:partial:<n>``), if any."""
        return self._get_hasher(block_size).partial_key(self.all_token_ids)

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict:
        # The match result holds tree nodes (and through them the whole tree).
        state = self.__dict__.copy()
        state["match_result"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.match_result = None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, prompt={len(self.prompt_token_ids)}, "
            f"output={len(self.output_token_ids)}, blocks={len(self.block_tables)}, "
            f"cached={self.num_cached_tokens}, computed={self.num_computed_tokens})"
        )




class BatchRequest:
    """One step's requests plus their merged cache metadata.

    Merging matters: the worker launches one host -> device copy and one
    device -> host copy per step, and merged runs of consecutive ids become single
    DMA runs.  Completion does not depend on the grouping: the scheduler resolves a
    returned metadata object block by block (``CacheManager.complete_swap``).
    """

    def __init__(self, requests: Optional[Iterable[Request]] = None) -> None:
        self.requests: list[Request] = []
        self.cache_swap_metadata: Optional[CacheSwapMetadata] = None  # host -> device
        self.cache_evict_metadata: Optional[CacheSwapMetadata] = None  # device -> host
        for req in requests or ():
            self.add_request(req)

    def add_request(self, request: Request) -> None:
        """Add ``request`` and move its pending metadata into the merged objects.

        Every metadata object is checked first, so a bad one changes neither the batch
        nor the request.
        """
        if not request.cache_evict_metadata and not request.cache_swap_metadata:
            self.requests.append(request)  # most requests of a step carry no copies
            return
        for meta in request.cache_evict_metadata:
            self._check_direction(meta, CopyDirection.DEVICE_TO_HOST)
        for meta in request.cache_swap_metadata:
            self._check_direction(meta, CopyDirection.HOST_TO_DEVICE)
        self.requests.append(request)
        for meta in request.cache_evict_metadata:
            self.append_evict_metadata(meta)
        for meta in request.cache_swap_metadata:
            self.append_swap_metadata(meta)
        request.cache_evict_metadata = []
        request.cache_swap_metadata = []

    @staticmethod
    def _check_direction(meta: Optional[CacheSwapMetadata], want: CopyDirection) -> None:
        if meta is None or meta.is_empty:
            return
        try:
            ok = meta.direction is want
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(
                f"cannot merge {CacheLevel(meta.src_type).name}->{CacheLevel(meta.dst_type).name} metadata "
                f"where {want.name} copies go"
            )

    @classmethod
    def _merge(
        cls, into: Optional[CacheSwapMetadata], meta: Optional[CacheSwapMetadata], want: CopyDirection
    ) -> Optional[CacheSwapMetadata]:
        if meta is None or meta.is_empty:
            return into
        cls._check_direction(meta, want)
        if into is None:
            into = CacheSwapMetadata(
                src_type=meta.src_type, dst_type=meta.dst_type, kind=meta.kind, frees_device_blocks=False
            )
        into.extend(meta)
        return into

    def append_swap_metadata(self, meta: Optional[CacheSwapMetadata]) -> None:
        """Merge a host -> device metadata object into ``cache_swap_metadata``."""
        self.cache_swap_metadata = self._merge(self.cache_swap_metadata, meta, CopyDirection.HOST_TO_DEVICE)

    def append_evict_metadata(self, meta: Optional[CacheSwapMetadata]) -> None:
        """Merge a device -> host metadata object into ``cache_evict_metadata``."""
        self.cache_evict_metadata = self._merge(self.cache_evict_metadata, meta, CopyDirection.DEVICE_TO_HOST)

    def __iter__(self) -> Iterator[Request]:
        return iter(self.requests)

    def __len__(self) -> int:
        return len(self.requests)

    def __getitem__(self, i: int) -> Request:
        return self.requests[i]

    def __repr__(self) -> str:
        sw = len(self.cache_swap_metadata) if self.cache_swap_metadata else 0
        ev = len(self.cache_evict_metadata) if self.cache_evict_metadata else 0
        return f"BatchRequest({len(self.requests)} requests, host_to_device={sw}, device_to_host={ev})"
