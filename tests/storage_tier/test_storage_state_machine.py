"""Hypothesis state machine over the storage tier: a real CacheManager, StorageTier,
StorageWorker, StorageTransfer and file backend (the Rig of test_tier.py), with storage
faults injected between steps.

The oracle is shadow memory: every host block that the tree serves (a valid host copy) must
hold exactly the bytes of its block hash, whether a backup wrote them or a prefetch brought
them back from storage.  A put that read a reallocated block, a prefetch that scattered a
block that did not arrive whole, or a stored hash whose object is wrong would all break it.
The tier's own books (pins, deferred frees, prefetch blocks) and the manager's invariants
are checked after every rule.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from fastdeploy_kvcache.core.block_pool import NoFreeBlocksError
from fastdeploy_kvcache.core.metadata import CacheLevel
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.storage_tier import PREFETCH_READY
from skip_helpers import needs_cpu_capi

from .test_split import seed_planner
from .test_tier import BS, Rig

pytestmark = needs_cpu_capi()

# Four prompts sharing prefixes pairwise, so matches stop at every depth.
_BASE = list(range(1000, 1000 + 6 * BS + 1))
PROMPTS = [
    _BASE,
    _BASE[: 2 * BS] + list(range(2000, 2000 + 4 * BS + 1)),
    list(range(3000, 3000 + 6 * BS + 1)),
    _BASE[: 4 * BS] + list(range(4000, 4000 + 2 * BS + 1)),
]


class StorageMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="fdkv-sm-"))
        self.rig = Rig(self.dir / "kv", policy="best_effort", host_blocks=6)

    def teardown(self) -> None:
        self.rig.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    @rule(p=st.integers(0, len(PROMPTS) - 1), blocks=st.integers(1, 6),
          prefetch=st.sampled_from(["none", "async", "wait"]))
    def serve(self, p: int, blocks: int, prefetch: str) -> None:
        """A request; its prefetch is left running (async) or waited for (wait) first."""
        tokens = PROMPTS[p][: blocks * BS + 1]
        if prefetch != "none":
            self.rig.tier.prefetch_state(Request(f"pf{p}", tokens))
        if prefetch == "wait":
            self.rig.submit()
            self.rig.drain()
        try:
            self.rig.serve(f"r{p}", tokens)
        except NoFreeBlocksError:
            pass
        self.rig.tier.forget_request(f"pf{p}")  # admitted (or given up): a later one asks again

    @rule(p=st.integers(0, len(PROMPTS) - 1), stage=st.sampled_from(["attach", "abort_in_flight", "abort_held",
                                                                     "late", "leave_in_flight"]),
          fresh=st.booleans())
    def split(self, p: int, stage: str, fresh: bool) -> None:
        """A concurrent split: the head recomputed while the tail is read, then the tail
        loaded (its bytes checked), or the request gone / the tail late at some stage.
        ``fresh``: the prompt is stored first and the cache dropped, so all of it is a
        storage hit."""
        rig = self.rig
        tokens = PROMPTS[p]
        rid = f"s{p}"
        if fresh:
            try:
                rig.serve(f"w{p}", tokens)
            except NoFreeBlocksError:
                return
            self.settle()
            rig.manager.reset_cache()
        seed_planner(rig, 1.0, 1.0)
        req = Request(rid, tokens)
        if rig.tier.prefetch_state(req) != PREFETCH_READY or rig.tier.split_head_end(rid) is None:
            rig.tier.forget_request(rid)
            return
        head_end = rig.tier.split_head_end(rid)
        rig.submit()
        if stage == "leave_in_flight":
            rig.tier.forget_request(rid)  # its job comes back with a later drain
            return
        if stage in ("abort_in_flight", "late"):
            if stage == "late":
                rig.now += 1e6  # past the tail's deadline: the request recomputes it
                assert rig.tier.split_tail_status(rid) == "late"
                rig.tier.drop_split(rid, "late")
            rig.tier.forget_request(rid)
            rig.drain()
            return
        rig.drain()
        if stage == "abort_held":
            rig.tier.forget_request(rid)
            return
        try:
            rig.manager.match_prefix(req)
            rig.manager.ensure_resident(req, head_end)
        except NoFreeBlocksError:
            rig.tier.forget_request(rid)
            return
        if req.num_computed_tokens <= head_end:
            req.num_computed_tokens = head_end  # the head, recomputed
            rig.manager.commit_computed_blocks(req)
            status = rig.tier.split_tail_status(rid)
            if status == "ready":
                hung = rig.tier.attach_split_tail(rid)
                if hung is None:
                    rig.manager.back_up_committed(req)
                    self.backups(True)
                    hung = rig.tier.attach_split_tail(rid)
                if hung is None:
                    rig.tier.drop_split(rid, "late")
                else:
                    before = len(req.cache_swap_metadata)
                    rig.tier.end_split(rid, rig.manager.extend_match(req) if hung else 0)
                    hashes = req.block_hashes(BS, len(tokens))
                    pos = head_end // BS
                    for meta in req.cache_swap_metadata[before:]:
                        assert meta.src_type is CacheLevel.HOST
                        n = len(meta.dst_block_ids)
                        # Each load lands in the request's table at its block's position.
                        assert list(meta.dst_block_ids) == req.block_tables[pos: pos + n]
                        assert list(meta.hash_values) == hashes[pos: pos + n]
                        for b, h in zip(meta.src_block_ids, meta.hash_values):
                            assert rig.read_host(b) == rig.expected(h), "a loaded tail block holds other bytes"
                        pos += n
                    assert req.num_computed_tokens == pos * BS
            elif status is not None:
                rig.tier.drop_split(rid, "late" if status in ("late", "waiting") else "failed")
        metas, req.cache_swap_metadata = req.cache_swap_metadata, []
        for meta in metas:
            meta.mark_done(True)
            rig.manager.complete_swap(meta)
        req.num_computed_tokens = len(tokens)
        rig.manager.request_finish(req)
        rig.tier.forget_request(rid)

    @rule(ok=st.booleans())
    def backups(self, ok: bool) -> None:
        meta = self.rig.manager.issue_pending_backup_to_batch_request()
        if meta is None:
            return
        if ok:
            for h, b in zip(meta.hash_values, meta.dst_block_ids):
                self.rig.write_host(b, self.rig.expected(h))
        meta.mark_done(ok, None if ok else "injected")
        self.rig.tier.on_host_copies(meta.hash_values, meta.dst_block_ids, ok)
        self.rig.manager.complete_swap(meta)

    @rule()
    def settle(self) -> None:
        """Backups land, their puts run and return."""
        self.backups(True)
        self.rig.submit()
        self.rig.drain()

    @rule()
    def submit(self) -> None:
        self.rig.submit()

    @rule()
    def drain(self) -> None:
        self.rig.drain()

    @rule(i=st.integers(0, 10_000), corrupt=st.booleans())
    def storage_fault(self, i: int, corrupt: bool) -> None:
        """Delete or corrupt one stored object (between the existence check and the get, or not)."""
        files = sorted((self.dir / "kv").glob("*.kv"))
        if not files:
            return
        f = files[i % len(files)]
        # NOTE: the store's own threads may delete the file meanwhile (a bad object found by
        # a read in flight is deleted): then there is nothing left to fault.
        try:
            if corrupt:
                raw = bytearray(f.read_bytes())
                raw[-1] ^= 0x5A
                f.write_bytes(bytes(raw))
            else:
                f.unlink()
        except FileNotFoundError:
            pass

    @rule(p=st.integers(0, len(PROMPTS) - 1))
    def churn(self, p: int) -> None:
        """The host tier lets go of everything and another prompt's backups take the blocks
        (while puts of the old ones may still be queued: their blocks must stay pinned)."""
        self.rig.manager.reset_cache()
        try:
            self.rig.serve(f"c{p}", PROMPTS[p])
        except NoFreeBlocksError:
            return
        self.backups(True)

    @rule()
    def reset(self) -> None:
        self.rig.manager.reset_cache()

    @rule()
    def restart(self) -> None:
        """A new scheduler and worker in front of the same directory (jobs drained first)."""
        self.rig.close()
        self.rig = Rig(self.dir / "kv", policy="best_effort", host_blocks=6)

    @invariant()
    def books(self) -> None:
        rig = self.rig
        rig.manager.check_invariants()  # counts the tier's held host blocks, checks its books
        for node in rig.manager.tree.iter_nodes():
            if node.host_block_id is not None and node.pending is None:
                assert rig.read_host(node.host_block_id) == rig.expected(node.hash_value), (
                    f"host block {node.host_block_id} of {node!r} does not hold its hash's bytes")


TestStorageMachine = StorageMachine.TestCase
TestStorageMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
