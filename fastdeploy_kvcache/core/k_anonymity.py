"""k-anonymous prefix sharing: a cached block is shared across tenants only once k distinct
tenants have computed it.

:class:`KAnonymityIndex` is the cache manager's record of who computed which block.  A
block hash is either *revealed* (k distinct tenants computed it, or it came from the
storage tier, which holds only revealed blocks) or *private* to the set of tenants that
computed it.  A tenant sees a block when it is revealed or when the tenant is in its set;
for everyone else a private block is a miss on every tier, so a prompt only its tenant
sent never changes another tenant's time to first token:

* matching walks the tree with :meth:`KAnonymityIndex.visible_to` as a filter (device and
  host hits, loads in flight, host blocks hung below a running request's prefix);
* a tenant that computes a private block of another tenant computes it like a miss (its
  copy is a duplicate the tree already holds) and joins the block's set
  (:meth:`record_computed`, called when the blocks become cached: commit, finish,
  preempt); the k-th distinct tenant's computation reveals the block;
* the storage tier writes revealed blocks only (:meth:`is_revealed`), so a store shared
  by many servers, or read after a restart, only ever serves revealed blocks, and a block
  it fetched is revealed here (:meth:`mark_revealed`); a block revealed while it has a host
  copy is written then (the lifecycle tells the tier);
* in-batch sharing (``core/prefix_sharing.py``) holds a request for another request's
  computation only when that tenant is its own or the block is revealed;
* KV events announce a block's copies only once it is revealed (``KVEventRecorder.publishable``),
  so a router's view holds what every tenant may reuse.

Because block hashes chain, a tenant that computed block i computed every block before
it, so a block's set is a subset of its parent's and revealed blocks form a prefix-closed
set: the visible part of a prompt is a prefix.

Requests without a tenant all count as one anonymous tenant: they see each other's
blocks, and together they add at most one tenant to any set.

Memory is bounded: at most ``capacity`` hashes are remembered, least recently used
forgotten first.  Forgetting only ever hides a block (from everyone, its own tenants
included) until it is computed again: it never reveals one.  Pure Python, no I/O.
"""

from __future__ import annotations

import collections
import logging
from typing import Callable, Iterable, Optional, Union

logger = logging.getLogger(__name__)

__all__ = ["ANONYMOUS_TENANT", "KAnonymityIndex"]

# The tenant of requests that name none (they share one set entry).
ANONYMOUS_TENANT = ""

_REVEALED = None  # the entry of a revealed hash


class KAnonymityIndex:
    """Which tenants computed each private block, and which blocks are revealed.

    Args:
        k: distinct tenants needed to reveal a block (>= 2; 1 would reveal everything).
        capacity: most block hashes remembered (private and revealed together).
    """

    def __init__(self, k: int, capacity: int = 1 << 20) -> None:
        if not isinstance(k, int) or isinstance(k, bool) or k < 2:
            raise ValueError(f"k-anonymity k must be an int >= 2, got {k!r}")
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"k-anonymity capacity must be an int >= 1, got {capacity!r}")
        self.k = k
        self.capacity = capacity
        # hash -> None (revealed), a tenant (str: the common one-tenant case, no set
        # allocated) or the set of tenants that computed it; most recently used last.
        self._entries: "collections.OrderedDict[int, Union[None, str, set[str]]]" = collections.OrderedDict()
        self.revealed_blocks = 0  # blocks revealed by their k-th tenant (counter)
        self.revealed_from_storage = 0  # blocks revealed because the store held them
        self.forgotten = 0  # entries dropped for capacity

    @staticmethod
    def tenant_key(tenant: Optional[str]) -> str:
        return ANONYMOUS_TENANT if tenant is None else tenant

    # ------------------------------------------------------------------ reads
    def is_revealed(self, block_hash: int) -> bool:
        """Whether every tenant may see ``block_hash`` (and the store may hold it)."""
        return block_hash in self._entries and self._entries[block_hash] is _REVEALED

    def visible(self, block_hash: int, tenant: Optional[str]) -> bool:
        """Whether ``tenant`` may reuse the block: revealed, or computed by the tenant."""
        entries = self._entries
        if block_hash not in entries:
            return False
        e = entries[block_hash]
        if e is _REVEALED:
            return True
        t = self.tenant_key(tenant)
        return e == t if isinstance(e, str) else t in e

    def visible_to(self, tenant: Optional[str]) -> Callable[[int], bool]:
        """:meth:`visible` for one tenant, as a one-argument filter (the tree's matcher)."""
        t = self.tenant_key(tenant)
        entries = self._entries

        def check(block_hash: int) -> bool:
            if block_hash not in entries:
                return False
            e = entries[block_hash]
            return e is _REVEALED or (e == t if isinstance(e, str) else t in e)

        return check

    def num_tenants(self, block_hash: int) -> int:
        """Distinct tenants known to have computed a private block (k for a revealed one)."""
        if block_hash not in self._entries:
            return 0
        e = self._entries[block_hash]
        if e is _REVEALED:
            return self.k
        return 1 if isinstance(e, str) else len(e)

    def __len__(self) -> int:
        return len(self._entries)

    # ------------------------------------------------------------------ writes
    def record_computed(self, tenant: Optional[str], hashes: Iterable[int]) -> list[int]:
        """``tenant`` computed (or holds) these blocks: it joins each one's set; a block
        whose set reaches k distinct tenants is revealed.  Returns the hashes revealed now."""
        t = self.tenant_key(tenant)
        entries = self._entries
        k = self.k
        revealed: list[int] = []
        for h in hashes:
            if h not in entries:
                entries[h] = t
                self._trim()
                continue
            e = entries[h]
            entries.move_to_end(h)
            if e is _REVEALED or e == t:
                continue
            if isinstance(e, str):
                e = entries[h] = {e, t}
            else:
                e.add(t)
            if len(e) >= k:
                entries[h] = _REVEALED
                revealed.append(h)
        if revealed:
            self.revealed_blocks += len(revealed)
            logger.debug("k-anonymity: %d blocks revealed (k=%d)", len(revealed), k)
        return revealed

    def mark_revealed(self, hashes: Iterable[int]) -> None:
        """These blocks came from the storage tier, which holds revealed blocks only."""
        entries = self._entries
        for h in hashes:
            if h in entries and entries[h] is _REVEALED:
                entries.move_to_end(h)
                continue
            entries[h] = _REVEALED
            entries.move_to_end(h)
            self.revealed_from_storage += 1
        self._trim()

    def _trim(self) -> None:
        entries = self._entries
        while len(entries) > self.capacity:
            entries.popitem(last=False)
            self.forgotten += 1

    def clear(self) -> None:
        """Forget everything (the cache was reset: what was computed before is gone)."""
        self._entries.clear()

    def stats(self) -> dict[str, int]:
        return {
            "k": self.k,
            "tracked_blocks": len(self._entries),
            "revealed_blocks": self.revealed_blocks,
            "revealed_from_storage": self.revealed_from_storage,
            "forgotten": self.forgotten,
        }
