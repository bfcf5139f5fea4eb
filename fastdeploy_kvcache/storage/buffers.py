"""Registered host regions: every pointer a transfer uses must lie inside one.

The check costs a bisect per key and catches the bug that would otherwise be a silent
memory corruption (a stale or wrong block address handed to a zero-copy read).
"""

from __future__ import annotations

import bisect
import threading

from fastdeploy_kvcache.storage.base import StorageError

__all__ = ["BufferRegistry"]


class BufferRegistry:
    """Sorted, non-overlapping ``[ptr, ptr + nbytes)`` regions."""

    def __init__(self) -> None:
        self._starts: list[int] = []
        self._ends: list[int] = []
        self._lock = threading.Lock()

    def add(self, ptr: int, nbytes: int) -> None:
        if not isinstance(ptr, int) or ptr <= 0 or not isinstance(nbytes, int) or nbytes <= 0:
            raise StorageError("invalid", f"register_buffer needs ptr > 0 and nbytes > 0, got {ptr!r}, {nbytes!r}")
        with self._lock:
            i = bisect.bisect_right(self._starts, ptr)
            if (i > 0 and self._ends[i - 1] > ptr) or (i < len(self._starts) and self._starts[i] < ptr + nbytes):
                raise StorageError("invalid", f"register_buffer: [{ptr:#x}, +{nbytes}) overlaps a registered region")
            self._starts.insert(i, ptr)
            self._ends.insert(i, ptr + nbytes)

    def remove(self, ptr: int) -> None:
        with self._lock:
            i = bisect.bisect_left(self._starts, ptr)
            if i == len(self._starts) or self._starts[i] != ptr:
                raise StorageError("invalid", f"unregister_buffer: {ptr:#x} is not the start of a registered region")
            del self._starts[i], self._ends[i]

    def regions(self) -> list[tuple[int, int]]:
        with self._lock:
            return [(s, e - s) for s, e in zip(self._starts, self._ends)]

    def spans_one_region(self, ptrs: "list[int] | tuple[int, ...]", nbytes: int) -> bool:
        """Whether ``nbytes`` at every ptr lie in one region (one bisect for the batch)."""
        if not ptrs:
            return True
        with self._lock:
            lo, hi = min(ptrs), max(ptrs) + nbytes
            j = bisect.bisect_right(self._starts, lo) - 1
            return j >= 0 and hi <= self._ends[j]

    def check(self, op: str, ptrs: "list[int] | tuple[int, ...]", sizes: "list[int] | tuple[int, ...]",
              name: str = "ptrs") -> None:
        """Raise ``StorageError("invalid")`` naming the first ptr not inside one region
        (as ``name[index]``).

        A batch's buffers usually lie in one region (a staging buffer, one host-tier tensor):
        when the span from the lowest start to the highest end does, that one bisect
        answers for the batch; only otherwise is each ptr looked up.
        """
        if not ptrs:
            return
        with self._lock:
            starts, ends = self._starts, self._ends
            # max(ptrs) + max(sizes) bounds every end without a sum per ptr.
            j = bisect.bisect_right(starts, min(ptrs)) - 1
            if j >= 0 and max(ptrs) + max(sizes) <= ends[j]:
                return
            for i, (ptr, size) in enumerate(zip(ptrs, sizes)):
                j = bisect.bisect_right(starts, ptr) - 1
                if j < 0 or ptr + size > ends[j]:
                    raise StorageError(
                        "invalid",
                        f"{op}: {name}[{i}] = {ptr:#x} (+{size} bytes) is not inside a registered buffer"
                    )
