"""Worker side: move whole blocks between the host tier and storage objects.

The host tier is layer-major: one pinned buffer per layer and cache kind (key, value, and
fp32 key/value scales for uint8 caches), each ``[num_host_blocks][bytes of one block]``,
because host-to-device loads go layer by layer.  A storage object is block-major: one block's
every layer, K then V (then scales), contiguous::

    object = [layer 0: K | V (| K scale | V scale)] [layer 1: ...] ... [layer L-1: ...]

:class:`StorageTransfer` converts between the two:

* backup (host -> storage): one native gather of all layers and all blocks of a batch into
  a block-major *staging buffer* registered with the backend once (``fdkv_swap_layout`` of
  the CPU build of the C ABI, mode 0: plain memcpy, run with the GIL released), then one
  ``batch_put_from`` of the staged objects;
* prefetch (storage -> host) where the backend reads into segments
  (:attr:`StorageBackend.reads_segments`: the file backend with the native library), the
  segments are not tiny (``DIRECT_READ_MIN_SEGMENT_BYTES`` on average) and the layout is host
  memory (``HostTierLayout.memory``; with the CUDA build the C library confirms that no
  tensor is device or managed memory): one ``batch_get_segments`` that reads each object's
  bytes straight into its host block's per-layer segments, no staging and no scatter; the
  host tier's tensors are registered with the backend for it.  The CUDA build's pinned host
  tier (cudaHostAlloc, or mmap + cudaHostRegister) is ordinary page-locked host memory to a
  ``preadv``, so a GPU server reads into it as a CPU one does;
* prefetch otherwise (Mooncake, no library): one ``batch_get_into`` into staging, then one
  native scatter (mode 1) of the blocks that arrived whole.

There are no per-layer Python copies: each direction is one or two native calls per batch,
whatever the layer count.  ``benchmarks/bench_storage.py``
measured why staging rather than a block-major host layout (docs/storage.md has the figures):
the gather runs at memory speed, several times the bandwidth of either backend, so it costs
a small fraction of a transfer, and the host tier keeps its layer-major layout, which the
per-layer device loads need.

Blocks are whole or nothing: a block whose object did not arrive complete (miss, corrupt,
wrong size, error) gets a negative result and is never used.  Through staging it is never
scattered into the host tier; read directly, a missing object or one of another size leaves
it untouched, and a corrupt one of the right size may leave bytes in it.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import numpy as np

from fastdeploy_kvcache.storage.base import Status, StorageBackend, StorageError
from fastdeploy_kvcache.storage.executor import BoundedExecutor

logger = logging.getLogger(__name__)

__all__ = ["HostTierLayout", "StorageTransfer"]

CACHE_KINDS = ("key", "value", "key_scale", "value_scale")
# Direct prefetches (no staging) pay per segment (one iovec, one hash update each): for
# 128 objects of 64 KiB they took 0.87-0.91x the staging path's time with segments of 4 or
# 8 KiB, 0.67x with 32 KiB, but 1.12x with 2 KiB (2-core VM).  Below this average segment
# size the staging path is kept.
DIRECT_READ_MIN_SEGMENT_BYTES = 4096


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
    # "host" (the host tier: files may be read straight into it) or "device" (the PD
    # hand-off's device caches: only the C library's swaps may touch them).
    memory: str = "host"

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
        if self.memory not in ("host", "device"):
            raise ValueError(f"HostTierLayout: memory must be 'host' or 'device', got {self.memory!r}")
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
        return _describe(self.num_layers, self.block_bytes[:per_layer])

    @staticmethod
    def describe_config(cfg: Any) -> str:
        """:meth:`describe` of the host tier a controller of ``cfg`` (a CacheConfig) would
        have, without one: the namespaces of other KV formats are formed from it."""
        sizes = [cfg.bytes_per_layer_block] * 2
        if cfg.kv_cache_quant is not None:
            sizes += [cfg.scale_bytes_per_layer_block] * 2
        return _describe(cfg.total_layers, sizes)

    @classmethod
    def from_controller(cls, controller: Any) -> "HostTierLayout":
        """The host tier of a :class:`~fastdeploy_kvcache.worker.cache_controller.CacheController`."""
        host = controller.get_host_cache_kvs_map()
        if not host:
            raise ValueError("HostTierLayout.from_controller: the controller has no host cache (initialize_host_cache)")
        return cls.of_caches(controller, lambda name: int(host[name]), int(controller.num_host_blocks))

    @classmethod
    def of_caches(cls, controller: Any, address_of: Callable[[str], int], num_blocks: int,
                  memory: str = "host") -> "HostTierLayout":
        """The layout of one tier of a controller's caches, ``address_of(cache name)`` giving each base.

        The host tier and the device tier (PD transfer) list their caches in the same object
        order, so both are built here: a second copy of the loop could drift from the first.
        """
        cfg = controller.config
        kinds = CACHE_KINDS if controller.quantized else CACHE_KINDS[:2]
        ptrs, sizes = [], []
        for layer in range(controller.num_layers):
            names = controller.cache_names(layer)
            for kind in kinds:
                ptrs.append(address_of(names[kind]))
                sizes.append(cfg.scale_bytes_per_layer_block if kind.endswith("scale") else cfg.bytes_per_layer_block)
        return cls(tuple(ptrs), tuple(sizes), num_blocks, int(controller.num_layers), memory)


def _describe(num_layers: int, lane_bytes: Sequence[int]) -> str:
    return f"blockmajor-L{num_layers}-t{len(lane_bytes)}-{'-'.join(str(b) for b in lane_bytes)}"


class _Staging:
    """One block-major buffer of ``blocks`` objects, registered with the backend."""

    def __init__(self, capi: Any, blocks: int, object_bytes: int) -> None:
        self.blocks = blocks
        self.nbytes = blocks * object_bytes
        self.ptr = int(capi.host_alloc(self.nbytes))
        self.registered = False


class _Lane:
    """One direction (put or get): its staging buffer and the lock that serializes its use.

    NOTE: a backend call that timed out may still be running (``StorageError.pending``):
    a late ``get_into`` would write into the staging buffer, a late ``put_from`` would still
    read it.  Reusing that buffer could store a mix of two batches under a key, so the lane
    *retires* it (freed when the late call ends) and carries on with a fresh one.
    """

    def __init__(self, name: str, staging: _Staging) -> None:
        self.name = name
        self.staging = staging
        self.lock = threading.Lock()
        self.retired = 0
        self.retired_live = 0


class StorageTransfer:
    """Host tier <-> storage backend, whole blocks at a time (see the module doc).

    Args:
        layout: the host tier (:meth:`HostTierLayout.from_controller`).
        backend: a storage backend; the staging buffers are registered with it here.
        staging_blocks: objects per staging buffer: the largest batch one native call and
            one backend call move (bigger batches are split).
        capi: the C ABI whose swap_layout does the gather; default the CPU build, which
            copies host memory with memcpy wherever the caches live.  With the CUDA build a
            ``memory="device"`` layout (the PD hand-off) always goes through staging, and a
            host layout reads directly only where the library confirms every tensor is host
            memory.
        max_pending: batches queued per direction before ``submit_*`` answers "busy".
        direct_read_min_segment_bytes: the average bytes per (layer, kind) block from which
            prefetches read straight into the host tier where the backend can (else staging).

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
        direct_read_min_segment_bytes: int = DIRECT_READ_MIN_SEGMENT_BYTES,
    ) -> None:
        if staging_blocks <= 0:
            raise ValueError(f"staging_blocks must be > 0, got {staging_blocks}")
        if capi is None:
            from fastdeploy_kvcache import ops

            capi = ops.load_capi(variant="cpu")
        self.layout = layout
        self.backend = backend
        self._capi = capi
        self.staging_blocks = staging_blocks
        self.object_bytes = layout.object_bytes
        self._state_lock = threading.Lock()
        self._put = _Lane("put", _Staging(capi, staging_blocks, self.object_bytes))
        self._get = _Lane("get", _Staging(capi, staging_blocks, self.object_bytes))
        try:
            for lane in (self._put, self._get):
                self._register(lane.staging)
        except BaseException:
            self._free(self._put.staging)
            self._free(self._get.staging)
            raise
        # Where the backend reads into segments, prefetches land straight in the host tier,
        # whose tensors are then registered with it too.  Never into device memory, which a
        # file read cannot target (see _direct_read_blocker).
        self._host_registered: list[int] = []
        self._seg_base = np.asarray(layout.ptrs, dtype=np.uint64)
        self._seg_stride = np.asarray(layout.block_bytes, dtype=np.uint64)
        self._direct_blocks = 0
        self._staged_blocks = 0
        self.direct_read_off_reason = self._direct_read_blocker(direct_read_min_segment_bytes)
        if self.direct_read_off_reason is None:
            self._register_host_tier()
            if not self._host_registered:
                self.direct_read_off_reason = f"the {backend.name} backend refused to register the host tier"
        if self.direct_read_off_reason is not None:
            logger.debug("storage transfer: prefetches go through staging: %s", self.direct_read_off_reason)
        self._writer = BoundedExecutor("fdkv-storage-put", max_pending)
        self._reader = BoundedExecutor("fdkv-storage-get", max_pending)
        self._closed = False

    @classmethod
    def from_controller(cls, controller: Any, backend: StorageBackend, **kwargs: Any) -> "StorageTransfer":
        """A transfer over a CacheController's host tier (after ``initialize_host_cache``)."""
        return cls(HostTierLayout.from_controller(controller), backend, **kwargs)

    def _direct_read_blocker(self, min_segment_bytes: int) -> Optional[str]:
        """Why prefetches cannot read straight into the layout (None: they can).

        A device layout never can.  With the CUDA build, a layout that says "host" is
        checked too: each tensor's address must be host memory (pinned or not) to the C
        library (``CApi.pointer_location``); a device or managed address, or a library that
        cannot tell, keeps the staging path."""
        lay = self.layout
        if not self.backend.reads_segments:
            return f"the {self.backend.name} backend does not read into segments"
        if lay.memory != "host":
            return f"the layout is {lay.memory} memory"
        segment_bytes = self.object_bytes / len(lay.block_bytes)
        if segment_bytes < min_segment_bytes:
            return f"segments of {segment_bytes:.0f} B on average (direct reads from {min_segment_bytes} B)"
        if getattr(self._capi, "is_cuda", False):
            from fastdeploy_kvcache.ops.capi import POINTER_HOST, POINTER_PINNED_HOST

            if not getattr(self._capi, "has_pointer_location", False):
                return "the CUDA C library cannot tell host from device memory (no fdkv_pointer_location)"
            for i, ptr in enumerate(lay.ptrs):
                where = self._capi.pointer_location(ptr)
                if where not in (POINTER_HOST, POINTER_PINNED_HOST):
                    return f"tensor {i} at {ptr:#x} is not host memory (location {where})"
        return None

    # ------------------------------------------------------------------ staging buffers
    def _register(self, st: _Staging) -> None:
        if not st.registered:
            self.backend.register_buffer(st.ptr, st.nbytes)
            st.registered = True

    def _register_host_tier(self) -> None:
        """Register every host-tier tensor with the backend (for :meth:`get_blocks`' direct
        read); on a refusal, undo and keep the staging path."""
        lay = self.layout
        try:
            for ptr, bb in zip(lay.ptrs, lay.block_bytes):
                self.backend.register_buffer(ptr, bb * lay.num_blocks)
                self._host_registered.append(ptr)
        except StorageError as exc:
            logger.warning("storage transfer: cannot register the host tier with the %s backend (%s); "
                           "prefetches go through the staging buffer", self.backend.name, exc)
            self._unregister_host_tier()

    def _unregister_host_tier(self) -> None:
        for ptr in self._host_registered:
            try:
                self.backend.unregister_buffer(ptr)
            except Exception:  # noqa: BLE001 - closing anyway
                logger.warning("storage transfer: unregister_buffer(%#x) failed", ptr, exc_info=True)
        self._host_registered = []

    @property
    def reads_direct(self) -> bool:
        """Whether :meth:`get_blocks` reads objects straight into host blocks (the backend
        reads into segments and holds the host tier registered) instead of via staging."""
        return bool(self._host_registered)

    def _free(self, st: _Staging) -> None:
        if st.registered:
            try:
                self.backend.unregister_buffer(st.ptr)
            except Exception:  # noqa: BLE001 - freeing anyway: nothing uses it any more
                logger.warning("storage transfer: unregister_buffer(%#x) failed", st.ptr, exc_info=True)
            st.registered = False
        if st.ptr:
            self._capi.host_free(st.ptr)
            st.ptr = 0

    def _backend_call(self, lane: _Lane, fn: Any, *args: Any) -> list[int]:
        """Run one backend batch on ``lane``'s staging; retire the buffer if the call outlives us."""
        try:
            return fn(*args)
        except StorageError as exc:
            pending = getattr(exc, "pending", None)
            if pending is not None and not pending.done():
                self._retire(lane, pending)
            raise

    def _retire(self, lane: _Lane, pending: "Future[Any]") -> None:
        old = lane.staging
        lane.staging = _Staging(self._capi, self.staging_blocks, self.object_bytes)
        with self._state_lock:
            lane.retired += 1
            lane.retired_live += 1
        logger.warning(
            "storage transfer: a %s call timed out but is still running; its staging buffer is "
            "retired until it ends", lane.name,
        )

        def release(_: Any) -> None:
            self._free(old)
            with self._state_lock:
                lane.retired_live -= 1

        pending.add_done_callback(release)

    def _staging_for(self, lane: _Lane) -> _Staging:
        st = lane.staging
        try:
            self._register(st)  # a fresh buffer after a retirement registers on first use
        except StorageError as exc:
            raise StorageError("unreachable", f"{lane.name}: cannot register the staging buffer: {exc}") from exc
        return st

    # ------------------------------------------------------------------ checks
    def _check(self, op: str, keys: Sequence[str], host_block_ids: Sequence[int]) -> list[int]:
        if self._closed:
            raise StorageError("unreachable", f"{op}: the storage transfer is closed")
        ids = [int(i) for i in host_block_ids]
        if len(ids) != len(keys):
            raise StorageError("invalid", f"{op}: {len(keys)} keys but {len(ids)} host block ids")
        # Fast path (every prefetch and backup): in range and distinct, in C-level passes.
        if not ids or (min(ids) >= 0 and max(ids) < self.layout.num_blocks and len(set(ids)) == len(ids)):
            return ids
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

    def _swap(self, st: _Staging, host_ids: list[int], slots: list[int], mode: int) -> None:
        """One native call: gather (mode 0) host blocks into staging ``slots``, or scatter (1)."""
        lay = self.layout
        self._capi.swap_layout(
            list(lay.ptrs), lay.num_blocks, list(lay.block_bytes), st.ptr, st.blocks,
            host_ids, slots, mode, 0, True,
        )

    # ------------------------------------------------------------------ synchronous
    def put_blocks(self, keys: Sequence[str], host_block_ids: Sequence[int]) -> list[int]:
        """Store host blocks under ``keys``: per key ``Status.OK`` or a negative Status.

        Raises StorageError when a chunk could not run at all (tier off, timeout); the results
        of earlier chunks are then lost to the caller, who treats every key as not stored.
        """
        ids = self._check("put_blocks", keys, host_block_ids)
        results: list[int] = []
        n = self.staging_blocks
        size = self.object_bytes
        with self._put.lock:
            for start in range(0, len(ids), n):
                st = self._staging_for(self._put)
                chunk = ids[start:start + n]
                self._swap(st, chunk, list(range(len(chunk))), 0)
                ptrs = [st.ptr + i * size for i in range(len(chunk))]
                results += self._backend_call(
                    self._put, self.backend.batch_put_from, list(keys[start:start + n]), ptrs, [size] * len(chunk)
                )
        return results

    def get_blocks(self, keys: Sequence[str], host_block_ids: Sequence[int]) -> list[int]:
        """Load objects into host blocks: per key the bytes read (== object size) or negative.

        Only whole objects reach the host tier.  An object of another size (a partial block, or
        another layout under a colliding key) is ``Status.INVALID`` and is not scattered.
        """
        ids = self._check("get_blocks", keys, host_block_ids)
        if self.reads_direct:
            got = self._get_direct(keys, ids)
            with self._state_lock:
                self._direct_blocks += len(ids)
            return got
        with self._state_lock:
            self._staged_blocks += len(ids)
        results: list[int] = []
        n = self.staging_blocks
        size = self.object_bytes
        with self._get.lock:
            for start in range(0, len(ids), n):
                st = self._staging_for(self._get)
                chunk = ids[start:start + n]
                ptrs = [st.ptr + i * size for i in range(len(chunk))]
                got = self._backend_call(
                    self._get, self.backend.batch_get_into, list(keys[start:start + n]), ptrs, [size] * len(chunk)
                )
                got = [r if r == size or r < 0 else int(Status.INVALID) for r in got]
                whole = [i for i, r in enumerate(got) if r == size]
                if whole:
                    self._swap(st, [chunk[i] for i in whole], whole, 1)
                results += got
        return results

    def _get_direct(self, keys: Sequence[str], ids: list[int]) -> list[int]:
        """:meth:`get_blocks` as one backend call that reads each object's layer segments
        straight into its host block (no staging buffer, no scatter).  A block whose object
        did not arrive whole holds unspecified bytes and gets a negative result, as a block
        that was never scattered would; the caller uses neither."""
        lay = self.layout
        size = self.object_bytes
        # Segment t of block b: ptrs[t] + b * block_bytes[t], blocks in order, t fastest.
        segs = (np.asarray(ids, dtype=np.uint64)[:, None] * self._seg_stride + self._seg_base).ravel().tolist()
        with self._get.lock:
            got = self.backend.batch_get_segments(list(keys), segs, list(lay.block_bytes))
        return [r if r == size or r < 0 else int(Status.INVALID) for r in got]

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
    def stats(self) -> dict[str, int]:
        """Staging buffers retired after timeouts (total, and still waiting for their call), and
        the blocks prefetches asked for by path: read straight into the host tier
        (``direct_read_blocks``) or through the staging buffer (``staged_read_blocks``)."""
        with self._state_lock:
            return {
                "retired_staging_buffers": self._put.retired + self._get.retired,
                "retired_staging_buffers_live": self._put.retired_live + self._get.retired_live,
                "direct_read_blocks": self._direct_blocks,
                "staged_read_blocks": self._staged_blocks,
            }

    def close(self) -> None:
        """Finish queued transfers, unregister and free the staging buffers (not the backend).

        A retired buffer whose late call has not ended is freed when that call ends.
        """
        if self._closed:
            return
        self._closed = True
        self._writer.close()
        self._reader.close()
        with self._put.lock, self._get.lock:
            self._free(self._put.staging)
            self._free(self._get.staging)
            self._unregister_host_tier()
