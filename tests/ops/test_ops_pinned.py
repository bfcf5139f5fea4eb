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


def test_alloc_reads_as_zero(capi_cpu: ops.CApi) -> None:
    """The host tier is not memset any more: the library's memory must read as zero."""
    n = 3 << 20
    ptr = capi_cpu.host_alloc(n)
    try:
        assert not np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(ptr)).any()
    finally:
        capi_cpu.host_free(ptr)


def test_reserve_then_pin_piecewise_keeps_data_in_shared_pages(capi_cpu: ops.CApi) -> None:
    """Ranges that share a page with data already written: a later pin must leave the data
    alone (pages are pinned once), and the size is recorded as host_alloc's is."""
    n = 5 * 4096 + 123
    base = capi_cpu.host_reserve(n)
    try:
        view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(base))
        assert capi_cpu.host_pin_ranges(base, [(0, 5000)], threads=2) == 2 * 4096  # rounded out
        view[:5000] = 7
        assert capi_cpu.host_pin_ranges(base, [(5000, 100), (4000, 10)]) == 0  # inside pinned pages
        assert capi_cpu.host_pin_ranges(base, [(6000, 10_000), (20_000, n - 20_000)], threads=3) == 4 * 4096
        view[5000:] = 9
        assert capi_cpu.host_pin_ranges(base, [(0, n)]) == 0
        assert (view[:5000] == 7).all() and (view[5000:] == 9).all()
        assert capi_cpu.host_pin_threads() >= 1
    finally:
        capi_cpu.host_free(base)


def test_pin_rejects_bad_ranges_and_foreign_pointers(capi_cpu: ops.CApi) -> None:
    base = capi_cpu.host_reserve(8192)
    try:
        with pytest.raises(ops.SwapOpError, match="not inside") as info:
            capi_cpu.host_pin_ranges(base, [(0, 10), (4096, 8192)])
        assert info.value.index == 1
        with pytest.raises(ops.SwapOpError, match="not inside"):
            capi_cpu.host_pin_ranges(base, [(-1, 10)])
        with pytest.raises(ops.SwapOpError, match="not a live allocation"):
            capi_cpu.host_pin_ranges(base + 4096, [(0, 10)])
        with pytest.raises(ops.SwapOpError, match="nbytes"):
            capi_cpu.host_reserve(0)
    finally:
        capi_cpu.host_free(base)
    with pytest.raises(ops.SwapOpError, match="not a live allocation"):
        capi_cpu.host_pin_ranges(base, [(0, 10)])
