"""Shadow memory: simulated device and host blocks, each holding the hash of what it stores.

It executes a step's ``BatchRequest`` the way the worker contract says a worker does:
first every device -> host copy (they read device blocks before this step's compute),
then every host -> device swap-in (reading host blocks after those copies wrote
them), then compute writes each running request's newly computed blocks.  A failed
copy writes nothing (a failed swap-in leaves GARBAGE in its destination, which the
oracle must never see in a block a request relies on).
"""

from __future__ import annotations

from typing import Optional

from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata
from fastdeploy_kvcache.core.request import BatchRequest, Request

GARBAGE = "garbage"


def apply_copy(meta: CacheSwapMetadata, dev: list, host: list, success: bool) -> list[int]:
    """Carry out one copy on simulated blocks the way the worker contract says.

    Every source is read before any destination is written; a successful copy asserts
    that each source holds the hash the metadata names; a failed load leaves GARBAGE in
    its device destinations (returned, so callers can track them); a failed device ->
    host copy writes nothing.  The metadata is then marked done.
    """
    if meta.src_type is CacheLevel.DEVICE:
        assert meta.dst_type is CacheLevel.HOST
        src, dst = dev, host
    else:
        assert (meta.src_type, meta.dst_type) == (CacheLevel.HOST, CacheLevel.DEVICE)
        src, dst = host, dev
    assert len(set(meta.dst_block_ids)) == len(meta.dst_block_ids), "duplicate destinations in one copy"
    values = [src[s] for s in meta.src_block_ids]
    garbage: list[int] = []
    for i, d in enumerate(meta.dst_block_ids):
        if success:
            assert values[i] == meta.hash_values[i], (
                f"{meta.src_type.name} block {meta.src_block_ids[i]} holds {values[i]!r}, "
                f"the copy expects {meta.hash_values[i]!r}"
            )
            dst[d] = values[i]
        elif meta.dst_type is CacheLevel.DEVICE:
            dst[d] = GARBAGE
            garbage.append(d)
    meta.mark_done(success, None if success else "injected failure")
    return garbage


class ShadowMemory:
    def __init__(self, num_device: int, num_host: int, block_size: int) -> None:
        self.dev: list[object] = [None] * num_device
        self.host: list[object] = [None] * num_host
        self.bs = block_size

    def copy(self, meta: Optional[CacheSwapMetadata], success: bool) -> Optional[CacheSwapMetadata]:
        if meta is None or meta.is_empty:
            return None
        apply_copy(meta, self.dev, self.host, success)
        return meta

    def compute(self, request: Request, target_tokens: int) -> None:
        """Write the KV of tokens [num_computed_tokens, target_tokens) of ``request``."""
        bs = self.bs
        start = request.num_computed_tokens
        if target_tokens <= start:
            return
        hashes = request.block_hashes(bs, target_tokens)
        for i in range(start // bs, (target_tokens - 1) // bs + 1):
            blk = request.block_tables[i]
            self.dev[blk] = hashes[i] if (i + 1) * bs <= target_tokens else ("partial", request.request_id, i)
        request.num_computed_tokens = target_tokens

    def run_step(
        self, batch: BatchRequest, evict_ok: bool = True, swap_ok: bool = True
    ) -> list[CacheSwapMetadata]:
        done = []
        for meta, ok in ((batch.cache_evict_metadata, evict_ok), (batch.cache_swap_metadata, swap_ok)):
            m = self.copy(meta, ok)
            if m is not None:
                done.append(m)
        for req in batch:
            self.compute(req, req.num_total_tokens)
        return done

    def check_request(self, request: Request, skip: frozenset = frozenset()) -> None:
        bs = self.bs
        hashes = request.block_hashes(bs, request.num_computed_tokens)
        for i in range(request.num_computed_tokens // bs):
            blk = request.block_tables[i]
            if blk in skip:
                continue
            assert self.dev[blk] == hashes[i], (
                f"{request.request_id} block {i} (device {blk}) holds {self.dev[blk]!r}, expected {hashes[i]!r}"
            )
