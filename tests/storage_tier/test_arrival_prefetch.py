"""Prefetch on arrival at the tier level (real CacheManager, real file backend, real worker
threads; the Rig of test_tier): it starts when a request is queued, stays within its host
budget, is shared by a second request with the same prefix, and an aborted request's
prefetch leaves no host block behind."""

from __future__ import annotations

from typing import Any

from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.storage_tier import PREFETCH_READY, PREFETCH_WAITING
from skip_helpers import needs_cpu_capi

from .test_tier import BS, TOKENS, rigs, store_tokens  # noqa: F401 - rigs is a fixture

pytestmark = needs_cpu_capi()


def _host_whole(rig: Any) -> None:
    counts = rig.manager.check_invariants()
    assert counts["host_owned"] == 0, counts
    assert not rig.tier.held_host_blocks()


def _finish_whole(rig: Any, req: Request) -> None:
    """The request computed its prompt and finished: nothing is left held on the host."""
    req.num_computed_tokens = len(TOKENS)
    rig.manager.request_finish(req)
    _host_whole(rig)


def test_arrival_prefetch_is_ready_by_admission_and_its_wait_starts_there(rigs: Any) -> None:
    store_tokens(rigs(), TOKENS)
    rig = rigs(policy="timeout")  # a restarted scheduler in front of the same directory
    rig.config.prefetch_timeout_base_s = 5.0  # a request waits at most 5 s for its prefetch
    req = Request("r", TOKENS)
    rig.tier.prefetch_on_arrival(req, budget_blocks=8)
    assert rig.tier.stats["arrival_prefetch_jobs"] == 1 and rig.tier.stats["arrival_prefetch_blocks"] == 4
    rig.now = 100.0  # queued far longer than the timeout policy waits: the wait starts at admission
    rig.submit()
    assert rig.tier.prefetch_state(req) == PREFETCH_WAITING, "the timeout counted from arrival"
    rig.drain()
    assert rig.tier.prefetch_state(req) == PREFETCH_READY
    assert rig.tier.stats["exists_calls"] == 1, "admission asked storage again"
    rig.manager.match_prefix(req)
    plan = rig.manager.ensure_resident(req, len(TOKENS))
    assert plan.num_host_hit_tokens == 4 * BS and rig.tier.admitted(req) == 4 * BS
    _finish_whole(rig, req)


def test_arrival_prefetch_keeps_to_its_budget_and_is_shared(rigs: Any) -> None:
    store_tokens(rigs(), TOKENS)
    rig = rigs()
    a, b = Request("a", TOKENS), Request("b", TOKENS + [7, 8])
    rig.tier.prefetch_on_arrival(a, budget_blocks=3)
    assert rig.tier.stats["arrival_prefetch_blocks"] == 3  # cut at the budget
    rig.tier.prefetch_on_arrival(b, budget_blocks=3)
    # b needs the same blocks: it follows a's fetch instead of fetching them again.
    assert rig.tier.stats["prefetch_jobs"] == 1 and rig.tier.stats["prefetch_blocks_shared"] == 3
    c = Request("c", list(range(900, 900 + 4 * BS + 1)))
    rig.tier.prefetch_on_arrival(c, budget_blocks=3)
    assert rig.tier.stats["arrival_prefetch_over_budget"] == 1
    rig.submit()
    rig.drain()
    assert rig.tier.prefetch_state(b) == PREFETCH_READY
    match = rig.manager.match_prefix(b)
    assert len(match.nodes) == 3
    for r in (a, b, c):
        rig.tier.forget_request(r.request_id)
    _host_whole(rig)


def test_an_aborted_request_leaves_no_prefetched_block_held(rigs: Any) -> None:
    store_tokens(rigs(), TOKENS)
    rig = rigs()
    req = Request("gone", TOKENS)
    rig.tier.prefetch_on_arrival(req, budget_blocks=8)
    rig.submit()
    rig.tier.forget_request("gone")  # aborted while its fetch is in flight
    assert rig.tier.stats["aborted_prefetches"] == 1
    rig.drain()
    # What arrived is host cache now (evictable, reachable by the next request); nothing held.
    assert rig.tier.stats["prefetch_blocks_inserted"] == 4
    _host_whole(rig)
    assert len(rig.manager.match_prefix(Request("next", TOKENS)).nodes) == 4


def test_a_failed_shared_fetch_leaves_every_follower_the_leading_run(rigs: Any, tmp_path: Any) -> None:
    """Block 2 of a fetch two requests share vanishes before the get: both match blocks 0-1
    only and compute the rest (nothing past the hole is used, nothing is held)."""
    hashes = store_tokens(rigs(), TOKENS)
    rig = rigs()
    a, b = Request("a", TOKENS), Request("b", TOKENS + [7, 8])
    rig.tier.prefetch_on_arrival(a, budget_blocks=8)
    rig.tier.prefetch_on_arrival(b, budget_blocks=8)
    assert rig.tier.stats["prefetch_blocks_shared"] == 4 and rig.tier.stats["prefetch_jobs"] == 1
    (tmp_path / "kv" / (rig.tier.ns.key(hashes[2]).replace(":", "=") + ".kv")).unlink()
    rig.submit()
    rig.drain()
    for r in (a, b):
        assert rig.tier.prefetch_state(r) == PREFETCH_READY
        match = rig.manager.match_prefix(r)
        assert len(match.nodes) == 2, f"{r.request_id} matched past the hole"
        for node, h in zip(match.nodes, hashes):
            assert rig.read_host(node.host_block_id) == rig.expected(h)
        rig.tier.forget_request(r.request_id)
    assert rig.tier.stats["prefetch_blocks_failed"] == 2
    _host_whole(rig)


def test_a_fetch_run_on_the_calling_thread_lands_whole_and_is_timed(rigs: Any) -> None:
    """StorageWorker.run (the engine's inline read when it would only wait): same bytes in
    the same host blocks as a submitted job, the fetch's times in order, and the request's
    fetch timing readable until admission forgets it."""
    hashes = store_tokens(rigs(), TOKENS)
    rig = rigs()
    req = Request("r", TOKENS)
    rig.tier.prefetch_on_arrival(req, budget_blocks=8)
    (job,) = rig.tier.take_jobs()
    assert rig.worker.loads_in_flight == 0
    rig.tier.complete(rig.worker.run(job))
    assert job.results == [rig.layout.object_bytes] * 4 and job.nbytes == 4 * rig.layout.object_bytes
    assert 0 < job.submitted_at <= job.done_at and job.seconds == job.done_at - job.submitted_at
    assert rig.worker.num_in_flight == 0, "an inline job is never left for collect_finished"
    assert rig.tier.prefetch_state(req) == PREFETCH_READY
    timing = rig.tier.fetch_timing(req)
    assert timing is not None and not timing["shared"] and timing["on_arrival"]
    assert timing["blocks"] == 4 and timing["bytes"] == job.nbytes and timing["job_s"] == job.seconds
    assert timing["landed"] == job.done_at and timing["completed"] == rig.now  # the rig's clock
    match = rig.manager.match_prefix(req)
    assert len(match.nodes) == 4
    for node, h in zip(match.nodes, hashes):
        assert rig.read_host(node.host_block_id) == rig.expected(h)
    rig.manager.ensure_resident(req, len(TOKENS))
    assert rig.tier.admitted(req) == 4 * BS
    assert rig.tier.fetch_timing(req) is None, "admission forgets the request's fetch"
    _finish_whole(rig, req)


def test_a_fetch_run_on_the_calling_thread_that_cannot_run_fails_like_a_submitted_one(rigs: Any) -> None:
    store_tokens(rigs(), TOKENS)
    rig = rigs()
    req = Request("r", TOKENS)
    rig.tier.prefetch_on_arrival(req, budget_blocks=8)
    (job,) = rig.tier.take_jobs()
    rig.transfer.close()  # the transfer refuses every batch now
    done = rig.worker.run(job)  # never raises: the job comes back failed
    assert done.error_kind == "unreachable" and all(r < 0 for r in done.results)
    rig.tier.complete(done)
    assert rig.tier.prefetch_state(req) == PREFETCH_READY
    assert len(rig.manager.match_prefix(req).nodes) == 0, "a failed fetch inserted blocks"
    rig.tier.forget_request("r")
    _host_whole(rig)


def _two_arrivals(rigs: Any) -> tuple[Any, list[Request], list[list[int]]]:
    other = [t + 7000 for t in TOKENS]
    hashes = [store_tokens(rigs(), TOKENS), store_tokens(rigs(), other)]
    rig = rigs()
    reqs = [Request("a", TOKENS), Request("b", other)]
    for r in reqs:
        rig.tier.prefetch_on_arrival(r, budget_blocks=16)
    return rig, reqs, hashes


def test_several_fetches_run_here_as_one_batch_land_each_in_its_own_request(rigs: Any) -> None:
    """StorageWorker.run_many (the idle engine's fetches for its next step): one transfer
    call, each job finished with its own slice of the results, bytes where each belongs."""
    rig, reqs, hashes = _two_arrivals(rigs)
    jobs = rig.tier.take_jobs()
    assert len(jobs) == 2
    calls: list[int] = []
    get_blocks = rig.transfer.get_blocks
    rig.transfer.get_blocks = lambda keys, ids: calls.append(len(keys)) or get_blocks(keys, ids)
    for job in rig.worker.run_many(jobs):
        rig.tier.complete(job)
    assert calls == [8], "the two fetches were not one transfer call"
    for job in jobs:
        assert job.results == [rig.layout.object_bytes] * 4 and job.nbytes == 4 * rig.layout.object_bytes
        assert 0 < job.submitted_at <= job.done_at
    assert rig.worker.num_in_flight == 0
    for r, hs in zip(reqs, hashes):
        assert rig.tier.prefetch_state(r) == PREFETCH_READY
        match = rig.manager.match_prefix(r)
        assert len(match.nodes) == 4
        for node, h in zip(match.nodes, hs):
            assert rig.read_host(node.host_block_id) == rig.expected(h), f"{r.request_id} got another's bytes"
        rig.tier.forget_request(r.request_id)


def test_a_batch_of_fetches_that_cannot_run_fails_every_job(rigs: Any) -> None:
    rig, reqs, _ = _two_arrivals(rigs)
    jobs = rig.tier.take_jobs()
    rig.transfer.close()
    for job in rig.worker.run_many(jobs):
        assert job.error_kind == "unreachable" and all(r < 0 for r in job.results)
        rig.tier.complete(job)
    for r in reqs:
        assert rig.tier.prefetch_state(r) == PREFETCH_READY
        assert len(rig.manager.match_prefix(r).nodes) == 0, "a failed fetch inserted blocks"
        rig.tier.forget_request(r.request_id)
    _host_whole(rig)
