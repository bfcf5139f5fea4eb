"""Reference semantics of the swap ops, shared by the CPU op tests and the GPU tests.

The expected state after a swap is computed here with numpy indexing, independently of
the ops, so every test compares the op against the same definition.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from fastdeploy_kvcache.core.metadata import CopyDirection

PATTERNS = ["consecutive", "scattered", "reversed", "single", "empty", "runs"]


def id_patterns(num_dev: int, num_host: int, rng: np.random.Generator) -> dict[str, tuple[list[int], list[int]]]:
    """Named (dev_ids, host_ids) cases: consecutive, scattered, reversed, single, empty,
    and a mix of consecutive runs and singletons (exercises run merging)."""
    n = min(num_dev, num_host) // 2
    return {
        "consecutive": (list(range(1, 1 + n)), list(range(2, 2 + n))),
        "scattered": (
            rng.choice(num_dev, n, replace=False).tolist(),
            rng.choice(num_host, n, replace=False).tolist(),
        ),
        "reversed": (list(range(n - 1, -1, -1)), list(range(num_host - 1, num_host - 1 - n, -1))),
        "single": ([num_dev - 1], [0]),
        "empty": ([], []),
        # two runs of consecutive pairs around a singleton (num_host must exceed 10)
        "runs": ([0, 1, 2, 7, 5, 6], [3, 4, 5, 0, 9, 10]),
    }


def expected_after_swap(
    dev: np.ndarray, host: np.ndarray, dev_ids: Sequence[int], host_ids: Sequence[int], mode: int
) -> tuple[np.ndarray, np.ndarray]:
    """Copies of ``(dev, host)`` as a swap in ``mode`` must leave them (block = dim 0)."""
    want_dev, want_host = np.array(dev, copy=True), np.array(host, copy=True)
    if mode == CopyDirection.DEVICE_TO_HOST:
        want_host[host_ids] = want_dev[dev_ids]
    else:
        want_dev[dev_ids] = want_host[host_ids]
    return want_dev, want_host


def run_stack(capi: Any, dev_ptrs: Any, host_ptrs: Any, group_size: int, num_dev_blocks: Any, block_bytes: Any,
              num_host_blocks: int, dev_ids: Any, host_ids: Any, mode: int, *, stream: Any = 0,
              events: Any = None, path: Any = None, progress: Any = None, sync: bool = False) -> None:
    """One layer stack enqueued on the calling thread through the library's one entry point
    (``capi.layer_stack_call(None, ...).run(...)``), with every argument in one call, the way
    the stack tests state their cases."""
    call = capi.layer_stack_call(None, dev_ptrs, host_ptrs, group_size, num_dev_blocks, block_bytes,
                                 num_host_blocks, mode, stream=stream, path=path)
    call.run(dev_ids, host_ids, events=events, progress=progress, sync=sync)
