"""Shared helpers of the storage tests: host buffers with known bytes."""

from __future__ import annotations

import numpy as np
import pytest


class HostArena:
    """One numpy byte buffer cut into fixed-size slots, like a registered host pool."""

    def __init__(self, slots: int, slot_bytes: int) -> None:
        self.slot_bytes = slot_bytes
        self.array = np.zeros(slots * slot_bytes, dtype=np.uint8)
        self.ptr = int(self.array.ctypes.data)
        self.nbytes = int(self.array.nbytes)

    def slot_ptr(self, i: int) -> int:
        return self.ptr + i * self.slot_bytes

    def slot(self, i: int) -> np.ndarray:
        return self.array[i * self.slot_bytes:(i + 1) * self.slot_bytes]

    def fill(self, i: int, seed: int) -> np.ndarray:
        data = np.random.default_rng(seed).integers(0, 256, self.slot_bytes, dtype=np.uint8)
        self.slot(i)[:] = data
        return data


@pytest.fixture
def arena() -> HostArena:
    return HostArena(16, 64 << 10)
