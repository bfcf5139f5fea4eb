"""Shared helpers of the storage tests: host buffers with known bytes."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import pytest

if TYPE_CHECKING:
    from fastdeploy_kvcache.storage.file_backend import FileBackend


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


# The file backend's readers: the C ABI's read that hashes as it reads (the default where
# built), its plain batch read hashed afterwards in Python, and Python's own reads.
READERS = ["hashed", "native", "python"]


def use_reader(backend: "FileBackend", reader: str) -> None:
    """Make ``backend`` read with ``reader`` (one of READERS); a reader that is not built fails
    the test, saying what builds it, or skips where the CPU cannot run it."""
    if reader == "python":
        backend._native = None
        return
    assert backend._native is not None, "the C ABI (build/libfdkv_capi_cpu.so) is not built: bash build.sh"
    if reader == "native":
        backend._hashed_step = 0
    elif not backend._reads_hashed():
        if backend._native.has_hashed_read:
            raise AssertionError("the backend does not use the hashed read its library has")
        pytest.skip("the hashed read needs the C ABI built with xxHash's header (libxxhash-dev, which "
                    "bash build.sh installs) and a CPU with AVX-512 F and BW")
