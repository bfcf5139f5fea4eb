"""The Paddle custom ops (``swap_cache_per_layer`` and friends): what an engine's worker
calls on ``paddle.Tensor`` caches.  The extension is built by ``setup_ops.py`` into
``build/paddle_ops`` and registered lazily, so importing this module never imports Paddle.

Arguments are checked here (:mod:`.checks`) before Paddle sees them; a failure the C++ core
reports comes back through the extension's own C ABI error state as the matching Python
error (:class:`~fastdeploy_kvcache.ops.checks.SwapOpError` for a bad argument).
"""

from __future__ import annotations

import ctypes
import logging
import warnings
import threading
from pathlib import Path
from typing import Any, Sequence, Union

from fastdeploy_kvcache import libpaths
from fastdeploy_kvcache.ops.capi import CApi
from fastdeploy_kvcache.ops.checks import (
    IdsLike,
    OpsNotBuiltError,
    StreamLike,
    check_tensor,
    check_tensors,
    id_list,
    int_arg,
    stream_handle,
)
from fastdeploy_kvcache.ops.paths import copy_path_code

logger = logging.getLogger(__name__)

_paddle_lock = threading.Lock()
_paddle_state: dict[str, Any] = {}


def paddle_ops_path() -> Path:
    """The Paddle ops library: the installed package's ``_lib/``, then a checkout's
    ``build/paddle_ops`` (the first candidate when neither exists, for the error message)."""
    return libpaths.find_paddle_ops() or libpaths.paddle_ops_candidates()[0]


def _load_paddle_ops() -> Any:
    """Register the custom ops with Paddle once and return ``paddle._C_ops``."""
    with _paddle_lock:
        if "c_ops" in _paddle_state:
            return _paddle_state["c_ops"]
        so_path = paddle_ops_path()
        if not so_path.is_file():
            raise OpsNotBuiltError(
                f"Paddle custom ops not found (looked in "
                f"{', '.join(str(p) for p in libpaths.paddle_ops_candidates())}); {libpaths.missing_hint('paddle_ops')}"
            )
        mismatch = libpaths.paddle_build_mismatch(so_path)
        if mismatch:
            logger.warning("%s", mismatch)
        with warnings.catch_warnings():
            # Importing Paddle (its extension builder) warns that ccache is missing: that only
            # matters to a compile, and loading prebuilt ops compiles nothing.
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle  # lazy: the scheduler side must not pay for Paddle
            from paddle.utils.cpp_extension.extension_utils import load_op_meta_info_and_register_op

        load_op_meta_info_and_register_op(str(so_path))
        from paddle import _C_ops

        _paddle_state["c_ops"] = _C_ops
        _paddle_state["capi"] = CApi(ctypes.CDLL(str(so_path)), str(so_path))
        logger.debug("registered Paddle ops from %s (paddle %s)", so_path, paddle.__version__)
        return _C_ops


def paddle_ops_capi() -> CApi:
    """The C ABI exported by the Paddle extension (registers the ops first).  Its
    ``last_path()`` reports the paths of the calling thread's last Paddle op."""
    _load_paddle_ops()
    return _paddle_state["capi"]


def paddle_ops_available() -> bool:
    """True if the Paddle extension is built (does not import Paddle)."""
    return paddle_ops_path().is_file()


def _run(name: str, *args: Any) -> Any:
    """Run a custom op; a failure the core reported becomes the matching Python error.

    NOTE: the op / argument / index of a validation error come from the extension's own
    C ABI error state (``fdkv_last_error_fields``, filled by the op on this thread), not
    from Paddle's rewrapped message text.  The state is cleared first, so an error Paddle
    raises before the op's code runs (a bad attribute type) is re-raised as Paddle's own.
    """
    c_ops = _load_paddle_ops()
    capi: CApi = _paddle_state["capi"]
    capi.clear_error()
    try:
        # NOTE: the call Paddle's generated wrapper of a custom op makes (cpp_extension); the
        # wrapper itself would hide the op's name from the error mapping below.
        return c_ops._run_custom_op(name, *args)
    except Exception:  # Paddle reports C++ errors as OSError with the message
        error = capi.error_from_last()
        if error is None:
            raise
        raise error from None


def _per_layer_args(op: str, cache_gpu: Any, cache_cpu_ptr: int, max_block_num_cpu: int, swap_block_ids_gpu: IdsLike,
                    swap_block_ids_cpu: IdsLike, rank: int, mode: int) -> list[Any]:
    """The arguments both one-tensor ops share, checked in order (errors name ``op``)."""
    return [
        check_tensor(cache_gpu, op), int_arg(cache_cpu_ptr, op, "cache_cpu_ptr"),
        int_arg(max_block_num_cpu, op, "max_block_num_cpu"), id_list(swap_block_ids_gpu, op, "swap_block_ids_gpu"),
        id_list(swap_block_ids_cpu, op, "swap_block_ids_cpu"), int_arg(rank, op, "rank", 32),
        int_arg(mode, op, "mode", 32),
    ]


def swap_cache_per_layer(
    cache_gpu: Any,
    cache_cpu_ptr: int,
    max_block_num_cpu: int,
    swap_block_ids_gpu: IdsLike,
    swap_block_ids_cpu: IdsLike,
    rank: int,
    mode: int,
    *,
    path: Union[int, str, None] = None,
) -> Any:
    """Copy blocks of one cache tensor between device and host, then wait for the copy.

    ``cache_gpu[swap_block_ids_gpu[i]]`` is paired with host block
    ``swap_block_ids_cpu[i]`` at ``cache_cpu_ptr`` (``max_block_num_cpu`` blocks of
    ``prod(cache_gpu.shape[1:]) * itemsize`` bytes; -1: the size :func:`cuda_host_alloc`
    recorded).  mode 0 (``CopyDirection.DEVICE_TO_HOST``): device to host; 1: host to device.  ``rank`` is
    the CUDA device ordinal ``cache_gpu`` lives on (-1: whichever; checked on GPU tensors,
    ignored on CPU ones).  ``cache_gpu`` must be contiguous.  In place: returns
    ``cache_gpu`` itself (same storage).  Runs on the tensor's current stream and
    synchronizes it, which is why engines use the async variant.

    ``path`` (keyword, every Paddle op): this call's copy path, as in
    :meth:`CApi.swap_per_layer`; None follows the process-wide option.  Passed as the op's
    optional trailing attribute ``path``; ignored on CPU tensors.
    """
    op = "swap_cache_per_layer"
    args = _per_layer_args(op, cache_gpu, cache_cpu_ptr, max_block_num_cpu, swap_block_ids_gpu, swap_block_ids_cpu,
                           rank, mode)
    return _run(op, *args, copy_path_code(path, op))[0]


def swap_cache_per_layer_async(
    cache_gpu: Any,
    cache_cpu_ptr: int,
    max_block_num_cpu: int,
    swap_block_ids_gpu: IdsLike,
    swap_block_ids_cpu: IdsLike,
    rank: int,
    mode: int,
    stream: StreamLike = 0,
    *,
    path: Union[int, str, None] = None,
) -> Any:
    """Like :func:`swap_cache_per_layer` but never synchronizes: the copy is enqueued on
    ``stream`` (0: the tensor's current stream) so it overlaps compute on other streams.
    The caller tracks completion with an event recorded on ``stream``, and must keep the
    host buffer alive and untouched until then.
    """
    op = "swap_cache_per_layer_async"
    args = _per_layer_args(op, cache_gpu, cache_cpu_ptr, max_block_num_cpu, swap_block_ids_gpu, swap_block_ids_cpu,
                           rank, mode)
    return _run(op, *args, stream_handle(stream), copy_path_code(path, op))[0]


def swap_cache_all_layers(
    cache_gpu_tensors: Sequence[Any],
    cache_cpu_ptrs: Sequence[int],
    max_block_num_cpu: int,
    swap_block_ids_gpu: IdsLike,
    swap_block_ids_cpu: IdsLike,
    rank: int,
    mode: int,
    stream: StreamLike = 0,
    *,
    path: Union[int, str, None] = None,
) -> list[Any]:
    """Copy the same block ids of every tensor in ``cache_gpu_tensors`` in one launch
    (one pointer table on the device), asynchronously on ``stream`` (0: the first
    tensor's current stream).  ``cache_cpu_ptrs[t]`` is tensor t's host cache; tensors
    may have different block sizes (fp32 scale caches next to K/V).  In place.
    """
    op = "swap_cache_all_layers"
    return list(_run(
        op, check_tensors(cache_gpu_tensors, op, "cache_gpu_tensors"),
        [int_arg(p, op, "cache_cpu_ptrs") for p in cache_cpu_ptrs], int_arg(max_block_num_cpu, op, "max_block_num_cpu"),
        id_list(swap_block_ids_gpu, op, "swap_block_ids_gpu"), id_list(swap_block_ids_cpu, op, "swap_block_ids_cpu"),
        int_arg(rank, op, "rank", 32), int_arg(mode, op, "mode", 32), stream_handle(stream), copy_path_code(path, op),
    ))


def swap_cache_layout(
    cache_gpu_tensors: Sequence[Any],
    cache_cpu_ptr: int,
    cache_shape: Sequence[int],
    gpu_block_ids: IdsLike,
    cpu_block_ids: IdsLike,
    rank: int,
    mode: int,
    stream: StreamLike = 0,
    max_block_num_cpu: int = -1,
    *,
    path: Union[int, str, None] = None,
) -> list[Any]:
    """Gather device blocks into (mode 0), or scatter them from (mode 1), a block-major
    host buffer ``[cpu_block][tensor][block bytes]``; passing tensors as
    ``[k0, v0, k1, v1, ...]`` gives ``[block][layer][k|v][...]``: one contiguous object per
    block, for the storage tier and prefill/decode hand-off.

    ``cache_shape`` is the shape every tensor must have (empty: each tensor's own shape,
    which lets scale tensors join).  ``max_block_num_cpu`` is the host buffer's block
    count; the default -1 takes it from the size :func:`cuda_host_alloc` recorded for
    ``cache_cpu_ptr`` (other memory needs the count).  ``cpu_block_ids`` are always
    range-checked.  Asynchronous on ``stream`` (0: the first tensor's current stream).
    In place.
    """
    op = "swap_cache_layout"
    return list(_run(
        op, check_tensors(cache_gpu_tensors, op, "cache_gpu_tensors"), int_arg(cache_cpu_ptr, op, "cache_cpu_ptr"),
        [int_arg(d, op, "cache_shape") for d in cache_shape], id_list(gpu_block_ids, op, "gpu_block_ids"),
        id_list(cpu_block_ids, op, "cpu_block_ids"), int_arg(rank, op, "rank", 32), int_arg(mode, op, "mode", 32),
        stream_handle(stream), int_arg(max_block_num_cpu, op, "max_block_num_cpu"), copy_path_code(path, op),
    ))
