"""Copy paths: the ``PATH_*`` bits a call reports (:meth:`CApi.last_path`) and the
per-call ``path`` argument every swap takes (docs/ops.md, "Which path runs when")."""

from __future__ import annotations

import numbers
from typing import Union

from fastdeploy_kvcache.ops.checks import SwapOpError

# Bits of CApi.last_path(): which copy paths the calling thread's last op used.
PATH_MEMCPY = 1
PATH_KERNEL = 2
PATH_DMA = 4
PATH_CPU = 8
PATH_STAGED = 16
PATH_DMA_ROWS = 32
"""Set with PATH_DMA: the copies went as one 2D copy per run of blocks over tensors that sit
at one pitch (docs/ops.md, "Lanes at one pitch"), not a batch entry per tensor."""

# Per-call copy path (the ``path`` argument of every swap): which path this one call takes,
# whatever the process-wide ``copy_path`` option says.  See docs/ops.md, "Which path runs when".
COPY_PATH_PROCESS = -1
"""Follow the process-wide ``copy_path`` option (``CApi.set_option``); the default."""
COPY_PATH_AUTO = 0
"""The size rule: DMA batch for average copies >= dma_min_bytes, else the copy kernel."""
COPY_PATH_KERNEL = 1
"""The copy kernel (<= ``copy_grid`` CTAs); merged runs >= merge_min_bytes still use memcpy."""
COPY_PATH_DMA = 2
"""The cudaMemcpyBatchAsync DMA batch: copy engines, no SMs (kernel on the legacy stream)."""
COPY_PATH_STAGED = 3
"""Device-side gather/scatter through a bounded device staging ring, plus one pipelined DMA per
contiguous host run (few SMs for microseconds per chunk); auto picks it when host ids form runs."""
COPY_PATHS: dict[str, int] = {
    "process": COPY_PATH_PROCESS, "auto": COPY_PATH_AUTO, "kernel": COPY_PATH_KERNEL, "dma": COPY_PATH_DMA,
    "staged": COPY_PATH_STAGED,
}


def copy_path_code(path: Union[int, str, None], op: str = "swap") -> int:
    """The C value of a per-call copy path: None or "process" -> -1, "auto" -> 0,
    "kernel" -> 1, "dma" -> 2, "staged" -> 3; an int is passed through for the core to check
    (it accepts -1..3 and names ``path`` otherwise).  Raises :class:`SwapOpError` naming ``path``.
    """
    if path is None:
        return COPY_PATH_PROCESS
    if isinstance(path, str):
        code = COPY_PATHS.get(path.strip().lower())
        if code is not None:
            return code
    elif isinstance(path, numbers.Integral) and not isinstance(path, bool):
        value = int(path)
        if -(1 << 31) <= value < (1 << 31):  # a C int; the core checks the range of values
            return value
    raise SwapOpError(
        f"{op}: path = {path!r} must be None/-1/'process' (the process-wide copy_path option), "
        f"0/'auto', 1/'kernel', 2/'dma' or 3/'staged'",
        op, "path", None,
    )


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
