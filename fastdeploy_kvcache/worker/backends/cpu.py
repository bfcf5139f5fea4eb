"""CPU backend: numpy "device" arrays, copies through the CPU build of the C ABI library.

It exists so the whole worker path (streams, events, ordering fences, failure handling) runs
in CI on machines with neither a GPU nor Paddle's compiled ops.  Copies run on host-thread
streams (:class:`~.base.HostStream`), either threaded (concurrent with the caller, like CUDA
streams) or synchronous (inline, deterministic).
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, Optional, Sequence

from fastdeploy_kvcache.worker.backends.base import HostThreadBackend

logger = logging.getLogger(__name__)

# numpy has no bfloat16: a bf16 cache is stored as uint16 (the copies move bytes only).
_NUMPY_DTYPES = {"bfloat16": "uint16", "float16": "float16", "float32": "float32", "uint8": "uint8"}


def numpy_dtype(dtype: str) -> str:
    try:
        return _NUMPY_DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unsupported cache dtype {dtype!r}; expected one of {sorted(_NUMPY_DTYPES)}") from None


class CpuBackend(HostThreadBackend):
    """numpy arrays + ``ops.load_capi(variant="cpu")`` (CPU build) on host-thread streams."""

    name = "cpu"

    def __init__(self, device_id: int = 0, threaded: bool = True) -> None:
        super().__init__(device_id, threaded)
        import numpy as np  # noqa: F401 - fail early and clearly if numpy is missing

        from fastdeploy_kvcache import ops

        self._capi = ops.load_capi(variant="cpu")
        if self._capi.is_cuda:
            # NOTE: a CUDA build would treat numpy addresses as device pointers.
            raise RuntimeError(
                "the cpu backend needs the CPU build of libfdkv_capi (bash build.sh); the loaded "
                "library was built with nvcc - use backend='cupy' on a GPU machine"
            )

    def alloc_device(self, shape: Sequence[int], dtype: str) -> Any:
        import numpy as np

        return np.zeros(tuple(shape), dtype=numpy_dtype(dtype))

    def fill_zero(self, array: Any) -> None:
        array.fill(0)

    def host_alloc(self, nbytes: int) -> int:
        ptr = self._capi.host_alloc(nbytes)
        ctypes.memset(ptr, 0, nbytes)
        return ptr

    def host_free(self, ptr: int) -> None:
        self._capi.host_free(ptr)

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
        # `path` is checked and ignored by the CPU build (one path: memcpy).
        self._capi.swap_all_layers(
            [a.ctypes.data for a in device_arrays],
            list(host_ptrs),
            [a.shape[0] for a in device_arrays],
            [a.nbytes // a.shape[0] for a in device_arrays],
            num_host_blocks,
            device_ids,
            host_ids,
            mode,
            stream=0,
            sync=True,
            path=path,
        )

    def last_path(self) -> int:
        return self._capi.last_path()
