"""KV cache events of the storage tier: the storage state machine (a real CacheManager,
StorageTier, worker and file backend, with faults, prefetches, resets and restarts) runs
with a recorder attached, and after every rule a msgpack-only consumer of the events must
hold exactly the tree's GPU and CPU tiers and the tier's stored hashes (DISK)."""

from __future__ import annotations

import msgpack
from hypothesis import HealthCheck, settings
from hypothesis.stateful import invariant, run_state_machine_as_test

from fastdeploy_kvcache.core.kv_event_recorder import KVEventRecorder, StoredHashes, cache_contents
from fastdeploy_kvcache.core.kv_events import encode_batch
from skip_helpers import needs_cpu_capi

from storage_tier.test_storage_state_machine import StorageMachine
from .subscriber import rebuild

pytestmark = needs_cpu_capi()

MASK = (1 << 64) - 1
SEEN: dict[str, int] = {}  # event kind and medium -> count, over the traces


class StorageEventsMachine(StorageMachine):
    """Each rig (a restart makes a new one, as a new server would) gets its own recorder."""

    @property
    def rig(self):
        return self._rig

    @rig.setter
    def rig(self, rig):
        self._rig = rig
        self.batches: dict[int, list] = {}
        rig.manager.tree.events = KVEventRecorder(rig.manager.block_size, "DISK")
        rig.tier.attach_events(rig.manager.tree.events)

    @invariant()
    def events_rebuild_every_tier(self) -> None:
        batch = self._rig.manager.tree.events.drain()
        if batch is not None:
            decoded = msgpack.unpackb(encode_batch(batch), raw=False)
            self.batches[len(self.batches)] = decoded
            for ev in decoded[1]:
                key = ev[0] if ev[0] == "AllBlocksCleared" else f"{ev[0]} {ev[-1]}"
                SEEN[key] = SEEN.get(key, 0) + 1
        truth = {m: {h & MASK for h in s} for m, s in cache_contents(self._rig.manager, "DISK").items() if s}
        assert rebuild(self.batches) == truth


def test_storage_machine_events_rebuild_every_tier():
    SEEN.clear()
    run_state_machine_as_test(StorageEventsMachine, settings=settings(
        max_examples=40, stateful_step_count=30, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.too_slow]))
    # The traces reached every kind of event the storage tier and the tree produce.
    for key in ("BlockStored GPU", "BlockStored CPU", "BlockStored DISK", "BlockRemoved GPU", "BlockRemoved CPU",
                "AllBlocksCleared"):
        assert SEEN.get(key, 0) > 0, (key, SEEN)


def test_stored_hashes_report_every_way_in_and_out():
    rec = KVEventRecorder(4, "MOONCAKE")
    stored = StoredHashes(rec, [1, 2])
    stored[3] = None
    stored[3] = None  # already there: nothing new
    stored.move_to_end(1)
    assert stored.popitem(last=False) == (2, None)
    assert stored.pop(3) is None and stored.pop(99, "gone") == "gone"
    del stored[1]
    stored[4] = None
    stored.clear()
    events = msgpack.unpackb(encode_batch(rec.drain()), raw=False)[1]
    assert events == [
        ["BlockStored", [1], None, [], 4, None, "MOONCAKE"],
        ["BlockStored", [2], None, [], 4, None, "MOONCAKE"],
        ["BlockStored", [3], None, [], 4, None, "MOONCAKE"],
        ["BlockRemoved", [2, 3, 1], "MOONCAKE"],
        ["BlockStored", [4], None, [], 4, None, "MOONCAKE"],
        ["BlockRemoved", [4], "MOONCAKE"],
    ]
