"""Per-key status codes of a storage batch (:class:`Status`), shared by the storage backends
that return them and the scheduler's storage tier that counts them.

It lives in ``core`` because the tier (``core/storage_tier.py``) reads these codes and core
imports nothing above it (docs/architecture.md, "Import layers");
``fastdeploy_kvcache.storage.base`` re-exports :class:`Status` for the backends.
"""

from __future__ import annotations

import enum

__all__ = ["Status"]


class Status(enum.IntEnum):
    """Per-key result of a batch get or put.  Gets return bytes read (>= 0) instead of OK."""

    OK = 0
    MISSING = -1
    """No object under the key (never stored, evicted, or removed since an exists check)."""
    CORRUPT = -2
    """The object failed its checksum or is truncated; it was deleted and counted."""
    FULL = -3
    """No space: the store is full (Mooncake -200) or the disk is (ENOSPC, free-space floor)."""
    UNREACHABLE = -4
    """The store could not be reached for this key (Mooncake RPC/transfer failure)."""
    TIMEOUT = -5
    IO = -6
    """Any other I/O error (permissions, a short read of a healthy file...)."""
    INVALID = -7
    """Bad arguments for this key, e.g. a buffer smaller than the object."""

    @property
    def kind(self) -> str:
        """The ``StorageError.kind`` / ``stats()['errors']`` name of a failure status."""
        return _STATUS_KIND[self]


_STATUS_KIND = {
    Status.OK: "ok",
    Status.MISSING: "missing",
    Status.CORRUPT: "corrupt",
    Status.FULL: "full",
    Status.UNREACHABLE: "unreachable",
    Status.TIMEOUT: "timeout",
    Status.IO: "io",
    Status.INVALID: "invalid",
}
