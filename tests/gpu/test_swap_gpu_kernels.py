"""Every scattered-block kernel variant (option ``copy_kernel``) and DMA slicing give
byte-exact results on the GPU, for aligned and unaligned block sizes.  Kept apart from
test_swap_gpu.py so that a faulting variant cannot poison that file's CUDA context."""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_kvcache import ops
from swap_reference import expected_after_swap

pytestmark = pytest.mark.gpu

NUM_DEV, NUM_HOST = 40, 48


@pytest.fixture
def options(capi):
    names = ("copy_path", "copy_kernel", "copy_grid", "dma_slice_bytes", "kernel_tables")
    saved = {k: capi.get_option(k) for k in names}
    yield capi.set_option
    for k, v in saved.items():
        capi.set_option(k, v)


@pytest.mark.parametrize("variant", [0, 1, 2, 3])
@pytest.mark.parametrize("block_bytes", [4096, 16400, 24, 256 << 10])
@pytest.mark.parametrize("grid", [1, 8])
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
@pytest.mark.parametrize("tables", [0, 1])
def test_kernel_variants_all_layers(cupy, capi, pinned, cuda_stream, options, variant, block_bytes, grid, mode,
                                    tables) -> None:
    options("copy_path", 1)
    options("kernel_tables", tables)
    options("copy_kernel", variant)
    options("copy_grid", grid)
    rng = np.random.default_rng(variant * 100 + grid)
    layers = 3
    dev_ids = rng.choice(NUM_DEV, 20, replace=False).tolist()
    host_ids = rng.choice(NUM_HOST, 20, replace=False).tolist()
    devs = [cupy.asarray(rng.integers(0, 256, (NUM_DEV, block_bytes), dtype=np.uint8)) for _ in range(layers)]
    hosts = [pinned(NUM_HOST * block_bytes).reshape(NUM_HOST, block_bytes) for _ in range(layers)]
    want_devs, want_hosts = zip(
        *(expected_after_swap(cupy.asnumpy(d), h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts))
    )
    s = cuda_stream()
    capi.swap_all_layers([d.data.ptr for d in devs], [h.ctypes.data for h in hosts], NUM_DEV, block_bytes, NUM_HOST,
                         dev_ids, host_ids, mode, stream=s)
    assert capi.last_path() == ops.PATH_KERNEL
    s.synchronize()
    for d, wd in zip(devs, want_devs):
        np.testing.assert_array_equal(cupy.asnumpy(d), wd)
    for h, wh in zip(hosts, want_hosts):
        np.testing.assert_array_equal(h, wh)


@pytest.mark.parametrize("copies_per_slice", [1, 7, 256])
def test_dma_slices(cupy, capi, pinned, cuda_stream, options, copies_per_slice) -> None:
    options("copy_path", 2)
    options("dma_slice_bytes", copies_per_slice * 8192)
    dma_slice = copies_per_slice
    rng = np.random.default_rng(dma_slice)
    bb = 8192
    dev = cupy.asarray(rng.integers(0, 256, (NUM_DEV, bb), dtype=np.uint8))
    host = pinned(NUM_HOST * bb).reshape(NUM_HOST, bb)
    dev_ids = rng.choice(NUM_DEV, 30, replace=False).tolist()
    host_ids = rng.choice(NUM_HOST, 30, replace=False).tolist()
    s = cuda_stream()
    capi.swap_per_layer(dev.data.ptr, NUM_DEV, bb, host.ctypes.data, NUM_HOST, dev_ids, host_ids, 0, stream=s)
    assert capi.last_path() == ops.PATH_DMA
    s.synchronize()
    np.testing.assert_array_equal(host[host_ids], cupy.asnumpy(dev)[dev_ids])
