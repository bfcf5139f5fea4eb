"""The cache manager's exceptions, in one place.

``NoFreeBlocksError`` lives in ``block_pool`` (the pool raises it too) and is
re-exported here so an engine imports every error from one module.
"""

from __future__ import annotations

from fastdeploy_kvcache.core.block_pool import NoFreeBlocksError

__all__ = ["CacheManagerError", "UnknownRequestError", "InvariantViolation", "NoFreeBlocksError"]


class CacheManagerError(ValueError):
    """Bad input to the cache manager; raised before any state is changed."""


class UnknownRequestError(CacheManagerError, KeyError):
    """The request is not running in this manager (never allocated, or already finished)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class InvariantViolation(RuntimeError):
    """The manager's bookkeeping is inconsistent (a bug); raised by ``check_invariants``.

    A named error rather than ``assert`` so the checks also run under ``python -O``.
    """
