"""DMA as 2D rows: tensors at one pitch on both sides (the worker's slab caches) move a run of
blocks of every tensor as one ``cudaMemcpy2DAsync`` (``ops.PATH_DMA_ROWS``), and anything
short of one pitch takes the per-tensor DMA batch.  Every case checks every byte against a
numpy model, including the bytes between the moved blocks (a row written too wide or at the
wrong pitch lands there)."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from fastdeploy_kvcache import ops

pytestmark = pytest.mark.gpu

LANES, NUM_DEV, NUM_HOST = 6, 24, 20
DEFAULT_MIN_LANES = 16  # dma_rows_min_lanes: fewer tensors take the batch (docs/ops.md)


@pytest.fixture(autouse=True)
def rows_from_three_lanes(capi):
    """These tests use LANES tensors: rows from 3 tensors on (restored afterwards)."""
    saved = capi.get_option("dma_rows_min_lanes")
    assert saved == DEFAULT_MIN_LANES
    capi.set_option("dma_rows_min_lanes", 3)
    yield
    capi.set_option("dma_rows_min_lanes", saved)


def _slab(cupy, capi, pinned, block_bytes: int, dev_gap: int = 0, host_gap: int = 0, seed: int = 0):
    """LANES device tensors carved from one CuPy array and LANES host tensors from one pinned
    buffer, each side at one pitch (a tensor plus ``*_gap`` spare blocks)."""
    rng = np.random.default_rng(seed)
    dev_pitch_blocks, host_pitch_blocks = NUM_DEV + dev_gap, NUM_HOST + host_gap
    dev = cupy.asarray(rng.integers(0, 256, (LANES, dev_pitch_blocks, block_bytes), dtype=np.uint8))
    host = pinned(LANES * host_pitch_blocks * block_bytes).reshape(LANES, host_pitch_blocks, block_bytes)
    host[:] = rng.integers(0, 256, host.shape, dtype=np.uint8)
    dev_ptrs = [dev[l].data.ptr for l in range(LANES)]
    host_ptrs = [host[l].ctypes.data for l in range(LANES)]
    return dev, host, dev_ptrs, host_ptrs


def _swap(cupy, capi, stream, dev, host, dev_ptrs, host_ptrs, block_bytes, dev_ids, host_ids, mode, path) -> int:
    """One all-layer call; checks every byte of both sides against the model; returns last_path()."""
    want_dev, want_host = cupy.asnumpy(dev), host.copy()
    for l in range(LANES):
        if mode == ops.CopyDirection.DEVICE_TO_HOST:
            want_host[l, host_ids] = want_dev[l, dev_ids]
        else:
            want_dev[l, dev_ids] = want_host[l, host_ids]
    capi.swap_all_layers(dev_ptrs, host_ptrs, NUM_DEV, block_bytes, NUM_HOST, dev_ids, host_ids, mode,
                         stream=stream, path=path)
    used = capi.last_path()
    stream.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(dev), want_dev)
    np.testing.assert_array_equal(host, want_host)
    return used


ROWS = ops.PATH_DMA | ops.PATH_DMA_ROWS

ID_SETS = {
    # (device ids, host ids): scattered pairs, a host run with scattered device ids, and both
    # sides consecutive (one merged run: one 2D copy as wide as four blocks).
    "scattered": ([5, 1, 9, 3, 12, 0, 7], [2, 8, 4, 0, 11, 6, 14]),
    "host_run": ([17, 3, 11, 6, 22], [7, 8, 9, 10, 11]),
    "merged_run": ([4, 5, 6, 7], [12, 13, 14, 15]),
}


@pytest.mark.parametrize("ids", sorted(ID_SETS))
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
@pytest.mark.parametrize("block_bytes", [64 << 10, 128 << 10, 96 << 10])
@pytest.mark.parametrize("gaps", [(0, 0), (3, 1)], ids=["packed", "gaps"])
def test_lanes_at_one_pitch_move_as_rows(cupy, capi, pinned, cuda_stream, ids, mode, block_bytes, gaps) -> None:
    dev, host, dev_ptrs, host_ptrs = _slab(cupy, capi, pinned, block_bytes, *gaps, seed=block_bytes + mode)
    d, h = ID_SETS[ids]
    for path in ("dma", "auto"):  # auto: copies >= dma_min_bytes at one pitch stay on DMA
        used = _swap(cupy, capi, cuda_stream(), dev, host, dev_ptrs, host_ptrs, block_bytes, d, h, mode, path)
        assert used == ROWS, f"{path}: last_path()={used}"


def test_the_default_needs_sixteen_tensors(cupy, capi, pinned, cuda_stream) -> None:
    """Rows pay per row in the copy engines (0.73-0.87 of the link with 3-8 tensors of 128
    KiB blocks against 0.95-0.97 for the batch): by default only 16 or more go as rows."""
    capi.set_option("dma_rows_min_lanes", DEFAULT_MIN_LANES)
    bb, lanes, n = 64 << 10, 16, 8
    dev = cupy.asarray(np.random.default_rng(5).integers(0, 256, (lanes, n, bb), dtype=np.uint8))
    host = pinned(lanes * n * bb).reshape(lanes, n, bb)
    stream = cuda_stream()
    for count, want in ((lanes - 1, ops.PATH_DMA), (lanes, ROWS)):
        host[:] = 0
        capi.swap_all_layers([dev[l].data.ptr for l in range(count)], [host[l].ctypes.data for l in range(count)],
                             n, bb, n, [3, 0, 6], [1, 2, 7], ops.CopyDirection.DEVICE_TO_HOST, stream=stream, path="dma")
        used = capi.last_path()
        stream.synchronize()
        assert used == want, f"{count} tensors: last_path()={used}"
        np.testing.assert_array_equal(host[:count, [1, 2, 7]], cupy.asnumpy(dev[:count, [3, 0, 6]]))
        assert not host[count:].any()


DEFAULT_ROWS_D2H_MIN_BYTES = 256 << 10  # rows_d2h_min_bytes: narrower device-to-host rows may stage


@pytest.mark.parametrize(
    "mode,rows_d2h_min_bytes,want",
    [
        (ops.CopyDirection.HOST_TO_DEVICE, DEFAULT_ROWS_D2H_MIN_BYTES, ROWS),  # host to device: rows at any width
        (ops.CopyDirection.DEVICE_TO_HOST, DEFAULT_ROWS_D2H_MIN_BYTES, ops.PATH_STAGED),  # 128 KiB rows write host memory slowly
        (ops.CopyDirection.DEVICE_TO_HOST, 128 << 10, ROWS),  # from 128 KiB on: rows again
    ],
)
def test_auto_at_one_pitch_stages_only_narrow_device_to_host_rows(cupy, capi, pinned, cuda_stream, mode,
                                                                  rows_d2h_min_bytes, want) -> None:
    """The staged rule takes all-layer-sized calls (>= 64 MiB, host runs) of any block size
    when the tensors are spread out; at one pitch the same call stays on DMA rows, except
    device to host with rows narrower than ``rows_d2h_min_bytes``."""
    saved = capi.get_option("rows_d2h_min_bytes")
    assert saved == DEFAULT_ROWS_D2H_MIN_BYTES
    capi.set_option("rows_d2h_min_bytes", rows_d2h_min_bytes)
    try:
        bb, lanes, n = 128 << 10, 32, 20  # 32 tensors x 20 blocks x 128 KiB = 80 MiB, one host run
        dev = cupy.zeros((lanes, 2 * n, bb), dtype=cupy.uint8)
        host = pinned(lanes * n * bb).reshape(lanes, n, bb)
        if mode == ops.CopyDirection.DEVICE_TO_HOST:
            dev[:, :n] = 7
            host[:] = 0
        else:
            host[:] = 7
        dev_ids = [int(i) for i in np.random.default_rng(3).permutation(n)]
        stream = cuda_stream()
        capi.swap_all_layers([dev[l].data.ptr for l in range(lanes)], [host[l].ctypes.data for l in range(lanes)],
                             2 * n, bb, n, dev_ids, list(range(n)), mode, stream=stream, path="auto")
        used = capi.last_path()
        stream.synchronize()
        assert used == want, f"last_path()={used}"
        if mode == ops.CopyDirection.DEVICE_TO_HOST:
            assert (host == 7).all()
            # The same call over the slab's tensors in reverse order (a negative pitch) goes staged.
            spread = [dev[l].data.ptr for l in reversed(range(lanes))]
            capi.swap_all_layers(spread, [host[l].ctypes.data for l in range(lanes)], 2 * n, bb, n, dev_ids,
                                 list(range(n)), ops.CopyDirection.DEVICE_TO_HOST, stream=stream, path="auto")
            assert capi.last_path() == ops.PATH_STAGED
            stream.synchronize()
        else:
            assert (cupy.asnumpy(dev[:, dev_ids]) == 7).all()
            assert not cupy.asnumpy(dev[:, [i for i in range(2 * n) if i not in dev_ids]]).any()
    finally:
        capi.set_option("rows_d2h_min_bytes", saved)


@pytest.mark.parametrize(
    "layout",
    ["two_lanes", "one_lane_off_pitch", "sizes_differ", "descending"],
)
def test_lanes_short_of_one_pitch_take_the_batch(cupy, capi, pinned, cuda_stream, layout) -> None:
    """Each way of missing "one pitch" gets the per-tensor batch (and the right bytes)."""
    bb = 128 << 10
    dev, host, dev_ptrs, host_ptrs = _slab(cupy, capi, pinned, bb, dev_gap=1, host_gap=1, seed=11)
    lanes = list(range(LANES))
    block_bytes: Any = bb
    if layout == "two_lanes":  # too few tensors for a row to pay
        lanes = [0, 1]
    elif layout == "one_lane_off_pitch":  # lanes 0, 1, 2, 4, 5: a hole breaks the pitch
        lanes = [0, 1, 2, 4, 5]
    elif layout == "descending":  # a negative pitch
        lanes = list(reversed(lanes))
    dp = [dev_ptrs[l] for l in lanes]
    hp = [host_ptrs[l] for l in lanes]
    if layout == "sizes_differ":  # the last tensor's blocks are half as big
        block_bytes = [bb] * (LANES - 1) + [bb // 2]
    d, h = ID_SETS["scattered"]
    want_host = host.copy()
    want_dev = cupy.asnumpy(dev)
    for i, l in enumerate(lanes):
        size = block_bytes[i] if isinstance(block_bytes, list) else bb
        # A tensor of `size`-byte blocks over the same memory.
        want_host[l].reshape(-1, size)[h] = want_dev[l].reshape(-1, size)[d]
    stream = cuda_stream()
    capi.swap_all_layers(dp, hp, NUM_DEV, block_bytes, NUM_HOST, d, h, ops.CopyDirection.DEVICE_TO_HOST, stream=stream, path="dma")
    used = capi.last_path()
    stream.synchronize()
    assert used == ops.PATH_DMA, f"last_path()={used}"
    np.testing.assert_array_equal(host, want_host)


def test_the_worker_caches_sit_at_one_pitch(cupy, capi) -> None:
    """The worker's device cache (CuPy backend) and host cache are slabs at one pitch, so its
    all-layer evictions of big blocks go as rows."""
    from fastdeploy_kvcache.config import CacheConfig
    from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata
    from fastdeploy_kvcache.worker import CacheController

    # 8 layers x (key, value) = 16 tensors of 128 KiB blocks: the default's rows.
    capi.set_option("dma_rows_min_lanes", DEFAULT_MIN_LANES)
    config = CacheConfig(num_layers=8, num_kv_heads=8, block_size=64, head_dim=128, dtype="float16")
    ctrl = CacheController(config, backend="cupy", d2h_copy_path="dma")
    try:
        caches = ctrl.initialize_kv_cache(16)
        ctrl.initialize_host_cache(16)
        dev_ptrs = [c.data.ptr for c in caches]
        host_ptrs = [ctrl.get_host_cache_kvs_map()[name] for name in ctrl.get_kv_caches()]
        assert len({b - a for a, b in zip(dev_ptrs, dev_ptrs[1:])}) == 1
        assert len({b - a for a, b in zip(host_ptrs, host_ptrs[1:])}) == 1
        for i, c in enumerate(caches):
            c[:] = i + 1
        ctrl.submit_swap_tasks(CacheSwapMetadata([3, 9], [5, 6], CacheLevel.DEVICE, CacheLevel.HOST), None)
        (done,) = ctrl.collect_finished(wait=True)
        assert done.success
        assert ctrl.get_stats()["d2h"]["paths"] == ROWS
        block = config.bytes_per_layer_block
        for i, ptr in enumerate(host_ptrs):
            got = np.ctypeslib.as_array((ctypes.c_uint8 * (16 * block)).from_address(ptr))
            assert (got[5 * block:7 * block].view(np.float16) == i + 1).all()
    finally:
        ctrl.close()
