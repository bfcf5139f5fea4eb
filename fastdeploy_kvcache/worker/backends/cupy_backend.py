"""CuPy backend: a GPU without Paddle (what runs on the lent device), copies via the C ABI.

Device caches are CuPy arrays, streams are ``cupy.cuda.Stream(non_blocking=True)`` so they
never serialize with the legacy default stream, and every copy is given its stream pointer
explicitly.  CuPy is imported lazily, when the backend is built.
"""

from __future__ import annotations

import ctypes
import logging
import time
from typing import Any, Callable, Optional, Sequence

from fastdeploy_kvcache.worker.backends.base import Backend, ErrorSink

logger = logging.getLogger(__name__)

# CuPy has no bfloat16: a bf16 cache is stored as uint16 (copies move bytes only).
_CUPY_DTYPES = {"bfloat16": "uint16", "float16": "float16", "float32": "float32", "uint8": "uint8"}


class CupyBackend(Backend):
    """CuPy memory, streams and events; ``ops.load_capi(variant="cuda")`` (CUDA build) for the copies."""

    name = "cupy"
    is_cuda = True

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
            return self._cp.zeros(tuple(shape), dtype=_CUPY_DTYPES[dtype])

    def fill_zero(self, array: Any) -> None:
        with self._device:
            array.fill(0)

    def release_device(self, arrays: Sequence[Any]) -> None:
        # The caller drops its references first; the pool then hands the blocks back.
        self._cp.get_default_memory_pool().free_all_blocks()

    def host_alloc(self, nbytes: int) -> int:
        ptr = self._capi.host_alloc(nbytes)
        # Zero it so a never-written host block reads as zeros rather than stale memory.
        ctypes.memset(ptr, 0, nbytes)
        return ptr

    def host_free(self, ptr: int) -> None:
        self._capi.host_free(ptr)

    # ------------------------------------------------------------------ streams and events
    def create_stream(self) -> Any:
        with self._device:
            return self._cp.cuda.Stream(non_blocking=True)

    def current_stream(self) -> Any:
        return self._cp.cuda.get_current_stream()

    def record_event(self, stream: Any, timing: bool = False) -> Any:
        event = self._cp.cuda.Event(block=False, disable_timing=not timing)
        event.record(stream)
        return event

    def stream_wait_event(self, stream: Any, event: Any, timeout_s: Optional[float] = None) -> None:
        stream.wait_event(event)

    def event_done(self, event: Any) -> bool:
        return bool(event.done)

    def event_wait_host(self, event: Any, timeout_s: float) -> bool:
        # NOTE: CUDA has no timed event wait.  Host-side waits (wait_all, shutdown) poll
        # with a backoff so they can honour the timeout; the compute path never does this,
        # it waits on the device (stream_wait_event).
        deadline = time.monotonic() + timeout_s
        delay = 20e-6
        while not event.done:
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return True

    def elapsed_s(self, start: Any, end: Any) -> float:
        return self._cp.cuda.get_elapsed_time(start, end) / 1e3

    def launch(self, stream: Any, fn: Callable[[], None], on_error: ErrorSink) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - routed to the task's metadata
            on_error(exc)

    def bind_thread(self) -> None:
        # CuPy's current device is per thread; the launcher records events on our device.
        self._device.use()

    def synchronize(self) -> None:
        with self._device:
            self._cp.cuda.runtime.deviceSynchronize()

    # ------------------------------------------------------------------ copy
    def prepare_ids(self, ids: Sequence[int]) -> Any:
        import numpy as np

        return np.ascontiguousarray(ids, dtype=np.int64)

    def swap_blocks(
        self,
        device_arrays: Sequence[Any],
        host_ptrs: Sequence[int],
        num_host_blocks: int,
        device_ids: Any,
        host_ids: Any,
        mode: int,
        stream: Any,
        path: Optional[int] = None,
    ) -> None:
        self._capi.swap_all_layers(
            [a.data.ptr for a in device_arrays],
            list(host_ptrs),
            [a.shape[0] for a in device_arrays],
            [a.nbytes // a.shape[0] for a in device_arrays],
            num_host_blocks,
            device_ids,
            host_ids,
            mode,
            stream=stream.ptr,
            sync=False,
            path=path,
        )

    def last_path(self) -> int:
        return self._capi.last_path()
