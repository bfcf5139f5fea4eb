"""Reading the file backend's objects into the caller's buffers, checksummed on the way in.

Why the checksum is computed here and not after the read: a page-cache read is a copy at
memory speed (13 to 17 GB/s on the development VM), and xxh3 over the same bytes runs at 20
to 30 GB/s when they come from memory, but at 90 to 130 GB/s while they are still in the
CPU's cache, a sixth or less of the copy.  So every reader here hashes a piece right after
it lands, while it is hot:

* :func:`read_object` reads one object in pieces of ``chunk`` bytes (the first piece with
  the header, the last with the byte past the payload) and hashes each complete checksum
  piece after the ``preadv`` that completed it.  The file system calls and the hash of a
  piece over 64 KiB release the GIL.
* :func:`hash_group` hashes objects that a batch read (the C ABI's ``read_files``) has just
  put in place, slicing one view of the group's memory instead of building a view per object.

Both return the same ``(got, digest)`` pairs, so one verdict (:func:`~.file_format.verdict`) serves every reader,
and so does the C ABI's ``read_objects``, which the file backend prefers where built (it
reads and hashes in C: see the backend's module doc).
``got`` counts the file's bytes read (header, payload and at most one byte past it: a longer
file shows up without an ``fstat``) or is ``-errno``; ``digest`` is the :func:`checksum` of
the first ``min(claimed, buffer)`` payload bytes, or None where the file ended before them or
the header is not of the current version (the verdict then hashes what the header claims).

The object format and :func:`~.file_format.checksum` are :mod:`.file_format`'s.
"""

from __future__ import annotations

import ctypes
import errno
import os
from typing import Optional, Sequence

import xxhash

from fastdeploy_kvcache.storage.file_format import CHECKSUM_PIECE, checksum, current_payload_size

__all__ = ["hash_group", "mem", "read_object", "views"]

_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_CLOEXEC", 0)


def mem(ptr: int, size: int) -> memoryview:
    """A writable byte view over ``size`` bytes at ``ptr`` (no copy)."""
    return memoryview((ctypes.c_char * size).from_address(ptr)).cast("B")


def read_object(path: str, header: memoryview, payload: memoryview, chunk: int) -> tuple[int, Optional[int]]:
    """Read the object at ``path``: its header into ``header``, payload into ``payload``.

    Reads in pieces of at most ``chunk`` payload bytes; each checksum piece is hashed right
    after the read that completed it.  Returns ``(got, digest)`` as the module doc says.
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
    digest = xxhash.xxh3_64_intdigest
    seed = 0  # the chain so far
    hashed = 0  # payload bytes hashed
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
        done = min(max(0, got - hsize), size)
        if want == -1 and got >= hsize:
            claim = current_payload_size(header)
            # Not the current version: no digest here, the verdict hashes (or rejects) it.
            want = min(claim, size) if claim is not None else -2
        while hashed + CHECKSUM_PIECE <= min(done, want):
            seed = digest(payload[hashed:hashed + CHECKSUM_PIECE], seed)
            hashed += CHECKSUM_PIECE
        if got > hsize + size or (n < asked and done == size):
            # The byte past the payload came (a longer file), or the file ended right after
            # the payload (the usual case): nothing more to read.
            break
        # NOTE: a read short of the payload's end is not taken as the end of the file: the
        # next read says (0 bytes), so a file system that returns short reads costs a
        # syscall, not a good object.
    if want < 0 or done < want:
        return got, None
    if hashed < want or want == 0:  # the last, partial piece (or an empty payload)
        seed = digest(payload[hashed:want], seed)
    return got, seed


def hash_group(ptrs: Sequence[int], sizes: Sequence[int], got: Sequence[int], header_size: int) -> list[Optional[int]]:
    """:func:`checksum` of each object a batch read just put in place, while the group is in cache.

    Only whole objects (``got == header_size + size``, the only ones that can pass as they
    are) are hashed; the others get None and their verdict hashes what the header claims.
    """
    return [checksum(v) if n == header_size + len(v) else None for v, n in zip(views(ptrs, sizes), got)]


def views(ptrs: Sequence[int], sizes: Sequence[int]) -> list[memoryview]:
    """Writable byte views of ``sizes[i]`` bytes at ``ptrs[i]``, cut from one view of their range.

    NOTE: a view per object (:func:`mem`: a ctypes array type lookup and a cast) cost as
    much as hashing a 64 KiB object.  Only the objects' own bytes are ever touched, never a
    gap between them.
    """
    base = min(ptrs)
    span = mem(base, max(p + s for p, s in zip(ptrs, sizes)) - base)
    return [span[p - base:p - base + s] for p, s in zip(ptrs, sizes)]
