"""The C ABI on CuPy device memory and pinned host memory: the CPU correctness matrix on
every copy path (kernel, DMA batch, merged memcpy), stream semantics of the async ops,
and a compute-sanitizer memcheck run.  Skipped off-GPU (see conftest.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fastdeploy_kvcache import ops
from swap_reference import PATTERNS, expected_after_swap, id_patterns

pytestmark = pytest.mark.gpu

NUM_DEV, NUM_HOST = 24, 32
BLOCK_BYTES = [4096, 16, 24, 6, 1, 4100, 256 << 10]
PATHS = {"kernel": 1, "dma": 2, "auto": 0}


@pytest.fixture
def copy_path(capi):
    """Force a copy path for one test; restores the options afterwards."""
    saved = {k: capi.get_option(k) for k in ("copy_path", "merge_min_bytes", "dma_min_bytes")}

    def use(name: str, merge_min_bytes: int | None = None) -> None:
        capi.set_option("copy_path", PATHS[name])
        if merge_min_bytes is not None:
            capi.set_option("merge_min_bytes", merge_min_bytes)

    yield use
    for k, v in saved.items():
        capi.set_option(k, v)


def _dev_random(cupy, shape, seed: int):
    rng = np.random.default_rng(seed)
    return cupy.asarray(rng.integers(0, 256, shape, dtype=np.uint8))


@pytest.mark.parametrize("path", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("block_bytes", BLOCK_BYTES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_per_layer_matrix(cupy, capi, pinned, cuda_stream, copy_path, path, block_bytes, pattern, mode) -> None:
    copy_path(path)
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, np.random.default_rng(block_bytes + mode))[pattern]
    dev = _dev_random(cupy, (NUM_DEV, block_bytes), 1)
    host = pinned(NUM_HOST * block_bytes).reshape(NUM_HOST, block_bytes)
    want_dev, want_host = expected_after_swap(cupy.asnumpy(dev), host, dev_ids, host_ids, mode)
    stream = cuda_stream()
    capi.swap_per_layer(dev.data.ptr, NUM_DEV, block_bytes, host.ctypes.data, NUM_HOST, dev_ids, host_ids, mode,
                        stream=stream)
    used = capi.last_path()
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(dev), want_dev)
    np.testing.assert_array_equal(host, want_host)
    if not dev_ids:
        assert used == 0
    elif path == "dma":
        assert used == ops.PATH_DMA
    elif path == "kernel":
        assert used & ~(ops.PATH_KERNEL | ops.PATH_MEMCPY) == 0 and used != 0


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_merged_runs_use_memcpy(cupy, capi, pinned, cuda_stream, copy_path, path, mode) -> None:
    """Consecutive ids with merge_min_bytes=0: the kernel path sends every run to
    cudaMemcpyAsync; the DMA path batches them."""
    copy_path(path, merge_min_bytes=0)
    bb = 4096
    dev = _dev_random(cupy, (NUM_DEV, bb), 2)
    host = pinned(NUM_HOST * bb).reshape(NUM_HOST, bb)
    dev_ids, host_ids = list(range(4, 14)), list(range(0, 10))
    want_dev, want_host = expected_after_swap(cupy.asnumpy(dev), host, dev_ids, host_ids, mode)
    s = cuda_stream()
    capi.swap_per_layer(dev.data.ptr, NUM_DEV, bb, host.ctypes.data, NUM_HOST, dev_ids, host_ids, mode, stream=s)
    assert capi.last_path() == (ops.PATH_MEMCPY if path == "kernel" else ops.PATH_DMA)
    s.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(dev), want_dev)
    np.testing.assert_array_equal(host, want_host)


@pytest.mark.parametrize("path", ["kernel", "dma", "auto"])
@pytest.mark.parametrize("pattern", ["consecutive", "scattered", "runs"])
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_all_layers_mixed_block_sizes(cupy, capi, pinned, cuda_stream, copy_path, path, pattern, mode) -> None:
    copy_path(path)
    sizes = [2048, 2048, 32, 32, 2048, 2048, 12, 12]  # K/V caches and scale caches
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, np.random.default_rng(7))[pattern]
    devs = [_dev_random(cupy, (NUM_DEV, b), 10 + i) for i, b in enumerate(sizes)]
    hosts = [pinned(NUM_HOST * b).reshape(NUM_HOST, b) for b in sizes]
    want_devs, want_hosts = zip(
        *(expected_after_swap(cupy.asnumpy(d), h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts))
    )
    s = cuda_stream()
    capi.swap_all_layers([d.data.ptr for d in devs], [h.ctypes.data for h in hosts], NUM_DEV, sizes, NUM_HOST,
                         dev_ids, host_ids, mode, stream=s)
    s.synchronize()
    for d, wd in zip(devs, want_devs):
        np.testing.assert_array_equal(cupy.asnumpy(d), wd)
    for h, wh in zip(hosts, want_hosts):
        np.testing.assert_array_equal(h, wh)


@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("pattern", ["consecutive", "scattered", "single", "empty"])
def test_layout_round_trip(cupy, capi, pinned, cuda_stream, copy_path, path, pattern) -> None:
    copy_path(path)
    sizes = [1024, 1024, 1024, 1024, 16, 16]
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, np.random.default_rng(9))[pattern]
    devs = [_dev_random(cupy, (NUM_DEV, b), 30 + i) for i, b in enumerate(sizes)]
    host = pinned(NUM_HOST * sum(sizes)).reshape(NUM_HOST, sum(sizes))
    want = host.copy()
    offsets = np.cumsum([0] + sizes[:-1])
    for d, off, b in zip(devs, offsets, sizes):
        want[host_ids, off:off + b] = cupy.asnumpy(d)[dev_ids]
    s = cuda_stream()
    capi.swap_layout([d.data.ptr for d in devs], NUM_DEV, sizes, host.ctypes.data, NUM_HOST, dev_ids, host_ids,
                     ops.CopyDirection.DEVICE_TO_HOST, stream=s)
    s.synchronize()
    np.testing.assert_array_equal(host, want)
    fresh = [cupy.zeros((NUM_DEV, b), np.uint8) for b in sizes]
    capi.swap_layout([f.data.ptr for f in fresh], NUM_DEV, sizes, host.ctypes.data, NUM_HOST, dev_ids, host_ids,
                     ops.CopyDirection.HOST_TO_DEVICE, stream=s, sync=True)
    for f, d in zip(fresh, devs):
        np.testing.assert_array_equal(cupy.asnumpy(f)[dev_ids], cupy.asnumpy(d)[dev_ids])


def test_validation_error_writes_nothing_on_gpu(cupy, capi, pinned) -> None:
    dev = _dev_random(cupy, (NUM_DEV, 64), 3)
    host = pinned(NUM_HOST * 64).reshape(NUM_HOST, 64)
    dev0, host0 = cupy.asnumpy(dev), host.copy()
    with pytest.raises(ops.SwapOpError) as info:
        capi.swap_per_layer(dev.data.ptr, NUM_DEV, 64, host.ctypes.data, NUM_HOST, [1, 2, 3], [4, 5, 4], 0,
                            sync=True)
    assert (info.value.argument, info.value.index) == ("host_ids", 2)
    cupy.cuda.runtime.deviceSynchronize()
    np.testing.assert_array_equal(cupy.asnumpy(dev), dev0)
    np.testing.assert_array_equal(host, host0)


# ----------------------------------------------------------------------------- streams
@pytest.mark.parametrize("path", ["kernel", "dma"])
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_copy_completes_on_transfer_stream_while_compute_stream_is_busy(
    cupy, capi, pinned, cuda_stream, copy_path, blocker, path, mode
) -> None:
    copy_path(path)
    compute, transfer = cuda_stream(), cuda_stream()
    bb = 8192
    dev = _dev_random(cupy, (NUM_DEV, bb), 4)
    host = pinned(NUM_HOST * bb).reshape(NUM_HOST, bb)
    dev_ids, host_ids = [5, 1, 17, 3], [0, 9, 2, 30]
    want_dev, want_host = expected_after_swap(cupy.asnumpy(dev), host, dev_ids, host_ids, mode)
    cupy.cuda.runtime.deviceSynchronize()
    blocker.block(compute)
    try:
        capi.swap_per_layer(dev.data.ptr, NUM_DEV, bb, host.ctypes.data, NUM_HOST, dev_ids, host_ids, mode,
                            stream=transfer)
        done = transfer.record()
        done.synchronize()  # would hang (until the safety cap) if the copy ran on `compute`
        assert not compute.done, "the compute stream must still be busy"
        np.testing.assert_array_equal(cupy.asnumpy(dev) if mode == ops.CopyDirection.HOST_TO_DEVICE else host,
                                      want_dev if mode == ops.CopyDirection.HOST_TO_DEVICE else want_host)
    finally:
        blocker.release()
    compute.synchronize()


@pytest.mark.parametrize("entry", ["per_layer", "all_layers", "layout"])
def test_async_ops_never_synchronize(cupy, capi, pinned, cuda_stream, blocker, entry) -> None:
    """Enqueue behind a blocked stream: the call returns while the stream is still busy,
    and the copy lands once the stream is released."""
    s = cuda_stream()
    bb = 4096
    dev = _dev_random(cupy, (NUM_DEV, bb), 5)
    host = pinned(NUM_HOST * bb).reshape(NUM_HOST, bb)
    want = cupy.asnumpy(dev)[[3, 7]]
    cupy.cuda.runtime.deviceSynchronize()
    blocker.block(s)
    try:
        if entry == "per_layer":
            capi.swap_per_layer(dev.data.ptr, NUM_DEV, bb, host.ctypes.data, NUM_HOST, [3, 7], [1, 2], 0, stream=s)
        elif entry == "all_layers":
            capi.swap_all_layers([dev.data.ptr], [host.ctypes.data], NUM_DEV, bb, NUM_HOST, [3, 7], [1, 2], 0,
                                 stream=s)
        else:
            capi.swap_layout([dev.data.ptr], NUM_DEV, bb, host.ctypes.data, NUM_HOST, [3, 7], [1, 2], 0, stream=s)
        assert not s.done, "the op returned with its stream still blocked: it did not synchronize"
    finally:
        blocker.release()
    s.synchronize()
    np.testing.assert_array_equal(host[[1, 2]], want)


def test_many_inflight_calls_reuse_scratch_safely(cupy, capi, pinned, cuda_stream, copy_path, blocker) -> None:
    """250 kernel-path calls queued behind a blocked stream (the scratch ring grows to
    that many slots instead of blocking the host) each keep their own id table."""
    copy_path("kernel")
    s = cuda_stream()
    bb = 64
    dev = _dev_random(cupy, (NUM_DEV, bb), 6)
    host = pinned(NUM_HOST * bb).reshape(NUM_HOST, bb)
    cupy.cuda.runtime.deviceSynchronize()
    rng = np.random.default_rng(0)
    expected = host.copy()
    src = cupy.asnumpy(dev)
    blocker.block(s)
    try:
        for _ in range(250):
            d = rng.choice(NUM_DEV, 3, replace=False)
            h = rng.choice(NUM_HOST, 3, replace=False)
            expected[h] = src[d]
            capi.swap_per_layer(dev.data.ptr, NUM_DEV, bb, host.ctypes.data, NUM_HOST, d, h, 0, stream=s)
    finally:
        blocker.release()
    s.synchronize()
    np.testing.assert_array_equal(host, expected)


# ----------------------------------------------------------------------------- sanitizer
def test_compute_sanitizer_memcheck_is_clean(capi) -> None:
    tool = shutil.which("compute-sanitizer")
    if tool is None:
        pytest.skip("needs compute-sanitizer on PATH (CUDA toolkit) to run memcheck")
    script = Path(__file__).with_name("memcheck_smoke.py")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    proc = subprocess.run([tool, "--tool", "memcheck", "--error-exitcode", "9", "--leak-check", "no",
                           sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]


@pytest.mark.parametrize("entry", ["per_layer", "all_layers", "layout"])
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_pageable_host_memory_never_reaches_the_kernel(cupy, capi, cuda_stream, copy_path, entry, mode) -> None:
    """numpy (pageable) host buffers: the kernel cannot dereference them, so the op falls
    back to one cudaMemcpyAsync per run and the bytes still arrive."""
    copy_path("kernel")
    bb = 4096
    dev = _dev_random(cupy, (NUM_DEV, bb), 8)
    host = np.random.default_rng(8).integers(0, 256, (NUM_HOST, bb), dtype=np.uint8)
    dev_ids, host_ids = [3, 9, 4, 20], [7, 0, 31, 2]
    want_dev, want_host = expected_after_swap(cupy.asnumpy(dev), host, dev_ids, host_ids, mode)
    s = cuda_stream()
    if entry == "per_layer":
        capi.swap_per_layer(dev.data.ptr, NUM_DEV, bb, host.ctypes.data, NUM_HOST, dev_ids, host_ids, mode, stream=s)
    elif entry == "all_layers":
        capi.swap_all_layers([dev.data.ptr], [host.ctypes.data], NUM_DEV, bb, NUM_HOST, dev_ids, host_ids, mode,
                             stream=s)
    else:
        capi.swap_layout([dev.data.ptr], NUM_DEV, bb, host.ctypes.data, NUM_HOST, dev_ids, host_ids, mode, stream=s)
    assert capi.last_path() == ops.PATH_MEMCPY
    s.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(dev), want_dev)
    np.testing.assert_array_equal(host, want_host)
