"""The scheduler-side storage tier on a real CacheManager, a real file backend, a real
StorageTransfer (CPU C ABI gather/scatter) over a CacheController's host tier on the CPU, and
the StorageWorker's threads.  The "device -> host" copies of a step are played by writing
each block's known bytes (a function of its hash) into the host tier, so every byte that
comes back from storage can be checked against what its hash must hold (shadow memory).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.cache_manager import CacheManager
from fastdeploy_kvcache.core.metadata import CacheLevel
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.storage_tier import PREFETCH_READY, PREFETCH_WAITING, StorageTier
from fastdeploy_kvcache.storage import KeyNamespace
from fastdeploy_kvcache.storage.config import StorageConfig
from fastdeploy_kvcache.storage.file_backend import FileBackend
from fastdeploy_kvcache.storage.transfer import HostTierLayout, StorageTransfer
from skip_helpers import needs_cpu_capi

pytestmark = needs_cpu_capi()

BS = 4


def host_view(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


class Rig:
    """Manager + tier + worker over one directory; ``shadow`` writes/reads host blocks."""

    def __init__(self, directory: Path, policy: str = "wait_complete", host_blocks: int = 8,
                 capacity_bytes: int = 0, backend: Any = None) -> None:
        from fastdeploy_kvcache.worker.cache_controller import CacheController
        from fastdeploy_kvcache.worker.storage_worker import StorageWorker

        cfg = CacheConfig(block_size=BS, num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32",
                          num_gpu_blocks=16, num_host_blocks=host_blocks, write_policy="write_through")
        self.ctl = CacheController(cfg, backend="cpu", threaded=False)
        self.ctl.initialize_host_cache()
        self.layout = HostTierLayout.from_controller(self.ctl)
        self.backend = backend or FileBackend(path=str(directory), min_free_bytes=0, capacity_bytes=capacity_bytes)
        self.transfer = StorageTransfer(self.layout, self.backend)
        self.worker = StorageWorker(self.transfer)
        ns = KeyNamespace(model="rig", weights_fingerprint="w", dtype="float32", block_size=BS,
                          layout=self.layout.describe())
        self.config = StorageConfig(backend="file", path=str(directory), prefetch_policy=policy,
                                    prefetch_timeout_base_s=0.0, prefetch_timeout_per_ktoken_s=0.0)
        self.now = 0.0
        self.tier = StorageTier(self.backend, ns, self.config, clock=lambda: self.now)
        self.manager = CacheManager(cfg, storage=self.tier)

    # -- shadow memory: what a block of hash h holds
    def expected(self, h: int) -> bytes:
        rng = np.random.default_rng(h % (2**63))
        return rng.integers(0, 256, self.layout.object_bytes, dtype=np.uint8).tobytes()

    def write_host(self, block: int, data: bytes) -> None:
        off = 0
        for p, bb in zip(self.layout.ptrs, self.layout.block_bytes):
            host_view(p + block * bb, bb)[:] = np.frombuffer(data[off:off + bb], dtype=np.uint8)
            off += bb

    def read_host(self, block: int) -> bytes:
        return b"".join(host_view(p + block * bb, bb).tobytes()
                        for p, bb in zip(self.layout.ptrs, self.layout.block_bytes))

    # -- a step's worth of worker activity
    def run_backups(self) -> None:
        """Issue the manager's backups, 'copy' them (shadow bytes), complete them."""
        meta = self.manager.issue_pending_backup_to_batch_request()
        if meta is None:
            return
        for h, b in zip(meta.hash_values, meta.dst_block_ids):
            self.write_host(b, self.expected(h))
        meta.mark_done(True)
        self.tier.on_host_copies(meta.hash_values, meta.dst_block_ids, True)
        self.manager.complete_swap(meta)

    def submit(self) -> None:
        for job in self.tier.take_jobs():
            self.worker.submit(job)

    def drain(self) -> None:
        deadline = time.monotonic() + 30
        while self.worker.num_in_flight and time.monotonic() < deadline:
            for job in self.worker.collect_finished(wait=True, timeout_s=1.0):
                self.tier.complete(job)
        assert not self.worker.num_in_flight

    def serve(self, rid: str, tokens: list[int]) -> Request:
        """Match, allocate, 'compute', finish: the request's full blocks become cached."""
        req = Request(rid, tokens)
        self.manager.match_prefix(req)
        self.manager.ensure_resident(req, len(tokens))
        req.num_computed_tokens = len(tokens)
        self.manager.request_finish(req)
        return req

    def close(self) -> None:
        self.drain()
        self.worker.close()
        self.backend.close()
        self.ctl.close()


@pytest.fixture
def rigs(tmp_path: Path) -> Any:
    made: list[Rig] = []

    def make(**kw: Any) -> Rig:
        rig = Rig(tmp_path / "kv", **kw)
        made.append(rig)
        return rig

    yield make
    for rig in made:
        rig.close()


TOKENS = list(range(100, 100 + 4 * BS + 1))  # 4 full blocks can match (the last token is computed)


def store_tokens(rig: Rig, tokens: list[int]) -> list[int]:
    req = rig.serve("writer", tokens)
    rig.run_backups()
    rig.submit()
    rig.drain()
    hashes = req.block_hashes(BS)[: (len(tokens) - 1) // BS]
    assert all(rig.tier.is_stored(h) for h in hashes)
    return hashes


def test_a_host_block_being_stored_is_not_reallocated(rigs: Any) -> None:
    rig = rigs(host_blocks=4)
    req = rig.serve("a", TOKENS)
    rig.run_backups()  # 4 blocks on host, their puts queued and pinned
    hashes = req.block_hashes(BS)[:4]
    pinned = sorted(rig.manager.host_pool.pin_counts())
    assert len(pinned) == 4 and not any(rig.tier.is_stored(h) for h in hashes)
    rig.manager.reset_cache()  # the tree lets go of every host copy while the puts are queued
    assert rig.manager.host_pool.num_free == 0, "a pinned host block went back to the free list"
    assert sorted(rig.manager.host_pool.deferred) == pinned
    rig.tier.check_invariants()
    # Another request's backups cannot get those blocks: there is nothing to allocate.
    rig.serve("b", list(range(900, 900 + 4 * BS + 1)))
    meta = rig.manager.issue_pending_backup_to_batch_request()
    assert meta is None or not set(meta.dst_block_ids) & set(pinned)
    rig.submit()
    rig.drain()
    assert all(rig.tier.is_stored(h) for h in hashes), "a put that returned OK marks its hash stored"
    assert rig.manager.host_pool.num_pinned == 0 and not rig.manager.host_pool.deferred
    assert rig.manager.host_pool.num_free == 4 - (len(meta.dst_block_ids) if meta else 0)
    out = np.zeros(rig.layout.object_bytes, dtype=np.uint8)
    rig.backend.register_buffer(int(out.ctypes.data), out.nbytes)
    for h in hashes:  # the bytes stored are the block's, not a later tenant's
        key = rig.tier.ns.key(h)
        assert rig.backend.batch_get_into([key], [int(out.ctypes.data)], [out.nbytes]) == [out.nbytes]
        assert out.tobytes() == rig.expected(h)


def test_restart_prefetch_missing_after_exists_and_partial_batch(rigs: Any, tmp_path: Path) -> None:
    first = rigs()
    hashes = store_tokens(first, TOKENS)
    # Skipped: a hash that is stored is not put again.
    first.serve("again", TOKENS)
    issued = first.tier.stats["put_blocks_issued"]
    first.run_backups()
    assert first.tier.take_jobs() == [] and first.tier.stats["put_blocks_issued"] == issued

    second = rigs()  # a restarted scheduler in front of the same directory
    req = Request("r", TOKENS)
    assert second.tier.prefetch_state(req) == PREFETCH_WAITING  # wait_complete: held
    assert second.tier.stats["exists_calls"] == 1 and second.tier.stats["hit_blocks"] == 4
    jobs = second.tier.take_jobs()
    assert len(jobs) == 1 and len(jobs[0].keys) == 4
    # The key of block 2 vanishes after the positive existence check.
    (tmp_path / "kv" / (second.tier.ns.key(hashes[2]).replace(":", "=") + ".kv")).unlink()
    second.worker.submit(jobs[0])
    second.drain()
    assert second.tier.prefetch_state(req) == PREFETCH_READY
    assert second.tier.stats["prefetch_blocks_loaded"] == 2 and second.tier.stats["prefetch_blocks_failed"] == 2
    second.tier.check_invariants()
    second.manager.check_invariants()
    match = second.manager.match_prefix(req)
    assert [t for t in match.tiers] == [CacheLevel.HOST, CacheLevel.HOST]  # the leading run only
    for node, h in zip(match.nodes, hashes):
        assert second.read_host(node.host_block_id) == second.expected(h), "prefetched bytes differ"
    plan = second.manager.ensure_resident(req, len(TOKENS))
    assert plan.num_host_hit_tokens == 2 * BS
    assert second.tier.admitted(req) == 2 * BS
    assert second.tier.stats["exists_calls"] == 1, "one round trip per request"
    assert second.manager.host_pool.num_free == second.manager.host_pool.num_blocks - 2


def test_timeout_policy_aborts_but_keeps_blocks_until_the_job_returns(rigs: Any) -> None:
    first = rigs()
    store_tokens(first, TOKENS)
    second = rigs(policy="timeout")
    req = Request("r", TOKENS)
    assert second.tier.prefetch_state(req) == PREFETCH_READY  # a timeout of 0 s: run now
    assert second.tier.stats["aborted_prefetches"] == 1
    held = [b for b, _ in second.tier.held_host_blocks()]
    assert len(held) == 4 and all(not second.manager.host_pool.is_free(b) for b in held)
    match = second.manager.match_prefix(req)
    assert match.nodes == []  # nothing has arrived: the request recomputes
    second.manager.ensure_resident(req, len(TOKENS))
    assert second.tier.admitted(req) == 0
    second.submit()
    second.drain()  # the late job still lands: a later request gets host hits
    assert not second.tier.held_host_blocks()
    later = Request("later", TOKENS)
    assert [t for t in second.manager.match_prefix(later).tiers] == [CacheLevel.HOST] * 4
    second.tier.check_invariants()


def test_tier_off_drops_backups_without_pinning(rigs: Any) -> None:
    rig = rigs()
    rig.backend.close()  # health().available is False from now on
    rig.serve("a", TOKENS)
    rig.run_backups()
    assert rig.tier.take_jobs() == []
    assert rig.manager.host_pool.num_pinned == 0 and rig.tier.errors["unreachable"] == 4
    assert rig.tier.prefetch_state(Request("b", list(range(5000, 5000 + 4 * BS + 1)))) == PREFETCH_READY
    assert rig.tier.stats["unavailable_skips"] >= 1


def test_write_back_stores_blocks_when_the_host_tier_evicts_them(rigs: Any, tmp_path: Path) -> None:
    rig = rigs(host_blocks=4)
    rig.config.put_policy = "write_back"
    first = rig.serve("a", TOKENS)
    rig.run_backups()  # on host; write_back stores nothing yet
    assert rig.tier.take_jobs() == [] and rig.manager.host_pool.num_pinned == 0
    hashes = first.block_hashes(BS)[:4]
    # Another prompt's backups need the host blocks: the LRU host leaves are evicted, and
    # each is stored first (pinned until its put returns).
    rig.serve("b", list(range(900, 900 + 4 * BS + 1)))
    rig.run_backups()
    rig.manager.check_invariants()
    assert rig.manager.host_pool.num_pinned > 0
    rig.submit()
    rig.drain()
    stored = [h for h in hashes if rig.tier.is_stored(h)]
    assert stored, "evicted host blocks were not written back to storage"
    assert rig.manager.host_pool.num_pinned == 0
    rig.manager.check_invariants()
    # A restarted scheduler finds them.
    second = rigs(host_blocks=4)
    req = Request("r", TOKENS)
    second.tier.prefetch_state(req)
    second.submit()
    second.drain()
    match = second.manager.match_prefix(req)
    assert len(match.nodes) >= 1
    for node in match.nodes:
        assert second.read_host(node.host_block_id) == second.expected(node.hash_value)


def test_a_second_request_waits_on_the_prefetch_in_flight_for_its_prefix(rigs: Any) -> None:
    first = rigs()
    hashes = store_tokens(first, TOKENS)
    second = rigs()
    a, b = Request("a", TOKENS), Request("b", TOKENS[:-1] + [7])  # same 4 full blocks
    assert second.tier.prefetch_state(a) == PREFETCH_WAITING
    assert second.tier.prefetch_state(b) == PREFETCH_WAITING  # follows a's job
    assert second.tier.stats["exists_calls"] == 1 and second.tier.stats["prefetch_jobs"] == 1
    second.submit()
    second.drain()
    assert second.tier.prefetch_state(b) == PREFETCH_READY
    assert second.tier.prefetch_state(a) == PREFETCH_READY
    for req in (a, b):  # both match the fetched blocks on host
        assert [n.hash_value for n in second.manager.match_prefix(req).nodes] == hashes
    second.manager.ensure_resident(a, a.num_total_tokens)
    assert second.tier.admitted(a) == 4 * BS
    second.tier.forget_request("b")
    second.manager.check_invariants()
    assert not second.tier._followers and not second.tier._prefetch


def _unlink(rig: Any, tmp_path: Path, h: int) -> None:
    (tmp_path / "kv" / (rig.tier.ns.key(h).replace(":", "=") + ".kv")).unlink()


def test_a_lookup_probes_the_first_and_last_block_and_asks_the_whole_run_only_when_they_differ(
        rigs: Any, tmp_path: Path) -> None:
    hashes = store_tokens(rigs(), TOKENS)
    assert len(hashes) == 4
    rig = rigs()
    assert rig.tier.query(hashes) == 4 and rig.tier.stats["exists_calls"] == 1
    _unlink(rig, tmp_path, hashes[3])  # the last gone: a second round trip finds the run's end
    assert rig.tier.query(hashes) == 3 and rig.tier.stats["exists_calls"] == 3
    _unlink(rig, tmp_path, hashes[0])  # the first gone: a miss after one round trip
    assert rig.tier.query(hashes) == 0 and rig.tier.stats["exists_calls"] == 4


def test_a_hole_the_probe_cannot_see_is_found_by_the_fetch(rigs: Any, tmp_path: Path) -> None:
    hashes = store_tokens(rigs(), TOKENS)
    rig = rigs()
    _unlink(rig, tmp_path, hashes[1])  # first and last still there
    req = Request("r", TOKENS)
    assert rig.tier.prefetch_state(req) == PREFETCH_WAITING
    jobs = rig.tier.take_jobs()
    assert len(jobs) == 1 and len(jobs[0].keys) == 4, "the probe took the whole run"
    rig.worker.submit(jobs[0])
    rig.drain()
    assert rig.tier.prefetch_state(req) == PREFETCH_READY
    assert rig.tier.stats["prefetch_blocks_loaded"] == 1 and rig.tier.stats["prefetch_blocks_failed"] == 3
    match = rig.manager.match_prefix(req)
    assert [t for t in match.tiers] == [CacheLevel.HOST], "only the leading run joins the tree"
    assert rig.read_host(match.nodes[0].host_block_id) == rig.expected(hashes[0])
    rig.tier.check_invariants()
    rig.manager.check_invariants()
    assert rig.manager.host_pool.num_free == rig.manager.host_pool.num_blocks - 1, "the unused blocks are free again"
