"""Prefetch on arrival in the engine: a queued burst of storage hits, more than
``max_num_seqs``, on a real file store in a real directory.

The burst is queued before the engine thread starts, so every request of it is in the first
pass (no timing involved): the requests the first step admits are read on the engine thread
and admitted together; those beyond the next two steps are looked up only after the first
step; every request reuses its whole prompt from storage with the tokens of recompute.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fastdeploy_kvcache.engine.llm_engine import LLMEngine
from fastdeploy_kvcache.storage.config import StorageConfig
from skip_helpers import needs_cpu_capi
from tests.engine.conftest import Collector, greedy
from tests.engine_args import engine_args

pytestmark = needs_cpu_capi()

BS = 16
BLOCKS = 10
N = 6  # three steps' worth at max_num_seqs 2


def _prompt(i: int) -> list[int]:
    return [3 + (i * 41 + j * 13) % 500 for j in range(BLOCKS * BS + 3)]


def _engine(monkeypatch: pytest.MonkeyPatch, tiny_model: Any, store: Path, **kwargs: Any) -> LLMEngine:
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1")
    storage = StorageConfig(backend="file", path=str(store), min_free=0, prefetch_policy="wait_complete")
    args = dict(model="tiny-llama-random", block_size=BS, max_model_len=512, max_num_batched_tokens=1024,
                max_num_seqs=2, swap_space=0.05, storage=storage)
    args.update(kwargs)
    return LLMEngine(engine_args(**args), loaded_model=tiny_model)


def _burst(engine: LLMEngine) -> Collector:
    col = Collector()
    for i in range(N):
        engine.add_request(f"r{i}", _prompt(i), greedy(4), col)
    engine.start()
    assert engine.wait_idle(120), "the burst did not finish"
    return col


def test_a_queued_burst_of_storage_hits_is_fetched_ahead_and_admitted_in_pairs(
        monkeypatch: pytest.MonkeyPatch, tiny_model: Any, tmp_path: Path) -> None:
    store = tmp_path / "kv"
    writer = _engine(monkeypatch, tiny_model, store)
    try:
        computed = _burst(writer)
        expected = {f"r{i}": computed.tokens(f"r{i}") for i in range(N)}
    finally:
        writer.shutdown()  # a graceful stop writes what the store lacks
    assert len(list(store.glob("*.kv"))) >= N * BLOCKS

    reader = _engine(monkeypatch, tiny_model, store)  # a restarted server: storage only
    try:
        col = _burst(reader)
        assert {f"r{i}": col.tokens(f"r{i}") for i in range(N)} == expected, \
            "storage-tier KV must give the same greedy output as recompute"
        stats = reader.get_stats()
        timings = {t["request_id"]: t for t in stats["request_timings"]}
        for i in range(N):
            t = timings[f"r{i}"]
            assert t["cached_tokens"]["storage"] == BLOCKS * BS, t
            assert t["fetch"] is not None and t["fetch"]["on_arrival"], t
        # The first step admits r0 and r1 together: both were read before it, on this thread.
        assert timings["r0"]["first_step"]["batch"] == 2 and timings["r1"]["first_step"]["batch"] == 2
        tier = stats["storage"]["tier"]
        assert tier["prefetch_jobs_inline"] >= 2, tier
        # r4 and r5 (beyond the first two steps) were looked up after r0 was admitted, not
        # before the first step.  Arrivals are microseconds apart, so the times after each
        # request's own arrival compare.
        for late in ("r4", "r5"):
            assert timings[late]["fetch"]["started_s"] > timings["r0"]["queued_s"], (timings[late], timings["r0"])
        for early in ("r2", "r3"):
            assert timings[early]["fetch"]["started_s"] < timings["r0"]["queued_s"], (timings[early], timings["r0"])
        counts = reader.pool.check_invariants()
        assert counts["device_owned"] == 0 and counts["host_owned"] == 0, counts
    finally:
        reader.shutdown()
