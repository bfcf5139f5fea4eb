"""Tensor parallelism on two GPUs: one rank process per GPU (CuPy, through the C ABI).

* the per-rank shadow-memory trace of tests/tp, with each rank's bytes checked on its GPU;
* streams, events and allocations on the controller's device, not the thread's current one
  (FastDeploy had to fix CuPy objects created on the wrong GPU);
* layer-wise loads overlapping each rank's compute, on both GPUs at once.

Never run in this repository's sessions so far: no two-GPU machine was lent.
"""

from __future__ import annotations

import os
import sys

import pytest

from skip_helpers import cuda_capi_missing

pytestmark = pytest.mark.gpu

TWO_GPU_REASON = (
    "needs 2 CUDA GPUs with CuPy and build/libfdkv_capi.so: run `bash build.sh gpu-test` on an "
    "nvidia-h200-x2 machine"
)


_why = cuda_capi_missing(min_gpus=2)
if _why is not None:
    pytest.skip(f"{TWO_GPU_REASON} ({_why})", allow_module_level=True)

import cupy as cp  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "tp"))
from tp_trace import OverlapProbe, run_tp_trace, tp_config  # noqa: E402

from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, TransferKind  # noqa: E402
from fastdeploy_kvcache.core.request import BatchRequest  # noqa: E402
from fastdeploy_kvcache.worker import CacheController  # noqa: E402
from fastdeploy_kvcache.worker.tp import TPCoordinator  # noqa: E402


@pytest.mark.parametrize("policy, seed, quant, mla", [
    ("write_back", 0, False, False),
    ("write_through", 1, True, False),
    ("write_through_selective", 2, False, True),
])
def test_trace_on_two_gpus_checks_each_ranks_bytes(policy: str, seed: int, quant: bool, mla: bool) -> None:
    counts = run_tp_trace(policy, seed, steps=45, tp_size=2, fail_p=0.3, quant=quant, mla=mla,
                          backend="cupy", devices=[0, 1], async_launch=True)
    # Completion timing steers the scheduler, so only what every run exercises is asserted
    # here; run_tp_trace checks each rank's bytes and every merged verdict.
    assert counts["d2h_blocks"] > 0, counts


@pytest.mark.parametrize("async_launch", [False, True], ids=["inline-launch", "launcher-threads"])
def test_streams_events_and_memory_live_on_the_controllers_device(async_launch: bool) -> None:
    """A controller on GPU 1 built and driven from a thread whose current device is GPU 0.

    Before the backend named its device around every creation, the events of a submit were
    made on GPU 0 and recording them on GPU 1's copy streams failed the copy.
    """
    cfg = tp_config("write_back", 1, quant=False, num_gpu_blocks=8, num_host_blocks=8)
    cp.cuda.Device(0).use()
    ctrl = CacheController(cfg, local_rank=1, device_id=1, backend="cupy", async_launch=async_launch)
    try:
        cp.cuda.Device(0).use()  # the engine thread is elsewhere from now on
        ctrl.initialize_kv_cache()
        ctrl.initialize_host_cache()
        cp.cuda.Device(0).use()
        tm = ctrl.transfer_manager
        for stream in (tm.input_stream, tm.output_stream):
            assert stream.device_id == 1
        assert all(a.device.id == 1 for layer in range(ctrl.num_layers) for a in ctrl.layer_caches(layer))
        # The compute stream is the caller's current stream on GPU 1 (-1: CuPy's null stream,
        # which belongs to whatever device is current when it is used: hence the backend's
        # `with device` around every record on it).
        assert ctrl.backend.current_stream().device_id in (1, -1)
        with cp.cuda.Device(1):
            for layer in range(ctrl.num_layers):
                for kind, array in enumerate(ctrl.layer_caches(layer)):
                    array[2] = 10 + layer * 4 + kind
            cp.cuda.Device(1).synchronize()
        cp.cuda.Device(0).use()
        out = CacheSwapMetadata([2], [5], CacheLevel.DEVICE, CacheLevel.HOST, kind=TransferKind.EVICT)
        ctrl.submit_swap_tasks(out, None)
        assert [m.success for m in ctrl.collect_finished(wait=True)] == [True], "device->host copy on GPU 1"
        load = CacheSwapMetadata([5], [6])
        counter = ctrl.submit_swap_tasks(None, load)
        counter.wait_all()
        done = ctrl.collect_finished(wait=True)
        assert [(m.task_id, m.success) for m in done] == [(load.task_id, True)], [m.error_message for m in done]
        assert cp.cuda.runtime.getDevice() == 0  # nothing switched the caller's device for good
        with cp.cuda.Device(1):
            for layer in range(ctrl.num_layers):
                for kind, array in enumerate(ctrl.layer_caches(layer)):
                    assert bool((array[6] == 10 + layer * 4 + kind).all()), (layer, kind)
    finally:
        ctrl.close()


def test_layerwise_loads_overlap_each_ranks_compute_on_both_gpus() -> None:
    cfg = tp_config("write_back", 2, quant=False, num_gpu_blocks=64, num_host_blocks=64, num_layers=8)
    with TPCoordinator(cfg, devices=[0, 1], backend="cupy", hook=OverlapProbe, async_launch=True,
                       timeout_s=60.0) as coord:
        batch = BatchRequest()
        batch.append_swap_metadata(CacheSwapMetadata(list(range(32)), list(range(32, 64))))
        result = coord.step(batch, payloads=[{"spin_ms": 50.0}] * 2, wait=True)
        assert [o["device"] for o in result.outcomes] == [0, 1]
        # Each rank's pinned host cache was placed on its own GPU's NUMA node.
        from types import SimpleNamespace

        from fastdeploy_kvcache.worker import numa

        as_cupy = SimpleNamespace(is_cuda=True, name="cupy")
        assert [i["numa_node"] for i in coord.rank_info] == [numa.gpu_numa_node(as_cupy, d) for d in (0, 1)]
        assert [o["compute_stream_device"] in (None, -1, o["device"]) for o in result.outcomes] == [True, True]
        assert all(o["overlapped"] for o in result.outcomes), result.outcomes
        assert [m.success for m in result.finished] == [True]
