"""KV cache events against the tree they describe.

The cache-manager state machine (tests/core/test_state_machine.py: every write policy,
failed and late copies, evictions, resets) runs with a recorder attached; after every
rule the step's batch is encoded, decoded with plain msgpack (not our structs) and
applied to a consumer's view, which must equal the tree's tiers exactly.
"""

from __future__ import annotations

import msgpack
from hypothesis.stateful import invariant, run_state_machine_as_test

from fastdeploy_kvcache.core.kv_event_recorder import KVEventRecorder, cache_contents
from fastdeploy_kvcache.core.kv_events import encode_batch, event_block_hashes

from . import test_cache_manager as tcm
from . import test_state_machine as sm

MASK = (1 << 64) - 1


class Consumer:
    """What a subscriber rebuilds from the decoded arrays: medium -> set of hashes."""

    def __init__(self) -> None:
        self.tiers: dict[str, set[int]] = {}
        self.tokens: dict[int, list[int]] = {}
        self.parents: dict[int, int | None] = {}

    def apply(self, payload: bytes, block_size: int) -> None:
        ts, events, rank = msgpack.unpackb(payload, raw=False)
        assert isinstance(ts, float) and rank == 0
        for ev in events:
            tag = ev[0]
            if tag == "BlockStored":
                _, hashes, parent, tokens, bs, lora, medium = ev
                assert bs == block_size and lora is None and hashes
                assert len(tokens) in (0, len(hashes) * bs), ev
                tier = self.tiers.setdefault(medium, set())
                for i, h in enumerate(hashes):
                    assert h not in tier, f"{medium} {h:#x} stored twice"
                    tier.add(h)
                    self.parents[h] = parent if i == 0 else hashes[i - 1]
                    if tokens:
                        self.tokens[h] = tokens[i * bs : (i + 1) * bs]
            elif tag == "BlockRemoved":
                _, hashes, medium = ev
                for h in hashes:
                    assert h in self.tiers.get(medium, ()), f"{medium} {h:#x} removed but never stored"
                    self.tiers[medium].discard(h)
            else:
                assert ev == ["AllBlocksCleared"], ev
                self.tiers.clear()

    def view(self) -> dict[str, set[int]]:
        return {m: s for m, s in self.tiers.items() if s}


def wire(contents: dict[str, set[int]]) -> dict[str, set[int]]:
    return {m: {h & MASK for h in s} for m, s in contents.items() if s}


class EventsMachine(sm.CacheMachine):
    """The state machine with a recorder on its cache manager, checked after every rule."""

    @property
    def mgr(self):
        return self._mgr

    @mgr.setter
    def mgr(self, manager):
        self._mgr = manager
        self.consumer = Consumer()
        if manager is not None:
            manager.tree.events = KVEventRecorder(sm.BS)

    @invariant()
    def events_rebuild_the_tree(self):
        if self._mgr is None:
            return
        batch = self._mgr.tree.events.drain()
        if batch is not None:
            self.consumer.apply(encode_batch(batch), sm.BS)
        truth = cache_contents(self._mgr)
        assert self.consumer.view() == wire(truth)
        assert {m: s for m, s in self._mgr.tree.events.announced().items() if s} == {m: s for m, s in truth.items() if s}
        # Parents are the tree's: every node's parent hash (None under the root).
        for node in self._mgr.tree.iter_nodes():
            h = node.hash_value & MASK
            if h in self.consumer.parents:
                want = None if node.parent.depth < 0 else node.parent.hash_value & MASK
                assert self.consumer.parents[h] == want


def test_events_rebuild_every_tier_of_the_state_machine():
    run_state_machine_as_test(EventsMachine, settings=sm._settings(60, 100, derandomize=True), _min_steps=30)


def test_device_insert_carries_tokens_and_reference_hashes():
    mgr, shadow = tcm.make("write_through", dev=16, host=16)
    mgr.tree.events = KVEventRecorder(tcm.BS)
    prompt = list(range(50, 61))  # 2 full blocks of 4 + 3 tokens
    tcm.cache_prompt(mgr, shadow, "a", prompt)
    raw = msgpack.unpackb(encode_batch(mgr.tree.events.drain()), raw=False)
    # One chained BlockStored for the two full blocks, with their tokens.
    assert raw[1] == [["BlockStored", event_block_hashes(prompt, 4), None, prompt[:8], 4, None, "GPU"]]
    # The write-through backups go out with the next step: announced on CPU when issued.
    tcm.step(mgr, shadow, [])
    raw = msgpack.unpackb(encode_batch(mgr.tree.events.drain()), raw=False)
    assert raw[1] == [["BlockStored", event_block_hashes(prompt, 4), None, prompt[:8], 4, None, "CPU"]]
    mgr.reset_cache()
    raw = msgpack.unpackb(encode_batch(mgr.tree.events.drain()), raw=False)
    assert raw[1] == [["AllBlocksCleared"]]
    assert mgr.tree.events.drain() is None  # nothing happened since


def test_write_back_eviction_moves_blocks_from_gpu_to_cpu():
    mgr, shadow = tcm.make("write_back", dev=4, host=8)
    mgr.tree.events = KVEventRecorder(tcm.BS)
    a = list(range(13))
    tcm.cache_prompt(mgr, shadow, "a", a)
    mgr.tree.events.drain()
    tcm.cache_prompt(mgr, shadow, "b", list(range(100, 115)))  # needs every device block
    events = msgpack.unpackb(encode_batch(mgr.tree.events.drain()), raw=False)[1]
    moved = set(event_block_hashes(a, 4))
    removed_gpu = {h for ev in events if ev[0] == "BlockRemoved" and ev[2] == "GPU" for h in ev[1]}
    stored_cpu = {h for ev in events if ev[0] == "BlockStored" and ev[6] == "CPU" for h in ev[1]}
    assert removed_gpu == moved and stored_cpu == moved
    # The CPU copies keep the tokens learnt when the blocks entered the device tier.
    cpu = [ev for ev in events if ev[0] == "BlockStored" and ev[6] == "CPU"]
    assert sorted(t for ev in cpu for t in ev[3]) == a[:12]
