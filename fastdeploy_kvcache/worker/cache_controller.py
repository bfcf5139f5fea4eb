"""Worker-side owner of the KV cache memory: device caches, pinned host caches, swap tasks.

The controller decides nothing.  The scheduler (``core.CacheManager``) says which blocks move
where; the controller allocates the memory those block ids index, hands each step's metadata to
the :class:`~fastdeploy_kvcache.worker.transfer_manager.TransferManager`, and hands finished
metadata back (:meth:`CacheController.collect_finished`) so the engine can pass each one to
``CacheManager.complete_swap``.

Per step, the engine does::

    counter = controller.submit_swap_tasks(batch.cache_evict_metadata, batch.cache_swap_metadata)
    model.forward(batch, layer_done=counter)      # calls counter.wait_for_layer(i) per layer
    for meta in controller.collect_finished():
        cache_manager.complete_swap(meta)
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import numbers
import threading
import time
from typing import Any, Optional, Union

from fastdeploy_kvcache.config import GiB, CacheConfig
from fastdeploy_kvcache.core.metadata import CacheSwapMetadata
from fastdeploy_kvcache.worker import numa
from fastdeploy_kvcache.worker.backends import Backend, make_backend
from fastdeploy_kvcache.worker.backends.base import slab_offsets
from fastdeploy_kvcache.worker.layer_done import LayerDoneCounter
from fastdeploy_kvcache.worker.transfer_manager import CacheLayout, ControllerClosedError, TransferManager

logger = logging.getLogger(__name__)

CACHE_KINDS = ("key", "value", "key_scale", "value_scale")


class CacheController:
    """Allocates and frees the caches of one worker and carries out the swap metadata.

    Args:
        config: cache shape and policy (``total_layers`` includes extra draft layers).
        local_rank: the worker's rank; cache names use ``local_rank % tensor_parallel_size``.
        device_id: the GPU (or pseudo device) this worker drives.
        backend: ``"auto"``, ``"cupy"``, ``"paddle"``, ``"cpu"`` or a Backend instance.
        threaded: host-thread backends only: run copies concurrently (True) or inline.
        disabled_rules: ordering fences to switch off (race tests only).
        async_launch: launch copies from a launcher thread so the forward pass need not
            wait for all layers' launches (default: on GPU backends).
        d2h_copy_path: copy path of evictions and backups ("dma", "auto", "kernel",
            "staged", "process"); default "dma", see TransferManager.
        backups_after_loads: start a step's backup behind the step's load; default on,
            see TransferManager.
    """

    def __init__(
        self,
        config: CacheConfig,
        local_rank: int = 0,
        device_id: int = 0,
        backend: Union[str, Backend] = "auto",
        *,
        threaded: bool = True,
        disabled_rules: Optional[set[int]] = None,
        async_launch: Optional[bool] = None,
        d2h_copy_path: Optional[str] = None,
        backups_after_loads: Optional[bool] = None,
    ) -> None:
        if not isinstance(config, CacheConfig):
            raise TypeError(f"config must be a CacheConfig, got {type(config).__name__}")
        config.validate()  # fields may have been changed since construction
        _check_index("local_rank", local_rank)
        _check_index("device_id", device_id)
        self.config = config
        self.local_rank = local_rank
        self.device_id = device_id
        self.backend = make_backend(backend, device_id, threaded=threaded)
        self.transfer_manager = TransferManager(
            self.backend,
            disabled_rules=disabled_rules,
            async_launch=async_launch,
            d2h_copy_path=d2h_copy_path,
            backups_after_loads=backups_after_loads,
        )
        self.cache_kvs_map: dict[str, Any] = {}
        self.host_cache_kvs_map: dict[str, int] = {}
        self._host_nbytes: dict[str, int] = {}
        self._host_slab: Optional[int] = None  # the one host allocation the buffers share
        # Background pinning of the host cache: blocks [0, _host_ready) have memory.  One
        # writer (the grower thread, or initialize_host_cache); readers take the int as is.
        self._host_ready = 0
        self._host_grower: Optional[threading.Thread] = None
        self._host_stop = threading.Event()
        self._host_pin_seconds: Optional[float] = None
        self.num_gpu_blocks = 0
        self.num_host_blocks = 0
        self.numa_node: Optional[int] = None
        self._layer_done_counter: Optional[LayerDoneCounter] = None
        self._lock = threading.RLock()
        logger.info(
            "CacheController rank=%d device=%d backend=%s layers=%d (+%d extra) dtype=%s",
            local_rank, device_id, self.backend.name, config.num_layers, config.num_extra_layers, config.dtype,
        )

    # ------------------------------------------------------------------ names and shapes
    @property
    def num_layers(self) -> int:
        """Cache layers: model layers plus extra (draft) layers."""
        return self.config.total_layers

    @property
    def quantized(self) -> bool:
        return self.config.kv_cache_quant is not None

    def cache_names(self, layer: int) -> dict[str, str]:
        """Names of layer ``layer``'s caches, ``key_caches_{layer}_rank{r}.device{d}`` etc."""
        self._check_layer(layer)
        rank = self.local_rank % self.config.tensor_parallel_size
        suffix = f"{layer}_rank{rank}.device{self.device_id}"
        return {
            "key": f"key_caches_{suffix}",
            "value": f"value_caches_{suffix}",
            "key_scale": f"key_cache_scales_{suffix}",
            "value_scale": f"value_cache_scales_{suffix}",
        }

    def _check_layer(self, layer: Any) -> None:
        if not isinstance(layer, numbers.Integral) or isinstance(layer, bool):
            raise TypeError(f"layer must be an int, got {_show(layer)}")
        if not 0 <= layer < self.num_layers:
            raise IndexError(
                f"layer {layer} is out of range [0, {self.num_layers}) "
                f"({self.config.num_layers} model + {self.config.num_extra_layers} extra layers)"
            )

    def _kinds(self) -> tuple[str, ...]:
        return CACHE_KINDS if self.quantized else CACHE_KINDS[:2]

    def _shape(self, kind: str, num_blocks: int) -> tuple[list[int], str]:
        heads, block_size, head_dim = self.config.block_shape
        if kind.endswith("scale"):
            return [num_blocks, heads, block_size], "float32"
        return [num_blocks, heads, block_size, head_dim], self.config.dtype

    # ------------------------------------------------------------------ device cache
    def initialize_kv_cache(self, num_gpu_blocks: Optional[int] = None) -> list[Any]:
        """Allocate every layer's key/value cache (and fp32 scales for uint8 caches).

        Layers ``[num_layers, total_layers)`` are the extra (draft) layers; they share the
        block ids of the main model, so every swap moves them too.  Returns the caches in
        ``[key_0, value_0, (key_scale_0, value_scale_0,) key_1, ...]`` order.
        """
        self.config.validate()
        blocks = self.config.num_gpu_blocks if num_gpu_blocks is None else num_gpu_blocks
        blocks = _check_block_count("initialize_kv_cache", "num_gpu_blocks", blocks)
        # NOTE: only host-thread backends are checked against a memory size: their "device"
        # arrays live in host RAM.  On a GPU the framework's allocator reports a shortage.
        limit = None if self.backend.is_cuda else numa.physical_memory_bytes()
        self._check_cache_size("device cache", blocks, limit, "num_gpu_blocks")
        with self._lock:
            self._check_open()
            if self.cache_kvs_map:
                raise RuntimeError("the device KV cache is already initialized; free_cache() first")
            try:
                # Every array in the copy op's lane order, at one pitch where the backend can
                # (one slab: CuPy; Paddle when unquantized), so an all-layer copy moves a run
                # of blocks as one 2D copy.
                names = [self.cache_names(layer)[kind] for layer in range(self.num_layers) for kind in self._kinds()]
                shapes = [self._shape(kind, blocks) for _layer in range(self.num_layers) for kind in self._kinds()]
                # No local name holds an array past this: on failure the map is the only owner.
                self.cache_kvs_map.update(zip(names, self.backend.alloc_device_lanes(shapes)))
            except BaseException:
                # A failure midway (out of memory at some layer) must not leave a half-built
                # cache behind: it would hold device memory and refuse every retry.  The map
                # held the only references, so the pool can hand the memory back.
                self.cache_kvs_map.clear()
                self.backend.release_device()
                raise
            caches = list(self.cache_kvs_map.values())
            self.num_gpu_blocks = blocks
            per_layer = 2 * (self.config.bytes_per_layer_block + self.config.scale_bytes_per_layer_block)
            logger.info(
                "device KV cache: %d layers x %d blocks, %.3f GiB",
                self.num_layers, blocks, per_layer * blocks * self.num_layers / (1 << 30),
            )
            self._update_layout()
            return caches

    def get_kv_caches(self) -> dict[str, Any]:
        """Device caches by name (the forward pass indexes them by layer)."""
        return self.cache_kvs_map

    def layer_caches(self, layer: int) -> list[Any]:
        """Layer ``layer``'s device arrays: key, value (, key scale, value scale)."""
        names = self.cache_names(layer)
        if not self.cache_kvs_map:
            raise RuntimeError("the device KV cache is not initialized; call initialize_kv_cache() first")
        return [self.cache_kvs_map[names[kind]] for kind in self._kinds()]

    # ------------------------------------------------------------------ host cache
    def initialize_host_cache(self, num_host_blocks: Optional[int] = None, *, grow_chunk_bytes: Optional[int] = 0,
                              grow_pace_s: float = 0.0, grow_in_pieces: Optional[bool] = None) -> None:
        """Allocate the pinned host cache (a buffer per device cache) for the host tier.

        ``grow_chunk_bytes`` > 0: return at once and pin the cache in the background, about
        that many bytes of blocks at a time, lowest block ids first (``grow_pace_s``: a pause
        between pieces).  :attr:`host_blocks_ready` says how many blocks have memory; the
        scheduler must use no other (``CacheManager.add_landed_host_blocks``).  Why: pinning
        32 GiB takes many seconds, and the server need not wait for it.  The buffers keep one
        base address each (the cache is reserved whole, then pinned block range by block
        range), so nothing else changes.  0 (the default): pinned before returning.  None:
        this controller's default, in the background with CUDA copies (as one piece, below),
        before returning with CPU copies.
        ``grow_in_pieces``: whether the background pinning goes piece by piece (None: yes,
        unless the copies are CUDA's, which need the whole buffer as one registration; then
        the whole cache lands at once, still without delaying the caller).

        One allocation holds every buffer, back to back in the copy op's lane order: buffers
        of one size then sit at one pitch, and an all-layer copy moves a run of blocks as one
        2D copy over every layer (docs/ops.md, "Lanes at one pitch"); it is also one pinned
        registration instead of ~100.  Allocated on the GPU's NUMA node when it can be
        found: pinned pages are placed by the allocating thread's memory policy, and a remote
        node costs host->device bandwidth.  Binding is best effort, logged, and never fatal.
        """
        self.config.validate()
        blocks = self.config.host_block_count if num_host_blocks is None else num_host_blocks
        blocks = _check_block_count("initialize_host_cache", "num_host_blocks", blocks)
        if grow_chunk_bytes is None:
            # The size of a piece only matters to pieces; one piece is the whole cache.
            grow_chunk_bytes = 1 if self.backend.is_cuda else 0
        if not isinstance(grow_chunk_bytes, numbers.Integral) or isinstance(grow_chunk_bytes, bool) or grow_chunk_bytes < 0:
            raise ValueError(f"initialize_host_cache: grow_chunk_bytes must be an int >= 0, got {_show(grow_chunk_bytes)}")
        if not isinstance(grow_pace_s, numbers.Real) or not 0 <= grow_pace_s < float("inf"):
            raise ValueError(f"initialize_host_cache: grow_pace_s must be a finite number >= 0, got {_show(grow_pace_s)}")
        self._check_cache_size("host cache", blocks, numa.physical_memory_bytes(), "swap_space / num_host_blocks")
        # NOTE: on an H200, cudaMemcpy2DAsync over a host range pinned as several
        # cudaHostRegister pieces failed with cudaErrorInvalidValue (bench_overlap
        # --host-grow-chunk-mib 4): every all-layer copy spans pieces.  So with CUDA copies the
        # background pinning registers the whole allocation as one piece: the tier is empty
        # until it lands, then complete.
        if grow_in_pieces is None:
            grow_in_pieces = not self.backend.is_cuda
        elif grow_in_pieces and self.backend.is_cuda and grow_chunk_bytes > 0:
            raise ValueError("initialize_host_cache: grow_in_pieces=True with CUDA copies: a copy across "
                             "separately registered pieces fails; pin in one piece")
        one_piece = grow_chunk_bytes > 0 and not grow_in_pieces
        with self._lock:
            self._check_open()
            if self.host_cache_kvs_map:
                raise RuntimeError("the host cache is already initialized; free_cache() first")
            node = numa.gpu_numa_node(self.backend, self.device_id)
            self.numa_node = node
            # Without a GPU there is no node to be near: nothing to bind, nothing to say.
            with numa.PreferredNumaNode(node) if self.backend.is_cuda else contextlib.nullcontext():
                try:
                    sizes = {
                        self.cache_names(layer)[kind]: blocks * self._block_bytes(kind)
                        for layer in range(self.num_layers)
                        for kind in self._kinds()
                    }
                    offsets, total = slab_offsets(sizes.values())
                    t0 = time.perf_counter()
                    grow = grow_chunk_bytes > 0
                    self._host_slab = self.backend.host_reserve(total) if grow else self.backend.host_alloc(total)
                    for (name, nbytes), offset in zip(sizes.items(), offsets):
                        self.host_cache_kvs_map[name] = self._host_slab + offset
                        self._host_nbytes[name] = nbytes
                except Exception:
                    self._free_host()
                    raise
            self.num_host_blocks = blocks
            gib = blocks * self.config.bytes_per_block / (1 << 30)
            where = f", NUMA node {node if node is not None else 'unknown'}" if self.backend.is_cuda else ""
            self._update_layout()
            if not grow:
                self._host_ready = blocks
                self._host_pin_seconds = time.perf_counter() - t0
                logger.info("host KV cache: %d blocks, %.3f GiB pinned in %.2f s%s", blocks, gib,
                            self._host_pin_seconds, where)
                return
            # Byte ranges of blocks [a, b) in every buffer: (offset in the slab, bytes per block).
            lanes = [(offset, self._block_bytes(kind))
                     for offset, kind in zip(offsets, [k for _ in range(self.num_layers) for k in self._kinds()])]
            chunk = blocks if one_piece else max(1, grow_chunk_bytes // self.config.bytes_per_block)
            if one_piece:
                lanes = []  # the whole allocation, padding between buffers included (one range)
            self._host_ready = 0
            self._host_stop.clear()
            logger.info("host KV cache: %d blocks, %.3f GiB, pinned in the background, %s%s", blocks, gib,
                        "as one piece (CUDA copies need one registration)" if one_piece
                        else f"{chunk} blocks at a time", where)
            self._host_grower = threading.Thread(
                target=self._grow_host, args=(self._host_slab, lanes, blocks, chunk, float(grow_pace_s), node, t0, total),
                name="fdkv-host-pin", daemon=True)
            self._host_grower.start()

    def _grow_host(self, slab: int, lanes: list[tuple[int, int]], blocks: int, chunk: int, pace_s: float,
                   node: Optional[int], t0: float, total: int) -> None:
        """Grower thread: pin blocks ``[ready, ready + chunk)`` of every buffer, publish, repeat.

        No ``lanes``: the whole allocation of ``total`` bytes as one range (CUDA copies).

        Stops between pieces when ``_host_stop`` is set (free_cache / close: SIGTERM while
        pinning); a failure leaves the tier at what landed (logged), never the process down.
        """
        done = 0
        try:
            with numa.PreferredNumaNode(node) if self.backend.is_cuda else contextlib.nullcontext():
                while done < blocks and not self._host_stop.is_set():
                    end = min(blocks, done + chunk)
                    ranges = [(off + done * bb, (end - done) * bb) for off, bb in lanes] if lanes else [(0, total)]
                    self.backend.host_pin(slab, ranges)
                    done = end
                    self._host_ready = end  # publish only after the piece is pinned
                    if pace_s and done < blocks and self._host_stop.wait(pace_s):
                        break
        except Exception:  # noqa: BLE001 - the tier keeps serving from what landed
            logger.error("host KV cache: pinning stopped at %d of %d blocks", done, blocks, exc_info=True)
            return
        if done == blocks:
            self._host_pin_seconds = time.perf_counter() - t0
            logger.info("host KV cache complete: %d blocks, %.3f GiB pinned in %.2f s", blocks,
                        blocks * self.config.bytes_per_block / (1 << 30), self._host_pin_seconds)
        else:
            logger.info("host KV cache: pinning stopped at %d of %d blocks (cache freed)", done, blocks)

    @property
    def host_blocks_ready(self) -> int:
        """Host blocks whose memory is pinned: all of them once the cache is complete."""
        return self._host_ready

    @property
    def host_pin_seconds(self) -> Optional[float]:
        """Seconds the whole host cache took to pin; None until it is complete."""
        return self._host_pin_seconds

    def _check_cache_size(self, what: str, blocks: int, limit: Optional[int], knob: str) -> None:
        """ValueError, before anything is allocated, for a cache that cannot fit.

        Each buffer's byte count must fit a signed 64-bit size (the ops and the allocators
        take one), and the whole cache must fit ``limit`` bytes when it is known.  Without
        this, a wrong shape surfaced as an allocator's "out of host memory" or a ctypes
        overflow, far from its cause.
        """
        per_block = {kind: self._block_bytes(kind) for kind in self._kinds()}
        largest = max(per_block.values())
        if blocks * largest >= 2**63:
            raise ValueError(
                f"{what}: {blocks} blocks x {largest} bytes per layer block overflows a 64-bit size; "
                f"check num_kv_heads, block_size, head_dim and the block count"
            )
        total = blocks * sum(per_block.values()) * self.num_layers
        if limit is not None and total > limit:
            raise ValueError(
                f"{what}: {blocks} blocks x {self.config.bytes_per_block} bytes per block = "
                f"{total / GiB:.3g} GiB exceeds this machine's physical memory ({limit / GiB:.3g} GiB); "
                f"lower {knob} or the cache shape"
            )

    def _block_bytes(self, kind: str) -> int:
        if kind.endswith("scale"):
            return self.config.scale_bytes_per_layer_block
        return self.config.bytes_per_layer_block

    def get_host_cache_kvs_map(self) -> dict[str, int]:
        """Host buffer addresses by cache name."""
        return self.host_cache_kvs_map

    def _update_layout(self) -> None:
        if not self.cache_kvs_map or not self.host_cache_kvs_map:
            self.transfer_manager.set_layout(None)
            return
        device, host = [], []
        for layer in range(self.num_layers):
            names = self.cache_names(layer)
            device.append([self.cache_kvs_map[names[k]] for k in self._kinds()])
            host.append([self.host_cache_kvs_map[names[k]] for k in self._kinds()])
        self.transfer_manager.set_layout(
            CacheLayout(device, host, self.num_gpu_blocks, self.num_host_blocks, self.config.bytes_per_block)
        )

    # ------------------------------------------------------------------ swaps
    def submit_swap_tasks(
        self,
        evict_metadata: Optional[CacheSwapMetadata],
        swap_in_metadata: Optional[CacheSwapMetadata],
    ) -> Optional[LayerDoneCounter]:
        """Start this step's copies; returns the load's LayerDoneCounter (None without one).

        Call it before the step's forward pass is enqueued: the device->host copy must read
        its blocks before this step's compute writes any of them (ordering rules 1 and 2).
        The forward pass calls ``counter.wait_for_layer(i)`` before layer ``i`` reads the
        cache.  Copy failures do not raise here: the metadata comes back through
        :meth:`collect_finished` with ``success=False``, and waits on a failed load raise
        ``LayerSwapError``.  One wait can raise: with launcher threads, fencing compute
        behind an eviction first waits (bounded by FDKV_LAYER_WAIT_TIMEOUT_S) for the
        eviction's launch, and raises ``LayerSwapTimeoutError`` (direction DEVICE_TO_HOST)
        past that limit.

        Raised before anything is enqueued: ``TypeError`` for an argument that is neither
        None nor a CacheSwapMetadata, ``ControllerClosedError`` after :meth:`close`.  A
        metadata of the wrong direction or with bad ids is data, not a type error: it comes
        back failed through :meth:`collect_finished`.
        """
        with self._lock:
            counter = self.transfer_manager.submit(evict_metadata, swap_in_metadata)
            self._layer_done_counter = counter
            return counter

    @property
    def swap_layer_done_counter(self) -> Optional[LayerDoneCounter]:
        """The counter of the last submitted load (None if the last step had none)."""
        return self._layer_done_counter

    def collect_finished(self, wait: bool = False, timeout_s: Optional[float] = None) -> list[CacheSwapMetadata]:
        """Finished metadata (success or failure) to hand to ``CacheManager.complete_swap``.

        Non-blocking by default: only copies whose done event has completed are returned, so
        nothing is reported as moved before its bytes have.  ``wait=True`` drains first.
        """
        if wait:
            return self.transfer_manager.drain(timeout_s)
        return self.transfer_manager.poll()

    def synchronize(self, timeout_s: Optional[float] = None) -> list[CacheSwapMetadata]:
        """Wait for every in-flight copy; returns the finished metadata (see collect_finished)."""
        return self.transfer_manager.drain(timeout_s)

    # ------------------------------------------------------------------ lifecycle
    def reset_cache(self) -> list[CacheSwapMetadata]:
        """Drain in-flight copies, then zero every device and host cache (memory is kept).

        Returns the metadata that finished during the drain so the caller can still hand it
        back; after a reset no block holds KV, so the scheduler must be reset too.
        """
        with self._lock:
            self._check_open()
            finished = self.transfer_manager.drain()
            for array in self.cache_kvs_map.values():
                self.backend.fill_zero(array)
            # Only the landed blocks: the rest are untouched zero pages the grower may be pinning.
            ready = self._host_ready
            for name, ptr in self.host_cache_kvs_map.items():
                ctypes.memset(ptr, 0, self._host_nbytes[name] // self.num_host_blocks * ready)
            self.transfer_manager.reset_stats()
            self._layer_done_counter = None
            return finished

    def free_cache(self) -> list[CacheSwapMetadata]:
        """Drain in-flight copies, then release device and pinned host memory."""
        with self._lock:
            # NOTE: a drain that times out raises and frees nothing: releasing memory that a
            # copy engine is still reading or writing would be a use-after-free.
            finished = self.transfer_manager.drain()
            self.transfer_manager.set_layout(None)
            # Every reference goes before release_device(): a framework pool (CuPy's) only
            # returns memory that no live array still holds.
            self.cache_kvs_map.clear()
            self.backend.release_device()
            self._free_host()
            self.num_gpu_blocks = 0
            self._layer_done_counter = None
            return finished

    def _free_host(self) -> None:
        grower, self._host_grower = self._host_grower, None
        if grower is not None:
            # The piece being pinned finishes first (a second or so at most): unmapping
            # under a cudaHostRegister would fail it, or worse.
            self._host_stop.set()
            grower.join()
        self._host_ready = 0
        self._host_pin_seconds = None
        slab, self._host_slab = self._host_slab, None
        if slab is not None:
            try:
                self.backend.host_free(slab)
            except Exception:  # noqa: BLE001 - the maps are cleared all the same
                logger.warning("failed to free the host cache", exc_info=True)
        self.host_cache_kvs_map.clear()
        self._host_nbytes.clear()
        self.num_host_blocks = 0

    @property
    def closed(self) -> bool:
        """True once :meth:`close` has been called: the controller cannot be used again."""
        return self.transfer_manager.closed

    def _check_open(self) -> None:
        # NOTE: a closed controller raises rather than re-opening.  Its copy streams and
        # launcher threads are gone; re-creating them under a live object would race with
        # callers still holding its counters, and a new controller costs nothing more.
        if self.transfer_manager.closed:
            raise ControllerClosedError(
                "this CacheController is closed (close() stopped its copy streams); build a new one"
            )

    def close(self) -> None:
        """free_cache() and stop the streams' threads (host-thread backends).

        The threads are stopped even when the drain times out (free_cache then raises and
        keeps the memory, which a copy may still use); each runs its queued work first.
        Idempotent: a second call frees what the first could not.  After close, every call
        that would allocate, copy or reset raises :class:`ControllerClosedError` at once;
        ``collect_finished``, ``synchronize``, ``free_cache`` and ``get_stats`` still work.
        """
        try:
            self.free_cache()
        finally:
            self.transfer_manager.close()

    def get_stats(self) -> dict[str, Any]:
        """Bytes and seconds per direction, failures, and the tasks still in flight."""
        stats = self.transfer_manager.get_stats()
        stats.update(
            backend=self.backend.name,
            num_layers=self.num_layers,
            num_gpu_blocks=self.num_gpu_blocks,
            num_host_blocks=self.num_host_blocks,
            host_blocks_ready=self._host_ready,
            numa_node=self.numa_node,
        )
        return stats


# ---------------------------------------------------------------------- argument checks
def _show(value: Any) -> str:
    return f"{value!r} ({type(value).__name__})"


def _check_index(name: str, value: Any) -> None:
    """TypeError / ValueError unless ``value`` is an int >= 0 (bool excluded)."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int >= 0, got {_show(value)}")
    if value < 0:
        raise ValueError(f"{name} must be an int >= 0, got {value}")


def _check_block_count(caller: str, name: str, value: Any) -> int:
    """The block count as an int > 0: TypeError for a non-int (2.5, "8", True), else ValueError."""
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{caller}: {name} must be an int, got {_show(value)}")
    if value <= 0:
        raise ValueError(f"{caller} needs {name} > 0, got {value}")
    return int(value)
