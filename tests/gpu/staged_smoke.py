"""Short run of the staged copy path for compute-sanitizer (memcheck and racecheck):
every direction and op, odd and aligned block sizes, block-major layout, ring wrap-around
with small chunks, and a call on the legacy default stream.  Driven by
``test_staged_gpu.py::test_sanitizer_staged_smoke``; by hand:
``compute-sanitizer --tool racecheck python3 tests/gpu/staged_smoke.py``."""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import cupy as cp  # noqa: E402
import numpy as np  # noqa: E402

from fastdeploy_kvcache import ops  # noqa: E402


def main() -> int:
    capi = ops.load_capi(variant="cuda")
    capi.set_option("staging_chunk_bytes", 64 << 10)
    capi.set_option("staging_bytes", 1 << 20)
    rng = np.random.default_rng(0)
    stream = cp.cuda.Stream(non_blocking=True)
    num_dev, num_host = 24, 28
    ptrs = []
    ok = True
    for bb in (4096, 24, 6, 40000, 1 << 20):
        devs = [cp.asarray(rng.integers(0, 256, (num_dev, bb), dtype=np.uint8)) for _ in range(2)]
        hosts = []
        for _ in range(2):
            hp = capi.host_alloc(num_host * bb)
            ptrs.append(hp)
            hosts.append(np.ctypeslib.as_array((ctypes.c_uint8 * (num_host * bb)).from_address(hp))
                         .reshape(num_host, bb))
        d_ids = rng.choice(num_dev, 10, replace=False)
        h_ids = np.arange(3, 13)
        for s in (stream, None):
            handle = 0 if s is None else s
            capi.swap_all_layers([d.data.ptr for d in devs], [h.ctypes.data for h in hosts], num_dev, bb, num_host,
                                 d_ids, h_ids, 0, stream=handle, sync=True, path="staged")
            ok &= all((h[h_ids] == cp.asnumpy(d)[d_ids]).all() for d, h in zip(devs, hosts))
            for d in devs:
                d[:] = 0
            capi.swap_all_layers([d.data.ptr for d in devs], [h.ctypes.data for h in hosts], num_dev, bb, num_host,
                                 d_ids, h_ids, 1, stream=handle, sync=True, path="staged")
            ok &= all((cp.asnumpy(d)[d_ids] == h[h_ids]).all() for d, h in zip(devs, hosts))
        capi.swap_per_layer(devs[0].data.ptr, num_dev, bb, hosts[0].ctypes.data, num_host, d_ids[::-1], h_ids, 0,
                            stream=stream, sync=True, path="staged")
        lay = capi.host_alloc(num_host * 2 * bb)
        ptrs.append(lay)
        capi.swap_layout([d.data.ptr for d in devs], num_dev, bb, lay, num_host, d_ids, h_ids, 0, stream=stream,
                         sync=True, path="staged")
        capi.swap_layout([d.data.ptr for d in devs], num_dev, bb, lay, num_host, d_ids, h_ids, 1, stream=stream,
                         sync=True, path="staged")
    cp.cuda.runtime.deviceSynchronize()
    for p in ptrs:
        capi.host_free(p)
    print("staged smoke:", "ok" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
