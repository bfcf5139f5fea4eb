"""The file backend's readers (storage/file_read.py) on real files: what they report for
whole, longer, torn, empty and missing objects, at sizes that are not a multiple of the
piece size, and the backend's verdicts through the piecewise reader."""

from __future__ import annotations

import errno
from pathlib import Path

import numpy as np
import pytest
import xxhash

from fastdeploy_kvcache.storage import Status
from fastdeploy_kvcache.storage import file_backend
from fastdeploy_kvcache.storage.file_backend import FileBackend
from fastdeploy_kvcache.storage.file_format import CHECKSUM_PIECE, FORMAT_VERSION, HEADER, MAGIC, checksum
from fastdeploy_kvcache.storage.file_read import hash_group, mem, read_object

from .conftest import HostArena, use_reader

NS = "fdkv1-test-0123456789abcdef-tp0of1"


def write_object(path: Path, payload: bytes, claimed: int | None = None, version: int = FORMAT_VERSION) -> None:
    """An object file as the backend writes it (``claimed``: the header's payload size;
    ``version`` 1: one xxh3-64 over the whole payload, as objects written before version 2)."""
    size = len(payload) if claimed is None else claimed
    digest = xxhash.xxh3_64_intdigest(payload) if version == 1 else checksum(memoryview(payload))
    path.write_bytes(HEADER.pack(MAGIC, version, HEADER.size, size, digest, 0) + payload)


def chain(payload: bytes) -> int:
    """The version-2 checksum spelled out: xxh3-64 of each 512 KiB piece, seeded with the last."""
    seed = 0
    for at in range(0, len(payload), CHECKSUM_PIECE):
        seed = xxhash.xxh3_64_intdigest(payload[at:at + CHECKSUM_PIECE], seed)
    return seed


def read(path: Path, size: int, chunk: int) -> tuple[int, int | None, bytes, bytes]:
    """read_object into fresh buffers; returns (got, digest, header bytes, payload bytes)."""
    header = bytearray(HEADER.size)
    payload = np.full(size, 0xEE, dtype=np.uint8)
    got, digest = read_object(str(path), memoryview(header), mem(int(payload.ctypes.data), size), chunk)
    return got, digest, bytes(header), payload.tobytes()


def test_checksum_is_plain_xxh3_for_one_piece_and_a_chain_beyond() -> None:
    rng = np.random.default_rng(0)
    for size in (0, 1, 65_536, CHECKSUM_PIECE, CHECKSUM_PIECE + 1, 3 * CHECKSUM_PIECE, 3 * CHECKSUM_PIECE - 7):
        payload = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert checksum(memoryview(payload)) == (xxhash.xxh3_64_intdigest(payload) if size <= CHECKSUM_PIECE
                                                 else chain(payload))
        assert checksum(memoryview(payload), 1) == xxhash.xxh3_64_intdigest(payload)
    two = rng.integers(0, 256, 2 * CHECKSUM_PIECE, dtype=np.uint8)
    swapped = np.concatenate([two[CHECKSUM_PIECE:], two[:CHECKSUM_PIECE]])
    assert checksum(memoryview(two)) != checksum(memoryview(swapped))  # the chain keeps the pieces' order


@pytest.mark.parametrize("size, chunk", [(10_000, 4096), (4096, 4096), (4097, 4096), (1, 4096), (300_001, 65_536),
                                         (65_536, 1 << 20), (CHECKSUM_PIECE * 2 + 12_345, 3000),
                                         (CHECKSUM_PIECE * 2 + 12_345, CHECKSUM_PIECE),
                                         (CHECKSUM_PIECE * 2, CHECKSUM_PIECE), (CHECKSUM_PIECE * 3 - 1, 1 << 20)])
def test_whole_object_any_size_and_piece(tmp_path: Path, size: int, chunk: int) -> None:
    payload = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8).tobytes()
    path = tmp_path / "o.kv"
    write_object(path, payload)
    got, digest, header, data = read(path, size, chunk)
    assert got == HEADER.size + size
    assert digest == checksum(memoryview(payload)) == HEADER.unpack(header)[4]
    assert data == payload and HEADER.unpack(header)[3] == size


def test_version_1_header_gets_no_digest_from_the_reader(tmp_path: Path) -> None:
    """The reader hashes the current version only; the verdict hashes older objects whole."""
    payload = bytes(range(256)) * 40
    path = tmp_path / "o.kv"
    write_object(path, payload, version=1)
    got, digest, _, data = read(path, len(payload), 4096)
    assert got == HEADER.size + len(payload) and digest is None and data == payload


def test_longer_file_reports_the_byte_past_and_hashes_only_the_buffer(tmp_path: Path) -> None:
    payload = bytes(range(256)) * 40  # 10,240 bytes
    path = tmp_path / "o.kv"
    write_object(path, payload)
    with open(path, "ab") as f:
        f.write(b"tail")
    got, digest, _, data = read(path, len(payload), 4096)
    assert got == HEADER.size + len(payload) + 1
    assert digest == checksum(memoryview(payload)) and data == payload


@pytest.mark.parametrize("cut", [HEADER.size + 4096, HEADER.size + 5000, HEADER.size + 10_239, HEADER.size, 7, 0])
def test_torn_file_has_no_digest(tmp_path: Path, cut: int) -> None:
    """A file cut anywhere (on a piece boundary, inside a piece, inside the header, empty)
    reports how much it held and no digest: the payload it claims never fully arrived."""
    payload = bytes(range(256)) * 40
    path = tmp_path / "o.kv"
    write_object(path, payload)
    path.write_bytes(path.read_bytes()[:cut])
    got, digest, _, _ = read(path, len(payload), 4096)
    assert got == cut and digest is None


def test_empty_object_digest_is_the_hash_of_nothing(tmp_path: Path) -> None:
    path = tmp_path / "o.kv"
    write_object(path, b"")
    got, digest, _, data = read(path, 8192, 4096)
    assert got == HEADER.size and digest == xxhash.xxh3_64_intdigest(b"")
    assert data == b"\xee" * 8192  # nothing written into the buffer


def test_header_claiming_less_hashes_only_the_claim(tmp_path: Path) -> None:
    payload = bytes(range(200)) * 50  # 10,000 bytes
    path = tmp_path / "o.kv"
    write_object(path, payload[:6000], claimed=6000)
    got, digest, _, data = read(path, len(payload), 4096)
    assert got == HEADER.size + 6000 and digest == xxhash.xxh3_64_intdigest(payload[:6000])
    assert data[:6000] == payload[:6000]


def test_missing_file_and_directory_are_errnos(tmp_path: Path) -> None:
    assert read(tmp_path / "absent.kv", 4096, 4096)[:2] == (-errno.ENOENT, None)
    (tmp_path / "dir.kv").mkdir()
    got, digest, _, _ = read(tmp_path / "dir.kv", 4096, 4096)
    assert got == -errno.EISDIR and digest is None


def test_hash_group_hashes_whole_objects_only() -> None:
    size = 5000
    buf = np.random.default_rng(1).integers(0, 256, 4 * size + CHECKSUM_PIECE + 1, dtype=np.uint8)
    base = int(buf.ctypes.data)
    ptrs = [base + 3 * size, base, base + size, base + 4 * size]  # any order, gaps allowed
    sizes = [size, size, size, CHECKSUM_PIECE + 1]
    got = [HEADER.size + size, HEADER.size + size - 1, -errno.ENOENT, HEADER.size + CHECKSUM_PIECE + 1]
    out = hash_group(ptrs, sizes, got, HEADER.size)
    assert out == [xxhash.xxh3_64_intdigest(buf[3 * size:4 * size].tobytes()), None, None,
                   chain(buf[4 * size:].tobytes())]


def key(i: int) -> str:
    return f"{NS}:{i:032x}"


@pytest.fixture(params=["piecewise", "hashed"])
def piecewise(request: pytest.FixtureRequest, tmp_path: Path, arena: HostArena,
              monkeypatch: pytest.MonkeyPatch) -> FileBackend:
    """A backend that reads every object piecewise, in pieces that do not divide 64 KiB:
    in Python, or in the C ABI's read that hashes as it reads."""
    monkeypatch.setattr(file_backend, "_CHUNKED_READ_MIN_BYTES", 1)
    monkeypatch.setattr(file_backend, "_HASH_CHUNK", 3000)
    monkeypatch.setattr(file_backend, "_HASHED_READ_STEP", 3000)
    backend = FileBackend(tmp_path, min_free_bytes=0)
    backend.register_buffer(arena.ptr, arena.nbytes)
    if request.param == "piecewise":
        backend._hashed_step = 0
    else:
        use_reader(backend, "hashed")
    yield backend
    backend.close()


@pytest.mark.parametrize("damage", ["flip_last_byte", "flip_piece_boundary", "cut_piece_boundary", "torn_tail"])
def test_damage_in_any_piece_is_a_miss(piecewise: FileBackend, arena: HostArena, tmp_path: Path, damage: str) -> None:
    size = arena.slot_bytes
    for i in range(3):
        arena.fill(i, seed=10 + i)
    assert piecewise.batch_put_from([key(i) for i in range(3)], [arena.slot_ptr(i) for i in range(3)],
                                    [size] * 3) == [Status.OK] * 3
    path = tmp_path / (key(1).replace(":", "=") + ".kv")
    raw = bytearray(path.read_bytes())
    if damage == "flip_last_byte":  # in the last, partial piece (65,536 = 21 * 3000 + 2536)
        raw[-1] ^= 0x01
    elif damage == "flip_piece_boundary":
        raw[HEADER.size + 3000] ^= 0x80
    elif damage == "cut_piece_boundary":
        raw = raw[:HEADER.size + 6000]
    else:  # a torn write: the second half from another object
        other = (tmp_path / (key(2).replace(":", "=") + ".kv")).read_bytes()
        raw[HEADER.size + size // 2:] = other[HEADER.size + size // 2:]
    path.write_bytes(bytes(raw))
    out = piecewise.batch_get_into([key(i) for i in range(3)], [arena.slot_ptr(8 + i) for i in range(3)], [size] * 3)
    assert out == [size, Status.CORRUPT, size]
    assert not path.exists() and piecewise.stats()["corrupt_objects"] == 1
    np.testing.assert_array_equal(arena.slot(8), arena.slot(0))
    np.testing.assert_array_equal(arena.slot(10), arena.slot(2))


@pytest.mark.parametrize("reader", ["hashed", "native", "piecewise"])
def test_every_reader_gives_the_same_verdict_on_empty_and_zero_byte_files(
        tmp_path: Path, arena: HostArena, monkeypatch: pytest.MonkeyPatch, reader: str) -> None:
    if reader == "piecewise":
        monkeypatch.setattr(file_backend, "_CHUNKED_READ_MIN_BYTES", 1)
        monkeypatch.setattr(file_backend, "_HASH_CHUNK", 3000)
    backend = FileBackend(tmp_path, min_free_bytes=0)
    backend.register_buffer(arena.ptr, arena.nbytes)
    use_reader(backend, "python" if reader == "piecewise" else reader)
    write_object(tmp_path / (key(0).replace(":", "=") + ".kv"), b"")  # a well-formed empty object
    (tmp_path / (key(1).replace(":", "=") + ".kv")).write_bytes(b"")  # a zero-byte file
    out = backend.batch_get_into([key(0), key(1)], [arena.slot_ptr(0), arena.slot_ptr(1)], [arena.slot_bytes] * 2)
    assert out == [0, Status.CORRUPT]
    assert not (tmp_path / (key(1).replace(":", "=") + ".kv")).exists()
    backend.close()



@pytest.mark.parametrize("reader", ["hashed", "native", "piecewise"])
@pytest.mark.parametrize("size", [768 << 10, (1 << 20) + 4321])
def test_objects_of_several_pieces_in_both_versions_read_back_and_damage_is_a_miss(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, size: int, reader: str) -> None:
    """Objects written before version 2 (one xxh3-64 over the payload) still read back; a
    flipped byte in the last piece is a miss in both versions; an unknown version is too."""
    if reader == "native":  # the native group read, which serves only small objects by default
        monkeypatch.setattr(file_backend, "_CHUNKED_READ_MIN_BYTES", 1 << 30)
    if reader == "hashed":  # a step that divides neither the piece nor the object
        monkeypatch.setattr(file_backend, "_HASHED_READ_STEP", 100_000)
    arena = HostArena(6, size)
    backend = FileBackend(tmp_path, min_free_bytes=0)
    backend.register_buffer(arena.ptr, arena.nbytes)
    use_reader(backend, "python" if reader == "piecewise" else reader)
    data = [arena.fill(i, seed=20 + i).tobytes() for i in range(3)]
    assert backend.batch_put_from([key(0)], [arena.slot_ptr(0)], [size]) == [Status.OK]  # version 2
    files = [tmp_path / (key(i).replace(":", "=") + ".kv") for i in range(3)]
    assert HEADER.unpack(files[0].read_bytes()[:HEADER.size])[1:5] == (FORMAT_VERSION, HEADER.size, size,
                                                                     chain(data[0]))
    write_object(files[1], data[1], version=1)
    write_object(files[2], data[2], version=1)
    keys, dsts = [key(i) for i in range(3)], [arena.slot_ptr(3 + i) for i in range(3)]
    assert backend.batch_get_into(keys, dsts, [size] * 3) == [size] * 3
    for i in range(3):
        assert arena.slot(3 + i).tobytes() == data[i]
    for f in files[:2]:  # flip a byte in the last piece of a version 2 and a version 1 object
        raw = bytearray(f.read_bytes())
        raw[-2] ^= 0x10
        f.write_bytes(bytes(raw))
    raw = bytearray(files[2].read_bytes())
    raw[4:6] = (3).to_bytes(2, "little")  # a version this code does not know
    files[2].write_bytes(bytes(raw))
    assert backend.batch_get_into(keys, dsts, [size] * 3) == [Status.CORRUPT] * 3
    assert not any(f.exists() for f in files) and backend.stats()["corrupt_objects"] == 3
    backend.close()
