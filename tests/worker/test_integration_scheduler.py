"""CacheManager drives a CacheController with real bytes (see trace_driver.py).

Paddle CPU tensors (the Paddle ops' CPU implementation) and numpy arrays (the CPU build of
the C ABI), copies on threaded streams, launched inline or by the launcher threads.
"""

from __future__ import annotations

import pytest

from trace_driver import SOAK, run_trace
from worker_helpers import capi_or_skip, paddle_ops_or_skip

POLICIES = ["write_through", "write_through_selective", "write_back"]


def _need(backend: str) -> None:
    if backend == "paddle":
        paddle_ops_or_skip()
    else:
        capi_or_skip()


@pytest.mark.parametrize("backend", ["paddle", "cpu"])
@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", [0, 1] if not SOAK else list(range(12)))
def test_random_traces_keep_every_running_request_exact(backend: str, policy: str, seed: int) -> None:
    _need(backend)
    counts = run_trace(policy, seed, steps=40 if not SOAK else 200, fail_p=0.0, quant=seed % 2 == 1,
                       async_launch=seed % 2 == 1, backend=backend)
    assert counts["steps"] > 0 and counts["failed"] == 0
    assert counts["d2h_blocks"] > 0  # the trace must move data, or it proves nothing


@pytest.mark.parametrize("policy", POLICIES)
def test_injected_copy_failures_are_recomputed_never_served(policy: str) -> None:
    _need("paddle")
    counts = run_trace(policy, seed=7, steps=50 if not SOAK else 300, fail_p=0.35, quant=False,
                       async_launch=policy == "write_back")
    assert counts["failed"] > 0


def test_traces_exercise_swap_ins() -> None:
    """The default traces load host blocks back, not just store them; requests admitted in
    one step share loads, and blocks are committed while their request runs."""
    _need("paddle")
    runs = [run_trace(policy, seed, steps=40, fail_p=0.0, quant=False) for policy in ("write_back", "write_through")
            for seed in (0, 1)]
    assert sum(c["swap_in_blocks"] for c in runs) > 0
    assert sum(c["shared_load_blocks"] for c in runs) > 0
    assert sum(c["committed_blocks"] for c in runs) > 0
