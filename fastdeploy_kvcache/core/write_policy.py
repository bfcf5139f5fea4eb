"""The write policy as a strategy object: when a device block gets a host copy.

The cache manager asks its policy; it never compares policy names.  Each policy
answers four questions:

* ``backup_on_insert``: is a block backed up as soon as it becomes cached?
* ``wants_backup(node, retry)``: after a hit on ``node`` (or when a backup of it
  failed or was cancelled, ``retry``), should it be queued for a backup?
* ``copies_on_eviction``: is a device block without a host copy copied to host when
  it is evicted (write_back), rather than dropped?
* ``exclusive_tiers``: is the host copy released once a load back to device is
  confirmed (write_back keeps device and host mostly exclusive)?

``host_prefix_closed`` says whether the host tier is kept prefix-closed (the through
policies: the liveness rule in docs/architecture.md rests on it; write_back keeps
liveness by always freeing on eviction instead).
"""

from __future__ import annotations

from fastdeploy_kvcache.core.metadata import BlockNode

__all__ = ["WritePolicy", "WriteThrough", "WriteThroughSelective", "WriteBack", "make_write_policy"]


class WritePolicy:
    """Base: never backs up, never copies on eviction."""

    name = ""
    backup_on_insert = False
    copies_on_eviction = False
    exclusive_tiers = False
    host_prefix_closed = True

    def wants_backup(self, node: BlockNode, retry: bool) -> bool:
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class WriteThrough(WritePolicy):
    """Every cached block is copied to host when it becomes cached; a failed copy is retried."""

    name = "write_through"
    backup_on_insert = True

    def wants_backup(self, node: BlockNode, retry: bool) -> bool:
        return retry


class WriteThroughSelective(WritePolicy):
    """A cached block is copied to host once it has been hit ``threshold`` times."""

    name = "write_through_selective"

    def __init__(self, threshold: int) -> None:
        self.threshold = threshold

    def wants_backup(self, node: BlockNode, retry: bool) -> bool:
        return node.hit_count >= self.threshold

    def __repr__(self) -> str:
        return f"WriteThroughSelective(threshold={self.threshold})"


class WriteBack(WritePolicy):
    """A block is copied to host only when evicted; its host copy goes once it is loaded back."""

    name = "write_back"
    copies_on_eviction = True
    exclusive_tiers = True
    host_prefix_closed = False


def make_write_policy(name: str, threshold: int = 1) -> WritePolicy:
    """The strategy for ``CacheConfig.write_policy`` (already validated by the config)."""
    if name == WriteThrough.name:
        return WriteThrough()
    if name == WriteThroughSelective.name:
        return WriteThroughSelective(threshold)
    if name == WriteBack.name:
        return WriteBack()
    raise ValueError(f"unknown write policy {name!r}")
