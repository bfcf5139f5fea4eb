"""Shared fixtures for tests that need a CUDA GPU (run them on the device machine).

Generic on purpose: ``cupy`` (the module, on a working GPU), ``capi`` (the CUDA build of
the C ABI), ``pinned`` (pinned host buffers as numpy views) and ``cuda_stream`` (fresh
non-blocking CuPy streams).  Every skip says what would make the test run.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Iterator

import numpy as np
import pytest

from fastdeploy_kvcache import ops

GPU_REASON = "needs a CUDA GPU with CuPy, and build/libfdkv_capi.so from `bash build.sh gpu` (run on the device machine)"
CAPI_REASON = "needs a CUDA GPU and build/libfdkv_capi.so built by `bash build.sh gpu`"


def _gpu_count(cupy) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # no driver / no device
        return 0


@pytest.fixture(scope="session")
def cupy():
    """The cupy module, on a machine where a CUDA device is usable."""
    cp = pytest.importorskip("cupy", reason=f"{GPU_REASON} (cupy is not installed)")
    if _gpu_count(cp) == 0:
        pytest.skip(f"{GPU_REASON} (no CUDA device visible)")
    return cp


@pytest.fixture(scope="session")
def capi(cupy) -> ops.CApi:
    """The CUDA build of the C ABI; device pointers are real device memory."""
    try:
        api = ops.load_capi(variant="cuda")
    except ops.OpsNotBuiltError:
        pytest.skip(CAPI_REASON)
    if not api.is_cuda:
        pytest.skip(CAPI_REASON + " (the library found was built without CUDA)")
    return api


@pytest.fixture
def pinned(capi) -> Iterator[Callable[[int], np.ndarray]]:
    """``pinned(nbytes)`` -> uint8 numpy view of pinned host memory (random bytes);
    freed at teardown after a device sync."""
    ptrs: list[int] = []

    def make(nbytes: int) -> np.ndarray:
        ptr = capi.host_alloc(nbytes)
        ptrs.append(ptr)
        view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        view[:] = np.random.default_rng(len(ptrs)).integers(0, 256, nbytes, dtype=np.uint8)
        return view

    yield make
    import cupy as cp

    cp.cuda.runtime.deviceSynchronize()
    for p in ptrs:
        capi.host_free(p)


@pytest.fixture
def cuda_stream(cupy) -> Callable[[], object]:
    """``cuda_stream()`` -> a new non-blocking CuPy stream (kept alive by the test)."""
    streams: list[object] = []

    def make():
        s = cupy.cuda.Stream(non_blocking=True)
        streams.append(s)
        return s

    return make
