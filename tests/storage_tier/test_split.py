"""Concurrent splits on the storage tier's Rig (real manager, tier, worker, file store).

The tier plans with ``choose_split``: the request recomputes the head of its stored prefix
while the tail is read into host blocks the tier holds outside the tree; once the head is
in the tree the tail hangs below it and the request loads it like host hits
(``CacheManager.extend_match``).  Shadow memory checks the bytes each load reads; the
manager's and the tier's invariants (which count held tail blocks) are checked after every
stage, so a leaked or double-freed host block fails here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastdeploy_kvcache.core.metadata import CacheLevel
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.storage_tier import PREFETCH_READY
from skip_helpers import needs_cpu_capi

from .test_tier import BS, TOKENS, Rig, rigs, store_tokens  # noqa: F401 - rigs is a fixture

pytestmark = needs_cpu_capi()


def seed_planner(rig: Rig, fetch_block_s: float, recompute_block_s: float) -> None:
    """Give the rig's planner measured rates: one block read in ``fetch_block_s``, one block
    recomputed in ``recompute_block_s`` (a real FetchCostModel, fed as the engine feeds it)."""
    rig.config.fetch_plan = "on"
    planner = rig.tier.planner
    planner.read.clear()  # forget what real reads measured so far
    planner.prefill.clear()
    planner.observe_read(rig.tier.backend_name, rig.layout.object_bytes, fetch_block_s, 1)
    planner.observe_prefill([(4 * BS, 0)], 4 * recompute_block_s)


def check(rig: Rig) -> None:
    rig.tier.check_invariants()
    rig.manager.check_invariants()


def split_rig(rigs: Any) -> tuple[Rig, list[int], Request]:
    """A store holding TOKENS' four blocks and a fresh scheduler planning a 2 + 2 split."""
    hashes = store_tokens(rigs(), TOKENS)
    rig = rigs()
    seed_planner(rig, 1.0, 1.0)  # equal costs: recompute two blocks while two are read
    req = Request("r", TOKENS)
    assert rig.tier.prefetch_state(req) == PREFETCH_READY, "a split never holds admission"
    assert rig.tier.split_head_end("r") == 2 * BS
    return rig, hashes, req


def test_a_split_tail_is_held_then_hung_below_the_recomputed_head_and_loaded(rigs: Any) -> None:
    rig, hashes, req = split_rig(rigs)
    jobs = rig.tier.take_jobs()
    assert len(jobs) == 1 and jobs[0].hashes == hashes[2:4], "the tail (blocks 2, 3) is read"
    for job in jobs:
        rig.worker.submit(job)
    rig.drain()
    assert rig.tier.split_tail_status("r") == "ready"
    assert rig.tier.get_stats()["held_tail_host_blocks"] == 2
    check(rig)
    # Admission: nothing of the prefix is in the tree (the tail hangs nowhere yet).
    assert rig.manager.match_prefix(req).num_matched_tokens == 0
    rig.manager.ensure_resident(req, 2 * BS)
    req.num_computed_tokens = 2 * BS  # the head, recomputed
    assert rig.manager.commit_computed_blocks(req) == 2
    # write_through keeps the host tier prefix-closed: the head needs its host copy first.
    assert rig.tier.attach_split_tail("r") is None
    assert rig.tier.wait_for_head("r")
    rig.manager.back_up_committed(req)  # queued at commit already (write_through): nothing more
    rig.run_backups()
    check(rig)
    assert rig.tier.attach_split_tail("r") == 2
    loaded = rig.manager.extend_match(req)
    rig.tier.end_split("r", loaded)
    assert loaded == 2 and req.num_computed_tokens == 4 * BS
    (meta,) = req.cache_swap_metadata
    assert meta.hash_values == hashes[2:4] and meta.src_type is CacheLevel.HOST
    for b, h in zip(meta.src_block_ids, meta.hash_values):
        assert rig.read_host(b) == rig.expected(h), "a fetched tail block does not hold its hash's bytes"
    assert list(meta.dst_block_ids) == req.block_tables[2:4]
    check(rig)
    req.cache_swap_metadata = []
    meta.mark_done(True)
    rig.manager.complete_swap(meta)
    req.num_computed_tokens = len(TOKENS)
    rig.manager.request_finish(req)
    check(rig)
    stats = rig.tier.get_stats()
    assert stats["plan_splits"] == 1 and stats["plan_tails_attached"] == 1 and stats["plan_tail_blocks_attached"] == 2
    assert stats["storage_hit_tokens"] == 2 * BS and stats["held_tail_host_blocks"] == 0
    assert stats["splits_pending"] == 0 and stats["plan_actual_requests"] == 1
    assert rig.tier.fetch_timing(req) is None  # the split is over


def test_an_abandoned_split_frees_its_tail_in_flight_and_held(rigs: Any) -> None:
    rig, _, req = split_rig(rigs)
    free = rig.manager.host_pool.num_free
    # Aborted while the tail is in flight: its blocks come back when the job does.
    rig.submit()
    rig.tier.forget_request("r")
    assert rig.tier.split_head_end("r") is None
    rig.drain()
    check(rig)
    assert rig.manager.host_pool.num_free == free + 2 and rig.tier.get_stats()["held_tail_host_blocks"] == 0
    # Aborted while the tail is held.
    seed_planner(rig, 1.0, 1.0)
    req2 = Request("r2", TOKENS)
    assert rig.tier.prefetch_state(req2) == PREFETCH_READY and rig.tier.split_head_end("r2") == 2 * BS
    rig.submit()
    rig.drain()
    assert rig.tier.get_stats()["held_tail_host_blocks"] == 2
    check(rig)
    rig.tier.forget_request("r2")
    check(rig)
    assert rig.manager.host_pool.num_free == free + 2 and rig.tier.get_stats()["held_tail_host_blocks"] == 0


def test_a_late_tail_and_a_failed_tail_are_dropped(rigs: Any, tmp_path: Path) -> None:
    rig, hashes, req = split_rig(rigs)
    # Predicted finish 2 s, tail recompute 2 s: the request waits for its tail until about 4 s.
    rig.now = 3.9
    assert rig.tier.split_tail_status("r") == "waiting"
    rig.now = 4.01
    assert rig.tier.split_tail_status("r") == "late"
    rig.tier.drop_split("r", "late")
    rig.submit()
    rig.drain()
    check(rig)
    assert rig.tier.get_stats()["plan_tails_late"] == 1 and rig.tier.get_stats()["held_tail_host_blocks"] == 0
    # The tail's first object is gone: nothing arrives, the split is dropped as failed.
    (tmp_path / "kv" / (rig.tier.ns.key(hashes[2]).replace(":", "=") + ".kv")).unlink()
    seed_planner(rig, 1.0, 1.0)
    req2 = Request("r2", TOKENS)
    assert rig.tier.prefetch_state(req2) == PREFETCH_READY and rig.tier.split_head_end("r2") == 2 * BS
    rig.submit()
    rig.drain()
    check(rig)
    assert rig.tier.split_head_end("r2") is None, "a tail with nothing arrived is dropped"
    stats = rig.tier.get_stats()
    assert stats["plan_tails_failed"] == 1 and stats["prefetch_blocks_failed"] == 2


def test_a_head_on_a_load_not_yet_confirmed_waits_for_it(rigs: Any) -> None:
    hashes = store_tokens(rigs(), TOKENS)
    rig = rigs()
    # Block 0 reaches the tree as a host-only node (a plain fetch of a one-block prompt).
    one = Request("one", TOKENS[: BS + 1])
    rig.tier.prefetch_state(one)
    rig.submit()
    rig.drain()
    rig.tier.forget_request("one")
    seed_planner(rig, 1.0, 1.0)
    req = Request("r", TOKENS)
    assert rig.tier.prefetch_state(req) == PREFETCH_READY
    # Block 0 is a host hit; of the three stored blocks after it, 1 and 2 are the head (ties go
    # to fetching less: the link adds a little to each fetched block), 3 the tail.
    assert rig.tier.split_head_end("r") == 3 * BS
    rig.submit()
    rig.drain()
    assert rig.manager.match_prefix(req).num_matched_tokens == BS
    rig.manager.ensure_resident(req, 3 * BS)
    (load,) = req.cache_swap_metadata
    req.num_computed_tokens = 3 * BS
    # The head sits on block 0's load, not confirmed yet: nothing is committed on top of it.
    assert rig.manager.commit_computed_blocks(req) == 1 and rig.manager.loads_in_flight(req)
    assert rig.tier.wait_for_head("r")
    req.cache_swap_metadata = []
    load.mark_done(True)
    rig.manager.complete_swap(load)
    assert not rig.manager.loads_in_flight(req) and rig.manager.commit_computed_blocks(req) == 3
    rig.run_backups()  # the head's host copy (write_through)
    assert rig.tier.attach_split_tail("r") == 1
    loaded = rig.manager.extend_match(req)
    rig.tier.end_split("r", loaded)
    assert loaded == 1 and req.cache_swap_metadata[0].hash_values == hashes[3:4]
    check(rig)
    (meta,) = req.cache_swap_metadata
    req.cache_swap_metadata = []
    meta.mark_done(True)
    rig.manager.complete_swap(meta)
    req.num_computed_tokens = len(TOKENS)
    rig.manager.request_finish(req)
    check(rig)
