"""``read_objects`` and ``files_exist`` (C ABI): the file backend's scattered hashed read and
its existence check, on real files in a real directory."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fastdeploy_kvcache import ops
from fastdeploy_kvcache.storage.file_format import CHECKSUM_PIECE, FORMAT_VERSION, HEADER, MAGIC

HSIZE = HEADER.size


def _need_read_objects(capi: ops.CApi) -> None:
    if not capi.has_read_objects:
        pytest.skip("read_objects needs the CPU C ABI built with xxHash's header (Debian libxxhash-dev; "
                    "bash build.sh installs it) on an x86-64 CPU with AVX-512 (F, BW)")


def _blob(paths: list[Path]) -> bytes:
    return b"".join(os.fsencode(str(p)) + b"\0" for p in paths)


def _object(path: Path, payload: bytes, recorded: int = 0, claimed: int = -1) -> Path:
    header = HEADER.pack(MAGIC, FORMAT_VERSION, HSIZE, len(payload) if claimed < 0 else claimed, recorded, 0)
    path.write_bytes(header + payload)
    return path


# Segment lengths that divide neither the 512 KiB checksum piece nor the read step, so pieces
# and steps cross segment boundaries at odd offsets; one shorter than a step, one longer
# than a piece.
SEGMENTS = [3001, 7, CHECKSUM_PIECE + 4097, 65_537, 12_345]


@pytest.mark.parametrize("step", [3000, 100_000, 1 << 20])
def test_scattered_read_gives_the_contiguous_reads_bytes_digests_and_verdicts(capi_cpu: ops.CApi, tmp_path: Path,
                                                                              step: int) -> None:
    _need_read_objects(capi_cpu)
    rng = np.random.default_rng(3)
    size = sum(SEGMENTS)
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(5)]
    paths = [_object(tmp_path / f"o{i}", p) for i, p in enumerate(payloads)]
    # The contiguous read's digests are the reference; then record them in the headers of
    # objects 0 and 1 (good), a wrong one in object 2 (corrupt), cut object 3 short, and
    # remove object 4 (missing).
    cont = np.zeros((5, size), dtype=np.uint8)
    _, got_c, digests_c = capi_cpu.read_files_hashed(
        [os.fsencode(str(p)) for p in paths], [int(r.ctypes.data) for r in cont], [size] * 5, HSIZE, CHECKSUM_PIECE,
        step)
    assert got_c == [HSIZE + size] * 5 and None not in digests_c
    for i in (0, 1):
        _object(paths[i], payloads[i], recorded=digests_c[i])
    _object(paths[2], payloads[2], recorded=digests_c[2] ^ 1)
    _object(paths[3], payloads[3][:-10], recorded=digests_c[3], claimed=size)
    paths[4].unlink()

    per = len(SEGMENTS)
    segbufs = [np.full(5 * n, 0xAB, dtype=np.uint8) for n in SEGMENTS]
    segs = [int(segbufs[t].ctypes.data) + i * SEGMENTS[t] for i in range(5) for t in range(per)]
    headers, got, digests, states = capi_cpu.read_objects(_blob(paths), 5, segs, SEGMENTS, per, True, HSIZE,
                                                          CHECKSUM_PIECE, step, FORMAT_VERSION)
    assert states == [2, 2, 1, 0, 0]
    assert got[:3] == [HSIZE + size] * 3 and got[3] == HSIZE + size - 10 and got[4] == -2  # ENOENT
    assert digests[:3] == digests_c[:3]
    for i in range(3):
        joined = b"".join(segbufs[t][i * SEGMENTS[t]:(i + 1) * SEGMENTS[t]].tobytes() for t in range(per))
        assert joined == payloads[i]
        assert HEADER.unpack_from(headers, i * HSIZE)[3] == size


def test_per_object_lengths_and_one_segment_match_read_files_hashed(capi_cpu: ops.CApi, tmp_path: Path) -> None:
    """Objects of different sizes (shared_lengths off, one segment each): the contiguous read."""
    _need_read_objects(capi_cpu)
    rng = np.random.default_rng(4)
    sizes = [1, 240, 4097, CHECKSUM_PIECE + 1]
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    paths = [_object(tmp_path / f"o{i}", p) for i, p in enumerate(payloads)]
    outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
    ptrs = [int(o.ctypes.data) for o in outs]
    _, got, digests, states = capi_cpu.read_objects(_blob(paths), 4, ptrs, sizes, 1, False, HSIZE, CHECKSUM_PIECE,
                                                    5000, 0)
    _, got_c, digests_c = capi_cpu.read_files_hashed([os.fsencode(str(p)) for p in paths], ptrs, sizes, HSIZE,
                                                     CHECKSUM_PIECE, 5000)
    assert got == got_c and digests == digests_c and states == [1] * 4  # check_version 0: no verdict
    assert [o.tobytes() for o in outs] == payloads


def test_size_first_leaves_the_segments_of_an_object_of_another_size_untouched(capi_cpu: ops.CApi,
                                                                              tmp_path: Path) -> None:
    _need_read_objects(capi_cpu)
    seg = [100, 28]
    paths = [_object(tmp_path / "small", b"s" * 100), _object(tmp_path / "large", b"l" * 200),
             _object(tmp_path / "right", b"r" * 128)]
    (tmp_path / "dir").mkdir()
    paths.append(tmp_path / "dir")
    buf = np.full(4 * 128, 7, dtype=np.uint8)
    segs = [int(buf.ctypes.data) + i * 128 + off for i in range(4) for off in (0, 100)]
    _, got, _, states = capi_cpu.read_objects(_blob(paths), 4, segs, seg, 2, True, HSIZE, CHECKSUM_PIECE, 4096,
                                              FORMAT_VERSION, size_first=True)
    assert states[:2] == [3, 3] and got[:2] == [0, 0] and states[3] == 3
    assert (buf[:256] == 7).all() and (buf[384:] == 7).all()
    assert buf[256:384].tobytes() == b"r" * 128 and states[2] == 1  # recorded checksum 0: not a match


def test_bad_arguments_raise_naming_them_and_read_nothing(capi_cpu: ops.CApi, tmp_path: Path) -> None:
    _need_read_objects(capi_cpu)
    path = _object(tmp_path / "o", b"p" * 64)
    buf = np.zeros(64, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    blob = _blob([path])
    cases = [
        (dict(segs=[0, ptr + 32]), "segs", 0),                      # null pointer
        (dict(seg_bytes=[32, -32]), "seg_bytes", 1),                # negative size
        (dict(seg_bytes=[32, 0]), "seg_bytes", 1),                  # empty segment
        (dict(per=0, segs=[], seg_bytes=[]), "segs_per_object", None),
        (dict(blob=blob[:-1]), "paths", 0),                         # no NUL: not a path
        (dict(blob=b"\0"), "paths", 0),                             # an empty path
        (dict(step=0), "step_bytes", None),
        (dict(piece=-1), "piece_bytes", None),
    ]
    for change, argument, index in cases:
        args = dict(blob=blob, segs=[ptr, ptr + 32], seg_bytes=[32, 32], per=2, step=4096, piece=CHECKSUM_PIECE)
        args.update(change)
        with pytest.raises(ops.SwapOpError) as e:
            capi_cpu.read_objects(args["blob"], 1, args["segs"], args["seg_bytes"], args["per"], True, HSIZE,
                                  args["piece"], args["step"], FORMAT_VERSION)
        assert e.value.argument == argument, (change, str(e.value))
        if index is not None:
            assert e.value.index == index, (change, str(e.value))
    with pytest.raises(ops.SwapOpError, match="3 segs for 1 objects of 2 segments"):
        capi_cpu.read_objects(blob, 1, [ptr, ptr, ptr], [32, 32], 2, True, HSIZE, CHECKSUM_PIECE, 4096)
    assert (buf == 0).all()
    assert capi_cpu.read_objects(b"", 0, [], [32], 1, True, HSIZE, CHECKSUM_PIECE, 4096)[1:] == ([], [], [])


def test_files_exist_counts_leading_regular_files(capi_cpu: ops.CApi, tmp_path: Path) -> None:
    if not capi_cpu.has_files_exist:
        pytest.fail(f"{capi_cpu.path} lacks fdkv_files_exist: rebuild it with bash build.sh")
    a, b = _object(tmp_path / "a", b"1"), _object(tmp_path / "b", b"2")
    (tmp_path / "d").mkdir()
    (tmp_path / "link").symlink_to(a)
    missing = tmp_path / "missing"
    assert capi_cpu.files_exist(_blob([a, b, tmp_path / "link"]), 3) == 3
    assert capi_cpu.files_exist(_blob([a, missing, b]), 3) == 1
    assert capi_cpu.files_exist(_blob([a, b, tmp_path / "d", a]), 4) == 2
    assert capi_cpu.files_exist(_blob([missing]), 1) == 0
    assert capi_cpu.files_exist(b"", 0) == 0
    with pytest.raises(ops.SwapOpError) as e:
        capi_cpu.files_exist(_blob([a]), 2)
    assert e.value.argument == "paths" and e.value.index == 1
    with pytest.raises(ops.SwapOpError) as e:
        capi_cpu.files_exist(_blob([a]), -1)
    assert e.value.argument == "n"
