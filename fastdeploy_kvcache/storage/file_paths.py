"""Where the file backend keeps each object: key -> file name, and back.

One directory, one file per object (no fan-out into subdirectories): ``<dir>/<key>.kv``
with ``:`` spelled ``=``.  Keys (``keys.KEY_RE``) never contain ``=`` or ``/``, so the
mapping is one to one and a key can never name a path outside the directory.  A put writes
``<dir>/.tmp-<key>-<pid>-<n>`` first and renames it in place; names starting with ``.`` are
never objects, and a start deletes the temp files it finds (:meth:`ObjectPaths.is_temp`).
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

from fastdeploy_kvcache.storage.base import StorageError

__all__ = ["MAX_KEY_LEN", "ObjectPaths", "check_key", "check_keys"]

_SUFFIX = ".kv"
_TMP_PREFIX = ".tmp-"
_ALLOWED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-:")
_ALLOWED_BYTES = "".join(sorted(_ALLOWED)).encode()
MAX_KEY_LEN = 200


def check_key(op: str, index: int, key: str) -> None:
    """Raise ``StorageError("invalid")`` naming ``keys[index]`` unless it can be a file name."""
    if len(key) > MAX_KEY_LEN or not _ALLOWED.issuperset(key):
        raise StorageError(
            "invalid",
            f"{op}: keys[{index}] = {key!r} must be at most {MAX_KEY_LEN} characters of [A-Za-z0-9._-:]",
        )


def check_keys(op: str, keys: Sequence[str]) -> None:
    """:func:`check_key` for a batch: one pass over all keys' characters, and a loop (naming
    the first bad key) only when that fails."""
    if keys and (max(map(len, keys)) > MAX_KEY_LEN or not _allowed_only("".join(keys))):
        for i, key in enumerate(keys):
            check_key(op, i, key)


def _allowed_only(text: str) -> bool:
    """Whether every character of ``text`` is allowed (a C-speed pass: deleting the allowed
    bytes leaves nothing; a set test per character cost 0.2 us per key)."""
    return text.isascii() and not text.encode().translate(None, _ALLOWED_BYTES)


class ObjectPaths:
    """The paths of one backend directory's objects (keys already checked)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._prefix = os.path.join(directory, "")  # "<dir>/": object paths by concatenation

    def path(self, key: str) -> str:
        """The file that holds ``key``."""
        return self._prefix + key.replace(":", "=") + _SUFFIX

    def blob(self, keys: Sequence[str]) -> bytes:
        """Every key's :meth:`path`, each ending in a NUL byte, as one bytes object (the
        native calls' argument): a few string operations for the batch, none per key."""
        pre = self._prefix
        joined = "\0".join(keys).replace(":", "=").replace("\0", _SUFFIX + "\0" + pre)
        return os.fsencode(pre + joined + _SUFFIX + "\0")

    def temp_path(self, key: str, serial: int) -> str:
        """A temp file for a put of ``key`` (unique per process and ``serial``)."""
        return f"{self._prefix}{_TMP_PREFIX}{key.replace(':', '=')}-{os.getpid()}-{serial}"

    @staticmethod
    def is_temp(filename: str) -> bool:
        """Whether ``filename`` (a directory entry's name) is a put's temp file."""
        return filename.startswith(_TMP_PREFIX)

    @staticmethod
    def key_of(filename: str) -> Optional[str]:
        """The key whose object ``filename`` is, or None where it is no object's name."""
        if not filename.endswith(_SUFFIX) or filename.startswith("."):
            return None
        return filename[: -len(_SUFFIX)].replace("=", ":")
