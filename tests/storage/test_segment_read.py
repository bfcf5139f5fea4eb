"""Reads straight into a layer-major host tier (``FileBackend.batch_get_segments`` and the
transfer's direct prefetch) against the staging path, on real files in real directories."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pytest

from fastdeploy_kvcache.storage import Status, StorageError
from fastdeploy_kvcache.storage import file_backend
from fastdeploy_kvcache.storage.file_backend import FileBackend
from fastdeploy_kvcache.storage.file_format import CHECKSUM_PIECE
from fastdeploy_kvcache.storage.transfer import HostTierLayout, StorageTransfer
from skip_helpers import needs_cpu_capi

pytestmark = needs_cpu_capi()

LAYERS = 3
# Per layer a key and a value tensor; sizes that divide neither the read step nor the piece,
# above the transfer's DIRECT_READ_MIN_SEGMENT_BYTES.
BLOCK_BYTES = (5003, 5003, 5003, 5003, 5003, 5003)
NUM_BLOCKS = 16


def key(i: int) -> str:
    return f"fdkv1-test-0123456789abcdef-tp0of1:{i:032x}"


def need_segments(backend: FileBackend) -> None:
    if not backend.reads_segments:
        pytest.skip("segment reads need the CPU C ABI built with xxHash's header (libxxhash-dev, which "
                    "bash build.sh installs) on a CPU with AVX-512 F and BW")


class HostTier:
    """A layer-major host tier in numpy buffers: one buffer per (layer, kind)."""

    def __init__(self, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.tensors = [rng.integers(0, 256, NUM_BLOCKS * bb, dtype=np.uint8) for bb in BLOCK_BYTES]
        self.layout = HostTierLayout(tuple(int(t.ctypes.data) for t in self.tensors), BLOCK_BYTES, NUM_BLOCKS,
                                     LAYERS)

    def block(self, b: int) -> bytes:
        return b"".join(t[b * bb:(b + 1) * bb].tobytes() for t, bb in zip(self.tensors, BLOCK_BYTES))


def test_direct_prefetch_gives_the_staging_paths_blocks_results_and_verdicts(tmp_path: Path) -> None:
    """Eight objects, one corrupt, one missing in the middle, one smaller and one larger than
    a block: the direct read and the staging read of identical directories agree on every
    result, every stat and every host block (the corrupt one aside: a direct read lands
    before its checksum fails, and the caller never uses a block whose result is negative)."""
    src = HostTier(seed=1)
    backend_a = FileBackend(tmp_path / "a", min_free_bytes=0)
    need_segments(backend_a)
    writer = StorageTransfer(src.layout, backend_a, staging_blocks=3)
    keys = [key(i) for i in range(8)]
    assert writer.put_blocks(keys, list(range(8))) == [Status.OK] * 8
    writer.close()
    object_bytes = sum(BLOCK_BYTES)
    # Damage, in directory a before it is copied: 2 corrupt, 4 gone, 5 smaller, 6 larger.
    path = Path(backend_a.file_path(keys[2]))
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    Path(backend_a.file_path(keys[4])).unlink()
    odd = np.arange(object_bytes + 50, dtype=np.uint8)
    backend_a.register_buffer(int(odd.ctypes.data), odd.nbytes)
    assert backend_a.batch_put_from([keys[5], keys[6]], [int(odd.ctypes.data)] * 2,
                                    [100, object_bytes + 50]) == [Status.OK] * 2
    backend_a.unregister_buffer(int(odd.ctypes.data))
    backend_a.close()
    shutil.copytree(tmp_path / "a", tmp_path / "b")

    results, tiers, stats, lost = {}, {}, {}, {}
    for name in ("a", "b"):
        backend = FileBackend(tmp_path / name, min_free_bytes=0)
        if name == "b":
            backend._hashed_step = 0  # the native read without segments: the transfer stages
        lost[name] = []
        backend.set_loss_listener(lost[name].extend)
        tiers[name] = HostTier(seed=2)
        transfer = StorageTransfer(tiers[name].layout, backend, staging_blocks=3)
        assert transfer.reads_direct == (name == "a")
        results[name] = transfer.get_blocks(keys, list(range(8, 16)))
        stats[name] = backend.stats()
        transfer.close()
        backend.close()
    expect = [object_bytes, object_bytes, Status.CORRUPT, object_bytes, Status.MISSING, Status.INVALID,
              Status.INVALID, object_bytes]
    assert results["a"] == results["b"] == expect
    for b in range(NUM_BLOCKS):
        if b != 10:  # the corrupt object's block
            assert tiers["a"].block(b) == tiers["b"].block(b), b
    for i in (0, 1, 3, 7):
        assert tiers["a"].block(8 + i) == src.block(i)
    assert tiers["a"].block(13) == HostTier(seed=2).block(13), "the smaller object touched its block"
    assert tiers["a"].block(14) == HostTier(seed=2).block(14), "the larger object touched its block"
    assert stats["a"]["segment_read_keys"] == 8 and stats["b"]["segment_read_keys"] == 0
    for field in ("hits", "misses", "corrupt_objects", "errors", "read_keys", "objects"):
        assert stats["a"][field] == stats["b"][field], field
    assert sorted(lost["a"]) == sorted(lost["b"]) and keys[2] in lost["a"] and keys[6] in lost["a"]
    names = {i: Path(backend_a.file_path(keys[i])).name for i in (2, 5, 6)}
    for name in ("a", "b"):  # the corrupt and the larger object are deleted, the smaller kept
        assert [(tmp_path / name / names[i]).exists() for i in (2, 5, 6)] == [False, True, False]


@pytest.mark.parametrize("segments", [[3001, 7, 61_000], [3001, 7, CHECKSUM_PIECE + 1000, 5]])
def test_segments_of_odd_sizes_read_back_objects_written_whole(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                segments: list[int]) -> None:
    """The checksum of a scattered read (pieces and steps crossing segments) is the one the
    writer recorded over the contiguous payload."""
    monkeypatch.setattr(file_backend, "_HASHED_READ_STEP", 3000)
    backend = FileBackend(tmp_path, min_free_bytes=0)
    need_segments(backend)
    size, n = sum(segments), 3
    rng = np.random.default_rng(5)
    src = rng.integers(0, 256, n * size, dtype=np.uint8)
    backend.register_buffer(int(src.ctypes.data), src.nbytes)
    keys = [key(i) for i in range(n)]
    assert backend.batch_put_from(keys, [int(src.ctypes.data) + i * size for i in range(n)], [size] * n) == [0] * n
    dst = [np.zeros(n * s, dtype=np.uint8) for s in segments]
    for d in dst:
        backend.register_buffer(int(d.ctypes.data), d.nbytes)
    segs = [int(dst[t].ctypes.data) + i * segments[t] for i in range(n) for t in range(len(segments))]
    assert backend.batch_get_segments(keys, segs, segments) == [size] * n
    for i in range(n):
        got = b"".join(dst[t][i * s:(i + 1) * s].tobytes() for t, s in enumerate(segments))
        assert got == src[i * size:(i + 1) * size].tobytes()
    assert backend.stats()["corrupt_objects"] == 0
    backend.close()


def test_bad_segment_arguments_raise_and_touch_nothing(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path, min_free_bytes=0)
    need_segments(backend)
    src = np.arange(256, dtype=np.uint8)
    dst = np.zeros(1024, dtype=np.uint8)
    outside = np.zeros(128, dtype=np.uint8)
    for a in (src, dst):
        backend.register_buffer(int(a.ctypes.data), a.nbytes)
    k = [key(0)]
    assert backend.batch_put_from(k, [int(src.ctypes.data)], [256]) == [Status.OK]
    d = int(dst.ctypes.data)
    before = backend.stats()
    cases = [
        (([d, 0], [128, 128]), r"seg_ptrs\[1\] must be a non-null address"),
        (([d, d + 128], [128, -128]), r"seg_bytes\[1\] must be a positive int"),
        (([], []), r"seg_bytes is empty"),
        (([d], [128, 128]), r"1 seg_ptrs for 1 keys of 2 segments"),
        (([d, int(outside.ctypes.data)], [128, 128]), r"seg_ptrs\[1\] = .* is not inside a registered buffer"),
        (([d, d + 1000], [128, 128]), r"seg_ptrs\[1\] = .* is not inside a registered buffer"),  # runs past
    ]
    for (segs, lens), message in cases:
        with pytest.raises(StorageError, match=message) as info:
            backend.batch_get_segments(k, segs, lens)
        assert info.value.kind == "invalid"
    with pytest.raises(StorageError, match=r"keys\[0\]"):
        backend.batch_get_segments(["bad/key"], [d], [256])
    assert (dst == 0).all() and (outside == 0).all()
    assert backend.stats()["read_keys"] == before["read_keys"] and Path(backend.file_path(k[0])).exists()
    backend.close()
    with pytest.raises(StorageError, match="closed") as info:
        backend.batch_get_segments(k, [d], [256])
    assert info.value.kind == "unreachable"


def test_batch_exists_agrees_between_the_native_check_and_python(tmp_path: Path,
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """Missing, directory, regular: the C stat loop and the Python fallback count alike, and
    a directory at a path is reported once either way."""
    backend = FileBackend(tmp_path, min_free_bytes=0)
    if backend._native is None or not backend._native.has_files_exist:
        pytest.fail("the CPU C ABI lacks fdkv_files_exist: rebuild it with bash build.sh")
    src = np.arange(64, dtype=np.uint8)
    backend.register_buffer(int(src.ctypes.data), 64)
    keys = [key(i) for i in range(6)]
    assert backend.batch_put_from([keys[i] for i in (0, 1, 3, 5)], [int(src.ctypes.data)] * 4, [64] * 4) == [0] * 4
    Path(backend.file_path(keys[4])).mkdir()
    native = backend._native
    with caplog.at_level(logging.WARNING, logger="fastdeploy_kvcache.storage.file_backend"):
        for reader in (native, None, native):
            backend._native = reader
            assert backend.batch_exists(keys) == 2  # key 2 is missing
            assert backend.batch_exists([keys[3], keys[5]]) == 2
            assert backend.batch_exists([keys[3], keys[4], keys[5]]) == 1  # the directory is a miss
            assert backend.batch_exists([]) == 0
    warnings = [r.getMessage() for r in caplog.records if "not a regular file" in r.getMessage()]
    assert len(warnings) == 1, warnings
    backend._native = native
    with pytest.raises(StorageError, match=r"keys\[1\]"):
        backend.batch_exists([keys[0], "a/b"])
    backend.close()


def test_tiny_segments_keep_the_staging_path(tmp_path: Path) -> None:
    """Segments below the direct read's floor (per-iovec costs outweigh the copy) stage."""
    backend = FileBackend(tmp_path, min_free_bytes=0)
    need_segments(backend)
    tier = HostTier(seed=3)
    small = StorageTransfer(tier.layout, backend, staging_blocks=2, direct_read_min_segment_bytes=5004)
    assert not small.reads_direct
    keys = [key(i) for i in range(3)]
    assert small.put_blocks(keys, [0, 1, 2]) == [Status.OK] * 3
    assert small.get_blocks(keys, [5, 6, 7]) == [sum(BLOCK_BYTES)] * 3
    assert [tier.block(b) for b in (5, 6, 7)] == [tier.block(b) for b in (0, 1, 2)]
    assert backend.stats()["segment_read_keys"] == 0
    small.close()
    direct = StorageTransfer(tier.layout, backend, staging_blocks=2, direct_read_min_segment_bytes=5003)
    assert direct.reads_direct
    assert direct.get_blocks(keys, [8, 9, 10]) == [sum(BLOCK_BYTES)] * 3
    assert backend.stats()["segment_read_keys"] == 3
    direct.close()
    backend.close()


class _CudaBuildView:
    """The real CPU C ABI, presented as the CUDA build's (``is_cuda``), optionally answering
    ``pointer_location`` as a GPU host would for device memory: what the transfer sees on a
    GPU server, where this machine has no GPU.  Every copy still runs in the real library."""

    is_cuda = True

    def __init__(self, capi: object, device_ptrs: frozenset = frozenset()) -> None:
        self._capi = capi
        self._device_ptrs = device_ptrs

    def pointer_location(self, ptr: int) -> int:
        from fastdeploy_kvcache.ops.capi import POINTER_DEVICE

        return POINTER_DEVICE if ptr in self._device_ptrs else self._capi.pointer_location(ptr)

    def __getattr__(self, name: str) -> object:
        return getattr(self._capi, name)


def test_the_cuda_build_reads_straight_into_a_host_tier_and_never_into_device_memory(tmp_path: Path) -> None:
    """With the CUDA build's C ABI, prefetches into the (pinned) host tier take the direct
    read, shown by the transfer's path counters and the backend's segment reads; a layout of
    device memory, by its declared kind or by the library's answer for one tensor, stages."""
    from fastdeploy_kvcache import ops
    from fastdeploy_kvcache.ops.capi import POINTER_HOST

    capi = ops.load_capi(variant="cpu")
    backend = FileBackend(tmp_path, min_free_bytes=0)
    need_segments(backend)
    tier = HostTier(seed=4)
    assert capi.has_pointer_location and capi.pointer_location(tier.layout.ptrs[0]) == POINTER_HOST
    keys = [key(i) for i in range(3)]
    writer = StorageTransfer(tier.layout, backend, staging_blocks=2)
    assert writer.put_blocks(keys, [0, 1, 2]) == [Status.OK] * 3
    writer.close()
    size = sum(BLOCK_BYTES)

    cuda = StorageTransfer(tier.layout, backend, staging_blocks=2, capi=_CudaBuildView(capi))
    assert cuda.reads_direct and cuda.direct_read_off_reason is None
    assert cuda.get_blocks(keys, [5, 6, 7]) == [size] * 3
    assert [tier.block(b) for b in (5, 6, 7)] == [tier.block(b) for b in (0, 1, 2)]
    st = cuda.stats()
    assert (st["direct_read_blocks"], st["staged_read_blocks"]) == (3, 0)
    assert backend.stats()["segment_read_keys"] == 3
    cuda.close()

    device_kind = HostTierLayout(tier.layout.ptrs, BLOCK_BYTES, NUM_BLOCKS, LAYERS, memory="device")
    device_answer = _CudaBuildView(capi, frozenset({tier.layout.ptrs[4]}))
    for layout, view, why in ((device_kind, _CudaBuildView(capi), "device memory"),
                              (tier.layout, device_answer, "tensor 4")):
        staged = StorageTransfer(layout, backend, staging_blocks=2, capi=view)
        assert not staged.reads_direct and why in staged.direct_read_off_reason
        assert staged.get_blocks(keys, [8, 9, 10]) == [size] * 3
        assert [tier.block(b) for b in (8, 9, 10)] == [tier.block(b) for b in (0, 1, 2)]
        st = staged.stats()
        assert (st["direct_read_blocks"], st["staged_read_blocks"]) == (0, 3)
        staged.close()
    assert backend.stats()["segment_read_keys"] == 3  # only the direct transfer's
    with pytest.raises(ValueError, match="memory"):
        HostTierLayout(tier.layout.ptrs, BLOCK_BYTES, NUM_BLOCKS, LAYERS, memory="gpu")
    backend.close()
