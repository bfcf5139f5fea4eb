"""Framework backends of the worker side; each imports its framework only when built.

``make_backend("auto")`` picks CuPy on a GPU machine without Paddle-GPU (the lent device),
Paddle where Paddle's compiled ops are available, and the numpy/C-ABI CPU backend otherwise.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Union

from fastdeploy_kvcache.worker.backends.base import (
    CACHE_DTYPES,
    CALLER_STREAM,
    Backend,
    HostEvent,
    HostStream,
    HostThreadBackend,
    storage_dtype,
)

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "cupy", "paddle", "cpu", "torch")


def make_backend(name: Union[str, Backend] = "auto", device_id: int = 0, threaded: bool = True) -> Backend:
    """Build a backend by name.

    ``threaded`` only matters for the host-thread backends (CPU paddle and ``cpu``): True runs
    copies on worker threads concurrently with the caller, False runs them inline.
    """
    if isinstance(name, Backend):
        return name
    if name not in BACKENDS:
        raise ValueError(f"unknown worker backend {name!r}; expected one of {BACKENDS}")
    if name == "auto":
        name = _auto_name()
        logger.info("worker backend 'auto' resolved to %r", name)
    if name == "cupy":
        from fastdeploy_kvcache.worker.backends.cupy_backend import CupyBackend

        return CupyBackend(device_id)
    if name == "torch":
        # Torch memory (the transformers model runner attends over it); never picked by "auto".
        from fastdeploy_kvcache.worker.backends.torch_backend import make_torch_backend

        return make_torch_backend(device_id, threaded=threaded)
    if name == "paddle":
        import paddle

        from fastdeploy_kvcache.worker.backends.paddle_backend import PaddleCpuBackend, PaddleGpuBackend

        if paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0:
            return PaddleGpuBackend(device_id)
        return PaddleCpuBackend(device_id, threaded=threaded)
    from fastdeploy_kvcache.worker.backends.cpu import CpuBackend

    return CpuBackend(device_id, threaded=threaded)


def _auto_name() -> str:
    if importlib.util.find_spec("paddle") is not None:
        try:
            from fastdeploy_kvcache import ops

            if ops.paddle_ops_available():
                return "paddle"
        except Exception:  # noqa: BLE001 - fall through to the next candidate
            logger.debug("paddle ops not usable", exc_info=True)
    if importlib.util.find_spec("cupy") is not None:
        try:
            import cupy

            if cupy.cuda.runtime.getDeviceCount() > 0:
                return "cupy"
        except Exception:  # noqa: BLE001
            logger.debug("cupy present but no usable GPU", exc_info=True)
    return "cpu"


__all__ = [
    "BACKENDS",
    "CACHE_DTYPES",
    "CALLER_STREAM",
    "Backend",
    "HostEvent",
    "HostStream",
    "HostThreadBackend",
    "make_backend",
    "storage_dtype",
]
