"""CuPy backend: a GPU without Paddle (what runs on the lent device), copies via the C ABI.

Device caches are CuPy arrays, streams are ``cupy.cuda.Stream(non_blocking=True)`` so they
never serialize with the legacy default stream, and every copy is given its stream pointer
explicitly.  CuPy is imported lazily, when the backend is built.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from fastdeploy_kvcache.worker.backends.base import CapiCopies, CudaBackend, slab_offsets, storage_dtype

logger = logging.getLogger(__name__)


class CupyBackend(CapiCopies, CudaBackend):
    """CuPy memory, streams and events; ``ops.load_capi(variant="cuda")`` (CUDA build) for the copies."""

    name = "cupy"

    def __init__(self, device_id: int = 0) -> None:
        super().__init__(device_id)
        import cupy

        from fastdeploy_kvcache import ops

        self._cp = cupy
        self._capi = ops.load_capi(variant="cuda")
        if not self._capi.is_cuda:
            raise RuntimeError(
                "the cupy backend needs the CUDA build of libfdkv_capi (bash build.sh gpu); the "
                "loaded library is the CPU build"
            )
        self._device = cupy.cuda.Device(device_id)
        self._device.use()

    # ------------------------------------------------------------------ memory
    def alloc_device(self, shape: Sequence[int], dtype: str) -> Any:
        with self._device:
            return self._cp.zeros(tuple(shape), dtype=storage_dtype(dtype))

    def alloc_device_lanes(self, shapes: Sequence[tuple[Sequence[int], str]]) -> list[Any]:
        # One slab, each array a view at an aligned offset (slab_offsets): arrays of one size
        # then sit at one pitch (the 2D copies of the DMA path), and a cache of ~100 arrays
        # is one allocation instead of ~100 in CuPy's pool.
        import numpy as np

        sizes = [int(np.prod(shape, dtype=np.int64)) * np.dtype(storage_dtype(dtype)).itemsize for shape, dtype in shapes]
        offsets, total = slab_offsets(sizes)
        with self._device:
            slab = self._cp.zeros(max(1, total), dtype=self._cp.uint8)
            return [
                slab[offset:offset + nbytes].view(storage_dtype(dtype)).reshape(tuple(shape))
                for (shape, dtype), nbytes, offset in zip(shapes, sizes, offsets)
            ]

    def fill_zero(self, array: Any) -> None:
        with self._device:
            array.fill(0)

    def release_device(self) -> None:
        # The caller drops its references first; the pool then hands the blocks back.
        # NOTE: CuPy's pool frees the *current* device's blocks: name ours.
        with self._device:
            self._cp.get_default_memory_pool().free_all_blocks()

    def host_alloc(self, nbytes: int) -> int:
        # cudaHostAlloc makes a context on the current device: on a rank whose thread is on
        # another GPU that would cost that GPU a context's memory.
        with self._device:
            return super().host_alloc(nbytes)

    # ------------------------------------------------------------------ streams and events
    def create_stream(self) -> Any:
        with self._device:
            return self._cp.cuda.Stream(non_blocking=True)

    def current_stream(self) -> Any:
        # NOTE: every stream, event and launch below is made under our device, whatever the
        # calling thread's current device is (a multi-GPU process, or an engine thread that
        # switched devices): an event created on GPU 0 and recorded on a GPU 1 stream fails
        # (invalid resource handle), and a kernel launched on the wrong device fails too.
        with self._device:
            return self._cp.cuda.get_current_stream()

    def record_event(self, stream: Any, timing: bool = False) -> Any:
        with self._device:
            event = self._cp.cuda.Event(block=False, disable_timing=not timing)
            event.record(stream)
        return event

    def event_done(self, event: Any) -> bool:
        return bool(event.done)

    def elapsed_s(self, start: Any, end: Any) -> float:
        return self._cp.cuda.get_elapsed_time(start, end) / 1e3

    def bind_thread(self) -> None:
        # CuPy's current device is per thread; the launcher records events on our device.
        self._device.use()

    def synchronize(self) -> None:
        with self._device:
            self._cp.cuda.runtime.deviceSynchronize()

    # ------------------------------------------------------------------ copy
    def swap_blocks(self, *args: Any, **kwargs: Any) -> None:
        # The C ABI picks its scratch rings, DMA locations and kernels by the current device.
        with self._device:
            super().swap_blocks(*args, **kwargs)

    has_layer_groups = True

    def _launch_scope(self) -> Any:
        # The launch records the calling thread's device for the launcher thread.
        return self._device

    def _new_events(self, count: int, timing: bool = False) -> list[Any]:
        with self._device:
            return [self._cp.cuda.Event(block=False, disable_timing=not timing) for _ in range(count)]

    def _device_ptr(self, array: Any) -> int:
        return array.data.ptr

    def _stream_handle(self, stream: Any) -> int:
        return stream.ptr
