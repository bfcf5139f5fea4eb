"""Short run of every C ABI op and copy path, for `compute-sanitizer --tool memcheck`
(driven by test_swap_gpu.py::test_compute_sanitizer_memcheck_is_clean; also runnable by
hand: `compute-sanitizer --tool memcheck python3 tests/gpu/memcheck_smoke.py`)."""

from __future__ import annotations

import ctypes
import sys

import cupy as cp
import numpy as np

from fastdeploy_kvcache import ops


def host_view(ptr: int, rows: int, row_bytes: int) -> np.ndarray:
    """A (rows, row_bytes) uint8 view of pinned memory at ``ptr``."""
    return np.ctypeslib.as_array((ctypes.c_uint8 * (rows * row_bytes)).from_address(ptr)).reshape(rows, row_bytes)


def main() -> int:
    capi = ops.load_capi(variant="cuda")
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    num_dev, num_host = 16, 20
    ptrs = []
    # (copy_path, copy_kernel): every kernel variant, the DMA batch, the staged path, and auto.
    for path, kernel in ((1, 0), (1, 1), (1, 2), (1, 3), (2, 0), (3, 0), (0, 0)):
        capi.set_option("copy_path", path)
        capi.set_option("copy_kernel", kernel)
        for bb in (4096, 24, 6, 1 << 20):
            dev = cp.asarray(rng.integers(0, 256, (num_dev, bb), dtype=np.uint8))
            hp = capi.host_alloc(num_host * bb)
            ptrs.append(hp)
            host = host_view(hp, num_host, bb)
            host[:] = 0
            d_ids = rng.choice(num_dev, 6, replace=False)
            h_ids = rng.choice(num_host, 6, replace=False)
            capi.swap_per_layer(dev.data.ptr, num_dev, bb, hp, num_host, d_ids, h_ids, 0, stream=stream, sync=True)
            assert (host[h_ids] == cp.asnumpy(dev)[d_ids]).all()
            dev[:] = 0
            capi.swap_per_layer(dev.data.ptr, num_dev, bb, hp, num_host, d_ids, h_ids, 1, stream=stream, sync=True)
            assert (cp.asnumpy(dev)[d_ids] == host[h_ids]).all()
            capi.swap_all_layers([dev.data.ptr] * 1, [hp], num_dev, bb, num_host, list(range(4)), list(range(3, 7)),
                                 0, stream=stream, sync=True)
            capi.swap_layout([dev.data.ptr], num_dev, bb, hp, num_host, [num_dev - 1], [num_host - 1], 1,
                             stream=stream, sync=True)
            # A layer stack: on the kernel its span after group 0 launches overlapped with
            # group 0's kernel (programmatic dependent launch).
            layers = [cp.asarray(rng.integers(0, 256, (num_dev, bb), dtype=np.uint8)) for _ in range(4)]
            stack_host = [capi.host_alloc(num_host * bb) for _ in layers]
            ptrs.extend(stack_host)
            capi.layer_stack_call(None, [d.data.ptr for d in layers], stack_host, 1, num_dev, bb, num_host, 0,
                                  stream=stream).run(d_ids, h_ids, sync=True)
            for d, hp_l in zip(layers, stack_host):
                got = host_view(hp_l, num_host, bb)
                assert (got[h_ids] == cp.asnumpy(d)[d_ids]).all()
                d[:] = 0
            capi.layer_stack_call(None, [d.data.ptr for d in layers], stack_host, 1, num_dev, bb, num_host, 1,
                                  stream=stream).run(d_ids, h_ids, sync=True)
            for d, hp_l in zip(layers, stack_host):
                got = host_view(hp_l, num_host, bb)
                assert (cp.asnumpy(d)[d_ids] == got[h_ids]).all()
    cp.cuda.runtime.deviceSynchronize()
    for p in ptrs:
        capi.host_free(p)
    print("memcheck smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
