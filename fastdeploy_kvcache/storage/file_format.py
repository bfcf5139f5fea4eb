"""The file backend's object format: the header layout, the payload checksum and the verdict
on an object as read.

On-disk object (little-endian)::

    offset 0   magic   b"FDKV"
           4   u16     format version (2; version 1 objects are still read)
           6   u16     header bytes (32)
           8   u64     payload bytes
          16   u64     checksum of the payload: xxh3-64 chained over 512 KiB pieces (the
                       plain xxh3-64 for a payload of one piece, and in version 1)
          24   u64     KV format of the payload (:func:`kv_format_code`; 0: not recorded)
          32   payload

The KV format field records the cache dtype, the quantization and the scale layout the
payload was written with.  The key's namespace already differs per format, so a reader never
asks for another format's key; the field makes the object say so itself, and a backend that
knows its format (``FileBackend(kv_format=...)``) treats an object of another format as a
miss (deleted, logged) instead of reading its bytes as its own.  Objects written before the
field existed carry 0 and are read as before.

The checksum (format version 2) is xxh3-64 chained over ``CHECKSUM_PIECE`` pieces of the
payload: each piece hashed in one call, seeded with the previous piece's hash.  For a payload
of one piece (the usual 64 KiB to 512 KiB block) it is the plain xxh3-64 of version 1.
NOTE: the chain, not one streaming xxh3 over the whole payload, because python-xxhash's
streaming ``update`` ran at about 85 GB/s where a one-call hash of the same 512 KiB ran at
about 130 GB/s: over a 17 GB/s page-cache copy that is the difference between a read at
0.76 and at 0.85 of a plain read (CPU time, 1 to 8 MiB objects).

This module only encodes and judges bytes: it does no I/O and keeps no state.  The readers
(:mod:`.file_read`, the C ABI's ``read_objects``) and the backend's writer use it; the
backend acts on a verdict (deletes the file, reports the key lost).
"""

from __future__ import annotations

import struct
from typing import Any, Callable, Optional

import xxhash

from fastdeploy_kvcache.storage.base import Status

__all__ = ["CHECKSUM_PIECE", "FORMAT_VERSION", "HEADER", "MAGIC", "READABLE_VERSIONS", "checksum", "current_payload_size",
           "describe_kv_format", "encode_header", "foreign_kv_format", "is_whole_and_good", "kv_format_code", "verdict"]

MAGIC = b"FDKV"
FORMAT_VERSION = 2  # written; 1 (one xxh3-64 over the whole payload) is still read
READABLE_VERSIONS = (1, 2)
CHECKSUM_PIECE = 512 << 10
# magic, version, header bytes, payload bytes, checksum of the payload, KV format.
HEADER = struct.Struct("<4sHHQQQ")
assert HEADER.size == 32
_VERSION_FIELD, _PAYLOAD_FIELD = 1, 3  # indices in HEADER's fields
_KV_FORMAT = struct.Struct("<Q")
_KV_FORMAT_AT = 24

# KV format code: b"KV" tag in the top 16 bits, then dtype, quantization and scale layout,
# one byte each.  The numbers are part of the on-disk format: append, never renumber.
_KV_TAG = 0x4B56
_KV_DTYPES = {"bfloat16": 1, "float16": 2, "float32": 3, "uint8": 4}
_KV_QUANTS = {None: 0, "int8": 1, "fp8": 2, "block_wise_fp8": 3, "block_wise_int8": 4}
# Scale layout: 0 none; 1 fp32 [heads, block_size] after each layer's K and V bytes (key
# scale, then value scale), the layout every quantized CacheConfig has.
_KV_SCALES = {0: "no scales", 1: "fp32 scales per (head, token) after each layer's K and V"}


def kv_format_code(dtype: str, kv_cache_quant: Optional[str] = None) -> int:
    """The header's KV format field for a cache of ``dtype`` (and ``kv_cache_quant``)."""
    if dtype not in _KV_DTYPES or kv_cache_quant not in _KV_QUANTS:
        raise ValueError(f"kv_format_code: unknown KV format dtype={dtype!r}, kv_cache_quant={kv_cache_quant!r}")
    scales = 1 if kv_cache_quant is not None else 0
    return (_KV_TAG << 48) | (_KV_DTYPES[dtype] << 16) | (_KV_QUANTS[kv_cache_quant] << 8) | scales


def describe_kv_format(code: int) -> str:
    """``"bfloat16"``, ``"uint8/block_wise_fp8 (fp32 scales ...)"``, ``"unrecorded"`` (0), or the raw code."""
    if code == 0:
        return "unrecorded"
    dtypes = {v: k for k, v in _KV_DTYPES.items()}
    quants = {v: k for k, v in _KV_QUANTS.items()}
    dtype, quant, scales = (code >> 16) & 0xFF, (code >> 8) & 0xFF, code & 0xFF
    if code >> 48 != _KV_TAG or dtype not in dtypes or quant not in quants or scales not in _KV_SCALES:
        return f"unknown KV format {code:#x}"
    if quants[quant] is None:
        return dtypes[dtype]
    return f"{dtypes[dtype]}/{quants[quant]} ({_KV_SCALES[scales]})"


def foreign_kv_format(headers: Any, at: int, kv_format: int) -> Optional[int]:
    """The KV format recorded in the header at ``headers[at:]`` when it is neither
    ``kv_format`` nor unrecorded (0); None when the object may be read as ``kv_format``
    (and always when ``kv_format`` is 0: a backend that does not know its own)."""
    if not kv_format:
        return None
    (recorded,) = _KV_FORMAT.unpack_from(headers, at + _KV_FORMAT_AT)
    return recorded if recorded not in (0, kv_format) else None


def checksum(payload: memoryview, version: int = FORMAT_VERSION) -> int:
    """The checksum of ``payload`` as an object of format ``version`` records it."""
    digest = xxhash.xxh3_64_intdigest
    if version == 1 or len(payload) <= CHECKSUM_PIECE:
        return digest(payload)
    seed = 0
    for at in range(0, len(payload), CHECKSUM_PIECE):
        seed = digest(payload[at:at + CHECKSUM_PIECE], seed)
    return seed


def encode_header(payload: memoryview, kv_format: int = 0) -> bytes:
    """The header a new object of ``payload`` is written with (current version), recording
    ``kv_format`` (:func:`kv_format_code`; 0 where the writer does not know it)."""
    return HEADER.pack(MAGIC, FORMAT_VERSION, HEADER.size, len(payload), checksum(payload), kv_format)


def current_payload_size(header: Any) -> Optional[int]:
    """The payload bytes ``header`` claims, if it is of the current version (a reader hashes
    while it reads only then); None otherwise (the verdict hashes, or rejects, the rest)."""
    fields = HEADER.unpack_from(header)
    return fields[_PAYLOAD_FIELD] if fields[_VERSION_FIELD] == FORMAT_VERSION else None


def is_whole_and_good(headers: Any, at: int, got: int, size: int, digest: Optional[int]) -> bool:
    """The fast path of :func:`verdict`: a whole current-version object of ``size`` payload
    bytes whose checksum (``digest``, computed by the reader) holds."""
    if got != HEADER.size + size:
        return False
    magic, version, header_size, payload_size, recorded, _ = HEADER.unpack_from(headers, at)
    return (magic == MAGIC and version == FORMAT_VERSION and header_size == HEADER.size and payload_size == size
            and digest == recorded)


def verdict(headers: Any, at: int, got: int, size: int, digest: Optional[int],
            payload: Callable[[int], Any]) -> tuple[int, str]:
    """The verdict on one object read into a buffer of ``size`` bytes: ``(result, why)``.

    ``got``: the file bytes read (header, payload, at most one byte past it; >= 0, an I/O
    error is the caller's).  ``headers[at:]``: the header read.  ``digest``: the payload's
    checksum where the reader computed it, else None; ``payload(n)`` gives the first ``n``
    payload bytes to hash otherwise.  ``result`` is the payload size of a good object (``why``
    empty), or ``Status.CORRUPT`` (damaged, truncated) or ``Status.INVALID`` (larger than
    the buffer: a key's namespace fixes its object size, so it is foreign or damaged), both
    with ``why`` saying what is wrong; the caller deletes such a file.
    """
    if got < HEADER.size:
        return Status.CORRUPT, f"{got}-byte file has no header"
    magic, version, header_size, payload_size, recorded, _ = HEADER.unpack_from(headers, at)
    if magic != MAGIC or version not in READABLE_VERSIONS or header_size != HEADER.size:
        return Status.CORRUPT, f"bad header (magic {magic!r}, version {version})"
    if payload_size > size:
        if got <= HEADER.size + size:
            return Status.CORRUPT, f"header claims {payload_size} payload bytes, file has {got - HEADER.size}"
        return Status.INVALID, f"object has {payload_size} bytes, buffer {size}"
    if got != HEADER.size + payload_size:
        return Status.CORRUPT, f"file has {got - HEADER.size} payload bytes, header says {payload_size}"
    if digest is None or version != FORMAT_VERSION:  # the readers hash the current version only
        digest = checksum(payload(payload_size), version)
    if digest != recorded:
        return Status.CORRUPT, "checksum mismatch"
    return payload_size, ""
