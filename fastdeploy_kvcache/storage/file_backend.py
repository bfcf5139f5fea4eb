"""The ``file`` storage backend: one object per file in one directory, LRU-capped.

The object format (header, checksum) and the verdict on an object as read are
:mod:`.file_format`'s, key -> path is :mod:`.file_paths`'s, the index (LRU order, held
objects, bytes) is :class:`~.file_index.ObjectIndex`'s; this module does the I/O and acts on
the verdicts.

* **Atomic writes.**  Header and payload go to ``.tmp-<key>-<pid>-<n>`` in the same
  directory with one ``writev``, then ``rename`` puts the object in place.  A crash or a
  full disk leaves at most a temp file, which the next start deletes; a reader never sees
  half an object under its key.
* **Checksum.**  Verified on every read, after the payload lands in the caller's buffer
  (zero-copy ``preadv`` into registered memory).  A mismatch or a short file counts as a
  miss (``Status.CORRUPT``); the file is deleted and ``corrupt_objects`` counted.
* **Capacity.**  ``capacity_bytes`` caps the files' total size; a put past it evicts the
  least recently used objects first, never an object of its own batch or, while
  :meth:`FileBackend.keep_new_objects` is on (the stop flush), one put since: then the put
  answers ``Status.FULL``.  The LRU order is seeded at start from the files
  already there (oldest ``max(atime, mtime)`` first).  A hit is recorded in a list and moved
  to the end of the in-memory order before anything reads or changes that order (a put, an
  eviction), which gives the same order as moving it at once; the files' atimes are refreshed later, off the read path: after
  the next put batch (puts run in the background), at close, or on the writer thread once
  ``_MAX_UNFLUSHED_TOUCHES`` hits are waiting.  A utime per hit cost a prefetch a quarter of
  its time, and a refresh right behind a read still competed with the engine for the GIL.
  A restart keeps the order up to the last refresh.  ``min_free_bytes`` keeps a floor of free space on the file
  system: a put that would cross it evicts too, and fails with ``Status.FULL`` when nothing
  of ours is left to evict.  ``ENOSPC`` (the floor undershot, or 0) evicts the same way,
  down to the floor plus the object, and retries the put once; if it still fails it is
  ``Status.FULL`` with the temp file removed.  Repeated I/O errors are logged once per
  minute per kind, with a count (:class:`~.log_limit.ThrottledLog`).
* **Healing.**  Every object this backend removes on its own (evicted, corrupt, larger
  than the buffer, or a header that claims more than the file holds) is reported to the
  loss listener (:meth:`StorageBackend.set_loss_listener`), so the scheduler stores the
  block again when it next computes it.  A non-file (a directory, say) at an object's path
  is reported once and its key skipped: a miss for gets and existence checks, a quiet
  ``Status.IO`` for puts, until it is gone.
* **Reads.**  Where the C ABI has it (built with xxHash's header, on a CPU with AVX-512),
  ``read_objects`` reads a thread's whole slice of a batch in one call that holds no GIL,
  ``_HASHED_READ_STEP`` bytes per ``preadv``, hashes each step right after it lands, while
  it is in the CPU cache, and compares each header and checksum with what it read: Python
  builds one buffer of paths per call and looks only at the objects that failed (the
  verdicts below), so a batch of good objects costs a few C-level passes, not a loop.
  ``batch_get_segments`` is the same read with each payload spread over a host tier's layer
  segments (an ``fstat`` first, so an object of another size never touches them).
  Elsewhere, objects under 256 KiB: one ``open``, one ``preadv`` (header, payload, and one
  byte past it, which tells a longer file without an ``fstat``) and one ``close`` each, a
  group of at most 1 MiB of them in one native call (``read_files``) that holds no GIL;
  each group is hashed right after its read, while it is still in the CPU cache.  Objects
  of 256 KiB and more (and every object where the library is not built) are read in Python
  in 512 KiB pieces, each hashed as it lands (:mod:`.file_read`); the file system calls and
  the hash release the GIL, so the engine thread and the server's event loop run while a
  prefetch reads.  Python then checks each header and checksum.  Hashing from the cache
  costs about a sixth of the page-cache copy on the development VM; a group of 256 KiB
  objects, hashed after its 1 MiB read, had partly left the cache (0.76 of a plain read in
  CPU time against 0.79 piecewise; 512 KiB objects 0.75 against 0.81).
* **Threads.**  Reads run on at most ``read_threads`` threads per batch (default
  :func:`default_read_threads`, ``--kvcache-storage-read-threads``): where the native
  read hashes as it reads, one call takes the whole batch and spreads its objects over that
  many threads of its own (each free thread takes the next object, so mixed sizes balance;
  the backend sets the C library's process-wide ``read_threads`` option to it); elsewhere
  the batch is split into contiguous slices of at least ``_MIN_KEYS_PER_THREAD`` keys, one
  per thread.  ``batch_put_from`` splits the same way over at most ``io_threads`` threads.
  File I/O releases the GIL, and an NVMe drive or a cold page cache wants several reads in
  flight; a task per key would cost more in hand-offs than a page-cache read of 64 KiB.
  ``submit_put_from`` queues a batch on the writer thread.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import itertools
import logging
import os
import time
from collections import Counter
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from fastdeploy_kvcache.storage.base import Status, StorageBackend, StorageError, StorageHealth, validate_batch
from fastdeploy_kvcache.storage.buffers import BufferRegistry
from fastdeploy_kvcache.storage.executor import BoundedExecutor
from fastdeploy_kvcache.storage.file_index import ObjectIndex
from fastdeploy_kvcache.storage.file_format import (CHECKSUM_PIECE, FORMAT_VERSION, HEADER, describe_kv_format,
                                                    encode_header, foreign_kv_format, is_whole_and_good, verdict)
from fastdeploy_kvcache.storage.file_paths import ObjectPaths, check_key, check_keys
from fastdeploy_kvcache.storage.file_read import hash_group, mem, read_object, views
from fastdeploy_kvcache.storage.log_limit import ThrottledLog
from fastdeploy_kvcache.storage.stats import StorageStats

logger = logging.getLogger(__name__)

__all__ = ["FileBackend", "default_io_threads", "default_read_threads", "MAX_READ_THREADS", "check_read_threads"]

# Fewer keys than this per thread cost more in hand-offs than the reads they spread.
_MIN_KEYS_PER_THREAD = 16
# Hits whose atime refresh may wait for a put batch or close before the writer does it.
_MAX_UNFLUSHED_TOUCHES = 8192
# The checksum must run while the bytes just read are still in the CPU cache (see file_read):
# objects of at least _CHUNKED_READ_MIN_BYTES (and every object where the C ABI is not built)
# are read and hashed in pieces of _HASH_CHUNK bytes; smaller ones go to the native batch read
# in groups of at most _READ_GROUP_BYTES, each group hashed right after its read.
_CHUNKED_READ_MIN_BYTES = 256 << 10
_HASH_CHUNK = 512 << 10
_READ_GROUP_BYTES = 1 << 20
# The native read that hashes as it reads (``read_objects``): bytes per read, each hashed
# right after it lands.  It takes a whole slice of a batch in one call: it holds no GIL and
# needs no group to keep its bytes in the cache.
_HASHED_READ_STEP = 256 << 10


# The most reader threads a batch may use (the C library's read_threads option's bound).
MAX_READ_THREADS = 256
# The default's cap: more readers than this gained nothing a default should bet on.
_DEFAULT_READ_THREADS_CAP = 16


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, which a container's cpuset narrows;
    ``os.cpu_count()`` where the platform has no mask)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def default_read_threads() -> int:
    """Half the usable CPUs, 1 to 16: a batch read from the page cache is CPU work (copy
    and checksum), and the engine's step loop and the server's event loop need the other
    half; a cold read gains from several reads in flight.  On a 2-core VM two threads made
    warm reads slower than one (docs/storage.md, "Measurements"), which
    this gives (1); a 16-core GPU host gets 8."""
    return max(1, min(_DEFAULT_READ_THREADS_CAP, usable_cpus() // 2))


def check_read_threads(value: Any, name: str = "read_threads") -> int:
    """``value`` as a reader-thread count (1 to :data:`MAX_READ_THREADS`), else ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_READ_THREADS:
        raise ValueError(f"{name} must be an int from 1 to {MAX_READ_THREADS}, got {value!r}")
    return value


def default_io_threads() -> int:
    """Half the cores, 1 to 4: the GIL-held part of each read (checksum, bookkeeping) makes
    more threads than cores slower on page-cache hits."""
    return max(1, min(4, (os.cpu_count() or 2) // 2))


class FileBackend(StorageBackend):
    """Objects as files under ``path``.

    Args:
        path: the directory (created if missing).  Several processes may share it; each keeps
            its own LRU view, and a file evicted by another process is simply a miss.
        capacity_bytes: cap on the objects' total size (``--kvcache-storage-size``); 0 means
            no cap besides ``min_free_bytes``.
        min_free_bytes: free space on the file system that puts never consume.
        io_threads: most threads one put batch's keys are spread over (default
            :func:`default_io_threads`).
        read_threads: most threads one batch read runs on (default
            :func:`default_read_threads`; 1 to :data:`MAX_READ_THREADS`).  With the native
            hashed read this sets the C library's process-wide ``read_threads`` option.
        max_pending_writes: batches queued on the writer thread before ``submit_put_from``
            answers ``StorageError("busy")``.
        fsync: fsync each object before the rename (durable across power loss; slower).
    """

    name = "file"

    def __init__(
        self,
        path: Union[str, os.PathLike],
        capacity_bytes: int = 0,
        min_free_bytes: int = 1 << 30,
        io_threads: Optional[int] = None,
        max_pending_writes: int = 64,
        fsync: bool = False,
        read_threads: Optional[int] = None,
        kv_format: int = 0,
    ) -> None:
        if capacity_bytes < 0:
            raise ValueError(f"capacity_bytes must be >= 0 (0: no cap), got {capacity_bytes}")
        if min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be >= 0, got {min_free_bytes}")
        if io_threads is None:
            io_threads = default_io_threads()
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise ValueError(f"io_threads must be >= 1, got {io_threads}")
        read_threads = check_read_threads(default_read_threads() if read_threads is None else read_threads)
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._dir = str(self.path)
        self._paths = ObjectPaths(self._dir)
        self.fsync = fsync
        self._stats = StorageStats()
        self._index = ObjectIndex(capacity_bytes, min_free_bytes, remove=self._remove_evicted, lost=self._evicted)
        self._lock = self._index.lock
        self._tmp_counter = itertools.count()
        self._buffers = BufferRegistry()
        self._closed = False
        self.io_threads = io_threads
        self._native = _native_reader()
        # Bytes per read of the native read that hashes as it reads (and can scatter each
        # payload over segments); 0 where the library lacks it (then the older readers hash).
        self._hashed_step = _HASHED_READ_STEP if self._native is not None and self._native.has_read_objects else 0
        self.read_threads = read_threads
        if self._hashed_step:
            # NOTE: process-wide (the C library keeps one value); a server builds one backend.
            self._native.set_option("read_threads", read_threads)
        self._touch_flush_queued = False
        self._log = ThrottledLog(logger)
        # The KV format (file_format.kv_format_code) written into each object's header and
        # required of each object read; 0: neither (a plain byte store).
        if isinstance(kv_format, bool) or not isinstance(kv_format, int) or kv_format < 0:
            raise ValueError(f"kv_format must be an int >= 0 (file_format.kv_format_code), got {kv_format!r}")
        self.kv_format = kv_format
        self._blocked: set[str] = set()  # keys whose path holds a non-file (reported once)
        # Keys whose bytes a put is writing now (a count per key: two puts may race on one).
        # A read that finds no file for such a key does not forget it (see _forget_missing).
        self._writing: Counter[str] = Counter()
        self._seed()
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="fdkv-file-io") if io_threads > 1 else None
        # Python-level read slices only where the native read does not thread itself.
        self._read_pool = (ThreadPoolExecutor(max_workers=read_threads, thread_name_prefix="fdkv-file-read")
                           if read_threads > 1 and not self._hashed_step else None)
        self._writer = BoundedExecutor("fdkv-file-writer", max_pending_writes)
        self._reader = BoundedExecutor("fdkv-file-reader", max_pending_writes)

    # ------------------------------------------------------------------ names
    def file_path(self, key: str) -> str:
        """The file that holds ``key`` (a benchmark reads it directly as its baseline)."""
        return self._paths.path(key)

    # ------------------------------------------------------------------ start-up
    def _seed(self) -> None:
        """Rebuild the LRU from the directory: oldest use first; drop stale temp files."""
        entries: list[tuple[float, str, int]] = []
        stale = 0
        with os.scandir(self._dir) as it:
            for entry in it:
                if ObjectPaths.is_temp(entry.name):
                    try:
                        os.unlink(entry.path)
                        stale += 1
                    except OSError:
                        pass
                    continue
                key = ObjectPaths.key_of(entry.name)
                if key is None or not entry.is_file(follow_symlinks=False):
                    continue
                st = entry.stat(follow_symlinks=False)
                entries.append((max(st.st_atime, st.st_mtime), key, st.st_size))
        entries.sort()
        evicted = self._index.seed((key, size) for _, key, size in entries)
        logger.info(
            "file storage %s: %d objects, %.3f GiB (cap %s), %d stale temp files removed, %d evicted to fit",
            self._dir, len(self._index), self._index.used_bytes / (1 << 30),
            f"{self.capacity_bytes / (1 << 30):.3f} GiB" if self.capacity_bytes else "none", stale, evicted,
        )

    # ------------------------------------------------------------------ LRU and space
    @property
    def capacity_bytes(self) -> int:
        """Cap on the objects' total size (0: none); settable (tests shrink a running store)."""
        return self._index.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        self._index.capacity_bytes = int(value)

    @property
    def min_free_bytes(self) -> int:
        return self._index.min_free_bytes

    def keep_new_objects(self, on: bool) -> None:
        """While on, no put evicts an object put since it was turned on: a put that would
        have to answers ``Status.FULL`` (the stop flush; see :mod:`.file_index`)."""
        self._index.keep_new_objects(on)

    def _remove_evicted(self, key: str) -> None:
        """The index evicted ``key``: delete its file (called with the index's lock held)."""
        try:
            os.unlink(self.file_path(key))
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._log.warning("evict", "file storage: could not evict %s: %s", key, exc)

    def _evicted(self, keys: list[str]) -> None:
        if keys:
            self._stats.add("evicted", len(keys))
            self._report_lost(keys)

    def _free_bytes(self) -> int:
        st = os.statvfs(self._dir)
        return st.f_bavail * st.f_frsize

    def _reserve(self, key: str, size: int) -> bool:
        """Make room for an object of ``size`` bytes and hold it; False when it cannot fit."""
        return self._index.reserve(key, size + HEADER.size, self._free_bytes if self.min_free_bytes else None)

    def _unreserve(self, key: str) -> None:
        self._index.unreserve(key)

    def _touch(self, keys: Sequence[str]) -> None:
        """Hits: newest in the in-memory LRU now; their files' atimes later (:meth:`_flush_touches`)."""
        self._index.touch(keys)

    def _queue_touch_flush(self) -> None:
        """Refresh atimes on the writer thread once many hits wait (never blocks a read)."""
        with self._lock:
            if (self._touch_flush_queued or self._index.pending_touches() < _MAX_UNFLUSHED_TOUCHES
                    or self._closed):
                return
            self._touch_flush_queued = True
        try:
            self._writer.submit(self._flush_touches)
        except StorageError:  # busy or closing: the next batch queues it again
            with self._lock:
                self._touch_flush_queued = False

    def _flush_touches(self) -> int:
        """Set atime = now on every file hit since the last flush (the LRU seed of a restart)."""
        keys = self._index.take_touched()
        with self._lock:
            self._touch_flush_queued = False
        now = time.time_ns()
        for key in keys:
            path = self.file_path(key)
            try:
                st = os.stat(path)
                os.utime(path, ns=(now, st.st_mtime_ns))
            except OSError:
                pass  # evicted or deleted meanwhile: nothing to order
        return len(keys)

    # ------------------------------------------------------------------ one object
    def _put_one(self, key: str, ptr: int, size: int) -> int:
        if key in self._blocked and self._still_blocked(key):
            return Status.IO
        with self._lock:
            self._writing[key] += 1
        try:
            return self._put_with_retry(key, ptr, size)
        finally:
            with self._lock:
                self._writing[key] -= 1
                if not self._writing[key]:
                    del self._writing[key]

    def _put_with_retry(self, key: str, ptr: int, size: int) -> int:
        try:
            return self._put_once(key, ptr, size)
        except _DiskFull:
            pass
        # NOTE: ENOSPC although our floor let the put through: the disk is fuller than
        # statvfs promised, or the floor is 0.  Evict down to the floor and retry once, so a
        # full disk keeps turning over instead of freezing the store's contents.
        if self._index.make_room_after_enospc(size + HEADER.size, self._free_bytes):
            try:
                return self._put_once(key, ptr, size)
            except _DiskFull:
                pass
        return Status.FULL

    def _put_once(self, key: str, ptr: int, size: int) -> int:
        """One attempt; raises :class:`_DiskFull` on ENOSPC / EDQUOT (nothing left behind)."""
        if not self._reserve(key, size):
            return Status.FULL
        payload = mem(ptr, size)
        header = encode_header(payload, self.kv_format)
        tmp = self._paths.temp_path(key, next(self._tmp_counter))
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            self._unreserve(key)
            return self._os_status("put", key, exc)
        try:
            try:
                views = [memoryview(header), payload]
                remaining = HEADER.size + size
                while remaining:
                    written = os.writev(fd, views)
                    remaining -= written
                    views = _advance(views, written)
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            # NOTE: the rename and the index check are one step under the index's lock, as
            # are eviction, delete and a read's forgetting: a concurrent put may have evicted
            # this key's reservation while its bytes were written (a tiny cap), and an
            # untracked file would escape the cap, so it is dropped instead of renamed.
            with self._lock:
                kept = key in self._index
                if kept:
                    os.rename(tmp, self.file_path(key))
            if not kept:
                os.unlink(tmp)
                return Status.FULL
        except OSError as exc:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            self._unreserve(key)
            return self._os_status("put", key, exc)
        return Status.OK

    def _get_slice(self, keys: Sequence[str], ptrs: Sequence[Any], sizes: Sequence[int],
                   seg_bytes: Optional[list[int]] = None) -> list[int]:
        """Read a slice of a batch (one native call where built), then check each object.

        ``ptrs[i]``: object i's buffer, or with ``seg_bytes`` its segments' addresses."""
        if self._blocked and not self._blocked.isdisjoint(keys):
            out = [int(Status.MISSING)] * len(keys)
            idx = [i for i, k in enumerate(keys) if k not in self._blocked]
            if idx:
                part = self._get_slice([keys[i] for i in idx], [ptrs[i] for i in idx], [sizes[i] for i in idx],
                                       seg_bytes)
                for i, r in zip(idx, part):
                    out[i] = r
            return out
        if self._reads_hashed():
            return self._read_objects(keys, ptrs, sizes, seg_bytes)
        group = max(1, _READ_GROUP_BYTES // max(sizes))
        if len(keys) <= group:
            return self._read_and_check(keys, ptrs, sizes)
        out = []
        for lo in range(0, len(keys), group):
            out += self._read_and_check(keys[lo:lo + group], ptrs[lo:lo + group], sizes[lo:lo + group])
        return out

    def _reads_hashed(self) -> bool:
        """Whether reads go to the native read that hashes as it reads (``read_objects``)."""
        return self._native is not None and self._hashed_step > 0

    def _read_objects(self, keys: Sequence[str], ptrs: Sequence[Any], sizes: Sequence[int],
                      seg_bytes: Optional[list[int]]) -> list[int]:
        """One ``read_objects`` call for the slice; Python looks only at the objects whose
        header and checksum the call did not find right (state 2 is a whole, good object).

        Segment reads check each file's size first, so an object of another size never
        touches the segments (a host block stays as it was, as with a staging copy); its verdict
        comes from :meth:`_verdict_via_scratch`."""
        hsize = HEADER.size
        if seg_bytes is None:
            segs, lens, per, shared = ptrs, sizes, 1, False
        else:
            segs, lens, per, shared = list(itertools.chain.from_iterable(ptrs)), seg_bytes, len(seg_bytes), True
        headers, got, digests, states = self._native.read_objects(
            self._paths.blob(keys), len(keys), segs, lens, per, shared, hsize, CHECKSUM_PIECE, self._hashed_step,
            FORMAT_VERSION, seg_bytes is not None)
        if states.count(2) == len(states) and not self.kv_format:
            self._touch(keys)
            return list(sizes)
        out: list[int] = []
        for i, (k, state) in enumerate(zip(keys, states)):
            if state == 2:
                out.append(self._own_format(k, headers, i * hsize, sizes[i]))
            elif state == 3:
                out.append(self._verdict_via_scratch(k, ptrs[i], sizes[i], seg_bytes))
            else:
                out.append(self._check_read(k, ptrs[i], sizes[i], headers, i * hsize, got[i],
                                            digests[i] if state else None, seg_bytes))
        return self._touch_hits(keys, out)

    def _touch_hits(self, keys: Sequence[str], results: list[int]) -> list[int]:
        """:meth:`_touch` the keys whose result is a hit; returns ``results``."""
        hits = [k for k, r in zip(keys, results) if r >= 0]
        if hits:
            self._touch(hits)
        return results

    def _verdict_via_scratch(self, key: str, segs: Sequence[int], size: int, seg_bytes: Optional[list[int]]) -> int:
        """The verdict on an object whose file is not ``size`` payload bytes long (or not a file),
        as :meth:`batch_get_into` gives it: read whole into a scratch buffer and checked.
        The segments stay untouched unless the object turns out whole after all (replaced
        meanwhile): then it is copied into them."""
        hsize = HEADER.size
        scratch = bytearray(size)
        view = (ctypes.c_char * size).from_buffer(scratch)
        ptr = ctypes.addressof(view)
        try:
            headers, got, digests, states = self._native.read_objects(
                self._paths.blob([key]), 1, [ptr], [size], 1, False, hsize, CHECKSUM_PIECE, self._hashed_step,
                FORMAT_VERSION)
            r = (self._own_format(key, headers, 0, size) if states[0] == 2 else
                 self._check_read(key, ptr, size, headers, 0, got[0], digests[0] if states[0] else None))
            if r == size and seg_bytes is not None:
                at = 0
                for seg, n in zip(segs, seg_bytes):
                    ctypes.memmove(seg, ptr + at, n)
                    at += n
            return r
        finally:
            del view

    def _read_and_check(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read a group of objects (see ``_READ_GROUP_BYTES``) where the native hashed read is
        not built, hashing each while it is in the CPU cache (see :mod:`.file_read`), then
        check each one."""
        hsize = HEADER.size
        digests: Sequence[Optional[int]]
        if self._native is None or min(sizes) >= _CHUNKED_READ_MIN_BYTES:
            headers = bytearray(len(keys) * hsize)
            hview = memoryview(headers)
            read = [read_object(self.file_path(k), hview[i * hsize:(i + 1) * hsize], v, _HASH_CHUNK)
                    for i, (k, v) in enumerate(zip(keys, views(ptrs, sizes)))]
            got = [r[0] for r in read]
            digests = [r[1] for r in read]
        else:
            headers, got = self._native.read_files([os.fsencode(self.file_path(k)) for k in keys], ptrs, sizes, hsize)
            digests = hash_group(ptrs, sizes, got, hsize)
        out: list[int] = []
        for i, (k, ptr, size, n, digest) in enumerate(zip(keys, ptrs, sizes, got, digests)):
            at = i * hsize
            if is_whole_and_good(headers, at, n, size, digest):
                out.append(self._own_format(k, headers, at, size))
                continue
            out.append(self._check_read(k, ptr, size, headers, at, n, digest))
        return self._touch_hits(keys, out)

    def _check_read(self, key: str, ptr: Any, size: int, headers: bytearray, at: int, got: int,
                    digest: Optional[int] = None, seg_bytes: Optional[list[int]] = None) -> int:
        """The verdict on one object as read (``got``: bytes or -errno), for every reader.

        ``digest``: the payload's checksum where the reader computed it already.  ``ptr``:
        the payload's buffer, or with ``seg_bytes`` its segments' addresses."""
        path = self.file_path(key)
        if got < 0:
            err = -got
            if err == errno.ENOENT:
                self._forget_missing(key)
                return Status.MISSING
            return self._os_status("get", key, OSError(err, os.strerror(err), path))
        result, why = verdict(headers, at, got, size, digest, lambda n: _payload(ptr, n, seg_bytes))
        if why:
            self._remove_bad(key, why)
            return result
        return self._own_format(key, headers, at, result)

    def _own_format(self, key: str, headers: Any, at: int, size: int) -> int:
        """``size`` for a whole, good object of this backend's KV format (or unrecorded); an
        object of another KV format is never read as this one: it is deleted and is a miss."""
        other = foreign_kv_format(headers, at, self.kv_format)
        if other is None:
            return size
        self._log.warning("foreign-kv-format", "file storage: object %s holds %s KV, this server's KV is %s: "
                          "deleted, counted as a miss (a store is never read as another KV dtype)", key,
                          describe_kv_format(other), describe_kv_format(self.kv_format))
        self._drop(key)
        return Status.MISSING

    def _remove_bad(self, key: str, why: str) -> None:
        self._log.warning("bad-object", "file storage: bad object %s (%s): deleted, counted as a miss", key, why)
        self._drop(key)

    def _drop(self, key: str) -> None:
        """Delete ``key``'s file and forget it, as one step under the index's lock (a put's
        rename takes the same lock, so the index and the directory never disagree)."""
        with self._lock:
            try:
                os.unlink(self.file_path(key))
            except OSError:
                pass
            self._index.pop_locked(key)
        self._report_lost([key])

    def _forget_missing(self, key: str) -> None:
        """A read found no file for ``key``: forget it, unless a put is writing it now or its
        file appeared since the read looked (a put landed meanwhile)."""
        with self._lock:
            if key in self._writing or os.path.exists(self.file_path(key)):
                return
            self._index.pop_locked(key)
        self._report_lost([key])

    def _os_status(self, op: str, key: str, exc: OSError) -> int:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._log.warning(f"{op}-full", "file storage %s %s: disk full (%s); evicting LRU objects", op, key, exc)
            if op == "put":
                raise _DiskFull() from exc
            return Status.FULL
        if exc.errno in (errno.EISDIR, errno.ENOTDIR, errno.ENOTEMPTY, errno.EEXIST) and self._not_a_file(key):
            return Status.IO if op == "put" else Status.MISSING
        self._log.warning(f"{op}-{exc.errno}", "file storage %s %s: %s", op, key, exc)
        return Status.IO

    def _not_a_file(self, key: str) -> bool:
        """Whether a non-file sits at ``key``'s path: reported once, the key skipped since."""
        path = self.file_path(key)
        try:
            if not os.path.lexists(path) or os.path.isfile(path):
                return False
        except OSError:
            return False
        with self._lock:
            first = key not in self._blocked
            self._blocked.add(key)
        if first:
            logger.warning("file storage: %s is not a regular file; key %s is skipped (a miss; puts fail) "
                           "until it is removed", path, key)
            self._stats.record_error("io")
        return True

    def _still_blocked(self, key: str) -> bool:
        path = self.file_path(key)
        if os.path.lexists(path) and not os.path.isfile(path):
            return True
        with self._lock:
            self._blocked.discard(key)
        return False

    # ------------------------------------------------------------------ batches
    def _map(self, fn: Any, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """``fn`` (one object) over the batch, in contiguous slices, one per thread."""

        def run(ks: Sequence[str], ps: Sequence[int], ns: Sequence[int]) -> list[int]:
            return [int(fn(k, p, n)) for k, p, n in zip(ks, ps, ns)]

        return self._map_slices(run, keys, ptrs, sizes)

    def _map_slices(self, fn: Any, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int],
                    reads: bool = False) -> list[int]:
        """``fn`` (a slice of the batch) over contiguous slices, one per thread (see the module
        doc): the put pool, or with ``reads`` the read pool (none where the native read threads
        itself: the whole batch is one call)."""
        n = len(keys)
        pool, most = (self._read_pool, self.read_threads) if reads else (self._pool, self.io_threads)
        threads = min(most, n // _MIN_KEYS_PER_THREAD) if pool is not None else 1
        if threads <= 1:
            return fn(keys, ptrs, sizes)
        step = -(-n // threads)
        out: list[int] = []
        for part in pool.map(lambda lo: fn(keys[lo:lo + step], ptrs[lo:lo + step], sizes[lo:lo + step]),
                                   range(0, n, step)):
            out += part
        return out

    def _check(
        self, op: str, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[str], list[int], list[int]]:
        if self._closed:
            raise StorageError("unreachable", f"{op}: the file backend is closed")
        keys, ptrs, sizes = validate_batch(op, keys, ptrs, sizes)
        check_keys(op, keys)
        self._buffers.check(op, ptrs, sizes)
        return keys, ptrs, sizes

    def _check_segments(self, op: str, keys: Sequence[str], seg_ptrs: Sequence[int],
                        seg_bytes: Sequence[int]) -> tuple[list[str], list[list[int]], list[int], list[int]]:
        """Validate a segment batch (see :meth:`batch_get_segments`); returns the keys, each
        object's segment addresses, the object sizes and the segment lengths."""
        if self._closed:
            raise StorageError("unreachable", f"{op}: the file backend is closed")
        if not self.reads_segments:
            raise StorageError("invalid", f"{op}: this file backend has no native segment read (the C ABI's "
                                          f"read_objects, built with xxHash on a CPU with AVX-512); use batch_get_into")
        lens = list(seg_bytes)
        if not lens:
            raise StorageError("invalid", f"{op}: seg_bytes is empty; each object needs at least one segment")
        for t, n in enumerate(lens):
            if type(n) is not int or n <= 0:
                raise StorageError("invalid", f"{op}: seg_bytes[{t}] must be a positive int, got {n!r}")
        per = len(lens)
        ptrs = list(seg_ptrs)
        if len(ptrs) != len(keys) * per:
            raise StorageError("invalid", f"{op}: {len(ptrs)} seg_ptrs for {len(keys)} keys of {per} segments "
                                          f"(need {len(keys) * per})")
        size = sum(lens)
        keys, _, _ = validate_batch(op, keys, [1] * len(keys), [size] * len(keys))
        if ptrs and (set(map(type, ptrs)) != {int} or min(ptrs) <= 0):
            for i, ptr in enumerate(ptrs):
                if type(ptr) is not int or ptr <= 0:
                    raise StorageError("invalid", f"{op}: seg_ptrs[{i}] must be a non-null address (int), got {ptr!r}")
        check_keys(op, keys)
        # Segment t of every object usually lies in one host-tier tensor: one span check each.
        if any(not self._buffers.spans_one_region(ptrs[t::per], lens[t]) for t in range(per)):
            self._buffers.check(op, ptrs, lens * len(keys), name="seg_ptrs")
        return keys, [ptrs[i:i + per] for i in range(0, len(ptrs), per)], [size] * len(keys), lens

    def register_buffer(self, ptr: int, nbytes: int) -> None:
        self._buffers.add(ptr, nbytes)

    def unregister_buffer(self, ptr: int) -> None:
        self._buffers.remove(ptr)

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Consecutive keys from the start whose files exist (a stat each, no read: in one
        native call where the library has it, else in Python).

        Only regular files count: a directory at an object's path is a miss."""
        self._stats.add("exists_calls")
        if self._native is not None and self._native.has_files_exist:
            check_keys("batch_exists", keys)
            count = self._native.files_exist(self._paths.blob(keys), len(keys)) if keys else 0
            if count < len(keys) and os.path.lexists(self.file_path(keys[count])):
                self._not_a_file(keys[count])
            return count
        count = 0
        for i, key in enumerate(keys):
            check_key("batch_exists", i, key)
            if not os.path.isfile(self.file_path(key)):
                if os.path.lexists(self.file_path(key)):
                    self._not_a_file(key)
                break
            count += 1
        return count

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        keys, ptrs, sizes = self._check("batch_get_into", keys, ptrs, sizes)
        start = time.perf_counter()
        results = self._map_slices(self._get_slice, keys, ptrs, sizes, reads=True)
        self._stats.record_reads(results, time.perf_counter() - start)
        self._queue_touch_flush()
        return results

    @property
    def reads_segments(self) -> bool:
        """Whether :meth:`batch_get_segments` works: the C ABI's ``read_objects`` is built
        (with xxHash, on a CPU with AVX-512)."""
        return self._reads_hashed()

    def batch_get_segments(self, keys: Sequence[str], seg_ptrs: Sequence[int], seg_bytes: Sequence[int]) -> list[int]:
        """Read each object's payload straight into segments (a host tier's layer-major
        blocks): object i's bytes fill ``seg_ptrs[i * S + t]`` (``seg_bytes[t]`` bytes, S =
        ``len(seg_bytes)``) for t in order, with no copy through a staging buffer.

        Results, verdicts, stats, LRU touches and loss reports are those of
        :meth:`batch_get_into` for objects of ``sum(seg_bytes)`` bytes; every segment must lie
        in a registered buffer.  The segments hold the object only where the result is
        ``sum(seg_bytes)``: an object of another size leaves them untouched (each file's size
        is checked first), while after any other negative result (a corrupt or truncated
        object, an I/O error) they hold unspecified bytes.  Raises
        ``StorageError("invalid")`` (nothing read) for bad input or where
        :attr:`reads_segments` is False.
        """
        keys, ptrs, sizes, lens = self._check_segments("batch_get_segments", keys, seg_ptrs, seg_bytes)
        start = time.perf_counter()
        results = self._map_slices(functools.partial(self._get_slice, seg_bytes=lens), keys, ptrs, sizes, reads=True)
        self._stats.record_reads(results, time.perf_counter() - start)
        self._stats.add("segment_read_keys", len(keys))
        self._queue_touch_flush()
        return results

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        keys, ptrs, sizes = self._check("batch_put_from", keys, ptrs, sizes)
        start = time.perf_counter()
        try:
            results = self._map(self._put_one, keys, ptrs, sizes)
        finally:
            self._index.release(keys)  # held while the batch ran: its own puts never evict them
        self._stats.record_writes(results, sizes, time.perf_counter() - start)
        if self._index.pending_touches():
            self._flush_touches()  # puts are background work already (see the module doc)
        return results

    def submit_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> "Future[list[int]]":
        keys, ptrs, sizes = self._check("submit_put_from", keys, ptrs, sizes)  # bad input fails now, not later
        return self._writer.submit(self.batch_put_from, keys, ptrs, sizes)

    def submit_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> "Future[list[int]]":
        keys, ptrs, sizes = self._check("submit_get_into", keys, ptrs, sizes)
        return self._reader.submit(self.batch_get_into, keys, ptrs, sizes)

    def delete(self, keys: Sequence[str]) -> int:
        removed = 0
        for i, key in enumerate(keys):
            check_key("delete", i, key)
            with self._lock:
                self._index.pop_locked(key)
                try:
                    os.unlink(self.file_path(key))
                    removed += 1
                except FileNotFoundError:
                    pass
        self._stats.add("deleted", removed)
        self._report_lost(list(keys))
        return removed

    # ------------------------------------------------------------------ state
    @property
    def used_bytes(self) -> int:
        return self._index.used_bytes

    def __len__(self) -> int:
        return len(self._index)

    def lru_keys(self) -> list[str]:
        """Keys, least recently used first (tests and debugging)."""
        return self._index.keys()

    def available(self) -> bool:
        """Open: no statvfs (health() reads the free space too).  A directory that vanished
        shows as misses and failed puts, as it would between two health checks."""
        return not self._closed

    def health(self) -> StorageHealth:
        try:
            free = self._free_bytes()
            ok = not self._closed
            detail = f"{free / (1 << 30):.2f} GiB free on the file system"
        except OSError as exc:
            free, ok, detail = 0, False, f"statvfs failed: {exc}"
        return StorageHealth(
            available=ok, backend=self.name, breaker="closed", detail=detail,
            used_bytes=self._index.used_bytes, capacity_bytes=self.capacity_bytes or None,
            extra={"free_bytes": free, "objects": len(self._index)},
        )

    def stats(self) -> dict[str, Any]:
        snap = self._stats.snapshot()
        snap.update(backend=self.name, used_bytes=self._index.used_bytes, capacity_bytes=self.capacity_bytes,
                    objects=len(self._index), breaker_state="closed", pending_writes=self._writer.pending())
        return snap

    def close(self) -> None:
        if self._closed:
            return
        self._writer.close()
        self._reader.close()
        self._closed = True
        self._flush_touches()
        for pool in (self._pool, self._read_pool):
            if pool is not None:
                pool.shutdown(wait=True)


class _DiskFull(Exception):
    """A put hit ENOSPC / EDQUOT (temp file removed, reservation undone)."""


def _native_reader() -> Optional[Any]:
    """A C ABI library for batch reads (file I/O only: either build serves); None (Python
    reads) where none is built."""
    from fastdeploy_kvcache import ops

    errors = []
    for variant in ("cpu", None):  # None: FDKV_OPS_LIB, or the CUDA build
        try:
            return ops.load_capi(variant=variant)
        except Exception as exc:  # noqa: BLE001 - OpsNotBuiltError, or an old library
            errors.append(str(exc))
    logger.info("file storage: native batch reads unavailable (%s); reading in Python", "; ".join(errors))
    return None


def _payload(ptr: Any, nbytes: int, seg_bytes: Optional[list[int]]) -> Any:
    """The first ``nbytes`` of a payload read into one buffer at ``ptr``, or into segments
    (``ptr``: their addresses, ``seg_bytes``: their lengths; joined in a copy, which only an
    object the native read could not vouch for costs)."""
    if seg_bytes is None:
        return mem(ptr, nbytes)
    return b"".join(mem(p, n) for p, n in zip(ptr, seg_bytes))[:nbytes]


def _advance(views: list[memoryview], nbytes: int) -> list[memoryview]:
    """The iovec list after ``nbytes`` of it were written (a short writev)."""
    out = []
    for v in views:
        if nbytes >= len(v):
            nbytes -= len(v)
            continue
        out.append(v[nbytes:])
        nbytes = 0
    return out
