"""CPU backend: numpy "device" arrays, copies through the CPU build of the C ABI library.

It exists so the whole worker path (streams, events, ordering fences, failure handling) runs
in CI on machines with neither a GPU nor Paddle's compiled ops.  Copies run on host-thread
streams (:class:`~.base.HostStream`), either threaded (concurrent with the caller, like CUDA
streams) or synchronous (inline, deterministic).
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from fastdeploy_kvcache.worker.backends.base import CapiCopies, HostThreadBackend, storage_dtype

logger = logging.getLogger(__name__)


class CpuBackend(CapiCopies, HostThreadBackend):
    """numpy arrays + ``ops.load_capi(variant="cpu")`` (CPU build) on host-thread streams."""

    name = "cpu"
    # The CPU build copies with memcpy inside the host-thread stream's task; `path` is
    # checked and ignored there (one path).
    _sync_copies = True

    def __init__(self, device_id: int = 0, threaded: bool = True) -> None:
        super().__init__(device_id, threaded)
        import numpy as np  # noqa: F401 - fail early and clearly if numpy is missing

        from fastdeploy_kvcache import ops

        # FDKV_OPS_LIB, when set, names the library (load_capi checks it is a CPU build).
        self._capi = ops.load_capi(variant="cpu")
        if self._capi.is_cuda:
            # NOTE: a CUDA build would treat numpy addresses as device pointers.
            raise RuntimeError(
                "the cpu backend needs the CPU build of libfdkv_capi (bash build.sh); the loaded "
                "library was built with nvcc - use backend='cupy' on a GPU machine"
            )

    def alloc_device(self, shape: Sequence[int], dtype: str) -> Any:
        import numpy as np

        return np.zeros(tuple(shape), dtype=storage_dtype(dtype))

    def fill_zero(self, array: Any) -> None:
        array.fill(0)

    def _device_ptr(self, array: Any) -> int:
        return array.ctypes.data

    def _stream_handle(self, stream: Any) -> int:
        # `stream` is a HostStream: the copy already runs on its thread, synchronously.
        return 0
