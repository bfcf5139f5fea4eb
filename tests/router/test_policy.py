"""The routing policies' decisions on hand-built worker views (no processes: pure logic)."""

from __future__ import annotations

import pytest

from fastdeploy_kvcache.entrypoints.router.policy import Candidate, CacheAwarePolicy, make_policy
from fastdeploy_kvcache.entrypoints.router.view import TierWeights, WorkerView

HASHES = list(range(100, 110))  # a 10-block prompt


def view(device: int = 0, host: int = 0, storage: int = 0) -> WorkerView:
    """A worker holding the prompt's first ``device`` blocks on the device, then ``host`` more on
    the host, then ``storage`` more in storage."""
    v = WorkerView()
    v.store(HASHES[:device], "GPU", 16)
    v.store(HASHES[device:device + host], "CPU", 16)
    v.store(HASHES[device + host:device + host + storage], "MOONCAKE", 16)
    return v


def cands(*views: WorkerView, loads: tuple[int, ...] = ()) -> list[Candidate]:
    loads = loads or (0,) * len(views)
    return [Candidate(i, loads[i], v, {}) for i, v in enumerate(views)]


def choose(policy: CacheAwarePolicy, cs: list[Candidate]) -> tuple[int, str, int]:
    d = policy.choose(cs, lambda v: HASHES, now=0.0)
    return d.index, d.reason, d.match.blocks


def test_device_blocks_beat_as_many_host_or_storage_blocks() -> None:
    p = CacheAwarePolicy(TierWeights(), shared_storage=False)
    assert choose(p, cands(view(host=6), view(device=6), view(storage=6))) == (1, "cache", 6)
    assert choose(p, cands(view(storage=6), view(host=6))) == (1, "cache", 6)


def test_a_longer_host_prefix_beats_a_shorter_device_prefix_by_the_weights() -> None:
    p = CacheAwarePolicy(TierWeights(device=1.0, host=0.8), shared_storage=False)
    assert choose(p, cands(view(device=4), view(host=6)))[0] == 1  # 4.8 > 4.0
    p = CacheAwarePolicy(TierWeights(device=1.0, host=0.5), shared_storage=False)
    assert choose(p, cands(view(device=4), view(host=6)))[0] == 0  # 3.0 < 4.0


def test_a_gap_ends_the_prefix() -> None:
    v = view(device=2)
    v.store(HASHES[3:10], "GPU", 16)  # block 2 missing: only 2 blocks reusable
    p = CacheAwarePolicy(TierWeights(), shared_storage=False)
    assert choose(p, cands(v, view(device=3))) == (1, "cache", 3)


def test_shared_storage_counts_another_workers_stored_blocks() -> None:
    mine, other = view(device=3), view(device=2, storage=6)
    shared = CacheAwarePolicy(TierWeights(), shared_storage=True)
    # Mine: 3 device blocks, then blocks 3..7 from the store the other worker filled (3 + 5 * 0.5).
    assert choose(shared, cands(mine, other)) == (0, "cache", 8)
    alone = CacheAwarePolicy(TierWeights(), shared_storage=False)
    assert choose(alone, cands(mine, other)) == (1, "cache", 8)  # 3.0 < 2 + 6 * 0.5


def test_imbalance_needs_both_thresholds() -> None:
    p = CacheAwarePolicy(TierWeights(), balance_abs_threshold=4, balance_rel_threshold=1.5)
    warm, cold = view(device=8), view()
    assert choose(p, cands(warm, cold, loads=(4, 0)))[:2] == (0, "cache")   # 4 - 0 is not > 4
    assert choose(p, cands(warm, cold, loads=(5, 0)))[:2] == (1, "balance")
    assert choose(p, cands(warm, cold, loads=(20, 14)))[:2] == (0, "cache")  # 20 <= 1.5 * 14
    assert choose(p, cands(warm, cold, loads=(22, 14)))[:2] == (1, "balance")


def test_under_imbalance_the_best_cache_among_the_others_wins() -> None:
    """The overloaded worker is left out; among the rest the cache still decides."""
    p = CacheAwarePolicy(TierWeights(), balance_abs_threshold=2, balance_rel_threshold=1.5, shared_storage=False)
    busy, partial, cold = view(device=10), view(device=3), view()
    assert choose(p, cands(busy, partial, cold, loads=(6, 2, 0))) == (1, "balance", 3)
    assert choose(p, cands(busy, partial, cold, loads=(6, 3, 0)))[:2] == (2, "balance")  # 3 > 0 + 2: left out too


def test_ties_and_no_match_go_to_the_least_loaded() -> None:
    p = CacheAwarePolicy(TierWeights())
    assert choose(p, cands(view(), view(), view(), loads=(2, 1, 3)))[:2] == (1, "no_match")
    assert choose(p, cands(view(device=5), view(device=5), loads=(2, 1)))[:2] == (1, "cache")


def test_pending_requests_count_as_device_blocks_until_they_expire() -> None:
    p = CacheAwarePolicy(TierWeights())
    cs = cands(view(), view())
    cs[1].pending.update({h: 5.0 for h in HASHES[:4]})
    d = p.choose(cs, lambda v: HASHES, now=1.0)
    assert (d.index, d.match.blocks, d.match.confirmed) == (1, 4, 0)  # steers placement, predicts no reuse
    assert p.choose(cs, lambda v: HASHES, now=6.0).match.blocks == 0


def test_round_robin_and_least_requests() -> None:
    rr = make_policy("round_robin", TierWeights(), 4, 1.5, True)
    cs = cands(view(device=8), view(), view())
    assert [rr.choose(cs, lambda v: HASHES, 0.0).index for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    lr = make_policy("least_requests", TierWeights(), 4, 1.5, True)
    assert lr.choose(cands(view(device=8), view(), loads=(3, 1)), lambda v: HASHES, 0.0).index == 1


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="policy"):
        make_policy("random", TierWeights(), 4, 1.5, True)
    with pytest.raises(ValueError, match="balance_rel_threshold"):
        CacheAwarePolicy(TierWeights(), balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="host weight"):
        TierWeights(host=1.5)
