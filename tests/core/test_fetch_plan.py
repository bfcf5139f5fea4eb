"""Fetch or recompute (core/fetch_plan.py): the pure choices and the online cost model."""

from __future__ import annotations

import pytest

from fastdeploy_kvcache.core.fetch_plan import (
    LINK_PRIOR_BYTES_PER_S,
    FetchCostModel,
    Rate,
    choose_leading,
    choose_split,
)


def _linear(fetch_per_block: float, recompute_per_block: float):
    return (lambda n: n * fetch_per_block), (lambda a, b: (b - a) * recompute_per_block)


def test_a_store_slower_than_recompute_gets_a_small_share_or_none() -> None:
    fetch, recompute = _linear(3.0, 1.0)
    plan = choose_leading(10, fetch, recompute)  # fetched first, then waited for: none
    assert plan.kind == "recompute_all" and plan.recompute_blocks == 10, plan
    assert plan.predicted_s == pytest.approx(10.0)
    plan = choose_split(10, fetch, recompute)  # read alongside the recompute: a small share
    assert (plan.fetch_first, plan.fetch_blocks) == (8, 2) and plan.predicted_s == pytest.approx(8.0), plan
    fetch, recompute = _linear(20.0, 1.0)  # one block takes longer than recomputing all
    assert choose_split(10, fetch, recompute).kind == "recompute_all"


def test_a_store_faster_than_recompute_is_fetched_whole() -> None:
    fetch, recompute = _linear(0.1, 1.0)
    for choose in (choose_split, choose_leading):
        plan = choose(10, fetch, recompute)
        assert plan.kind == "fetch_all" and plan.fetch_blocks == 10 and plan.fetch_first == 0, (choose, plan)
        assert plan.predicted_s == pytest.approx(1.0)
        assert plan.all_recompute_s == pytest.approx(10.0)


def test_the_concurrent_split_balances_both_sides() -> None:
    # Equal rates: half recomputed while the other half is read.
    fetch, recompute = _linear(1.0, 1.0)
    plan = choose_split(10, fetch, recompute)
    assert (plan.recompute_blocks, plan.fetch_blocks, plan.fetch_first) == (5, 5, 5)
    assert plan.predicted_s == pytest.approx(5.0) and plan.all_fetch_s == pytest.approx(10.0)
    # A store 3x slower than the prefill gets a quarter of the blocks (small share, not none).
    fetch, recompute = _linear(3.0, 1.0)
    plan = choose_split(8, fetch, recompute)
    assert plan.fetch_blocks == 2 and plan.recompute_blocks == 6 and plan.predicted_s == pytest.approx(6.0)


def test_context_dependent_recompute_favours_fetching_the_expensive_tail() -> None:
    # Block j costs j+1 to recompute (attention grows with context); fetching costs 4 a block.
    fetch = lambda n: 4.0 * n  # noqa: E731
    recompute = lambda a, b: sum(j + 1 for j in range(a, b))  # noqa: E731
    plan = choose_split(8, fetch, recompute)
    best = min(max(recompute(0, k), fetch(8 - k)) for k in range(9))
    assert plan.predicted_s == best
    assert 0 < plan.fetch_blocks < 8


def test_empty_and_bad_sizes() -> None:
    fetch, recompute = _linear(1.0, 1.0)
    assert choose_split(0, fetch, recompute).num_blocks == 0
    assert choose_leading(0, fetch, recompute).predicted_s == 0.0
    with pytest.raises(ValueError, match="num_blocks"):
        choose_split(-1, fetch, recompute)


def test_rate_is_an_ewma_that_ignores_empty_samples() -> None:
    r = Rate()
    assert r.value is None
    r.observe(100, 1.0)
    assert r.value == 100
    r.observe(0, 1.0)  # nothing read: ignored
    r.observe(10, 0.0)  # no time: ignored
    r.observe(200, 1.0)
    assert r.samples == 2 and r.value == pytest.approx(0.7 * 100 + 0.3 * 200)
    with pytest.raises(ValueError, match="weight"):
        Rate(weight=0.0)


def _model(now: list[float]) -> FetchCostModel:
    return FetchCostModel(block_size=16, probe_interval_s=30.0, clock=lambda: now[0])


def test_unknown_rates_fetch_everything() -> None:
    now = [0.0]
    m = _model(now)
    plan = m.plan("file", 0, 12)
    assert plan.reason == "unknown" and plan.kind == "fetch_all" and plan.fetch_blocks == 12
    m.observe_read("file", 1 << 20, 1.0, 4)  # the read rate alone is not enough
    assert m.plan("file", 0, 12).reason == "unknown"
    assert m.rates("file")["link_bytes_per_s"] == LINK_PRIOR_BYTES_PER_S


def test_model_chooses_recompute_for_a_slow_store_and_fetch_for_a_fast_one() -> None:
    now = [0.0]
    m = _model(now)
    # Prefill: 64-token chunks at 1,600 tokens/s (0.01 s a block).
    m.observe_prefill([(64, 0)], 64 / 1600)
    m.observe_prefill([(64, 64), (1, 300)], 65 / 1600)
    assert m.prefill_rate(64, 128) == pytest.approx(1600)
    # Slow store: a 64 KiB block at 64 KiB/s (1 s a block) -> recompute all.
    m.observe_read("slow", 4 << 16, 4.0, 4)
    plan = m.plan("slow", 0, 10)
    assert plan.reason == "model" and plan.kind == "recompute_all", plan
    assert plan.predicted_s == pytest.approx(0.1)
    # Fast store: 64 KiB blocks at 1 GB/s -> fetch all.
    m.observe_read("fast", 4 << 16, (4 << 16) / 1e9, 4)
    plan = m.plan("fast", 0, 10)
    assert plan.kind == "fetch_all" and plan.fetch_s < plan.all_recompute_s
    # Concurrent: the slow store still gets nothing (one block takes longer than all).
    assert m.plan("slow", 0, 10, concurrent=True).fetch_blocks == 0


def test_decode_steps_do_not_count_as_prefill() -> None:
    m = _model([0.0])
    m.observe_prefill([(1, 100), (1, 200), (1, 300)], 0.01)
    m.observe_prefill([(2, 100), (1, 200), (1, 300), (1, 400)], 0.01)  # 2 of 5 tokens: mostly decode
    assert m.prefill_rate(64, 64) is None


def test_a_store_judged_too_slow_is_probed_after_the_interval() -> None:
    now = [0.0]
    m = _model(now)
    m.observe_prefill([(64, 0)], 64 / 1600)
    m.observe_read("slow", 1 << 16, 1.0, 1)
    assert m.plan("slow", 0, 10).fetch_blocks == 0
    now[0] = 31.0
    plan = m.plan("slow", 0, 10)
    assert plan.reason == "probe" and plan.fetch_blocks == 1 and plan.fetch_first == 0
    m.observe_read("slow", 1 << 16, 1.0, 1)  # the probe's read: no probe for another interval
    assert m.plan("slow", 0, 10).reason == "model"


def test_a_forced_split_replaces_the_choice_for_the_offline_sweep(monkeypatch: pytest.MonkeyPatch) -> None:
    """FDKV_STORAGE_FORCE_FETCH_BLOCKS (benchmarks' oracle sweep) fixes the fetched blocks:
    the head with a leading plan, the tail with a concurrent one, whatever the rates; bad
    values are refused by name."""
    now = [0.0]
    m = _model(now)
    m.observe_prefill([(64, 0)], 64 / 1600)
    m.observe_read("slow", 4 << 16, 4.0, 4)
    assert m.plan("slow", 0, 10).kind == "recompute_all"  # the model's own choice
    monkeypatch.setenv("FDKV_STORAGE_FORCE_FETCH_BLOCKS", "4")
    lead = m.plan("slow", 0, 10)
    assert (lead.reason, lead.fetch_first, lead.fetch_blocks, lead.recompute_blocks) == ("forced", 0, 4, 6)
    assert lead.predicted_s == pytest.approx(lead.fetch_s + lead.recompute_s) and lead.fetch_s == pytest.approx(4.0, rel=1e-3)
    tail = m.plan("slow", 0, 10, concurrent=True)
    assert (tail.fetch_first, tail.fetch_blocks, tail.recompute_blocks) == (6, 4, 6)
    assert tail.predicted_s == pytest.approx(max(tail.fetch_s, tail.recompute_s))
    assert m.plan("unmeasured", 0, 3).fetch_blocks == 3  # more than the prefix: all of it, rates unknown
    monkeypatch.setenv("FDKV_STORAGE_FORCE_FETCH_BLOCKS", "0")
    assert m.plan("slow", 0, 10).kind == "recompute_all"
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv("FDKV_STORAGE_FORCE_FETCH_BLOCKS", bad)
        with pytest.raises(ValueError, match="FDKV_STORAGE_FORCE_FETCH_BLOCKS"):
            m.plan("slow", 0, 10)
