"""Records, as they happen, the blocks entering and leaving each tier; drained once per step.

The prefix tree calls it whenever a node gains or loses its device or host copy, is cut
out with its subtree, or the tree is reset (``RadixTree.events``); the storage tier's set
of stored hashes calls it when a hash is added or forgotten (:class:`StoredHashes`).  The
engine drains one :class:`~fastdeploy_kvcache.core.kv_events.KVEventBatch` per step and
hands it to the publisher.

The recorder keeps, per hash, the tiers it has announced, so that every ``BlockRemoved``
follows a ``BlockStored`` on the same medium and nothing is announced twice (a consumer
rebuilding the tiers from the events never goes wrong).  With events off nothing of this
exists: the tree's ``events`` is None and each hook costs one attribute test.
"""

from __future__ import annotations

import collections
import logging
import time
from typing import Any, Callable, Optional, Sequence

from fastdeploy_kvcache.core.kv_events import (
    EVENT_HASH_MASK,
    MEDIUM_CPU,
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from fastdeploy_kvcache.core.metadata import CacheLevel

logger = logging.getLogger(__name__)

__all__ = ["KVEventRecorder", "StoredHashes"]

# Tiers are ``CacheLevel`` values (0 device, 1 host, 2 storage); a hash's announced tiers
# are kept as bits ``1 << tier``.
_DEVICE = int(CacheLevel.DEVICE)
_HOST = int(CacheLevel.HOST)
_STORAGE = int(CacheLevel.STORAGE)

_STORED = 0
_REMOVED = 1
_CLEARED = 2


class KVEventRecorder:
    """The event log of one cache manager between two drains (engine thread only).

    ``storage_medium`` names the storage tier in the events (``"DISK"`` for the file
    backend, ``"MOONCAKE"``); None when there is no storage tier.
    """

    def __init__(self, block_size: int, storage_medium: Optional[str] = None) -> None:
        self.block_size = block_size
        self.storage_medium = storage_medium
        self._mediums = {_DEVICE: MEDIUM_GPU, _HOST: MEDIUM_CPU, _STORAGE: storage_medium}
        self._log: list[tuple[Any, ...]] = []
        # hash -> (announced tiers as bits 1 << tier, parent hash, the block's tokens or None).
        # NOTE: immutable tuples of ints rather than record objects: the cyclic GC stops
        # tracking them, and its full passes over 100k+ tree nodes are already what the
        # scheduler's tail latency is made of.
        self._known: dict[int, tuple[int, Optional[int], Optional[tuple[int, ...]]]] = {}
        # The request whose blocks are being inserted: (its block hashes, the request), so a
        # device insert can carry the block's token ids (see set_token_source).
        self._source: Optional[tuple[Sequence[int], Any]] = None
        self._emptied: list[int] = []  # hashes whose last tier went since the last drain
        self._resync = False
        self.num_events = 0
        # Which tree blocks may be announced (k-anonymity: revealed ones only; a private
        # block's copies are announced when it is revealed).  None: every block.
        self.publishable: Optional[Callable[[int], bool]] = None

    # ------------------------------------------------------------------ hooks
    def set_token_source(self, hashes: Sequence[int], request: Any) -> None:
        """Blocks inserted next may be ``request``'s (``hashes[i]`` is its block i).

        Only read for a block whose hash equals ``hashes[depth]``, so a stale source is
        never wrong, just unused.
        """
        self._source = (hashes, request)

    def node_stored(self, node: Any, tier: int) -> None:
        """A tree node gained its copy on ``tier`` (``CacheLevel.DEVICE`` or ``HOST``)."""
        if node.detached or (self.publishable is not None and not self.publishable(node.hash_value)):
            return
        parent = node.parent
        self._stored(node.hash_value, tier, parent.hash_value if parent.depth >= 0 else None, node.depth)

    def node_removed(self, node: Any, tier: int) -> None:
        """A tree node lost its copy on ``tier`` (``CacheLevel.DEVICE`` or ``HOST``)."""
        if not node.detached:
            self.hash_removed(node.hash_value, tier)

    def nodes_detached(self, nodes: Sequence[Any]) -> None:
        """Nodes about to be cut out of the tree: their device and host copies are gone."""
        for node in nodes:
            if not node.detached:
                for tier in (_DEVICE, _HOST):
                    self.hash_removed(node.hash_value, tier)

    def hash_stored(self, h: int, tier: int = _STORAGE) -> None:
        """A hash became known on ``tier`` without a tree node (the storage tier)."""
        self._stored(h, tier, None, -1)

    def hash_removed(self, h: int, tier: int = _STORAGE) -> None:
        """``h`` left ``tier``; nothing is recorded unless it was announced there."""
        rec = self._known.get(h)
        bit = 1 << tier
        if rec is None or not rec[0] & bit:
            return
        bits = rec[0] & ~bit
        self._known[h] = (bits, rec[1], rec[2])
        if not bits:
            # Kept until the drain: a block moving between tiers leaves one before it
            # enters the other, and keeps its parent and tokens.
            self._emptied.append(h)
        self._log.append((_REMOVED, tier, h))

    def cleared(self) -> None:
        """The device and host tiers were emptied (cache reset).

        Consumers drop everything on ``AllBlocksCleared``; the storage blocks this
        instance still knows are announced again right after.
        """
        self._log.append((_CLEARED,))
        storage = 1 << _STORAGE
        self._known = {h: (storage, rec[1], rec[2]) for h, rec in self._known.items() if rec[0] & storage}
        self._emptied = []
        self._log.extend((_STORED, _STORAGE, h, rec[1], rec[2]) for h, rec in self._known.items())

    def _stored(self, h: int, tier: int, parent: Optional[int], depth: int) -> None:
        bit = 1 << tier
        rec = self._known.get(h)
        if rec is None:
            rec = self._known[h] = (bit, parent, self._tokens_of(h, depth))
        elif rec[0] & bit:
            return
        else:
            tokens = rec[2]
            if tokens is None:
                tokens = self._tokens_of(h, depth)
            rec = self._known[h] = (rec[0] | bit, rec[1] if rec[1] is not None else parent, tokens)
        self._log.append((_STORED, tier, h, rec[1], rec[2]))

    def _tokens_of(self, h: int, depth: int) -> Optional[tuple[int, ...]]:
        """Block ``depth``'s tokens from the token source, if that block is ``h``."""
        source = self._source
        if source is None or depth < 0:
            return None
        hashes, request = source
        if depth >= len(hashes) or hashes[depth] != h:
            return None
        bs = self.block_size
        tokens = request.token_slice(depth * bs, (depth + 1) * bs)
        return tuple(tokens) if type(tokens) is list else tuple(int(t) for t in tokens)  # numpy ids: plain ints

    def request_resync(self) -> None:
        """Make the next batch ``AllBlocksCleared`` followed by everything announced now.

        For when a batch was lost (the publisher's queue was full): a subscriber that
        applies the next batch is right again whatever it missed.
        """
        self._resync = True

    # ------------------------------------------------------------------ views
    def announced(self) -> dict[str, set[int]]:
        """Per medium, the tree hashes announced and not removed since (tests, debugging)."""
        out: dict[str, set[int]] = {m: set() for m in self._mediums.values() if m is not None}
        for h, (bits, _, _) in self._known.items():
            for tier, medium in self._mediums.items():
                if bits & (1 << tier) and medium is not None:
                    out[medium].add(h)
        return out

    # ------------------------------------------------------------------ drain
    def drain(self) -> Optional[KVEventBatch]:
        """This step's events as one batch (None when nothing changed); clears the log.

        Consecutive stores on one medium that continue a chain become one
        ``BlockStored``; consecutive removals on one medium one ``BlockRemoved``.
        """
        log = self._log
        self._source = None
        known = self._known
        for h in self._emptied:
            rec = known.get(h)
            if rec is not None and not rec[0]:
                del known[h]
        self._emptied = []
        if self._resync:
            self._resync = False
            log = [(_CLEARED,)]
            for tier in (_DEVICE, _HOST, _STORAGE):
                bit = 1 << tier
                log.extend((_STORED, tier, h, rec[1], rec[2]) for h, rec in known.items() if rec[0] & bit)
        if not log:
            return None
        self._log = []
        events: list[Any] = []
        last: Any = None
        last_kind = -1
        last_tier = 0
        last_hash: Optional[int] = None
        bs = self.block_size
        mask = EVENT_HASH_MASK
        for rec in log:
            kind = rec[0]
            if kind == _CLEARED:
                last = AllBlocksCleared()
                events.append(last)
                last_kind = kind
                continue
            tier, h = rec[1], rec[2]
            if kind == _STORED:
                parent, tokens = rec[3], rec[4]
                if (
                    last_kind == _STORED
                    and last_tier == tier
                    and parent is not None
                    and parent == last_hash
                    and (tokens is not None) == bool(last.token_ids)
                ):
                    last.block_hashes.append(h & mask)
                    if tokens is not None:
                        last.token_ids.extend(tokens)
                else:
                    last = BlockStored(
                        block_hashes=[h & mask],
                        parent_block_hash=None if parent is None else parent & mask,
                        token_ids=list(tokens) if tokens is not None else [],
                        block_size=bs,
                        lora_id=None,
                        medium=self._mediums[tier],
                    )
                    events.append(last)
                last_hash = h
            else:
                if last_kind == _REMOVED and last_tier == tier:
                    last.block_hashes.append(h & mask)
                else:
                    last = BlockRemoved(block_hashes=[h & mask], medium=self._mediums[tier])
                    events.append(last)
                last_hash = None
            last_kind, last_tier = kind, tier
        self.num_events += len(events)
        return KVEventBatch(ts=time.time(), events=events, data_parallel_rank=0)


class StoredHashes(collections.OrderedDict):
    """The storage tier's ordered set of stored hashes, reporting additions and removals.

    Used in place of the tier's plain ``OrderedDict`` when events are on; every way a
    hash enters (``d[h] = None``) or leaves (``popitem``, ``pop``, ``del``) is reported.
    """

    def __init__(self, recorder: KVEventRecorder, items: Any = ()) -> None:
        super().__init__()
        self._recorder = recorder
        for h in items:
            self[h] = None

    def __setitem__(self, h: int, value: Any) -> None:
        new = h not in self
        super().__setitem__(h, value)
        if new:
            self._recorder.hash_stored(h)

    def __delitem__(self, h: int) -> None:
        super().__delitem__(h)
        self._recorder.hash_removed(h)

    def popitem(self, last: bool = True) -> tuple[int, Any]:
        h, value = super().popitem(last)
        self._recorder.hash_removed(h)
        return h, value

    _MISSING = object()

    def pop(self, h: int, default: Any = _MISSING) -> Any:
        if h in self:
            value = super().pop(h)
            self._recorder.hash_removed(h)
            return value
        if default is StoredHashes._MISSING:
            raise KeyError(h)
        return default

    def clear(self) -> None:
        for h in list(self):
            self._recorder.hash_removed(h)
        super().clear()


def cache_contents(manager: Any, storage_medium: Optional[str] = None) -> dict[str, set[int]]:
    """Per medium, the tree hashes a cache manager holds now: what the events must rebuild.

    ``GPU``: tree nodes with a device copy; ``CPU``: with a host copy (copies in flight
    included, as the events announce them when issued; under k-anonymity revealed blocks
    only); ``storage_medium``: the hashes
    the storage tier knows are stored.  O(cache size): for tests and the debug endpoint.
    """
    out: dict[str, set[int]] = {MEDIUM_GPU: set(), MEDIUM_CPU: set()}
    kanon = getattr(manager, "k_anonymity", None)
    for node in manager.tree.iter_nodes():
        if kanon is not None and not kanon.is_revealed(node.hash_value):
            continue  # k-anonymity: private blocks are not announced (KVEventRecorder.publishable)
        if node.device_block_id is not None:
            out[MEDIUM_GPU].add(node.hash_value)
        if node.host_block_id is not None:
            out[MEDIUM_CPU].add(node.hash_value)
    if storage_medium is not None and manager.storage is not None:
        out[storage_medium] = set(manager.storage.stored_hashes())
    return out
