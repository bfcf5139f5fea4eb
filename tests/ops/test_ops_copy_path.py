"""The per-call copy path (``path``) of every swap op, on CPU.

The CPU build and the Paddle ops on CPU tensors have one path (memcpy): they must accept
every valid value, ignore it (same bytes, ``last_path() == PATH_CPU``), reject bad values
with a :class:`SwapOpError` naming ``path`` before writing anything, and leave the
process-wide ``copy_path`` option alone.  tests/gpu/test_copy_path_gpu.py checks that the
override takes effect on a GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fastdeploy_kvcache import ops

NUM_DEV, NUM_HOST, BB = 6, 8, 64
DEV_IDS, HOST_IDS = [4, 0, 1], [7, 2, 3]

VALID = [None, -1, 0, 1, 2, 3, "process", "auto", "kernel", "dma", "DMA", "staged", np.int64(2)]
# Values the core rejects (C ints out of range) and ones Python rejects (wrong type/name).
BAD_IN_CORE = [4, -2, 100]
BAD_IN_PYTHON = ["fast", "", 1.5, True, 2**40, object()]


def test_copy_path_code_maps_names_and_defaults() -> None:
    assert ops.copy_path_code(None) == ops.COPY_PATH_PROCESS == -1
    assert [ops.copy_path_code(n) for n in ("process", "auto", "kernel", "dma", "staged")] == [-1, 0, 1, 2, 3]
    assert ops.copy_path_code(" Kernel ") == ops.COPY_PATH_KERNEL
    assert ops.copy_path_code(np.int32(2)) == ops.COPY_PATH_DMA
    assert ops.COPY_PATHS == {"process": -1, "auto": 0, "kernel": 1, "dma": 2, "staged": 3}
    # ints pass through: the core owns the range check (tested below)
    assert ops.copy_path_code(7) == 7


@pytest.mark.parametrize("bad", BAD_IN_PYTHON, ids=repr)
def test_copy_path_code_rejects_names_and_types(bad: Any) -> None:
    with pytest.raises(ops.SwapOpError) as info:
        ops.copy_path_code(bad, "swap_all_layers")
    err = info.value
    assert (err.op, err.argument, err.index) == ("swap_all_layers", "path", None)
    assert str(err).startswith("swap_all_layers: path = ")


def test_abi_version_is_checked(capi_cpu: ops.CApi) -> None:
    assert capi_cpu.lib.fdkv_abi_version() >= 2

    class OldLibrary:  # a library built before the per-call path: no fdkv_abi_version
        pass

    with pytest.raises(ops.OpsNotBuiltError, match="ABI version 1"):
        ops.CApi(OldLibrary(), "old/libfdkv_capi.so")  # type: ignore[arg-type]


# ---------------------------------------------------------------------- C ABI (CPU build)
ENTRIES = ["per_layer", "all_layers", "layout"]


def _memory(entry: str, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random (device, host) memory for ``entry``: 2 tensors except per_layer; the layout
    op's host buffer is block-major ``[host block][tensor][bytes]``."""
    rng = np.random.default_rng(seed)
    if entry == "per_layer":
        shapes = ((NUM_DEV, BB), (NUM_HOST, BB))
    elif entry == "all_layers":
        shapes = ((2, NUM_DEV, BB), (2, NUM_HOST, BB))
    else:
        shapes = ((2, NUM_DEV, BB), (NUM_HOST, 2, BB))
    return tuple(rng.integers(0, 256, shape, dtype=np.uint8) for shape in shapes)  # type: ignore[return-value]


def _call(capi: ops.CApi, entry: str, dev: np.ndarray, host: np.ndarray, mode: int, path: Any) -> None:
    if entry == "per_layer":
        capi.swap_per_layer(dev.ctypes.data, NUM_DEV, BB, host.ctypes.data, NUM_HOST, DEV_IDS, HOST_IDS, mode,
                            path=path)
    elif entry == "all_layers":
        capi.swap_all_layers([dev[0].ctypes.data, dev[1].ctypes.data], [host[0].ctypes.data, host[1].ctypes.data],
                             NUM_DEV, BB, NUM_HOST, DEV_IDS, HOST_IDS, mode, path=path)
    else:
        capi.swap_layout([dev[0].ctypes.data, dev[1].ctypes.data], NUM_DEV, BB, host.ctypes.data, NUM_HOST,
                         DEV_IDS, HOST_IDS, mode, path=path)


def _expected(entry: str, dev: np.ndarray, host: np.ndarray, mode: int) -> tuple[np.ndarray, np.ndarray]:
    dev, host = dev.copy(), host.copy()
    views = [(dev, host)] if entry == "per_layer" else [(dev[t], host[t] if entry == "all_layers" else host[:, t])
                                                          for t in range(2)]
    for d, h in views:
        if mode == ops.CopyDirection.DEVICE_TO_HOST:
            h[HOST_IDS] = d[DEV_IDS]
        else:
            d[DEV_IDS] = h[HOST_IDS]
    return dev, host


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
@pytest.mark.parametrize("path", VALID, ids=repr)
def test_capi_cpu_accepts_and_ignores_every_valid_path(capi_cpu: ops.CApi, entry: str, mode: int, path: Any) -> None:
    """Same bytes for every path value; the CPU build reports its one path."""
    before = capi_cpu.get_option("copy_path")
    dev, host = _memory(entry, 3)
    want_dev, want_host = _expected(entry, dev, host, mode)
    _call(capi_cpu, entry, dev, host, mode, path)
    assert capi_cpu.last_path() == ops.PATH_CPU
    np.testing.assert_array_equal(dev, want_dev)
    np.testing.assert_array_equal(host, want_host)
    assert capi_cpu.get_option("copy_path") == before  # the per-call value never leaks


@pytest.mark.parametrize("entry", ENTRIES)
@pytest.mark.parametrize("bad", BAD_IN_CORE + BAD_IN_PYTHON, ids=repr)
def test_capi_cpu_rejects_bad_path_and_writes_nothing(capi_cpu: ops.CApi, entry: str, bad: Any) -> None:
    dev, host = _memory(entry, 9)
    dev0, host0 = dev.copy(), host.copy()
    op = {"per_layer": "swap_per_layer", "all_layers": "swap_all_layers", "layout": "swap_layout"}[entry]
    with pytest.raises(ops.SwapOpError) as info:
        _call(capi_cpu, entry, dev, host, ops.CopyDirection.DEVICE_TO_HOST, bad)
    err = info.value
    assert (err.op, err.argument, err.index) == (op, "path", None)
    assert str(err).startswith(f"{op}: path = ") and "dma" in str(err)
    np.testing.assert_array_equal(dev, dev0)
    np.testing.assert_array_equal(host, host0)


def test_core_checks_path_before_ids(capi_cpu: ops.CApi) -> None:
    """A bad path is reported even when the ids are fine, and it is the core that says so."""
    dev = np.zeros((NUM_DEV, BB), np.uint8)
    host = np.zeros((NUM_HOST, BB), np.uint8)
    with pytest.raises(ops.SwapOpError, match=r"^swap_per_layer: path = 4 must be -1 .*3 \(staged\)"):
        capi_cpu.swap_per_layer(dev.ctypes.data, NUM_DEV, BB, host.ctypes.data, NUM_HOST, [0], [0], 0, path=4)


# ---------------------------------------------------------------------- Paddle ops (CPU)
def _paddle_call(name: str, tensors: list, host: np.ndarray, mode: int, **kw: Any) -> None:
    if name == "swap_cache_per_layer":
        ops.swap_cache_per_layer(tensors[0], host.ctypes.data, NUM_HOST, DEV_IDS, HOST_IDS, 0, mode, **kw)
    elif name == "swap_cache_per_layer_async":
        ops.swap_cache_per_layer_async(tensors[0], host.ctypes.data, NUM_HOST, DEV_IDS, HOST_IDS, 0, mode, 0, **kw)
    elif name == "swap_cache_all_layers":
        ops.swap_cache_all_layers(tensors[:1], [host.ctypes.data], NUM_HOST, DEV_IDS, HOST_IDS, 0, mode, 0, **kw)
    else:
        ops.swap_cache_layout(tensors[:1], host.ctypes.data, [NUM_DEV, BB], DEV_IDS, HOST_IDS, 0, mode, 0,
                              NUM_HOST, **kw)


PADDLE_OPS = ["swap_cache_per_layer", "swap_cache_per_layer_async", "swap_cache_all_layers", "swap_cache_layout"]


@pytest.mark.parametrize("name", PADDLE_OPS)
@pytest.mark.parametrize("path", [None, -1, 0, 1, 2, 3, "dma", "kernel", "auto", "staged"], ids=repr)
def test_paddle_ops_accept_and_ignore_path_on_cpu(paddle_ops: Any, name: str, path: Any) -> None:
    rng = np.random.default_rng(21)
    src = rng.integers(0, 256, (NUM_DEV, BB), dtype=np.uint8)
    cache = paddle_ops.to_tensor(src)
    host = np.zeros((NUM_HOST, BB), np.uint8)
    _paddle_call(name, [cache], host, ops.CopyDirection.DEVICE_TO_HOST, path=path)
    np.testing.assert_array_equal(host[HOST_IDS], src[DEV_IDS])
    assert ops.paddle_ops_capi().last_path() == ops.PATH_CPU


@pytest.mark.parametrize("name", PADDLE_OPS)
@pytest.mark.parametrize("bad", [4, -5, "fast", 0.5], ids=repr)
def test_paddle_ops_reject_bad_path_and_write_nothing(paddle_ops: Any, name: str, bad: Any) -> None:
    rng = np.random.default_rng(22)
    cache = paddle_ops.to_tensor(rng.integers(0, 256, (NUM_DEV, BB), dtype=np.uint8))
    host = rng.integers(0, 256, (NUM_HOST, BB), dtype=np.uint8)
    host0 = host.copy()
    with pytest.raises(ops.SwapOpError) as info:
        _paddle_call(name, [cache], host, ops.CopyDirection.DEVICE_TO_HOST, path=bad)
    assert (info.value.op, info.value.argument, info.value.index) == (name, "path", None)
    np.testing.assert_array_equal(host, host0)


def test_paddle_ops_without_path_follow_the_design_attributes(paddle_ops: Any) -> None:
    """Calls with only FastDeploy's attributes (no trailing ``path``) work as before."""
    src = (np.arange(NUM_DEV * BB) % 251).astype(np.uint8).reshape(NUM_DEV, BB)
    cache = paddle_ops.to_tensor(src)
    host = np.zeros((NUM_HOST, BB), np.uint8)
    ops.swap_cache_per_layer(cache, host.ctypes.data, NUM_HOST, DEV_IDS, HOST_IDS, 0, ops.CopyDirection.DEVICE_TO_HOST)
    np.testing.assert_array_equal(host[HOST_IDS], src[DEV_IDS])
    with pytest.raises(TypeError):  # path is keyword-only: no positional slot shifts
        ops.swap_cache_all_layers([cache], [host.ctypes.data], NUM_HOST, DEV_IDS, HOST_IDS, 0, 0, 0, 2)  # type: ignore[misc]
