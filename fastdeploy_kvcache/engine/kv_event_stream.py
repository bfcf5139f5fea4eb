"""The engine's KV cache events: the recorder on its cache, the publisher, once per step.

:func:`make_kv_event_stream` wires a :class:`~fastdeploy_kvcache.core.kv_event_recorder.KVEventRecorder`
into the pool's radix tree and storage tier and opens the ZMQ publisher;
:meth:`KVEventStream.flush` (engine thread, once per step) drains the step's batch and
queues it.  A batch the full queue dropped makes the next one a resynchronisation.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from fastdeploy_kvcache.core.kv_event_recorder import KVEventRecorder, cache_contents
from fastdeploy_kvcache.core.kv_events import EVENT_HASH_MASK, MEDIUM_DISK, MEDIUM_MOONCAKE
from fastdeploy_kvcache.engine.kv_events_config import KVEventsConfig

if TYPE_CHECKING:
    from fastdeploy_kvcache.engine.kv_pool import KVPool

logger = logging.getLogger(__name__)

__all__ = ["KVEventStream", "make_kv_event_stream", "storage_medium", "kv_cache_blocks"]

_STORAGE_MEDIUMS = {"file": MEDIUM_DISK, "mooncake": MEDIUM_MOONCAKE}


def storage_medium(pool: "KVPool") -> Optional[str]:
    """The ``medium`` of the pool's storage tier (None without one)."""
    if pool.tier is None or pool.storage_config is None:
        return None
    backend = pool.storage_config.backend
    return _STORAGE_MEDIUMS.get(backend, str(backend).upper())


class KVEventStream:
    """A recorder and a publisher, flushed by the engine once per step (engine thread)."""

    def __init__(self, recorder: KVEventRecorder, publisher: Any) -> None:
        self.recorder = recorder
        self.publisher = publisher

    def flush(self) -> None:
        """Publish what changed since the last flush (nothing when nothing did)."""
        batch = self.recorder.drain()
        if batch is not None and not self.publisher.publish(batch):
            self.recorder.request_resync()

    def stats(self) -> dict[str, Any]:
        return {**self.publisher.stats(), "events": self.recorder.num_events}

    def close(self) -> None:
        self.flush()
        self.publisher.shutdown()


def make_kv_event_stream(config: Optional[KVEventsConfig], pool: "KVPool") -> Optional[KVEventStream]:
    """The stream for ``--kv-events-config``; None when events are off.

    Raises ValueError when events are asked for without the tiered cache manager (the
    plain allocator caches nothing to describe) or the endpoint cannot be bound.
    """
    if config is None or not config.active:
        return None
    manager = pool.manager
    if manager is None:
        raise ValueError(
            "--kv-events-config: KV cache events describe the tiered cache; set ENABLE_V1_KVCACHE_MANAGER=1"
        )
    from fastdeploy_kvcache.engine.kv_events_publisher import ZmqEventPublisher

    recorder = KVEventRecorder(manager.block_size, storage_medium(pool))
    publisher = ZmqEventPublisher(config)
    if manager.k_anonymity is not None:
        # Private blocks are not announced: a router or any subscriber sees what every tenant
        # may reuse, and nothing one tenant alone sent.
        recorder.publishable = manager.k_anonymity.is_revealed
    manager.tree.events = recorder
    if pool.tier is not None:
        pool.tier.attach_events(recorder)
    return KVEventStream(recorder, publisher)


def kv_cache_blocks(pool: "KVPool") -> dict[str, list[int]]:
    """Per medium, the block hashes (event form: low 64 bits) the pool's cache holds now.

    What a subscriber that applied every batch published so far must hold.  O(cache
    size); call it on the engine thread.
    """
    manager = pool.manager
    if manager is None:
        return {}
    contents = cache_contents(manager, storage_medium(pool))
    return {m: sorted(h & EVENT_HASH_MASK for h in hashes) for m, hashes in contents.items()}
