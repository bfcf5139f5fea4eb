"""``read_files`` (C ABI): the file backend's batch read, on real files in a real directory."""

from __future__ import annotations

import errno
import os
import threading
import time
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


@pytest.fixture
def read_options(capi_cpu: ops.CApi):
    """The read threading options, restored after the test (they are process-wide)."""
    names = ("read_threads", "read_thread_min_bytes")
    before = {k: capi_cpu.get_option(k) for k in names}
    yield before
    for k, v in before.items():
        capi_cpu.set_option(k, v)


def _mixed_batch(tmp_path: Path) -> tuple[list[bytes], list[int], list[bytes]]:
    """Objects of mixed sizes (around the piece and step edges, up to ~1 MiB), with short,
    long, headerless, missing and unreadable ones among them: paths, buffer sizes, payloads."""
    rng = np.random.default_rng(25)
    sizes = [0, 1, 240, 4096, 4097, 65_536, 300_000, 1 << 20, 12_289, 777]
    payloads = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in sizes]
    paths = [_write(tmp_path / f"o{i}", bytes([i]) * HEADER, p) for i, p in enumerate(payloads)]
    bufs = list(sizes)
    paths.append(_write(tmp_path / "short", b"h" * HEADER, b"x" * 100))
    bufs.append(50_000)
    paths.append(_write(tmp_path / "long", b"l" * HEADER, bytes(range(256)) * 400))
    bufs.append(60_000)
    paths.append(_write(tmp_path / "headless", b"h" * 10, b""))
    bufs.append(4096)
    paths.append(os.fsencode(str(tmp_path / "missing")))
    bufs.append(4096)
    (tmp_path / "dir").mkdir()
    paths.append(os.fsencode(str(tmp_path / "dir")))
    bufs.append(4096)
    # Interleave the failures with the good objects, so each thread meets some of both.
    order = [0, 10, 1, 2, 11, 3, 4, 12, 5, 6, 13, 7, 8, 14, 9]
    return [paths[i] for i in order], [bufs[i] for i in order], payloads


def _read_all(capi: ops.CApi, paths: list[bytes], bufs: list[int]) -> tuple[bytes, list[int], list, list[bytes]]:
    out = [np.full(max(n, 1), 7, dtype=np.uint8) for n in bufs]
    headers, got, digests = capi.read_files_hashed(paths, [int(o.ctypes.data) for o in out], bufs, HEADER, 4096, 3000)
    return bytes(headers), got, digests, [o.tobytes() for o in out]


@pytest.mark.parametrize("threads", [2, 3, 16])
def test_threaded_hashed_read_matches_the_one_thread_read(capi_cpu: ops.CApi, tmp_path: Path, read_options: dict,
                                                          threads: int) -> None:
    """Headers, byte counts, digests and buffers are the same whatever the read threads,
    for a batch of mixed sizes with failures among the objects."""
    _need_hashed(capi_cpu)
    paths, bufs, payloads = _mixed_batch(tmp_path)
    capi_cpu.set_option("read_threads", 1)
    one = _read_all(capi_cpu, paths, bufs)
    capi_cpu.set_option("read_threads", threads)
    capi_cpu.set_option("read_thread_min_bytes", 0)
    many = _read_all(capi_cpu, paths, bufs)
    assert many == one
    # And the one-thread read is right: every good object whole, with the chained checksum.
    _, got, digests, data = one
    good = [i for i, p in enumerate(paths) if os.path.basename(p).startswith(b"o")]
    assert len(good) == len(payloads)
    for i in good:
        p = payloads[int(os.path.basename(paths[i])[1:])]
        assert got[i] == HEADER + len(p) and digests[i] == _chain(p, 4096) and data[i][:len(p)] == p
    assert sorted(g for i, g in enumerate(got) if i not in good) == \
        sorted([HEADER + 100, HEADER + 60_001, 10, -errno.ENOENT, -errno.EISDIR])
    assert [d for i, d in enumerate(digests) if i not in good].count(None) == 4


def _reads_past_a_stalled_object(capi: ops.CApi, tmp_path: Path, wait_s: float) -> tuple[bool, list[int]]:
    """Read [a FIFO nobody writes yet, a regular file]: whether the file's bytes landed while
    the FIFO's open still waited for a writer (only another read thread can get them), and
    ``got``.  After ``wait_s`` the FIFO gets its writer, so the read always ends."""
    tmp_path.mkdir(exist_ok=True)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    payload = b"\x5a" * 8192
    paths = [os.fsencode(str(fifo)), _write(tmp_path / "file", b"f" * HEADER, payload)]
    out = np.zeros((2, len(payload)), dtype=np.uint8)
    result: dict = {}

    def read() -> None:
        result["r"] = capi.read_files_hashed(paths, [int(out.ctypes.data), int(out.ctypes.data) + len(payload)],
                                              [len(payload)] * 2, HEADER, 4096, 4096)

    reader = threading.Thread(target=read)
    reader.start()
    deadline = time.monotonic() + wait_s
    landed = False
    while time.monotonic() < deadline and not landed:
        landed = bool(out[1, -1] == 0x5A)  # the reader holds no GIL: its writes show as they land
        time.sleep(0.005)
    with open(fifo, "wb"):  # lets the FIFO's open return; the read on it then fails
        pass
    reader.join(30)
    assert not reader.is_alive()
    return landed, result["r"][1]


def test_other_objects_are_read_while_one_stalls(capi_cpu: ops.CApi, tmp_path: Path, read_options: dict) -> None:
    """With several read threads a slow object (a cold file, here a FIFO's open) holds up
    only its own thread; with one, the objects after it wait."""
    _need_hashed(capi_cpu)
    capi_cpu.set_option("read_threads", 2)
    capi_cpu.set_option("read_thread_min_bytes", 0)
    landed, got = _reads_past_a_stalled_object(capi_cpu, tmp_path / "two", 20.0)
    assert landed and got[1] == HEADER + 8192 and got[0] < 0
    capi_cpu.set_option("read_threads", 1)
    landed, got = _reads_past_a_stalled_object(capi_cpu, tmp_path / "one", 0.3)
    assert not landed and got[1] == HEADER + 8192 and got[0] < 0


def test_read_thread_min_bytes_keeps_small_batches_on_the_caller(capi_cpu: ops.CApi, tmp_path: Path,
                                                                 read_options: dict) -> None:
    """A batch of less than read_thread_min_bytes of payload per thread reads on the calling
    thread alone."""
    _need_hashed(capi_cpu)
    capi_cpu.set_option("read_threads", 4)
    capi_cpu.set_option("read_thread_min_bytes", 1 << 20)  # the batch below moves 16 KiB
    landed, _ = _reads_past_a_stalled_object(capi_cpu, tmp_path, 0.3)
    assert not landed


def test_read_thread_options_default_and_refuse_bad_values(capi_cpu: ops.CApi, read_options: dict) -> None:
    assert read_options["read_threads"] == max(1, min(4, os.sysconf("SC_NPROCESSORS_ONLN") // 2))
    assert read_options["read_thread_min_bytes"] == 2 << 20
    for name, bad in (("read_threads", 0), ("read_threads", -2), ("read_threads", 257), ("read_thread_min_bytes", -1)):
        with pytest.raises(ops.SwapOpError, match=f"'{name}' is unknown or value {bad} is out of its range"):
            capi_cpu.set_option(name, bad)
        assert capi_cpu.get_option(name) == read_options[name]
    capi_cpu.set_option("read_threads", 256)
    assert capi_cpu.get_option("read_threads") == 256
