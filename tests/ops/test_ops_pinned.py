"""Pinned host memory: cuda_host_alloc / cuda_host_free through both faces."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

from fastdeploy_kvcache import ops


@pytest.mark.parametrize("nbytes", [1, 4096, 10_000_000])
def test_alloc_is_aligned_writable_and_freed(capi_cpu: ops.CApi, nbytes: int) -> None:
    ptr = capi_cpu.host_alloc(nbytes)
    try:
        assert ptr != 0 and ptr % 256 == 0, "aligned for 16-byte vector access and DMA"
        view = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        view[:] = 0x5A
        assert int(view.sum()) == 0x5A * nbytes
    finally:
        capi_cpu.host_free(ptr)


def test_zero_bytes_is_rejected(capi_cpu: ops.CApi) -> None:
    with pytest.raises(ops.SwapOpError, match="nbytes"):
        capi_cpu.host_alloc(0)


def test_free_of_null_is_a_no_op(capi_cpu: ops.CApi) -> None:
    capi_cpu.host_free(0)


def test_module_level_alloc_free(paddle_ops) -> None:
    """ops.cuda_host_alloc uses the Paddle extension's ABI when the ops are built."""
    ptr = ops.cuda_host_alloc(1 << 20, 0)
    try:
        view = np.ctypeslib.as_array((ctypes.c_uint8 * (1 << 20)).from_address(ptr))
        view[:] = 3
        assert view[-1] == 3
    finally:
        ops.cuda_host_free(ptr)


def test_module_level_alloc_falls_back_to_capi(monkeypatch, capi_cpu: ops.CApi) -> None:
    monkeypatch.setattr(ops.pinned, "paddle_ops_available", lambda: False)
    monkeypatch.setattr(ops.pinned, "load_capi", lambda *a, **k: capi_cpu)
    ptr = ops.cuda_host_alloc(4096)
    assert ptr != 0
    ops.cuda_host_free(ptr)
