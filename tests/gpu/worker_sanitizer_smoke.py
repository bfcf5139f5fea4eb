"""Short worker run for compute-sanitizer (memcheck and racecheck).

Driven by ``test_worker_cupy.py::test_compute_sanitizer_on_a_short_worker_run``; also
runnable by hand on a GPU machine:
``compute-sanitizer --tool memcheck python3 tests/gpu/worker_sanitizer_smoke.py``.
It evicts, backs up and loads blocks both ways through the CacheController (all layers in
one launch out, per layer in), with compute in between that waits on the per-layer events,
then checks the bytes.  Exit status 0 means the data was right.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy as cp  # noqa: E402

from fastdeploy_kvcache import ops  # noqa: E402
from fastdeploy_kvcache.config import CacheConfig  # noqa: E402
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, TransferKind  # noqa: E402
from fastdeploy_kvcache.worker import CacheController  # noqa: E402


def main(argv: "list[str] | None" = None) -> int:
    p = argparse.ArgumentParser(description="short worker run for compute-sanitizer")
    p.add_argument("--copy-path", default=None, choices=["auto", "kernel", "dma", "staged"],
                   help="the process-wide copy_path option the loads follow (default: the library's)")
    p.add_argument("--d2h-copy-path", default=None, help="the worker's d2h_copy_path (default: the worker's)")
    args = p.parse_args(argv)
    if args.copy_path is not None:
        ops.load_capi(variant="cuda").set_option("copy_path", ops.copy_path_code(args.copy_path))
    config = CacheConfig(num_layers=3, num_extra_layers=1, num_kv_heads=2, head_dim=16, block_size=8,
                         dtype="uint8", kv_cache_quant="int8")
    ctrl = CacheController(config, backend="cupy", d2h_copy_path=args.d2h_copy_path)
    ctrl.initialize_kv_cache(12)
    ctrl.initialize_host_cache(12)
    compute = cp.cuda.Stream(non_blocking=True)
    with compute:
        for layer in range(ctrl.num_layers):
            for kind, array in enumerate(ctrl.layer_caches(layer)):
                for block in range(12):
                    array[block] = (block * 5 + layer * 3 + kind) % 200
        want = [[a[[0, 1, 2, 3]].copy() for a in ctrl.layer_caches(layer)] for layer in range(ctrl.num_layers)]
        ctrl.submit_swap_tasks(
            CacheSwapMetadata([0, 1, 2, 3], [7, 2, 9, 4], CacheLevel.DEVICE, CacheLevel.HOST, kind=TransferKind.BACKUP),
            None,
        )
        # write_back eviction of block 11 and a load from the host blocks just written, one step
        counter = ctrl.submit_swap_tasks(
            CacheSwapMetadata([11], [11], CacheLevel.DEVICE, CacheLevel.HOST, kind=TransferKind.EVICT),
            CacheSwapMetadata([7, 2, 9, 4], [8, 5, 10, 6], CacheLevel.HOST, CacheLevel.DEVICE),
        )
        bad = cp.zeros(1, dtype=cp.int64)
        for layer in range(ctrl.num_layers):
            counter.wait_for_layer(layer)
            for array, expect in zip(ctrl.layer_caches(layer), want[layer]):
                bad += (array[[8, 5, 10, 6]] != expect).sum()
        for array in ctrl.layer_caches(0):
            array[11] = 0  # compute reuses the evicted block (fenced behind the eviction)
    finished = ctrl.collect_finished(wait=True)
    cp.cuda.runtime.deviceSynchronize()
    ok = int(bad.get()[0]) == 0 and len(finished) == 3 and all(m.success for m in finished)
    ctrl.close()
    print("worker sanitizer smoke:", "ok" if ok else f"MISMATCH bad={int(bad.get()[0])} {finished}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
