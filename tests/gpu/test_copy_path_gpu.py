"""The per-call copy path on a GPU: the ``path`` argument beats the process-wide
``copy_path`` option for that one call (and only for it, also with two threads issuing
calls at once), and the worker's device->host copies take the DMA path by default while
its loads follow the process-wide rule.  CPU counterparts: tests/ops/test_ops_copy_path.py,
tests/worker/test_d2h_copy_path.py."""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import pytest

from fastdeploy_kvcache import ops
from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, TransferKind

pytestmark = pytest.mark.gpu

NUM_DEV, NUM_HOST, BB = 16, 16, 16 << 10  # 16 KiB blocks: where "auto" picks the copy kernel
# Scattered pairs (no (src+1, dst+1) neighbours), so no run merging decides the path.
DEV_IDS = [5, 1, 9, 3, 12, 0, 7]
HOST_IDS = [2, 8, 4, 0, 11, 6, 14]


@pytest.fixture
def process_path(capi):
    """Set the process-wide copy_path option for one test; restored afterwards."""
    saved = capi.get_option("copy_path")
    yield lambda value: capi.set_option("copy_path", value)
    capi.set_option("copy_path", saved)


def _run(cupy, capi, pinned, stream, entry: str, mode: int, path: Any) -> int:
    """One call of ``entry`` with ``path``; checks the bytes, returns ``last_path()``."""
    rng = np.random.default_rng(len(entry) * 10 + mode)
    devs = [cupy.asarray(rng.integers(0, 256, (NUM_DEV, BB), dtype=np.uint8)) for _ in range(2)]
    if entry == "layout":
        host = pinned(NUM_HOST * 2 * BB).reshape(NUM_HOST, 2, BB)
        host_views = [host[:, 0], host[:, 1]]
    else:
        hosts = [pinned(NUM_HOST * BB).reshape(NUM_HOST, BB) for _ in range(2)]
        host_views = hosts
    if entry == "per_layer":
        devs, host_views = devs[:1], host_views[:1]
    want_dev = [cupy.asnumpy(d) for d in devs]
    want_host = [h.copy() for h in host_views]
    for wd, wh in zip(want_dev, want_host):
        if mode == ops.CopyDirection.DEVICE_TO_HOST:
            wh[HOST_IDS] = wd[DEV_IDS]
        else:
            wd[DEV_IDS] = wh[HOST_IDS]
    if entry == "per_layer":
        capi.swap_per_layer(devs[0].data.ptr, NUM_DEV, BB, hosts[0].ctypes.data, NUM_HOST, DEV_IDS, HOST_IDS, mode,
                            stream=stream, path=path)
    elif entry == "all_layers":
        capi.swap_all_layers([d.data.ptr for d in devs], [h.ctypes.data for h in hosts], NUM_DEV, BB, NUM_HOST,
                             DEV_IDS, HOST_IDS, mode, stream=stream, path=path)
    else:
        capi.swap_layout([d.data.ptr for d in devs], NUM_DEV, BB, host.ctypes.data, NUM_HOST, DEV_IDS, HOST_IDS,
                         mode, stream=stream, path=path)
    used = capi.last_path()
    stream.synchronize()
    for d, wd in zip(devs, want_dev):
        np.testing.assert_array_equal(cupy.asnumpy(d), wd)
    for h, wh in zip(host_views, want_host):
        np.testing.assert_array_equal(h, wh)
    return used


def test_ids_are_scattered() -> None:
    pairs = set(zip(DEV_IDS, HOST_IDS))
    assert not any((d + 1, h + 1) in pairs for d, h in pairs)


@pytest.mark.parametrize("entry", ["per_layer", "all_layers", "layout"])
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
@pytest.mark.parametrize(
    "process,call,want",
    [
        (1, "dma", ops.PATH_DMA),          # the case: process says kernel, the call says DMA
        (1, ops.COPY_PATH_DMA, ops.PATH_DMA),
        (1, None, ops.PATH_KERNEL),        # no override: the process option
        (1, "process", ops.PATH_KERNEL),
        (2, "kernel", ops.PATH_KERNEL),
        (2, None, ops.PATH_DMA),
        (1, "auto", ops.PATH_KERNEL),      # the size rule at 16 KiB
        (0, "dma", ops.PATH_DMA),
    ],
    ids=lambda v: repr(v),
)
def test_per_call_path_overrides_the_process_option(cupy, capi, pinned, cuda_stream, process_path, entry, mode,
                                                    process, call, want) -> None:
    process_path(process)
    used = _run(cupy, capi, pinned, cuda_stream(), entry, mode, call)
    assert used == want, f"last_path()={used}, want {want}"
    assert capi.get_option("copy_path") == process  # the call left the option alone


def test_bad_path_raises_before_any_copy(cupy, capi, pinned, cuda_stream) -> None:
    dev = cupy.zeros((NUM_DEV, BB), dtype=cupy.uint8)
    host = pinned(NUM_HOST * BB).reshape(NUM_HOST, BB)
    before = host.copy()
    for bad in (4, -2, "fast"):
        with pytest.raises(ops.SwapOpError) as info:
            capi.swap_per_layer(dev.data.ptr, NUM_DEV, BB, host.ctypes.data, NUM_HOST, DEV_IDS, HOST_IDS,
                                ops.CopyDirection.DEVICE_TO_HOST, stream=cuda_stream(), path=bad)
        assert info.value.argument == "path"
    cupy.cuda.runtime.deviceSynchronize()
    np.testing.assert_array_equal(host, before)


def test_two_threads_on_different_paths_at_once(cupy, capi, pinned, process_path) -> None:
    """What the worker does: one launcher thread forces DMA, the other takes the process
    rule (kernel here), concurrently; each call gets its own path."""
    process_path(ops.COPY_PATH_KERNEL)
    devs = [cupy.zeros((NUM_DEV, BB), dtype=cupy.uint8) for _ in range(2)]
    hosts = [pinned(NUM_HOST * BB) for _ in range(2)]
    seen: dict[str, set[int]] = {"dma": set(), "process": set()}
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(k: int, name: str, mode: int) -> None:
        try:
            cupy.cuda.Device(0).use()
            stream = cupy.cuda.Stream(non_blocking=True)
            start.wait()
            for _ in range(40):
                capi.swap_per_layer(devs[k].data.ptr, NUM_DEV, BB, hosts[k].ctypes.data, NUM_HOST, DEV_IDS, HOST_IDS,
                                    mode, stream=stream, path=name)
                seen[name].add(capi.last_path())
            stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(0, "dma", ops.CopyDirection.DEVICE_TO_HOST)),
               threading.Thread(target=worker, args=(1, "process", ops.CopyDirection.HOST_TO_DEVICE))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert seen == {"dma": {ops.PATH_DMA}, "process": {ops.PATH_KERNEL}}


# ---------------------------------------------------------------------- the worker
def _worker(d2h_copy_path: Any = None):
    from fastdeploy_kvcache.worker import CacheController

    # 1 head x 64 tokens x 128 dims x fp16 = 16 KiB per layer block: "auto" picks the kernel.
    config = CacheConfig(num_layers=4, num_kv_heads=1, head_dim=128, block_size=64, dtype="float16",
                         num_gpu_blocks=16, num_host_blocks=16)
    ctrl = CacheController(config, backend="cupy", d2h_copy_path=d2h_copy_path)
    ctrl.initialize_kv_cache()
    ctrl.initialize_host_cache()
    return ctrl


def _step(cupy, ctrl) -> dict[str, Any]:
    """Evict (write_back), back up and load blocks with real bytes; returns the stats."""
    for layer in range(ctrl.num_layers):
        for kind, array in enumerate(ctrl.layer_caches(layer)):
            for block in (1, 2, 3, 9):
                array[block] = (block * 10 + layer * 2 + kind) % 251
    cupy.cuda.runtime.deviceSynchronize()
    ctrl.transfer_manager.reset_stats()
    ctrl.submit_swap_tasks(CacheSwapMetadata([1, 3], [4, 8], CacheLevel.DEVICE, CacheLevel.HOST,
                                             kind=TransferKind.EVICT), None)
    ctrl.submit_swap_tasks(CacheSwapMetadata([2, 9], [6, 12], CacheLevel.DEVICE, CacheLevel.HOST,
                                             kind=TransferKind.BACKUP), None)
    assert all(m.success for m in ctrl.synchronize())
    counter = ctrl.submit_swap_tasks(None, CacheSwapMetadata([4, 8, 6, 12], [10, 5, 14, 0], CacheLevel.HOST,
                                                             CacheLevel.DEVICE))
    counter.wait_all()
    assert all(m.success for m in ctrl.synchronize())
    cupy.cuda.runtime.deviceSynchronize()
    for layer in range(ctrl.num_layers):
        for kind, array in enumerate(ctrl.layer_caches(layer)):
            for src, dst in ((1, 10), (3, 5), (2, 14), (9, 0)):
                got = set(cupy.unique(array[dst]).get().tolist())
                assert got == {float((src * 10 + layer * 2 + kind) % 251)}, (layer, kind, src, dst, got)
    return ctrl.get_stats()


@pytest.mark.parametrize("process", [ops.COPY_PATH_KERNEL, ops.COPY_PATH_AUTO])
def test_worker_evictions_use_dma_by_default(cupy, capi, process_path, process) -> None:
    process_path(process)  # even a process-wide "kernel" does not put evictions on SMs
    ctrl = _worker()
    try:
        stats = _step(cupy, ctrl)
        assert stats["d2h_copy_path"] == "dma"
        # 4 layers: 8 tensors, too few for DMA rows (test_dma_rows_gpu.py): the batch.
        assert stats["d2h"]["paths"] == ops.PATH_DMA
        assert stats["h2d"]["paths"] == ops.PATH_KERNEL  # loads: the process rule (kernel at 16 KiB)
    finally:
        ctrl.close()


@pytest.mark.parametrize("setting,want", [("process", ops.PATH_KERNEL), ("kernel", ops.PATH_KERNEL),
                                          ("auto", ops.PATH_KERNEL), ("dma", ops.PATH_DMA)])
def test_worker_d2h_path_is_configurable(cupy, capi, process_path, setting, want) -> None:
    process_path(ops.COPY_PATH_AUTO)
    ctrl = _worker(d2h_copy_path=setting)
    try:
        stats = _step(cupy, ctrl)
        assert stats["d2h"]["paths"] == want
        assert stats["h2d"]["paths"] == ops.PATH_KERNEL
    finally:
        ctrl.close()
