"""Fixtures for the CPU op tests: the C ABI library built without CUDA (numpy memory
stands in for device memory) and the Paddle ops on CPU tensors.

A test whose ops are not built skips, saying which build makes them, unless
``FDKV_REQUIRE_OPS=1`` (CI sets it): then it fails, so a broken build cannot pass as a
run of skips.
"""

from __future__ import annotations

import ctypes
from typing import Callable, Iterator

import numpy as np
import pytest

from fastdeploy_kvcache import ops

from ops_required import ops_missing


@pytest.fixture(scope="session")
def capi_cpu() -> ops.CApi:
    """The CPU build of the C ABI (``bash build.sh`` makes build/libfdkv_capi_cpu.so)."""
    try:
        return ops.load_capi(variant="cpu")
    except ops.OpsNotBuiltError as exc:
        ops_missing(f"needs build/libfdkv_capi_cpu.so from `bash build.sh`: {exc}")
        raise  # not reached: ops_missing skips or fails


@pytest.fixture(scope="session")
def paddle_ops():
    """Paddle (CPU) with the custom ops registered; returns the paddle module."""
    try:
        import paddle
    except ImportError:
        ops_missing("needs paddlepaddle (installed by `bash build.sh`)")
        raise
    if not ops.paddle_ops_available():
        ops_missing("needs the Paddle ops built into build/paddle_ops by `bash build.sh`")
    ops.paddle_ops_capi()  # registers the ops
    return paddle


@pytest.fixture
def host_buffer() -> Iterator[Callable[[int], np.ndarray]]:
    """Allocate pinned (or aligned) host memory through ops.cuda_host_alloc, viewed as a
    uint8 numpy array filled with random bytes; freed at teardown."""
    ptrs: list[int] = []

    def make(nbytes: int) -> np.ndarray:
        ptr = ops.cuda_host_alloc(nbytes)
        ptrs.append(ptr)
        arr = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        arr[:] = np.random.default_rng(ptr & 0xFFFF).integers(0, 256, nbytes, dtype=np.uint8)
        return arr

    yield make
    for p in ptrs:
        ops.cuda_host_free(p)
