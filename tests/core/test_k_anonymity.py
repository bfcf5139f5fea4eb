"""k-anonymous sharing through the cache manager's public calls: a block another tenant
computed is a miss on every tier until k distinct tenants computed it, and the storage tier
never writes a block that is not revealed."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import pytest

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.cache_manager import CacheManager
from fastdeploy_kvcache.core.k_anonymity import KAnonymityIndex
from fastdeploy_kvcache.core.metadata import TransferKind
from fastdeploy_kvcache.core.prefix_sharing import PrefixSharing
from fastdeploy_kvcache.core.request import Request

BS = 4
PROMPT = list(range(100, 100 + 4 * BS + 1))  # 4 full blocks matchable (the last token is computed)


def _manager(k: int = 2, **kw) -> CacheManager:
    cfg = dict(block_size=BS, num_gpu_blocks=32, num_host_blocks=32, k_anonymity_k=k)
    cfg.update(kw)
    return CacheManager(CacheConfig(**cfg))


class Runner:
    """Runs one request at a time through match, residency, compute and finish; the host
    tier's copies complete as they are issued (the worker's side, with no bytes)."""

    def __init__(self, mgr: CacheManager) -> None:
        self.mgr = mgr
        self.n = 0

    def run(self, tenant: Optional[str], tokens: list[int] = PROMPT) -> tuple[int, int, int]:
        """(device hit tokens, host hit tokens, cached tokens) of one request."""
        self.n += 1
        req = Request(f"r{self.n}", tokens, tenant=tenant)
        self.mgr.match_prefix(req)
        plan = self.mgr.ensure_resident(req, len(tokens))
        for meta in req.cache_swap_metadata + req.cache_evict_metadata:
            meta.mark_done(True)
            self.mgr.complete_swap(meta)
        req.cache_swap_metadata, req.cache_evict_metadata = [], []
        req.num_computed_tokens = len(tokens)
        self.mgr.request_finish(req)
        self.flush_backups()
        self.mgr.check_invariants()
        return plan.num_device_hit_tokens, plan.num_host_hit_tokens, plan.num_cached_tokens

    def flush_backups(self) -> None:
        meta = self.mgr.issue_pending_backup_to_batch_request()
        if meta is not None:
            meta.mark_done(True)
            self.mgr.complete_swap(meta)

    def evict_device(self) -> None:
        """Fill the device pool with a request of its own: every cached block leaves it."""
        self.n += 1
        big = Request(f"fill{self.n}", list(range(10**6, 10**6 + 32 * BS)), tenant="filler")
        self.mgr.match_prefix(big)
        self.mgr.ensure_resident(big, 32 * BS)
        for meta in big.cache_evict_metadata:
            meta.mark_done(True)
            self.mgr.complete_swap(meta)
        big.cache_evict_metadata = []
        self.mgr.request_finish(big)  # computed nothing: its blocks go back to the pool
        self.flush_backups()


FULL = 4 * BS


@pytest.mark.parametrize("k", [2, 3])
def test_a_block_is_revealed_exactly_by_the_kth_tenant(k: int) -> None:
    r = Runner(_manager(k))
    tenants = [f"t{i}" for i in range(k + 1)]
    for t in tenants[:k]:
        assert r.run(t)[2] == 0, f"{t} matched a block fewer than {k} tenants computed"
    # The k-th distinct tenant's computation revealed it: a new tenant hits.
    assert r.run(tenants[k])[2] == FULL
    assert r.mgr.get_stats()["k_anonymity"]["revealed_blocks"] == 4


def test_a_tenant_always_sees_its_own_blocks_and_repeats_do_not_count() -> None:
    r = Runner(_manager(2))
    assert r.run("a")[2] == 0
    assert r.run("a")[2] == FULL  # its own
    assert r.run("a")[2] == FULL
    assert r.run("b")[2] == 0, "one tenant sending a prompt many times must not reveal it"
    assert r.run("c")[2] == FULL  # a and b: k = 2


def test_anonymous_requests_are_one_tenant() -> None:
    r = Runner(_manager(2))
    assert r.run(None)[2] == 0
    assert r.run(None)[2] == FULL  # the same (anonymous) tenant
    assert r.run("a")[2] == 0
    assert r.run("b")[2] == FULL


def test_a_private_block_on_host_is_a_miss_for_others_and_a_host_hit_after_reveal() -> None:
    r = Runner(_manager(2, write_policy="write_through"))
    assert r.run("a")[2] == 0
    r.evict_device()
    assert r.run("a")[:2] == (0, FULL), "its own tenant loads it from host"
    r.evict_device()
    assert r.run("b") == (0, 0, 0), "another tenant must miss the host copy too"
    r.evict_device()
    assert r.run("c")[:2] == (0, FULL)  # a and b computed it: revealed, on host


def test_a_load_in_flight_is_not_shared_with_another_tenant() -> None:
    mgr = _manager(2, write_policy="write_through")
    r = Runner(mgr)
    r.run("a")
    r.evict_device()
    own = Request("own", PROMPT, tenant="a")
    mgr.match_prefix(own)
    mgr.ensure_resident(own, len(PROMPT))
    assert own.cache_swap_metadata, "a's blocks load from host"
    other = Request("other", PROMPT, tenant="b")
    m = mgr.match_prefix(other)
    assert m.num_matched_tokens == 0, "b shares a's load of a's private blocks"
    again = Request("again", PROMPT, tenant="a")
    assert mgr.match_prefix(again).num_matched_tokens == FULL  # a shares its own load
    assert any(nd.pending is TransferKind.SWAP_IN for nd in mgr.match_prefix(again).nodes)


def test_a_duplicate_computation_joins_the_set_and_the_tree_keeps_one_copy() -> None:
    mgr = _manager(2)
    r = Runner(mgr)
    r.run("a")
    nodes = mgr.tree.num_nodes
    before = mgr.get_stats()["duplicate_blocks"]
    r.run("b")  # computes as a miss; its copies are duplicates of a's
    assert mgr.tree.num_nodes == nodes
    assert mgr.get_stats()["duplicate_blocks"] - before == 4
    assert mgr.k_anonymity is not None
    assert all(mgr.k_anonymity.is_revealed(h) for h in Request("x", PROMPT).block_hashes(BS)[:4])


def test_a_shared_prefix_is_revealed_and_private_tails_stay_private() -> None:
    r = Runner(_manager(2))
    system = list(range(500, 500 + 2 * BS))
    assert r.run("a", system + [1] * (2 * BS) + [9])[2] == 0
    assert r.run("b", system + [2] * (2 * BS) + [9])[2] == 0
    # c shares the system prompt (two tenants computed it) but not a's private tail.
    assert r.run("c", system + [1] * (2 * BS) + [9])[2] == 2 * BS
    assert r.run("a", system + [1] * (2 * BS) + [9])[2] == 4 * BS  # c made it k = 2 too


def test_commit_counts_the_tenant_while_the_request_runs() -> None:
    mgr = _manager(2)
    r = Runner(mgr)
    r.run("a")
    running = Request("b-run", PROMPT, tenant="b")
    mgr.match_prefix(running)
    mgr.ensure_resident(running, len(PROMPT))
    running.num_computed_tokens = len(PROMPT)
    mgr.commit_computed_blocks(running)
    assert r.run("c")[2] == FULL, "b's committed computation should have revealed the prefix"
    mgr.request_finish(running)


def test_prefix_sharing_holds_only_for_the_own_tenant_or_revealed_blocks() -> None:
    kanon = KAnonymityIndex(2)
    sh = PrefixSharing(BS, max_hold_s=5.0, k_anonymity=kanon)
    sh.admitted(Request("lead", PROMPT, tenant="a"), 0)
    assert sh.should_hold(Request("same", PROMPT, tenant="a"), 0)
    assert not sh.should_hold(Request("other", PROMPT, tenant="b"), 0), "b would wait for a's private block"
    kanon.mark_revealed(Request("x", PROMPT).block_hashes(BS)[:1])
    assert sh.should_hold(Request("other2", PROMPT, tenant="b"), 0), "a revealed block is shared in flight"
    plain = PrefixSharing(BS, max_hold_s=5.0)
    plain.admitted(Request("lead", PROMPT, tenant="a"), 0)
    assert plain.should_hold(Request("other", PROMPT, tenant="b"), 0)  # no k-anonymity: shared


def test_the_index_is_bounded_and_forgetting_only_hides() -> None:
    idx = KAnonymityIndex(2, capacity=3)
    idx.record_computed("a", [1, 2, 3])
    idx.record_computed("b", [1])
    assert idx.is_revealed(1) and idx.visible(2, "a") and not idx.visible(2, "b")
    idx.record_computed("a", [4, 5])  # 2 and 3 were used least recently: forgotten
    assert len(idx) == 3 and not idx.visible(2, "a") and not idx.is_revealed(2)
    assert idx.stats()["forgotten"] == 2


@pytest.mark.parametrize("bad", [0, 1, True, 2.0, "2"])
def test_bad_k_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="k must be an int >= 2"):
        KAnonymityIndex(bad)


def test_config_refuses_k_of_one() -> None:
    with pytest.raises(ValueError, match="k_anonymity_k"):
        CacheConfig(num_gpu_blocks=8, k_anonymity_k=1)


def test_storage_writes_revealed_blocks_only(tmp_path: Path) -> None:
    from fastdeploy_kvcache.core.storage_tier import StorageTier
    from fastdeploy_kvcache.storage import KeyNamespace
    from fastdeploy_kvcache.storage.config import StorageConfig
    from fastdeploy_kvcache.storage.file_backend import FileBackend

    ns = KeyNamespace(model="m", weights_fingerprint="w", dtype="float32", block_size=BS, layout="l")
    tier = StorageTier(FileBackend(path=str(tmp_path), min_free_bytes=0), ns,
                       StorageConfig(backend="file", path=str(tmp_path)))
    mgr = CacheManager(CacheConfig(block_size=BS, num_gpu_blocks=32, num_host_blocks=32, k_anonymity_k=2,
                                   write_policy="write_through"), storage=tier)

    def run(rid: str, tenant: str, tokens: list[int]) -> None:
        req = Request(rid, tokens, tenant=tenant)
        mgr.match_prefix(req)
        mgr.ensure_resident(req, len(tokens))
        req.num_computed_tokens = len(tokens)
        mgr.request_finish(req)

    def backups() -> list[int]:
        meta = mgr.issue_pending_backup_to_batch_request()
        assert meta is not None
        meta.mark_done(True)
        tier.on_host_copies(meta.hash_values, meta.dst_block_ids, True)
        mgr.complete_swap(meta)
        return [h for job in tier.take_jobs() if job.kind is TransferKind.STORAGE_SAVE for h in job.hashes]

    private = list(range(1, 1 + 2 * BS + 1))
    run("a1", "a", private)
    assert backups() == [], "a private block was written under its shared key"
    assert tier.stats["put_skipped_private"] == 2
    # b computes it too: revealed, with its host copy made already: put now.
    run("b1", "b", private)
    puts = [h for job in tier.take_jobs() if job.kind is TransferKind.STORAGE_SAVE for h in job.hashes]
    assert puts == Request("x", private).block_hashes(BS)[:2]
    shared = list(range(50, 50 + 2 * BS + 1))
    run("a2", "a", shared)
    run("b2", "b", shared)  # revealed before its host copy is made
    assert backups() == Request("x", shared).block_hashes(BS)[:2]


def test_kv_events_announce_a_block_when_it_is_revealed_not_before() -> None:
    from fastdeploy_kvcache.core.kv_event_recorder import KVEventRecorder, cache_contents
    from fastdeploy_kvcache.core.kv_events import EVENT_HASH_MASK, BlockRemoved, BlockStored

    mgr = _manager(2, write_policy="write_through")
    rec = KVEventRecorder(BS)
    assert mgr.k_anonymity is not None
    rec.publishable = mgr.k_anonymity.is_revealed  # as engine/kv_event_stream.py sets it
    mgr.tree.events = rec
    r = Runner(mgr)
    want = [h & EVENT_HASH_MASK for h in Request("x", PROMPT).block_hashes(BS)[:4]]

    def announced() -> dict[str, list[int]]:
        batch = rec.drain()
        out: dict[str, list[int]] = {}
        for ev in (batch.events if batch is not None else []):
            assert not isinstance(ev, BlockRemoved) or not set(ev.block_hashes) & set(want), ev
            if isinstance(ev, BlockStored):
                out.setdefault(ev.medium, []).extend(ev.block_hashes)
        return out

    r.run("a")  # computed, backed up to host: private, so not announced on either medium
    got = announced()
    assert not any(set(hs) & set(want) for hs in got.values()), got
    assert not set(want) & {h & EVENT_HASH_MASK for hs in cache_contents(mgr).values() for h in hs}
    r.evict_device()  # a private block leaving the device announces no removal either
    got = announced()
    r.run("b")  # b's computation reveals it: its copies (device, host) are announced now
    got = announced()
    assert got.get("GPU", [])[:4] == want and set(want) <= set(got.get("CPU", [])), got
    assert set(want) <= {h & EVENT_HASH_MASK for h in cache_contents(mgr)["GPU"]}


def _probe_copies(k_anonymity_k: int, victim_sent: bool) -> tuple[int, int]:
    """A victim sends the secret (or a decoy as long), then an attacker computes the secret
    in two chunks: (blocks copied to host while the attacker's request computes, blocks
    copied once it has left), under write_through."""
    mgr = _manager(k_anonymity_k, write_policy="write_through")
    r = Runner(mgr)
    decoy = [t + 1000 for t in PROMPT]
    r.run("victim", PROMPT if victim_sent else decoy)
    req = Request("probe", PROMPT, tenant="attacker")
    mgr.match_prefix(req)
    mgr.ensure_resident(req, len(PROMPT))
    assert not req.cache_swap_metadata, "the attacker must not load the victim's blocks"
    during = 0
    for computed in (2 * BS, len(PROMPT)):  # two chunks, each committed as it is computed
        req.num_computed_tokens = computed
        mgr.commit_computed_blocks(req)
        meta = mgr.issue_pending_backup_to_batch_request()
        if meta is not None:
            during += len(meta.dst_block_ids)
            meta.mark_done(True)
            mgr.complete_swap(meta)
    mgr.request_finish(req)
    meta = mgr.issue_pending_backup_to_batch_request()
    after = 0 if meta is None else len(meta.dst_block_ids)
    if meta is not None:
        meta.mark_done(True)
        mgr.complete_swap(meta)
    mgr.check_invariants()
    return during, after


def test_a_request_copies_nothing_while_it_computes_whatever_other_tenants_sent() -> None:
    """The timing attack's probe: under k-anonymity its blocks are fresh nodes (backed up)
    when the victim did not send the secret, duplicates of the victim's private blocks (no
    copy) when it did.  Copies made while the probe computes would slow it in the first case
    only, so none is made before it leaves; the fresh blocks are backed up then."""
    fresh = _probe_copies(2, victim_sent=False)
    duplicate = _probe_copies(2, victim_sent=True)
    assert fresh[0] == duplicate[0] == 0, (fresh, duplicate)
    assert fresh[1] == FULL // BS, "the attacker's own fresh blocks are backed up once it leaves"
    assert duplicate[1] == 0
    # Without k-anonymity write_through backs each chunk up as it commits (what the rule
    # above changes): the fresh blocks are copied while the request still computes.
    assert _probe_copies(0, victim_sent=False)[0] > 0
