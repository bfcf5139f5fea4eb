"""Typed counters of the cache manager (``CacheManager.get_stats`` turns them into a dict).

Counters only ever grow, except ``cached_device``: the number of device blocks that
are cached and unreferenced right now (a gauge the manager keeps exact, because
``check_invariants`` compares it with a full count and ``get_stats`` reports it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["CacheStats"]


@dataclass
class CacheStats:
    """Everything the manager counts.  Field names are the keys ``get_stats`` reports."""

    num_requests: int = 0
    query_tokens: int = 0
    matched_tokens_device: int = 0
    matched_tokens_host: int = 0
    matched_tokens_storage: int = 0
    device_evictions: int = 0
    host_evictions: int = 0
    write_back_blocks_issued: int = 0
    write_back_blocks: int = 0
    backup_blocks_issued: int = 0
    backup_blocks: int = 0
    swap_in_blocks_issued: int = 0  # loads (host -> device) emitted
    swap_in_blocks: int = 0  # loads confirmed
    failed_blocks: int = 0
    inserted_blocks: int = 0
    duplicate_blocks: int = 0
    shared_load_blocks: int = 0  # host -> device loads in flight another request shared
    committed_blocks: int = 0  # prompt blocks made matchable while their request still ran
    shared_recompute_fallbacks: int = 0
    # Gauge, not a counter: cached (ref 0, in the tree) device blocks right now.
    cached_device: int = 0

    def as_dict(self, bytes_per_block: int) -> dict[str, Any]:
        """The counters plus what derives from them (hit rate, bytes moved)."""
        s: dict[str, Any] = {name: getattr(self, name) for name in _COUNTER_NAMES}
        matched = self.matched_tokens_device + self.matched_tokens_host + self.matched_tokens_storage
        s["matched_tokens"] = matched
        s["hit_rate"] = matched / self.query_tokens if self.query_tokens else 0.0
        s["swap_in_bytes"] = self.swap_in_blocks * bytes_per_block
        s["swap_out_blocks"] = self.write_back_blocks + self.backup_blocks
        s["swap_out_bytes"] = s["swap_out_blocks"] * bytes_per_block
        return s


# The counters' names, read once.  NOTE: not ``dataclasses.fields(self)`` per call: this runs
# after every engine step, and there the tuple that call builds stayed allocated about once
# per three steps (about 200 bytes each; why is not known: the same call made elsewhere on
# the engine thread keeps nothing), so the server's RSS grew with its steps.
_COUNTER_NAMES: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(CacheStats) if f.name != "cached_device")
