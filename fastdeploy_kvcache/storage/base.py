"""The storage tier's backend interface, its typed errors, and its per-key status codes.

A storage backend holds *objects*: one object is one KV block (all layers, K and V, and
scales where there are any) as one contiguous byte string, under a key from
:mod:`fastdeploy_kvcache.storage.keys`.  Backends move bytes between objects and host
memory the caller owns (registered once with :meth:`StorageBackend.register_buffer`), so a
put or get is a copy between that memory and the store, never through Python ``bytes``.

Result convention (one for every backend)
-----------------------------------------
* A batch call that could not run *at all* raises :class:`StorageError`: bad arguments
  (``kind="invalid"``), the tier is off or the store cannot be reached
  (``"unreachable"``), the call ran past its time limit (``"timeout"``), the write queue
  is full (``"busy"``).
* Otherwise it returns one ``int`` per key, so a partly failed batch is visible key by
  key: for gets, the number of bytes read (``>= 0``) or a negative :class:`Status`; for
  puts, ``Status.OK`` (0) or a negative :class:`Status`.  A get that returns a negative
  status wrote nothing the caller may use; the caller treats that block as a miss and
  recomputes it.

NOTE: per-key ints rather than exceptions because a batch of 64 blocks where block 40 was
evicted between the existence check and the get is the normal case, not an exceptional
one: the scheduler uses the prefix that did arrive (keys 0..39) and recomputes the rest.

A node counts as stored only once a put has returned ``Status.OK`` for its key; an async
put (:meth:`StorageBackend.submit_put_from`) is a future of the same list.
"""

from __future__ import annotations

import abc
import logging
import numbers
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

from fastdeploy_kvcache.core.storage_status import Status

logger = logging.getLogger(__name__)

__all__ = [
    "ERROR_KINDS",
    "Status",
    "StorageError",
    "StorageHealth",
    "StorageBackend",
    "validate_batch",
]

ERROR_KINDS = ("unreachable", "full", "missing", "corrupt", "timeout", "io", "invalid", "busy")
"""Every ``StorageError.kind`` and every key of the ``errors`` counters in ``stats()``."""


class StorageError(RuntimeError):
    """A storage call that failed as a whole.  ``kind`` is one of :data:`ERROR_KINDS`."""

    def __init__(self, kind: str, message: str) -> None:
        if kind not in ERROR_KINDS:
            raise ValueError(f"StorageError kind must be one of {ERROR_KINDS}, got {kind!r}")
        super().__init__(f"[{kind}] {message}")
        self.kind = kind


@dataclass
class StorageHealth:
    """What the scheduler needs to decide whether to use the tier this step.

    ``available`` is the one bit it must check: False means every call would raise
    ``StorageError("unreachable")`` right now (tier off: not set up yet, or the breaker is
    open).  The rest is for logs and metrics.
    """

    available: bool
    backend: str
    breaker: str = "closed"  # closed | open | half_open
    consecutive_failures: int = 0
    detail: str = ""
    used_bytes: Optional[int] = None
    capacity_bytes: Optional[int] = None
    extra: dict[str, Any] = field(default_factory=dict)
    generation: int = 0
    """Changes whenever the store may have lost objects without saying which (a restarted
    Mooncake master, a holder that went away): the caller forgets what it knew was stored."""


_INT, _STR = {int}, {str}


def validate_batch(
    op: str, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
) -> tuple[list[str], list[int], list[int]]:
    """Raise ``StorageError("invalid")`` naming the argument and index of bad batch input.

    Checked before anything is read or written, so a bad batch changes nothing.  Returns the
    batch as lists of Python ints (numpy integers accepted).
    """
    if not (len(keys) == len(ptrs) == len(sizes)):
        raise StorageError(
            "invalid", f"{op}: keys, ptrs and sizes differ in length ({len(keys)}, {len(ptrs)}, {len(sizes)})"
        )
    # Fast path (a prefetch of hundreds of keys, every call): plain ints and distinct str keys.
    # Each test is one C-level pass (a generator per element cost ~0.4 us a key).
    if (not keys or (set(map(type, ptrs)) == _INT and set(map(type, sizes)) == _INT and set(map(type, keys)) == _STR
                     and min(ptrs) > 0 and min(sizes) > 0 and all(keys) and len(set(keys)) == len(keys))):
        return list(keys), list(ptrs), list(sizes)
    seen: set[str] = set()
    for i, (key, ptr, size) in enumerate(zip(keys, ptrs, sizes)):
        if not isinstance(key, str) or not key:
            raise StorageError("invalid", f"{op}: keys[{i}] must be a non-empty str, got {key!r}")
        if key in seen:
            raise StorageError("invalid", f"{op}: keys[{i}] = {key!r} appears twice in one batch")
        seen.add(key)
        if not isinstance(ptr, numbers.Integral) or isinstance(ptr, bool) or ptr <= 0:
            raise StorageError("invalid", f"{op}: ptrs[{i}] must be a non-null address (int), got {ptr!r}")
        if not isinstance(size, numbers.Integral) or isinstance(size, bool) or size <= 0:
            raise StorageError("invalid", f"{op}: sizes[{i}] must be a positive int, got {size!r}")
    return list(keys), [int(p) for p in ptrs], [int(x) for x in sizes]


class StorageBackend(abc.ABC):
    """One storage tier backend (``file`` or ``mooncake``).

    Thread safety: every method may be called from any thread; batch calls from several
    threads may run concurrently.  Nothing here blocks longer than the backend's per-call
    time limit, and the constructor never blocks on a remote service.
    """

    name: str = "base"
    _loss_listener: Optional[Callable[[list[str]], None]] = None

    # ------------------------------------------------------------------ losses
    def set_loss_listener(self, listener: Optional[Callable[[list[str]], None]]) -> None:
        """Call ``listener(keys)`` whenever this backend removes objects on its own.

        Evictions (byte cap, free-space floor, a full disk), deleted corrupt objects and
        misses of keys it thought it held: a caller that remembers what is stored (the
        scheduler's stored-set) forgets those keys, so the blocks are written again when
        next computed.  It may be called from any of the backend's threads, so it must only
        hand the keys over (e.g. append to a deque).  Losses the backend cannot name are
        announced by :attr:`StorageHealth.generation` instead.
        """
        self._loss_listener = listener

    @property
    def generation(self) -> int:
        """:attr:`StorageHealth.generation`, without the rest of ``health()`` (cheap)."""
        return 0

    def _report_lost(self, keys: list[str]) -> None:
        listener = self._loss_listener
        if listener is not None and keys:
            try:
                listener(keys)
            except Exception:  # noqa: BLE001 - a listener must never fail a storage call
                logger.warning("storage loss listener raised", exc_info=True)

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Declare host memory that later ``ptrs`` point into (zero-copy transfers).

        Register the whole staging or host pool once, at start; ptrs outside every
        registered region are refused with ``StorageError("invalid")``.
        """

    @abc.abstractmethod
    def unregister_buffer(self, ptr: int) -> None:
        """Forget a region from :meth:`register_buffer` (before freeing it)."""

    # ------------------------------------------------------------------ data
    @abc.abstractmethod
    def batch_exists(self, keys: Sequence[str]) -> int:
        """How many consecutive keys from the start exist (one round trip).

        Existence is a hint: a key may vanish before the get (eviction, a dead holder), which
        the get reports as ``Status.MISSING``.
        """

    @abc.abstractmethod
    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Read each object into ``ptrs[i]`` (capacity ``sizes[i]``): bytes read or a negative Status.

        An object larger than its buffer gives ``Status.INVALID`` for that key and writes
        nothing past the buffer.  After any negative result the buffer's bytes are
        unspecified (they may hold part of the object): callers use only buffers whose
        result is the object's size.
        """

    @property
    def reads_segments(self) -> bool:
        """Whether :meth:`batch_get_segments` works (the file backend with the native
        library); a transfer tests it to skip its staging copy."""
        return False

    def batch_get_segments(self, keys: Sequence[str], seg_ptrs: Sequence[int], seg_bytes: Sequence[int]) -> list[int]:
        """Read each object straight into ``len(seg_bytes)`` segments: object i's bytes fill
        ``seg_ptrs[i * S + t]`` (``seg_bytes[t]`` bytes) for t in order.  Results as
        :meth:`batch_get_into` for objects of ``sum(seg_bytes)`` bytes.  Raises
        ``StorageError("invalid")`` where :attr:`reads_segments` is False."""
        raise StorageError("invalid", f"batch_get_segments: the {self.name} backend does not read into segments")

    @abc.abstractmethod
    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        """Store ``sizes[i]`` bytes at ``ptrs[i]`` under ``keys[i]``: ``Status.OK`` or negative.

        Overwrites an existing object (the bytes of a key never differ in practice, but a
        partial object from an older writer must not survive).  Returns once the bytes are
        stored (file: renamed into place; mooncake: acknowledged by the store), so the source
        memory may be reused as soon as this returns.
        """

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> int:
        """Remove the objects (missing keys are ignored); returns how many were removed."""

    @abc.abstractmethod
    def health(self) -> StorageHealth:
        """Cheap, non-blocking: current availability and breaker state."""

    def available(self) -> bool:
        """Whether calls may go out now: ``health().available``, for a hot path that needs no
        detail (a backend whose health() costs a system call answers cheaper)."""
        return bool(self.health().available)

    def keep_new_objects(self, on: bool) -> None:
        """While on, objects put from now on are not evicted to make room for later puts: a
        put that would have to answers ``Status.FULL`` instead.  The stop flush turns it on,
        so a store smaller than the cache fills once and says so, rather than evicting what
        the flush just wrote (each eviction then reported lost and written again).  A
        backend whose store evicts on its own (Mooncake's master) ignores it; the flush then
        does not write again what it wrote and lost (``StorageTier``)."""

    @abc.abstractmethod
    def stats(self) -> dict[str, Any]:
        """Counters for metrics: bytes/seconds read and written, errors by kind, ..."""

    @abc.abstractmethod
    def close(self) -> None:
        """Drain queued writes, stop threads, release the connection.  Idempotent."""

    # ------------------------------------------------------------------ async
    @abc.abstractmethod
    def submit_put_from(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> "Future[list[int]]":
        """Queue a :meth:`batch_put_from` on the backend's writer thread.

        Returns a future of the per-key results.  The source memory must stay untouched
        until the future is done (a host block being written is not reallocated).  Raises
        ``StorageError("busy")`` when the bounded queue is full: the caller skips the
        backup this step instead of blocking the scheduler.
        """

    @abc.abstractmethod
    def submit_get_into(
        self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> "Future[list[int]]":
        """Queue a :meth:`batch_get_into` on the backend's reader thread (prefetch)."""

    # ------------------------------------------------------------------ helpers
    def __enter__(self) -> "StorageBackend":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
