"""Paddle backends: device caches are ``paddle.Tensor``s, copies are the Paddle custom ops.

* :class:`PaddleGpuBackend` (paddlepaddle-gpu): streams and events are Paddle's, and every
  async op gets its stream explicitly (``swap_cache_*_async(..., stream)``); passing 0 would
  put the copy on the tensor's current stream, i.e. the compute stream, which is the peer
  hazard of copies that never overlap.
* :class:`PaddleCpuBackend` (CPU paddlepaddle): CPU tensors and the ops' CPU implementation,
  on host-thread streams.  This is what the CI integration test drives with real bytes.

Paddle is imported lazily, when a backend is built.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

from fastdeploy_kvcache.core.metadata import CopyDirection
from fastdeploy_kvcache.worker.backends.base import CudaBackend, HostThreadBackend, storage_dtype

logger = logging.getLogger(__name__)


def _ops() -> Any:
    from fastdeploy_kvcache import ops

    if not ops.paddle_ops_available():
        raise RuntimeError("the paddle backend needs the compiled Paddle custom ops (bash build.sh)")
    return ops


def _last_path(ops: Any) -> int:
    """PATH_* bits of this thread's last op: the Paddle extension exports the C ABI too."""
    try:
        return ops.paddle_ops_capi().last_path()
    except Exception:  # noqa: BLE001 - statistics only
        return 0


class PaddleOpsCopies:
    """Memory and copies through the Paddle custom ops, shared by the CPU and GPU backends."""

    _ops: Any
    _paddle: Any
    device_id: int

    def _op_stream(self, stream: Any) -> Any:
        """The stream argument handed to the op (the CPU implementation takes none)."""
        return 0

    def fill_zero(self, array: Any) -> None:
        array.zero_()

    def alloc_device_lanes(self, shapes: Sequence[tuple[Sequence[int], str]]) -> list[Any]:
        # Arrays of one shape and dtype (an unquantized model's key/value caches) are slab[i]
        # of one allocation: views at one pitch, which the ops write in place (the CPU suite
        # checks that with real bytes).  Quantized caches mix dtypes: a tensor each, as the
        # Paddle versions at hand offer no dtype view that shares memory (a `view(dtype)` of
        # a slice did not, on Paddle 3.3).  The addresses are checked, so a Paddle whose
        # indexing copied would get a tensor per cache, not a wrong cache.
        if len(shapes) < 2 or any(tuple(s) != tuple(shapes[0][0]) or d != shapes[0][1] for s, d in shapes):
            return super().alloc_device_lanes(shapes)  # type: ignore[misc]
        shape, dtype = tuple(shapes[0][0]), shapes[0][1]
        slab = self.alloc_device([len(shapes), *shape], dtype)
        views = [slab[i] for i in range(len(shapes))]
        pitch = views[1].data_ptr() - views[0].data_ptr()
        if pitch <= 0 or any(v.data_ptr() != slab.data_ptr() + i * pitch for i, v in enumerate(views)):
            logger.info("paddle: slab indexing did not give views; one allocation per cache")
            return super().alloc_device_lanes(shapes)  # type: ignore[misc]
        return views

    def host_alloc(self, nbytes: int) -> int:
        # The library's memory reads as zero (fresh anonymous pages): no memset of the tier.
        return self._ops.cuda_host_alloc(nbytes)

    def host_reserve(self, nbytes: int) -> int:
        return self._ops.cuda_host_reserve(nbytes)

    def host_pin(self, base: int, ranges: Sequence[tuple[int, int]]) -> int:
        return self._ops.cuda_host_pin_ranges(base, ranges, device=self.device_id if self.is_cuda else -1)

    def host_free(self, ptr: int) -> None:
        self._ops.cuda_host_free(ptr)

    def prepare_ids(self, ids: Sequence[int]) -> Any:
        # The ops take ids as an int64 vector attribute: they are read (and planned into runs
        # of consecutive blocks) on the host, so no device tensor and no sync is needed.
        # NOTE: an int64 array, converted once per task: the op's id check is then a dtype
        # check, not a Python loop per layer.
        # The dtype is inferred, not forced: a float id must reach the op's check, not be
        # truncated here.
        import numpy as np

        return np.asarray(list(ids))

    def swap_blocks(
        self,
        device_arrays: Sequence[Any],
        host_ptrs: Sequence[int],
        num_host_blocks: int,
        device_ids: Any,
        host_ids: Any,
        direction: CopyDirection,
        stream: Any,
        path: Optional[int] = None,
    ) -> None:
        # The ops' `rank` is the CUDA device ordinal the tensors must live on: the op checks
        # it against their place (CPU tensors ignore it).
        self._ops.swap_cache_all_layers(
            list(device_arrays), list(host_ptrs), num_host_blocks, device_ids, host_ids,
            self.device_id, int(direction), self._op_stream(stream), path=path,
        )

    def last_path(self) -> int:
        return _last_path(self._ops)


class PaddleCpuBackend(PaddleOpsCopies, HostThreadBackend):
    """CPU Paddle tensors + the ops' CPU implementation on host-thread streams."""

    name = "paddle"

    def __init__(self, device_id: int = 0, threaded: bool = True) -> None:
        super().__init__(device_id, threaded)
        import paddle

        self._paddle = paddle
        self._ops = _ops()

    def alloc_device(self, shape: Sequence[int], dtype: str) -> Any:
        storage_dtype(dtype)  # the one table of cache dtypes; Paddle stores the real dtype
        return self._paddle.zeros(list(shape), dtype=dtype).cpu()


class PaddleGpuBackend(PaddleOpsCopies, CudaBackend):
    """GPU Paddle tensors, Paddle streams/events, async Paddle ops with explicit streams."""

    name = "paddle"

    def __init__(self, device_id: int = 0) -> None:
        super().__init__(device_id)
        import paddle

        self._paddle = paddle
        self._ops = _ops()
        paddle.set_device(f"gpu:{device_id}")

    def alloc_device(self, shape: Sequence[int], dtype: str) -> Any:
        storage_dtype(dtype)  # the one table of cache dtypes; Paddle stores the real dtype
        return self._paddle.zeros(list(shape), dtype=dtype)

    def release_device(self) -> None:
        self._paddle.device.cuda.empty_cache()

    def create_stream(self) -> Any:
        # Named device, not the thread's current one (a multi-GPU process may be elsewhere).
        return self._paddle.device.Stream(device=f"gpu:{self.device_id}")

    def current_stream(self) -> Any:
        return self._paddle.device.current_stream(device=f"gpu:{self.device_id}")

    def record_event(self, stream: Any, timing: bool = False) -> Any:
        event = self._paddle.device.Event(enable_timing=timing)
        event.record(stream)
        return event

    def event_done(self, event: Any) -> bool:
        return bool(event.query())

    def elapsed_s(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) / 1e3

    def bind_thread(self) -> None:
        self._paddle.device.set_device(f"gpu:{self.device_id}")

    def synchronize(self) -> None:
        self._paddle.device.synchronize()

    def _op_stream(self, stream: Any) -> Any:
        # Explicit: 0 would put the copy on the tensor's current stream (the compute stream).
        return stream
