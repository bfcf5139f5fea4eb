"""One Python API over the compiled KV swap ops: Paddle custom ops and a ctypes C ABI.

Both faces call the same C++ core (``custom_ops/csrc``), so validation, run merging and
path selection behave identically whichever one a caller uses:

* The **Paddle ops** (``swap_cache_per_layer`` and friends) take ``paddle.Tensor`` caches
  and are what an engine's worker calls.  They are built by ``setup_ops.py`` into
  ``build/paddle_ops`` and loaded lazily, so importing this module never imports Paddle.
* The **C ABI** (:func:`load_capi`) takes raw pointers, for callers without Paddle (CuPy
  or torch memory on the GPU; numpy memory with the CPU build), and for the GPU tests.

Every op validates its arguments before touching memory: ids are 1-D integers (no
floats, no 2-D arrays, nothing outside int64), in range, of equal lengths, with no
duplicate destination ids; tensors are contiguous; host ids are bounded by the host
buffer's size.  A violation raises :class:`SwapOpError` naming the op, the argument and
the index, and nothing has been written.  The C++ core hands those three over as values
(``fdkv_last_error_fields``), never as text to be parsed.

The package's modules, one job each: :mod:`.checks` (argument checks and errors),
:mod:`.paths` (copy paths), :mod:`.capi` (the C ABI binding), :mod:`.layer_stack` (the
layer-stack call), :mod:`.paddle_ops` (the Paddle functions) and :mod:`.pinned` (pinned
host memory).  Callers import the names below from ``fastdeploy_kvcache.ops``.

See ``docs/ops.md`` for semantics, stream behaviour and which copy path runs when.
"""

from __future__ import annotations

from fastdeploy_kvcache.core.metadata import CopyDirection
from fastdeploy_kvcache.ops.capi import CApi, TensorTable, load_capi
from fastdeploy_kvcache.ops.checks import OpsNotBuiltError, SwapOpError
from fastdeploy_kvcache.ops.layer_stack import GroupProgress, HandleArray, LayerStackCall, ProgressState, StackLauncher
from fastdeploy_kvcache.ops.paddle_ops import (
    paddle_ops_available,
    paddle_ops_capi,
    swap_cache_all_layers,
    swap_cache_layout,
    swap_cache_per_layer,
    swap_cache_per_layer_async,
)
from fastdeploy_kvcache.ops.paths import (
    COPY_PATH_AUTO,
    COPY_PATH_DMA,
    COPY_PATH_KERNEL,
    COPY_PATH_PROCESS,
    COPY_PATH_STAGED,
    COPY_PATHS,
    PATH_CPU,
    PATH_DMA,
    PATH_DMA_ROWS,
    PATH_KERNEL,
    PATH_MEMCPY,
    PATH_STAGED,
    copy_path_code,
)
from fastdeploy_kvcache.ops.pinned import cuda_host_alloc, cuda_host_free, cuda_host_pin_ranges, cuda_host_reserve

__all__ = [
    "CopyDirection",
    "PATH_MEMCPY",
    "PATH_KERNEL",
    "PATH_DMA",
    "PATH_DMA_ROWS",
    "PATH_STAGED",
    "PATH_CPU",
    "COPY_PATH_PROCESS",
    "COPY_PATH_AUTO",
    "COPY_PATH_KERNEL",
    "COPY_PATH_DMA",
    "COPY_PATH_STAGED",
    "COPY_PATHS",
    "copy_path_code",
    "SwapOpError",
    "OpsNotBuiltError",
    "CApi",
    "TensorTable",
    "LayerStackCall",
    "HandleArray",
    "GroupProgress",
    "ProgressState",
    "StackLauncher",
    "load_capi",
    "paddle_ops_available",
    "paddle_ops_capi",
    "cuda_host_alloc",
    "cuda_host_reserve",
    "cuda_host_pin_ranges",
    "cuda_host_free",
    "swap_cache_per_layer",
    "swap_cache_per_layer_async",
    "swap_cache_all_layers",
    "swap_cache_layout",
]
