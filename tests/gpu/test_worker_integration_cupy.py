"""CacheManager drives a CacheController on the GPU (CuPy backend) with real bytes.

The same random traces as the CPU integration test (``tests/worker/trace_driver.py``), here
with CUDA streams, the launcher threads and device-side ``wait_for_layer`` waits on a
non-blocking compute stream: after every layer's wait and every step, each running request's
computed blocks must hold exactly its prefix's KV.
"""

from __future__ import annotations

import os
import sys

import pytest

from skip_helpers import cuda_capi_missing

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy", reason="needs CuPy and a CUDA GPU (run on the device tool)")


_reason = cuda_capi_missing()
if _reason is not None:
    pytest.skip(f"needs a CUDA GPU, CuPy and `bash build.sh gpu` (device tool): {_reason}", allow_module_level=True)

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "worker"))
from trace_driver import run_trace  # noqa: E402

POLICIES = ["write_through", "write_through_selective", "write_back"]


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [0, 1])
def test_scheduler_driven_traces_on_gpu(policy: str, seed: int) -> None:
    with cp.cuda.Stream(non_blocking=True):
        counts = run_trace(policy, seed, steps=40, fail_p=0.0, quant=seed == 1, async_launch=True, backend="cupy")
    assert counts["failed"] == 0 and counts["d2h_blocks"] > 0


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_scheduler_driven_traces_with_injected_failures_on_gpu(policy: str) -> None:
    with cp.cuda.Stream(non_blocking=True):
        counts = run_trace(policy, seed=7, steps=50, fail_p=0.35, quant=False, async_launch=True, backend="cupy")
    assert counts["failed"] > 0
