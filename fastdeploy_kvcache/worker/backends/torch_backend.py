"""Torch backends: the device caches are ``torch.Tensor``s, the copies the C ABI library.

The transformers model runner (``engine/transformers_runner/torch_runner.py``) attends over the very tensors the
controller allocates, so the cache is never copied or converted between the worker and the
model.  Only the memory is torch's:

* :class:`TorchCudaBackend` keeps CuPy's streams and events (the copy streams and the
  per-layer events are the CuPy backend's, unchanged), and takes the compute stream from torch
  (``torch.cuda.current_stream()``), so the eviction fence and the per-layer waits land on the
  stream the model's kernels run on;
* :class:`TorchCpuBackend` is the CPU backend (host-thread streams) over torch CPU tensors,
  so the runner's logic runs in CI-like machines that have torch but no GPU.

Torch is imported lazily, when a backend is built.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from fastdeploy_kvcache.worker.backends.base import slab_offsets
from fastdeploy_kvcache.worker.backends.cpu import CpuBackend
from fastdeploy_kvcache.worker.backends.cupy_backend import CupyBackend

logger = logging.getLogger(__name__)


def torch_dtype(name: str) -> Any:
    """The torch dtype of cache dtype ``name`` (ValueError naming the accepted ones)."""
    import torch

    table = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "uint8": torch.uint8}
    try:
        return table[name]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported cache dtype {name!r}; expected one of {sorted(table)}") from None


def torch_lanes(shapes: Sequence[tuple[Sequence[int], str]], device: Any) -> list[Any]:
    """Zero-filled tensors, one per ``(shape, dtype)``, carved from one byte slab.

    Views at aligned offsets of one allocation (``slab_offsets``): arrays of one size sit at
    one pitch, as on the CuPy backend, so an all-layer copy moves a run of blocks of every
    layer as one 2D copy.
    """
    import torch

    dtypes = [torch_dtype(d) for _, d in shapes]
    sizes = [int(torch.Size(tuple(s)).numel()) * dt.itemsize for (s, _), dt in zip(shapes, dtypes)]
    offsets, total = slab_offsets(sizes)
    slab = torch.zeros(max(1, total), dtype=torch.uint8, device=device)
    return [
        slab[off:off + n].view(dt).view(tuple(s))
        for (s, _), dt, n, off in zip(shapes, dtypes, sizes, offsets)
    ]


class TorchCudaBackend(CupyBackend):
    """Torch device memory; CuPy streams and events; the C ABI's CUDA build for the copies."""

    name = "torch"

    def __init__(self, device_id: int = 0) -> None:
        super().__init__(device_id)
        import torch

        self._torch = torch
        self._torch_device = torch.device("cuda", device_id)

    def alloc_device(self, shape: Sequence[int], dtype: str) -> Any:
        return self._torch.zeros(tuple(shape), dtype=torch_dtype(dtype), device=self._torch_device)

    def alloc_device_lanes(self, shapes: Sequence[tuple[Sequence[int], str]]) -> list[Any]:
        return torch_lanes(shapes, self._torch_device)

    def fill_zero(self, array: Any) -> None:
        array.zero_()

    def release_device(self) -> None:
        # The caller drops its references first; torch's caching allocator then returns them.
        self._torch.cuda.empty_cache()

    def current_stream(self) -> Any:
        # The compute stream is torch's current stream on our device (the model's kernels run
        # there), seen as a CuPy stream so events and waits use the same calls as the copies.
        ptr = self._torch.cuda.current_stream(self._torch_device).cuda_stream
        with self._device:
            return self._cp.cuda.Stream.null if ptr == 0 else self._cp.cuda.ExternalStream(ptr)

    def _device_ptr(self, array: Any) -> int:
        return int(array.data_ptr())


class TorchCpuBackend(CpuBackend):
    """Torch CPU tensors on host-thread streams (the CPU build of the C ABI copies them)."""

    name = "torch"

    def alloc_device(self, shape: Sequence[int], dtype: str) -> Any:
        import torch

        return torch.zeros(tuple(shape), dtype=torch_dtype(dtype))

    def alloc_device_lanes(self, shapes: Sequence[tuple[Sequence[int], str]]) -> list[Any]:
        return torch_lanes(shapes, "cpu")

    def fill_zero(self, array: Any) -> None:
        array.zero_()

    def _device_ptr(self, array: Any) -> int:
        return int(array.data_ptr())


def make_torch_backend(device_id: int = 0, threaded: bool = True) -> Any:
    """The CUDA torch backend when torch sees a GPU, the CPU one otherwise."""
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() > device_id:
        return TorchCudaBackend(device_id)
    return TorchCpuBackend(device_id, threaded=threaded)
