"""Worker side: move whole blocks between the host tier and storage objects.

The host tier is layer-major: one pinned buffer per layer and cache kind (key, value, and
fp32 key/value scales for uint8 caches), each ``[num_host_blocks][bytes of one block]``,
because host-to-device loads go layer by layer.  A storage object is block-major: one block's
every layer, K then V (then scales), contiguous::

    object = [layer 0: K | V (| K scale | V scale)] [layer 1: ...] ... [layer L-1: ...]

:class:`StorageTransfer` converts between the two through a block-major *staging buffer*
that is registered with the backend once:

* backup (host -> storage): one native gather of all layers and all blocks of a batch into
  staging (``fdkv_swap_layout`` of the CPU build of the C ABI, mode 0: plain memcpy, run
  with the GIL released), then one ``batch_put_from`` of the staged objects;
* prefetch (storage -> host): one ``batch_get_into`` into staging, then one native scatter
  (mode 1) of the blocks that arrived whole.

There are no per-layer Python copies: each direction is two native calls per batch of up to
``staging_blocks`` blocks, whatever the layer count.  ``benchmarks/bench_storage.py``
measured why staging rather than a block-major host layout (docs/storage.md has the figures):
the gather runs at memory speed, several times the bandwidth of either backend, so it costs
a small fraction of a transfer, and the host tier keeps its layer-major layout, which the
per-layer device loads need.

Blocks are whole or nothing: a block whose object did not arrive complete (miss, corrupt,
wrong size, error) is never scattered into the host tier, and its result is negative.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional, Sequence

from fastdeploy_kvcache.storage.base import Status, StorageBackend, StorageError
from fastdeploy_kvcache.storage.executor import BoundedExecutor

logger = logging.getLogger(__name__)

__all__ = ["HostTierLayout", "StorageTransfer"]

CACHE_KINDS = ("key", "value", "key_scale", "value_scale")


@dataclass(frozen=True)
class HostTierLayout:
    """Where a worker's host tier lives: per (layer, kind) buffer, in object order.

    ``ptrs[t]`` holds ``num_blocks`` blocks of ``block_bytes[t]`` bytes; tensors are ordered
    ``[layer 0: key, value, (key_scale, value_scale)], [layer 1: ...]``, which is also the
    order of one object's bytes.
    """

    ptrs: tuple[int, ...]
    block_bytes: tuple[int, ...]
    num_blocks: int
    num_layers: int

    def __post_init__(self) -> None:
        if len(self.ptrs) != len(self.block_bytes) or not self.ptrs:
            raise ValueError(
                f"HostTierLayout: {len(self.ptrs)} ptrs and {len(self.block_bytes)} block sizes; need equal, > 0"
            )
        if self.num_blocks <= 0 or self.num_layers <= 0 or len(self.ptrs) % self.num_layers:
            raise ValueError(
                f"HostTierLayout: num_blocks={self.num_blocks}, num_layers={self.num_layers}, "
                f"{len(self.ptrs)} tensors (must be a positive multiple of num_layers)"
            )
        for i, (p, b) in enumerate(zip(self.ptrs, self.block_bytes)):
            if p <= 0 or b <= 0:
                raise ValueError(f"HostTierLayout: tensor {i} has ptr {p:#x} and block_bytes {b}")

    @property
    def object_bytes(self) -> int:
        """Bytes of one stored block: every layer's K, V and scales."""
        return sum(self.block_bytes)

    def describe(self) -> str:
        """The layout part of the key namespace: changes whenever an object's bytes would."""
        per_layer = len(self.ptrs) // self.num_layers
        sizes = "-".join(str(b) for b in self.block_bytes[:per_layer])
        return f"blockmajor-L{self.num_layers}-t{per_layer}-{sizes}"

    @classmethod
    def from_controller(cls, controller: Any) -> "HostTierLayout":
        """The host tier of a :class:`~fastdeploy_kvcache.worker.cache_controller.CacheController`."""
        host = controller.get_host_cache_kvs_map()
        if not host:
            raise ValueError("HostTierLayout.from_controller: the controller has no host cache (initialize_host_cache)")
        cfg = controller.config
        kinds = CACHE_KINDS if controller.quantized else CACHE_KINDS[:2]
        ptrs, sizes = [], []
        for layer in range(controller.num_layers):
            names = controller.cache_names(layer)
            for kind in kinds:
                ptrs.append(int(host[names[kind]]))
                sizes.append(cfg.scale_bytes_per_layer_block if kind.endswith("scale") else cfg.bytes_per_layer_block)
        return cls(tuple(ptrs), tuple(sizes), int(controller.num_host_blocks), int(controller.num_layers))


class _Staging:
    """One block-major buffer of ``blocks`` objects, used by one direction at a time."""

    def __init__(self, capi: Any, blocks: int, object_bytes: int) -> None:
        self.blocks = blocks
        self.nbytes = blocks * object_bytes
        self.ptr = int(capi.host_alloc(self.nbytes))
        self.lock = threading.Lock()


class StorageTransfer:
    """Host tier <-> storage backend, whole blocks at a time (see the module doc).

    Args:
        layout: the host tier (:meth:`HostTierLayout.from_controller`).
        backend: a storage backend; the staging buffers are registered with it here.
        staging_blocks: objects per staging buffer: the largest batch one native call and
            one backend call move (bigger batches are split).
        capi: the C ABI whose swap_layout does the gather; default the CPU build, which
            copies host memory with memcpy wherever the caches live.
        max_pending: batches queued per direction before ``submit_*`` answers "busy".

    The caller (the worker, on the scheduler's instructions) must keep the host blocks of a
    put unchanged, and those of a get unused, until the call or its future completes.
    """

    def __init__(
        self,
        layout: HostTierLayout,
        backend: StorageBackend,
        staging_blocks: int = 32,
        capi: Optional[Any] = None,
        max_pending: int = 16,
    ) -> None:
        if staging_blocks <= 0:
            raise ValueError(f"staging_blocks must be > 0, got {staging_blocks}")
        if capi is None:
            from fastdeploy_kvcache import ops

            capi = ops.load_capi(variant="cpu")
        self.layout = layout
        self.backend = backend
        self._capi = capi
        self.object_bytes = layout.object_bytes
        self._put_staging = _Staging(capi, staging_blocks, self.object_bytes)
        self._get_staging = _Staging(capi, staging_blocks, self.object_bytes)
        self._registered: list[int] = []
        try:
            for st in (self._put_staging, self._get_staging):
                backend.register_buffer(st.ptr, st.nbytes)
                self._registered.append(st.ptr)
        except BaseException:
            self._release()
            raise
        self._writer = BoundedExecutor("fdkv-storage-put", max_pending)
        self._reader = BoundedExecutor("fdkv-storage-get", max_pending)
        self._closed = False

    # ------------------------------------------------------------------ checks
    def _check(self, op: str, keys: Sequence[str], host_block_ids: Sequence[int]) -> list[int]:
        if self._closed:
            raise StorageError("unreachable", f"{op}: the storage transfer is closed")
        ids = [int(i) for i in host_block_ids]
        if len(ids) != len(keys):
            raise StorageError("invalid", f"{op}: {len(keys)} keys but {len(ids)} host block ids")
        seen: set[int] = set()
        for i, block in enumerate(ids):
            if not 0 <= block < self.layout.num_blocks:
                raise StorageError(
                    "invalid", f"{op}: host_block_ids[{i}] = {block} is outside [0, {self.layout.num_blocks})"
                )
            if block in seen:
                raise StorageError("invalid", f"{op}: host_block_ids[{i}] = {block} appears twice")
            seen.add(block)
        return ids

    def _swap(self, staging: _Staging, host_ids: list[int], mode: int) -> None:
        """One native call: gather (mode 0) host blocks into staging slots 0..n-1, or scatter (1)."""
        lay = self.layout
        self._capi.swap_layout(
            list(lay.ptrs), lay.num_blocks, list(lay.block_bytes), staging.ptr, staging.blocks,
            host_ids, list(range(len(host_ids))), mode, 0, True,
        )

    # ------------------------------------------------------------------ synchronous
    def put_blocks(self, keys: Sequence[str], host_block_ids: Sequence[int]) -> list[int]:
        """Store host blocks under ``keys``: per key ``Status.OK`` or a negative Status.

        Raises StorageError when a chunk could not run at all (tier off, timeout); the results
        of earlier chunks are then lost to the caller, who treats every key as not stored.
        """
        ids = self._check("put_blocks", keys, host_block_ids)
        results: list[int] = []
        st = self._put_staging
        n = st.blocks
        with st.lock:
            for start in range(0, len(ids), n):
                chunk = ids[start:start + n]
                self._swap(st, chunk, 0)
                ptrs = [st.ptr + i * self.object_bytes for i in range(len(chunk))]
                results += self.backend.batch_put_from(list(keys[start:start + n]), ptrs, [self.object_bytes] * len(chunk))
        return results

    def get_blocks(self, keys: Sequence[str], host_block_ids: Sequence[int]) -> list[int]:
        """Load objects into host blocks: per key the bytes read (== object size) or negative.

        Only whole objects reach the host tier.  An object of another size (a partial block, or
        another layout under a colliding key) is ``Status.INVALID`` and is not scattered.
        """
        ids = self._check("get_blocks", keys, host_block_ids)
        results: list[int] = []
        st = self._get_staging
        n = st.blocks
        size = self.object_bytes
        with st.lock:
            for start in range(0, len(ids), n):
                chunk = ids[start:start + n]
                ptrs = [st.ptr + i * size for i in range(len(chunk))]
                got = self.backend.batch_get_into(list(keys[start:start + n]), ptrs, [size] * len(chunk))
                got = [r if r == size or r < 0 else int(Status.INVALID) for r in got]
                whole = [i for i, r in enumerate(got) if r == size]
                if len(whole) == len(chunk):
                    self._swap(st, chunk, 1)
                elif whole:
                    lay = self.layout
                    self._capi.swap_layout(
                        list(lay.ptrs), lay.num_blocks, list(lay.block_bytes), st.ptr, st.blocks,
                        [chunk[i] for i in whole], whole, 1, 0, True,
                    )
                results += got
        return results

    # ------------------------------------------------------------------ asynchronous
    def submit_put_blocks(self, keys: Sequence[str], host_block_ids: Sequence[int]) -> "Future[list[int]]":
        """:meth:`put_blocks` on the put thread; the host blocks stay busy until it is done."""
        self._check("submit_put_blocks", keys, host_block_ids)
        return self._writer.submit(self.put_blocks, list(keys), list(host_block_ids))

    def submit_get_blocks(self, keys: Sequence[str], host_block_ids: Sequence[int]) -> "Future[list[int]]":
        """:meth:`get_blocks` on the get thread (prefetch); its host blocks are unusable until done."""
        self._check("submit_get_blocks", keys, host_block_ids)
        return self._reader.submit(self.get_blocks, list(keys), list(host_block_ids))

    # ------------------------------------------------------------------ lifecycle
    def _release(self) -> None:
        for ptr in self._registered:
            try:
                self.backend.unregister_buffer(ptr)
            except Exception:  # noqa: BLE001 - shutting down; the memory goes next
                logger.warning("storage transfer: unregister_buffer(%#x) failed", ptr, exc_info=True)
        self._registered.clear()
        for st in (getattr(self, "_put_staging", None), getattr(self, "_get_staging", None)):
            if st is not None and st.ptr:
                self._capi.host_free(st.ptr)
                st.ptr = 0

    def close(self) -> None:
        """Finish queued transfers, unregister and free the staging buffers (not the backend)."""
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        self._reader.close()
        with self._put_staging.lock, self._get_staging.lock:
            self._release()
