"""Reuse changes nothing: greedy outputs with the tiered cache equal recompute without it.

Each workload runs twice on the same seeded tiny Llama: with ENABLE_V1_KVCACHE_MANAGER=0 (plain
block allocator, every prompt recomputed) and with it on, under each write policy, in the
situation named (device hits, host hits, write_back evictions, failed loads, preemption).  The
token ids must be identical, the reuse counters must show that the situation really happened,
and after everything finished every block is free or cached (check_invariants).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Optional

import pytest

from fastdeploy_kvcache.core.metadata import CopyDirection
from tests.engine.conftest import Collector, greedy

POLICIES = ("write_through", "write_through_selective", "write_back")
BS = 16


def _doc(i: int, n: int = 3 * BS) -> list[int]:
    """A fixed 'document' of n token ids, different per i (ids stay below the tiny vocab)."""
    return [3 + (i * 37 + j * 11) % 500 for j in range(n)]


def _question(i: int, j: int) -> list[int]:
    return [3 + (i * 13 + j * 29 + k * 7) % 500 for k in range(6)]


def _req(i: int, j: int) -> tuple[str, list[int]]:
    return f"d{i}q{j}", _doc(i) + _question(i, j)


# A prompt that is exactly a cached prefix plus one token, and one that shares none.
_TAIL = [("d0short", _doc(0)[: 2 * BS + 1]), ("fresh", _doc(9))]


def _waves(concurrent: bool) -> list[list[tuple[str, list[int]]]]:
    """Three documents, three questions each.

    Sequential: each document is asked twice in a row (a device hit, which is what makes
    write_through_selective back it up), then all three again after the others pushed it
    out of a small device pool (host hits).  Concurrent: one wave per question.
    """
    if concurrent:
        return [[_req(i, j) for i in range(3)] for j in range(3)] + [_TAIL]
    order = [_req(i, j) for i in range(3) for j in range(2)] + [_req(i, 2) for i in range(3)] + _TAIL
    return [order]


def run_waves(engine: Any, concurrent: bool = False, max_tokens: int = 8) -> tuple[dict[str, list[int]], Collector]:
    col = Collector()
    for wave in _waves(concurrent):
        for rid, prompt in wave:
            engine.add_request(rid, prompt, greedy(max_tokens), col)
            if not concurrent:
                assert engine.wait_idle(60), f"{rid} did not finish"
        assert engine.wait_idle(60), "wave did not finish"
    return {rid: col.tokens(rid) for wave in _waves(concurrent) for rid, _ in wave}, col


_BASELINE: dict[tuple, dict[str, list[int]]] = {}


def baseline(engine_factory: Any, concurrent: bool = False) -> dict[str, list[int]]:
    key = (concurrent,)
    if key not in _BASELINE:
        eng = engine_factory(v1=False)
        out, col = run_waves(eng, concurrent)
        for rid in out:
            assert col.final(rid).num_cached_tokens == 0, "the switch off must reuse nothing"
        eng.pool.check_invariants()
        assert eng.pool.check_invariants()["device_owned"] == 0
        _BASELINE[key] = out
    return _BASELINE[key]


def assert_no_leak(engine: Any) -> dict[str, int]:
    counts = engine.pool.check_invariants()
    assert counts["device_owned"] == 0, f"device blocks still owned after everything finished: {counts}"
    assert counts.get("host_owned", 0) == 0, f"host blocks still owned: {counts}"
    assert engine.pool.copies_in_flight == 0
    return counts


@pytest.mark.parametrize("policy", POLICIES)
def test_device_hits_change_nothing(engine_factory: Any, policy: str) -> None:
    ref = baseline(engine_factory)
    eng = engine_factory(v1=True, write_policy=policy, write_through_threshold=1)
    got, col = run_waves(eng)
    assert got == ref
    assert col.final("d0q0").num_cached_tokens == 0
    for rid in ("d0q1", "d1q1", "d1q2", "d0short"):
        fin = col.final(rid)
        assert fin.num_cached_tokens > 0 and fin.cached_tokens_by_tier["device"] == fin.num_cached_tokens, fin
    assert col.final("d0short").num_cached_tokens == 2 * BS
    assert_no_leak(eng)


@pytest.mark.parametrize("policy", POLICIES)
def test_host_hits_change_nothing(engine_factory: Any, policy: str) -> None:
    """A device pool of 8 blocks holds two of the three documents: LRU sends each to host in turn."""
    ref = baseline(engine_factory)
    eng = engine_factory(v1=True, write_policy=policy, write_through_threshold=1,
                         num_gpu_blocks_override=8, num_host_blocks=64, max_num_seqs=2)
    got, col = run_waves(eng)
    assert got == ref
    host = sum(col.final(rid).cached_tokens_by_tier["host"] for rid in got)
    assert host > 0, "no host hit happened: the test does not test what it says"
    stats = eng.get_stats()
    assert stats["cache"]["swap_in_blocks"] > 0
    # Every layer of every step with a load waited for that layer's copy before attending.
    eng_stats = stats["engine"]
    assert eng_stats["steps_with_loads"] > 0
    assert eng_stats["layer_waits"] == eng_stats["steps_with_loads"] * eng.loaded.num_layers
    if policy == "write_back":
        assert stats["cache"]["write_back_blocks"] > 0, "write_back never evicted to host"
    else:
        assert stats["cache"]["backup_blocks"] > 0
    assert_no_leak(eng)


def test_write_back_evictions_under_concurrency(engine_factory: Any) -> None:
    """Concurrent waves on a small pool: evictions to host run in the same steps as compute."""
    ref = baseline(engine_factory, concurrent=True)
    eng = engine_factory(v1=True, write_policy="write_back", num_gpu_blocks_override=9,
                         num_host_blocks=48, max_num_seqs=2)
    got, col = run_waves(eng, concurrent=True)
    assert got == ref
    st = eng.get_stats()["cache"]
    assert st["write_back_blocks"] > 0 and st["swap_in_blocks"] > 0, st
    assert sum(col.final(r).num_cached_tokens for r in got) > 0
    assert_no_leak(eng)


class FailLoads:
    """TransferManager fault injector: the first ``n`` host->device loads fail at ``layer``."""

    def __init__(self, n: int, layer: int = 1) -> None:
        self.left = n
        self.layer = layer
        self.failed = 0

    def __call__(self, direction: CopyDirection, layer: int, meta: Any) -> None:
        if direction is CopyDirection.HOST_TO_DEVICE and layer == self.layer and self.left > 0:
            self.left -= 1
            self.failed += 1
            raise RuntimeError("injected load failure")


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_loads_recompute_and_change_nothing(engine_factory: Any, policy: str) -> None:
    ref = baseline(engine_factory)
    eng = engine_factory(v1=True, write_policy=policy, write_through_threshold=1,
                         num_gpu_blocks_override=8, num_host_blocks=64, max_num_seqs=2)
    inject = FailLoads(2)
    eng.pool.controller.transfer_manager.fault_injector = inject
    got, col = run_waves(eng)
    assert inject.failed == 2, "no load was attempted: the test does not test what it says"
    assert got == ref
    st = eng.get_stats()
    assert st["failed_loads"] >= 1 and st["cache"]["failed_blocks"] > 0, st
    assert st["engine"]["num_failed_load_steps"] >= 1
    assert_no_leak(eng)


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_changes_nothing(engine_factory: Any, policy: str) -> None:
    """Four long requests at once on 12 blocks: some are preempted and resume from the cache."""
    prompts = {f"p{i}": _doc(0)[:BS] + _doc(i + 1, 3 * BS) for i in range(4)}

    def run(eng: Any) -> tuple[dict[str, list[int]], Collector]:
        col = Collector()
        for rid, p in prompts.items():
            eng.add_request(rid, p, greedy(24), col)
        assert eng.wait_idle(120)
        return {rid: col.tokens(rid) for rid in prompts}, col

    ref, _ = run(engine_factory(v1=False, num_gpu_blocks_override=12, max_num_seqs=4))
    eng = engine_factory(v1=True, write_policy=policy, write_through_threshold=1, num_gpu_blocks_override=12,
                         num_host_blocks=32, max_num_seqs=4)
    got, col = run(eng)
    assert got == ref
    assert all(len(t) == 24 for t in got.values())
    assert eng.get_stats()["engine"]["num_preemptions"] > 0, "nothing was preempted"
    assert_no_leak(eng)


def test_last_request_is_backed_up_while_idle(engine_factory: Any) -> None:
    """write_through: the blocks of the last request before the engine goes idle reach host
    without another request (the next one's allocation would evict them from the device
    first, and the next turn would recompute them)."""
    eng = engine_factory(v1=True, write_policy="write_through", write_through_threshold=1,
                         num_gpu_blocks_override=8, num_host_blocks=64, max_num_seqs=1)
    col = Collector()
    eng.add_request("first", _doc(0), greedy(2), col)
    assert eng.wait_idle(60)
    deadline = time.monotonic() + 30
    while eng.pool.copies_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.pool.copies_in_flight == 0, "the idle engine left copies or queued backups"
    # Its 3 full blocks (48 tokens: the prompt and its first generated tokens) are on host.
    assert eng.get_stats()["cache"]["backup_blocks"] >= 2, eng.get_stats()["cache"]
    # A different document fills the 8-block device pool; the first one comes back from host.
    eng.add_request("other", _doc(5, 7 * BS), greedy(2), col)
    assert eng.wait_idle(60)
    eng.add_request("again", _doc(0) + [7], greedy(2), col)
    assert eng.wait_idle(60)
    again = col.final("again").cached_tokens_by_tier
    assert again["host"] >= 2 * BS, again
    assert_no_leak(eng)


def test_a_request_arriving_during_idle_backups_starts_without_waiting_for_them(engine_factory: Any) -> None:
    """write_through: while the engine is idle, the last request's backups are in flight; a
    request arriving then (a miss) must run at once, not after those copies (the cache must
    cost nothing on a miss).  The backup is held on its copy stream until the new request
    has finished; the copies still complete afterwards and nothing leaks."""
    eng = engine_factory(v1=True, write_policy="write_through", write_through_threshold=1,
                         num_gpu_blocks_override=16, num_host_blocks=64, max_num_seqs=1)
    backup_started, release = threading.Event(), threading.Event()

    def hold_backups(direction: CopyDirection, layer: int, meta: Any) -> None:
        if direction is CopyDirection.DEVICE_TO_HOST:
            backup_started.set()
            release.wait(60)

    eng.pool.controller.transfer_manager.fault_injector = hold_backups
    col = Collector()
    try:
        eng.add_request("first", _doc(0), greedy(2), col)
        assert backup_started.wait(60), "no backup was issued: the test does not test what it says"
        assert col.final("first").finish_reason == "length"
        eng.add_request("second", _doc(1), greedy(2), col)
        deadline = time.monotonic() + 30
        while not (col.outputs.get("second") and col.outputs["second"][-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert col.outputs.get("second") and col.outputs["second"][-1].finished, (
            "the new request waited for the idle engine's backups")
        assert not release.is_set() and eng.pool.copies_in_flight > 0, "the backup was not held in flight"
    finally:
        release.set()
    assert eng.wait_idle(60)
    deadline = time.monotonic() + 30
    while eng.pool.copies_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.get_stats()["cache"]["backup_blocks"] >= 4, eng.get_stats()["cache"]
    assert_no_leak(eng)
