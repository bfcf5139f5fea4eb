"""Reading the file backend's objects into the caller's buffers, checksummed on the way in.

Why the checksum is computed here and not after the read: a page-cache read is a copy at
memory speed, and xxh3 over the same bytes costs a fifth to a quarter of that copy when the
bytes come from memory, but only a few percent when they are still in the CPU's cache.  So
every reader here hashes a piece right after it lands, while it is hot:

* :func:`read_object` reads one object in pieces of ``chunk`` bytes (the first piece with
  the header, the last with the byte past the payload) and hashes each piece after its
  ``preadv``.  The file system calls and the hash of a piece over 64 KiB release the GIL.
* :func:`hash_group` hashes objects that a batch read (the C ABI's ``read_files``) has just
  put in place, slicing one view of the group's memory instead of building a view per object.

Both return the same ``(got, digest)`` pairs, so one verdict function serves every reader.
``got`` counts the file's bytes read (header, payload and at most one byte past it: a longer
file shows up without an ``fstat``) or is ``-errno``; ``digest`` is the xxh3-64 of the
first ``min(claimed, buffer)`` payload bytes, or None where the file ended before them.
"""

from __future__ import annotations

import ctypes
import errno
import os
import struct
from typing import Optional, Sequence

import xxhash

__all__ = ["HEADER", "MAGIC", "FORMAT_VERSION", "mem", "read_object", "hash_group"]

MAGIC = b"FDKV"
FORMAT_VERSION = 1
# magic, version, header bytes, payload bytes, xxh3-64 of the payload, reserved.
HEADER = struct.Struct("<4sHHQQQ")
assert HEADER.size == 32
_PAYLOAD_FIELD = 3  # index of "payload bytes" in HEADER's fields
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def mem(ptr: int, size: int) -> memoryview:
    """A writable byte view over ``size`` bytes at ``ptr`` (no copy)."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def read_object(path: str, header: memoryview, payload: memoryview, chunk: int) -> tuple[int, Optional[int]]:
    """Read the object at ``path``: its header into ``header``, payload into ``payload``.

    Reads in pieces of at most ``chunk`` payload bytes, each hashed right after it lands.
    Returns ``(got, digest)`` as the module doc says.
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        return -(exc.errno or errno.EIO), None
    try:
        return _read_fd(fd, header, payload, chunk)
    except OSError as exc:
        return -(exc.errno or errno.EIO), None
    finally:
        os.close(fd)


def _read_fd(fd: int, header: memoryview, payload: memoryview, chunk: int) -> tuple[int, Optional[int]]:
    hsize, size = len(header), len(payload)
    past = bytearray(1)  # filled only when the file is longer than header + payload
    h = xxhash.xxh3_64()
    got = 0  # file bytes read so far (= the next read's offset)
    done = 0  # payload bytes in place
    want = -1  # payload bytes to hash: the header's claim, capped at the buffer; -1 until read
    while True:
        end = min(size, done + chunk)
        iov = [header[got:]] if got < hsize else []
        if done < size:
            iov.append(payload[done:end])
        if end == size:
            iov.append(past)
        asked = sum(len(v) for v in iov)
        n = os.preadv(fd, iov, got)
        if n == 0:
            break  # end of file
        got += n
        before, done = done, min(max(0, got - hsize), size)
        if want < 0 and got >= hsize:
            want = min(HEADER.unpack_from(header)[_PAYLOAD_FIELD], size)
        if before < want:
            h.update(payload[before:min(done, want)])
        if got > hsize + size or (n < asked and done == size):
            # The byte past the payload came (a longer file), or the file ended right after
            # the payload (the usual case): nothing more to read.
            break
        # NOTE: a read short of the payload's end is not taken as the end of the file: the
        # next read says (0 bytes), so a file system that returns short reads costs a
        # syscall, not a good object.
    return got, (h.intdigest() if 0 <= want <= done else None)


def hash_group(ptrs: Sequence[int], sizes: Sequence[int], got: Sequence[int], header_size: int) -> list[Optional[int]]:
    """xxh3-64 of each object a batch read just put in place, while the group is in cache.

    Only whole objects (``got == header_size + size``, the only ones that can pass as they
    are) are hashed; the others get None and their verdict hashes what the header claims.
    """
    base = min(ptrs)
    span = mem(base, max(p + s for p, s in zip(ptrs, sizes)) - base)
    # NOTE: one view over the group's range, sliced per object: a view per object (a ctypes
    # array type lookup and a cast) cost as much as hashing a 64 KiB object.  Only the
    # objects' own bytes are ever touched, never a gap between them.
    digest = xxhash.xxh3_64_intdigest
    return [digest(span[p - base:p - base + s]) if n == header_size + s else None
            for p, s, n in zip(ptrs, sizes, got)]
