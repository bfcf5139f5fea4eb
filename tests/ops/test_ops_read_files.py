"""``read_files`` (C ABI): the file backend's batch read, on real files in a real directory."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from fastdeploy_kvcache import ops

HEADER = 32


def _write(path: Path, header: bytes, payload: bytes) -> bytes:
    path.write_bytes(header + payload)
    return os.fsencode(str(path))


def test_reads_headers_and_payloads_and_tells_each_outcome(capi_cpu: ops.CApi, tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    size = 4096
    payloads = [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(3)]
    heads = [bytes([i + 1]) * HEADER for i in range(3)]
    paths = [_write(tmp_path / f"o{i}", heads[i], payloads[i]) for i in range(3)]
    _write(tmp_path / "short", b"h" * HEADER, b"x" * 100)           # shorter than the buffer
    _write(tmp_path / "long", b"l" * HEADER, b"y" * (size + 10))     # longer than the buffer
    paths += [os.fsencode(str(tmp_path / n)) for n in ("short", "long", "missing")]
    (tmp_path / "dir").mkdir()
    paths.append(os.fsencode(str(tmp_path / "dir")))                  # not a readable file
    out = np.full((len(paths), size), 7, dtype=np.uint8)
    dsts = [int(out.ctypes.data) + i * size for i in range(len(paths))]
    headers, got = capi_cpu.read_files(paths, dsts, [size] * len(paths), HEADER)
    for i in range(3):
        assert got[i] == HEADER + size  # the whole object, and nothing past it
        assert bytes(headers[i * HEADER:(i + 1) * HEADER]) == heads[i]
        assert out[i].tobytes() == payloads[i]
    assert got[3] == HEADER + 100 and out[3, :100].tobytes() == b"x" * 100 and (out[3, 100:] == 7).all()
    assert got[4] == HEADER + size + 1  # one byte past the buffer: the file is longer
    assert got[5] == -errno.ENOENT
    assert got[6] == -errno.EISDIR
    assert (out[5] == 7).all() and (out[6] == 7).all()


def test_an_empty_batch_reads_nothing(capi_cpu: ops.CApi) -> None:
    headers, got = capi_cpu.read_files([], [], [], HEADER)
    assert got == []


def test_bad_arguments_raise_naming_them(capi_cpu: ops.CApi, tmp_path: Path) -> None:
    path = _write(tmp_path / "o", b"h" * HEADER, b"p" * 64)
    buf = np.zeros(64, dtype=np.uint8)
    with pytest.raises(ops.SwapOpError) as e:
        capi_cpu.read_files([path], [int(buf.ctypes.data)], [-1], HEADER)
    assert e.value.argument == "dst_bytes" and e.value.index == 0
    with pytest.raises(ops.SwapOpError) as e:
        capi_cpu.read_files([path], [0], [64], HEADER)
    assert e.value.argument == "dsts" and e.value.index == 0
    with pytest.raises(ops.SwapOpError) as e:
        capi_cpu.read_files([path], [int(buf.ctypes.data)], [64], -3)
    assert e.value.argument == "header_bytes"
    with pytest.raises(ops.SwapOpError) as e:
        capi_cpu.read_files([path, path], [int(buf.ctypes.data)], [64], HEADER)
    assert e.value.argument == "dsts"
    assert (buf == 0).all()


def _chain(payload: bytes, piece: int) -> int:
    """The file backend's checksum spelled out: xxh3-64 of each piece, seeded with the last."""
    seed = 0
    for at in range(0, len(payload), piece):
        seed = xxhash.xxh3_64_intdigest(payload[at:at + piece], seed)
    return seed if payload else xxhash.xxh3_64_intdigest(b"")


def _need_hashed(capi: ops.CApi) -> None:
    if not capi.has_hashed_read:
        pytest.skip("read_files_hashed needs the CPU C ABI built with xxHash's header (Debian libxxhash-dev; "
                    "bash build.sh installs it) on an x86-64 CPU with AVX-512 (F, BW)")


# Sizes around the piece and step edges; xxh3 takes another code path at 240 bytes and below.
HASHED_SIZES = [0, 1, 240, 241, 4095, 4096, 4097, 12_288, 12_289, 3 * 4096 * 2 + 5]


@pytest.mark.parametrize("step", [1000, 4096, 8192, 1 << 20])
def test_hashed_read_gives_the_chained_checksum_of_every_filled_buffer(capi_cpu: ops.CApi, tmp_path: Path,
                                                                      step: int) -> None:
    """The digest equals the Python chain whatever the read step (it need not divide the
    piece); the bytes and ``got`` are those of read_files."""
    _need_hashed(capi_cpu)
    piece = 4096
    rng = np.random.default_rng(step)
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in HASHED_SIZES]
    paths = [_write(tmp_path / f"o{i}", bytes([i]) * HEADER, p) for i, p in enumerate(payloads)]
    out = [np.full(max(len(p), 1), 7, dtype=np.uint8) for p in payloads]
    dsts = [int(o.ctypes.data) for o in out]
    headers, got, digests = capi_cpu.read_files_hashed(paths, dsts, [len(p) for p in payloads], HEADER, piece, step)
    for i, p in enumerate(payloads):
        assert got[i] == HEADER + len(p)
        assert bytes(headers[i * HEADER:(i + 1) * HEADER]) == bytes([i]) * HEADER
        assert out[i][:len(p)].tobytes() == p
        assert digests[i] == _chain(p, piece), (len(p), step)


def test_hashed_read_tells_short_long_missing_and_unreadable_files(capi_cpu: ops.CApi, tmp_path: Path) -> None:
    """A buffer left partly unfilled has no digest; a longer file's digest covers the buffer."""
    _need_hashed(capi_cpu)
    size = 10_000
    long_payload = bytes(range(256)) * 40
    paths = [_write(tmp_path / "short", b"h" * HEADER, b"x" * 100),
             _write(tmp_path / "long", b"l" * HEADER, long_payload),
             _write(tmp_path / "headless", b"h" * 10, b""),
             os.fsencode(str(tmp_path / "missing"))]
    (tmp_path / "dir").mkdir()
    paths.append(os.fsencode(str(tmp_path / "dir")))
    out = np.full((len(paths), size), 7, dtype=np.uint8)
    dsts = [int(out.ctypes.data) + i * size for i in range(len(paths))]
    _, got, digests = capi_cpu.read_files_hashed(paths, dsts, [size] * len(paths), HEADER, 4096, 3000)
    assert got[0] == HEADER + 100 and digests[0] is None and (out[0, 100:] == 7).all()
    assert got[1] == HEADER + size + 1 and digests[1] == _chain(long_payload[:size], 4096)
    assert got[2] == 10 and digests[2] is None
    assert got[3] == -errno.ENOENT and digests[3] is None
    assert got[4] == -errno.EISDIR and digests[4] is None
    assert (out[3] == 7).all() and (out[4] == 7).all()


def test_hashed_read_refuses_bad_arguments_naming_them(capi_cpu: ops.CApi, tmp_path: Path) -> None:
    _need_hashed(capi_cpu)
    path = _write(tmp_path / "o", b"h" * HEADER, b"p" * 64)
    buf = np.zeros(64, dtype=np.uint8)
    ptr = int(buf.ctypes.data)
    for piece, step, bad in ((0, 64, "piece_bytes"), (64, -1, "step_bytes")):
        with pytest.raises(ops.SwapOpError) as e:
            capi_cpu.read_files_hashed([path], [ptr], [64], HEADER, piece, step)
        assert e.value.argument == bad
    with pytest.raises(ops.SwapOpError) as e:
        capi_cpu.read_files_hashed([path], [ptr], [-1], HEADER, 64, 64)
    assert e.value.argument == "dst_bytes" and e.value.index == 0
    with pytest.raises(ops.SwapOpError) as e:
        capi_cpu.read_files_hashed([path, path], [ptr], [64], HEADER, 64, 64)
    assert e.value.argument == "dsts"
    assert (buf == 0).all()
    assert capi_cpu.read_files_hashed([], [], [], HEADER, 64, 64)[1:] == ([], [])
