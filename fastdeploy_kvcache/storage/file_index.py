"""The file store's index: which objects it holds, their LRU order and the bytes they take.

No I/O of its own: the backend (:mod:`.file_backend`) hands it a ``remove(key)`` callback that
deletes an evicted object's file, and a ``free_bytes()`` that reads the file system's free
space.  Every method takes the index's lock, so the backend's I/O threads share one index.

* **LRU.**  ``_lru`` holds the evictable objects, oldest first.  A hit is recorded in a list
  (:meth:`touch`) and moved to the newest end before anything reads or changes the order,
  which gives the same order as moving it at once for the price of one list extend per read.
* **Held objects.**  An object a put batch just wrote is *held* (in ``_held``, out of the LRU)
  until the batch ends, and, while :meth:`keep_new_objects` is on, until it is turned off: a
  later put evicts only objects outside the batch (or the stop flush).  When no evictable
  object is left, the put does not fit (``Status.FULL``) instead of evicting what it just
  wrote.  Without this, a store smaller than the data being written evicts its own newest
  objects, each of which is then reported lost and written again.
* **Capacity.**  ``capacity_bytes`` caps the objects' total size (0: no cap);
  ``min_free_bytes`` keeps a floor of free space on the file system.  A reservation counts an
  object before its bytes are written, so concurrent puts see the space as taken.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Callable, Iterable, Optional

__all__ = ["ObjectIndex"]


class ObjectIndex:
    """LRU order and space accounting of one file store (see the module docstring).

    Args:
        capacity_bytes: cap on the objects' total size; 0 means none.
        min_free_bytes: free space on the file system that puts never consume.
        remove: deletes an evicted object's file (called with the lock held, so a concurrent
            put of the same key cannot interleave).
        lost: told the keys evicted, after the lock is released.
    """

    def __init__(self, capacity_bytes: int, min_free_bytes: int, remove: Callable[[str], None],
                 lost: Callable[[list[str]], None]) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.min_free_bytes = int(min_free_bytes)
        self._remove = remove
        self._lost = lost
        self.lock = threading.Lock()
        self._lru: "OrderedDict[str, int]" = OrderedDict()  # key -> object bytes, oldest first
        self._held: dict[str, int] = {}  # written by a batch still running or during keep_new_objects
        self._keep = False
        self._kept: list[str] = []  # held keys released when keep_new_objects turns off
        self._used = 0
        self._held_bytes = 0
        self._hits: list[str] = []  # hits not yet moved in the LRU
        self.touched: set[str] = set()  # hits whose file atime is not refreshed yet (the backend's)

    # ------------------------------------------------------------------ state
    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._lru) + len(self._held)

    def __contains__(self, key: str) -> bool:
        return key in self._lru or key in self._held

    def keys(self) -> list[str]:
        """Keys, least recently used first, then the held ones."""
        with self.lock:
            self._apply_hits_locked()
            return list(self._lru) + list(self._held)

    def pending_touches(self) -> int:
        return len(self.touched) + len(self._hits)

    # ------------------------------------------------------------------ building
    def seed(self, entries: Iterable[tuple[str, int]]) -> int:
        """Objects already on disk, oldest use first; evicts to fit the cap; returns how many."""
        with self.lock:
            for key, size in entries:
                self._lru[key] = size
                self._used += size
            victims = self._evict_to_cap_locked(0) if self.capacity_bytes else []
        self._lost(victims)
        return len(victims)

    # ------------------------------------------------------------------ hits
    def touch(self, keys: Iterable[str]) -> None:
        with self.lock:
            self._hits.extend(keys)

    def take_touched(self) -> set[str]:
        """The hits whose atime the backend should refresh now (and forget)."""
        with self.lock:
            self._apply_hits_locked()
            keys, self.touched = self.touched, set()
            return keys

    def _apply_hits_locked(self) -> None:
        if not self._hits:
            return
        lru, hits, self._hits = self._lru, self._hits, []
        move = lru.move_to_end
        for key in hits:
            if key in lru:  # else forgotten meanwhile, held, or another process's object
                move(key)
                self.touched.add(key)

    # ------------------------------------------------------------------ space
    def reserve(self, key: str, nbytes: int, free_bytes: Optional[Callable[[], int]]) -> bool:
        """Make room for an object of ``nbytes`` under ``key`` and hold it; False when it cannot
        fit without evicting a held object.  ``free_bytes``: the file system's free space (None:
        no floor to keep)."""
        victims: list[str] = []
        try:
            with self.lock:
                self._apply_hits_locked()
                if self.capacity_bytes and nbytes > self.capacity_bytes:
                    return False
                old = self.pop_locked(key)
                if self.capacity_bytes:
                    if self._held_bytes + nbytes > self.capacity_bytes:
                        return False  # only held objects stand in the way: evict nothing for nothing
                    victims += self._evict_to_cap_locked(nbytes)
                    if self._used + nbytes > self.capacity_bytes:
                        return False
                if self.min_free_bytes and free_bytes is not None:
                    # NOTE: statvfs per put (a few µs) rather than a cached figure: other
                    # processes fill the same disk.  Puts in flight on other io threads are not
                    # yet visible in it, so the floor can be undershot by up to io_threads
                    # objects; keep the floor well above that.
                    ok, more = self._evict_for_space_locked(nbytes, free_bytes() + (old or 0))
                    victims += more
                    if not ok:
                        return False
                self._held[key] = nbytes
                self._held_bytes += nbytes
                self._used += nbytes
                return True
        finally:
            self._lost(victims)

    def make_room_after_enospc(self, nbytes: int, free_bytes: Callable[[], int]) -> bool:
        """The disk said ENOSPC: evict LRU objects down to the floor plus ``nbytes`` (at least
        one, whatever statvfs says); True when anything was evicted, so one retry may succeed."""
        victims: list[str] = []
        with self.lock:
            self._apply_hits_locked()
            if self._lru:
                victims.append(self._drop_oldest_locked())
            try:
                free = free_bytes()
            except OSError:
                free = 0
            victims += self._evict_for_space_locked(nbytes, free)[1]
        self._lost(victims)
        return bool(victims)

    def unreserve(self, key: str) -> bool:
        """Forget ``key`` (its put failed, or its object is gone); False if it was not there."""
        with self.lock:
            return self.pop_locked(key) is not None

    def release(self, keys: Iterable[str]) -> None:
        """A put batch ended: its objects join the LRU as the newest (unless the flush keeps
        them held: then when :meth:`keep_new_objects` turns off)."""
        with self.lock:
            for key in keys:
                if self._keep:
                    if key in self._held:
                        self._kept.append(key)
                    continue
                self._unhold_locked(key)

    def keep_new_objects(self, on: bool) -> None:
        """While on, objects put are not evicted by later puts (the stop flush)."""
        with self.lock:
            self._keep = on
            if on:
                return
            kept, self._kept = self._kept, []
            for key in kept:
                self._unhold_locked(key)

    def _unhold_locked(self, key: str) -> None:
        """A held object joins the LRU as the newest."""
        size = self._held.pop(key, None)
        if size is not None:
            self._held_bytes -= size
            self._lru[key] = size

    # ------------------------------------------------------------------ eviction (lock held)
    def pop_locked(self, key: str) -> Optional[int]:
        """Forget ``key`` with :attr:`lock` held (the backend deletes its file under the same
        lock); returns its size, None if it was not there."""
        size = self._lru.pop(key, None)
        if size is None:
            size = self._held.pop(key, None)
            if size is not None:
                self._held_bytes -= size
        if size is not None:
            self._used -= size
        return size

    def _evict_to_cap_locked(self, incoming: int) -> list[str]:
        victims = []
        while self._lru and self._used + incoming > self.capacity_bytes:
            victims.append(self._drop_oldest_locked())
        return victims

    def _evict_for_space_locked(self, nbytes: int, free: int) -> tuple[bool, list[str]]:
        victims = []
        while free - nbytes < self.min_free_bytes and self._lru:
            free += next(iter(self._lru.values()))
            victims.append(self._drop_oldest_locked())
        return free - nbytes >= self.min_free_bytes, victims

    def _drop_oldest_locked(self) -> str:
        key, size = self._lru.popitem(last=False)
        self._used -= size
        self._remove(key)
        return key
