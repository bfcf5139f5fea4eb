"""Shared fixtures for tests that need a CUDA GPU (run them on the device machine).

Generic on purpose: ``cupy`` (the module, on a working GPU), ``capi`` (the CUDA build of
the C ABI), ``pinned`` (pinned host buffers as numpy views), ``cuda_stream`` (fresh
non-blocking CuPy streams) and ``blocker`` (a stream held busy until released).  Every skip says what would make the test run.
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


_WAIT_SRC = r"""
extern "C" __global__ void wait_flag(const volatile int* flag, long long max_cycles) {
    long long start = clock64();
    while (*flag == 0 && clock64() - start < max_cycles) { }
}
"""


@pytest.fixture
def blocker(cupy, capi):
    """``block(stream)`` enqueues a kernel that spins until ``release()`` sets a flag in
    pinned memory (with a ~10 s safety cap): a stream held busy for as long as the test
    needs, with no timing assumption."""
    flag_ptr = capi.host_alloc(4)
    flag = np.ctypeslib.as_array((ctypes.c_int32 * 1).from_address(flag_ptr))
    flag[0] = 0
    kernel = cupy.RawKernel(_WAIT_SRC, "wait_flag")

    class Blocker:
        def block(self, stream) -> None:
            with stream:
                kernel((1,), (1,), (np.uint64(flag_ptr), np.int64(20_000_000_000)))

        def release(self) -> None:
            flag[0] = 1

    b = Blocker()
    yield b
    b.release()
    cupy.cuda.runtime.deviceSynchronize()
    capi.host_free(flag_ptr)
