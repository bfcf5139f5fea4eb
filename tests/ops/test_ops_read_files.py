"""``read_files`` (C ABI): the file backend's batch read, on real files in a real directory."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

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
