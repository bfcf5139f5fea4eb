"""The storage tier: a backend interface, a ``file`` and a ``mooncake`` backend, keys, and
the worker-side transfer between host-tier blocks and storage objects.

See ``docs/storage.md``.  Importing this package imports neither Paddle nor Mooncake.
"""

from __future__ import annotations

from typing import Any

from fastdeploy_kvcache.storage.base import (
    ERROR_KINDS,
    Status,
    StorageBackend,
    StorageError,
    StorageHealth,
)
from fastdeploy_kvcache.storage.keys import KeyNamespace, block_key, block_keys, weights_fingerprint

__all__ = [
    "ERROR_KINDS",
    "Status",
    "StorageBackend",
    "StorageError",
    "StorageHealth",
    "KeyNamespace",
    "block_key",
    "block_keys",
    "weights_fingerprint",
    "BACKENDS",
    "make_storage_backend",
]

BACKENDS = ("file", "mooncake")


def make_storage_backend(kind: str, **kwargs: Any) -> StorageBackend:
    """``--kvcache-storage-backend``: build a ``file`` or ``mooncake`` backend.

    ``file`` takes ``path`` (``--kvcache-storage-path``) and ``capacity_bytes``
    (``--kvcache-storage-size``); ``mooncake`` takes the MooncakeBackend arguments (its
    ``config``, a ``MooncakeConfig``, defaults to the MOONCAKE_* environment variables).
    """
    if kind == "file":
        from fastdeploy_kvcache.storage.file_backend import FileBackend

        return FileBackend(**kwargs)
    if kind == "mooncake":
        from fastdeploy_kvcache.storage.mooncake_backend import MooncakeBackend

        return MooncakeBackend(**kwargs)
    raise ValueError(f"storage backend must be one of {BACKENDS}, got {kind!r}")
