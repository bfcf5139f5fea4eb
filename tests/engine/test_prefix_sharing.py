"""In-batch prefix sharing at the scheduler level: a burst of requests that share an uncached
prefix computes it once, the hold is bounded, a leader that leaves releases its followers.

The engine is built, the burst is queued, and only then is the engine thread started, so
every request of the burst is in the first scheduling pass (no timing involved).  Greedy
outputs are compared with the same burst on an engine with holding off, and every test ends
with the pools whole (check_invariants, no device block owned).
"""

from __future__ import annotations

from typing import Any

import pytest

from fastdeploy_kvcache.engine.llm_engine import LLMEngine
from tests.engine.conftest import Collector, greedy
from tests.engine_args import engine_args

BS = 16
PREFIX = [3 + (j * 11) % 500 for j in range(20 * BS)]  # 20 full blocks, cached nowhere yet


def _prompt(i: int) -> list[int]:
    return PREFIX + [5 + i, 7 + i, 9 + i]


def _engine(monkeypatch: pytest.MonkeyPatch, tiny_model: Any, **kwargs: Any) -> LLMEngine:
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1")
    args = dict(model="tiny-llama-random", block_size=BS, max_model_len=1024, max_num_batched_tokens=1024,
                max_num_seqs=8, swap_space=0.01)
    args.update(kwargs)
    return LLMEngine(engine_args(**args), loaded_model=tiny_model)


def _burst(engine: LLMEngine, n: int, max_tokens: int = 6, abort_first: bool = False) -> Collector:
    """Queue ``n`` requests before the engine thread runs, then run them to the end."""
    col = Collector()
    for i in range(n):
        engine.add_request(f"r{i}", _prompt(i), greedy(max_tokens), col)
    if abort_first:
        engine.abort("r0")
    engine.start()
    assert engine.wait_idle(120), "the burst did not finish"
    return col


def _assert_whole(engine: LLMEngine) -> None:
    counts = engine.pool.check_invariants()
    assert counts["device_owned"] == 0 and counts["host_owned"] == 0, counts


@pytest.fixture
def recompute_tokens(monkeypatch: pytest.MonkeyPatch, tiny_model: Any) -> dict[str, list[int]]:
    """The burst's greedy tokens on an engine with holding off (each computes its own prefix)."""
    eng = _engine(monkeypatch, tiny_model, max_prefix_hold_s=0.0)
    try:
        col = _burst(eng, 4)
        stats = eng.get_stats()
        assert stats["prefix_sharing"]["held_requests"] == 0
        # All four were admitted in the first step: the prefix was computed four times.
        assert [col.final(f"r{i}").num_cached_tokens for i in range(4)] == [0, 0, 0, 0]
        return {f"r{i}": col.tokens(f"r{i}") for i in range(4)}
    finally:
        eng.shutdown()


def test_burst_computes_the_shared_prefix_once(monkeypatch, tiny_model, recompute_tokens):
    eng = _engine(monkeypatch, tiny_model)
    try:
        col = _burst(eng, 4)
        assert {f"r{i}": col.tokens(f"r{i}") for i in range(4)} == recompute_tokens
        cached = [col.final(f"r{i}").num_cached_tokens for i in range(4)]
        assert cached == [0] + [len(PREFIX)] * 3, cached
        stats = eng.get_stats()
        share = stats["prefix_sharing"]
        assert share["held_requests"] == 3 and share["held_reused_tokens"] == 3 * len(PREFIX), share
        assert share["hold_expired"] == 0 and share["held_now"] == 0
        # The prefix was computed once: the leader's prompt, then three suffixes.
        assert stats["engine"]["prompt_tokens_computed"] == len(PREFIX) + 4 * 3
        _assert_whole(eng)
    finally:
        eng.shutdown()


def test_chunked_leader_releases_followers_as_its_chunks_commit(monkeypatch, tiny_model, recompute_tokens):
    """The leader prefills in 48-token chunks (it takes the whole budget until its last one).
    In the pass of its last chunk the followers find 18 of the 20 prefix blocks committed,
    are held for the other two, and start one step later with all 20."""
    eng = _engine(monkeypatch, tiny_model, max_num_batched_tokens=48)
    try:
        col = _burst(eng, 4)
        assert {f"r{i}": col.tokens(f"r{i}") for i in range(4)} == recompute_tokens
        assert [col.final(f"r{i}").num_cached_tokens for i in range(1, 4)] == [len(PREFIX)] * 3
        stats = eng.get_stats()
        assert stats["cache"]["committed_blocks"] >= len(PREFIX) // BS
        assert stats["prefix_sharing"]["held_requests"] == 3
        _assert_whole(eng)
    finally:
        eng.shutdown()


def test_a_leader_aborted_mid_prefill_leaves_its_chunks_to_the_next(monkeypatch, tiny_model, recompute_tokens):
    """Stepped by hand: the leader computes six 48-token chunks and is aborted; the next
    request starts from the 18 blocks it committed, computes the rest, and the other two
    are held for that one instead."""
    eng = _engine(monkeypatch, tiny_model, max_num_batched_tokens=48)
    try:
        col = Collector()
        for i in range(4):
            eng.add_request(f"r{i}", _prompt(i), greedy(6), col)
        for _ in range(6):
            eng.step()
        assert [er.request_id for er in eng.scheduler.running] == ["r0"] and eng.scheduler.running[0].req.num_computed_tokens == 288
        eng.abort("r0")
        eng.step()  # takes the abort; r1 leads now, r2 and r3 wait for it
        assert col.final("r0").finish_reason == "abort"
        assert [er.request_id for er in eng.scheduler.running] == ["r1"]
        assert eng.scheduler.sharing.stats.held_now == 2
        eng.start()
        with pytest.raises(RuntimeError, match="thread is running"):
            eng.step()  # by hand only while the engine's own thread is not stepping
        assert eng.wait_idle(120)
        assert {f"r{i}": col.tokens(f"r{i}") for i in range(1, 4)} == {
            k: v for k, v in recompute_tokens.items() if k != "r0"}
        assert col.final("r1").num_cached_tokens == 288
        assert [col.final(f"r{i}").num_cached_tokens for i in (2, 3)] == [len(PREFIX)] * 2
        assert eng.get_stats()["prefix_sharing"]["held_requests"] == 2
        assert eng.scheduler.sharing.num_blocks_being_computed == 0
        _assert_whole(eng)
    finally:
        eng.shutdown()


def test_preemption_under_sharing_keeps_tokens_and_frees_everything(monkeypatch, tiny_model):
    """A device pool too small for the burst: requests are preempted while others wait for
    them; all finish with the tokens of a roomy engine and the pools come back whole."""
    roomy = _engine(monkeypatch, tiny_model, max_num_batched_tokens=48)
    try:
        col = _burst(roomy, 4, max_tokens=80)
        want = {f"r{i}": col.tokens(f"r{i}") for i in range(4)}
    finally:
        roomy.shutdown()
    # 30 blocks: the prefix (20) plus a few requests' suffix and decode blocks.
    eng = _engine(monkeypatch, tiny_model, max_num_batched_tokens=48, num_gpu_blocks=30, swap_space=0.0)
    try:
        col = _burst(eng, 4, max_tokens=80)
        assert {f"r{i}": col.tokens(f"r{i}") for i in range(4)} == want
        stats = eng.get_stats()
        assert stats["engine"]["num_preemptions"] >= 1, stats["engine"]
        assert stats["prefix_sharing"]["held_requests"] >= 1
        assert eng.scheduler.sharing.num_blocks_being_computed == 0
        _assert_whole(eng)
    finally:
        eng.shutdown()


# ---------------------------------------------------------------------- loads in flight shared
def _host_only_prefix(monkeypatch: pytest.MonkeyPatch, tiny_model: Any) -> LLMEngine:
    """An engine (thread not started) whose tree holds PREFIX on host only: computed, backed
    up (write_through), then pushed off the 70-block device pool by a filler.  (Room for
    three readers: each reader of a shared load holds a standby block per block.)"""
    eng = _engine(monkeypatch, tiny_model, num_gpu_blocks=70, num_host_blocks=256, max_model_len=2048,
                  write_policy="write_through", max_prefix_hold_s=0.0)
    col = Collector()
    for rid, prompt in (("warm", _prompt(99)), ("filler", [7 + (j * 13) % 490 for j in range(70 * BS - 1)])):
        eng.add_request(rid, prompt, greedy(1), col)
        eng.step()
        while eng.scheduler.running or eng.scheduler.waiting:
            eng.step()
        eng.pool.complete_finished(wait=True)  # the backups land
        col.final(rid)
    hashes = _prefix_hashes()
    nodes, tiers = eng.pool.manager.tree.match(hashes, len(hashes))
    assert len(nodes) == len(hashes) and all(t.name == "HOST" for t in tiers), "the prefix is not host-only"
    return eng


def _prefix_hashes() -> list[int]:
    from fastdeploy_kvcache.core.request import Request

    return Request("h", PREFIX).block_hashes(BS)


def test_a_load_in_flight_is_shared(monkeypatch, tiny_model, recompute_tokens):
    """Three requests admitted in one pass need the host-only prefix: one load, read by all."""
    eng = _host_only_prefix(monkeypatch, tiny_model)
    try:
        before = eng.get_stats()["cache"]
        col = Collector()
        for i in range(1, 4):
            eng.add_request(f"r{i}", _prompt(i), greedy(6), col)
        eng.step()
        cache = eng.pool.stats()["cache"]
        n = len(PREFIX) // BS
        assert cache["swap_in_blocks_issued"] - before["swap_in_blocks_issued"] == n
        assert cache["shared_load_blocks"] - before["shared_load_blocks"] == 2 * n
        eng.start()
        assert eng.wait_idle(120)
        assert {f"r{i}": col.tokens(f"r{i}") for i in range(1, 4)} == {
            k: v for k, v in recompute_tokens.items() if k != "r0"}
        assert [col.final(f"r{i}").cached_tokens_by_tier["host"] for i in range(1, 4)] == [len(PREFIX)] * 3
        _assert_whole(eng)
    finally:
        eng.shutdown()


def test_a_failed_shared_load_makes_every_reader_recompute(monkeypatch, tiny_model, recompute_tokens):
    from fastdeploy_kvcache.worker.backends.faulty import FaultInjectingBackend
    from tests.reuse_workloads import FailLoads

    eng = _host_only_prefix(monkeypatch, tiny_model)
    try:
        inject = FailLoads(1)
        eng.pool.controller.transfer_manager.wrap_backend(FaultInjectingBackend).rule = inject
        col = Collector()
        for i in range(1, 4):
            eng.add_request(f"r{i}", _prompt(i), greedy(6), col)
        eng.step()  # the step is dropped: its one load failed
        assert inject.failed == 1
        stats = eng.get_stats()
        assert stats["engine"]["num_failed_load_steps"] == 1
        assert stats["cache"]["shared_load_blocks"] == 2 * len(PREFIX) // BS
        assert stats["cache"]["failed_blocks"] == len(PREFIX) // BS
        assert all(er.req.num_computed_tokens == 0 for er in eng.scheduler.running), "a reader kept the failed blocks"
        eng.start()
        assert eng.wait_idle(120)
        assert {f"r{i}": col.tokens(f"r{i}") for i in range(1, 4)} == {
            k: v for k, v in recompute_tokens.items() if k != "r0"}
        assert [col.final(f"r{i}").num_cached_tokens for i in range(1, 4)] == [0, 0, 0]
        _assert_whole(eng)
    finally:
        eng.shutdown()


def test_under_k_anonymity_a_request_waits_only_for_its_own_tenants_prefix(monkeypatch, tiny_model,
                                                                           recompute_tokens):
    """k = 2.  r0 (tenant a) computes the prefix; r1 (a) is held for it; r2 (b) and r3 (c) are
    not held for a's private blocks: they compute the prefix at once, as if nothing were
    in flight.  a and b computed it, so a fifth tenant then reuses it."""
    eng = _engine(monkeypatch, tiny_model, k_anonymity_k=2)
    try:
        col = Collector()
        for i, tenant in enumerate(("a", "a", "b", "c")):
            eng.add_request(f"r{i}", _prompt(i), greedy(6), col, tenant=tenant)
        eng.start()
        assert eng.wait_idle(120), "the burst did not finish"
        assert {f"r{i}": col.tokens(f"r{i}") for i in range(4)} == recompute_tokens
        cached = [col.final(f"r{i}").num_cached_tokens for i in range(4)]
        assert cached == [0, len(PREFIX), 0, 0], cached
        stats = eng.get_stats()
        assert stats["prefix_sharing"]["held_requests"] == 1, stats["prefix_sharing"]
        assert stats["cache"]["k_anonymity"]["revealed_blocks"] == len(PREFIX) // BS
        eng.add_request("r4", _prompt(4), greedy(6), col, tenant="d")
        assert eng.wait_idle(120)
        assert col.final("r4").num_cached_tokens == len(PREFIX)
        _assert_whole(eng)
    finally:
        eng.shutdown()
