"""Fetch or recompute in the engine, on a real file store in a real directory.

A writer engine computes the prompts and its graceful stop writes them to the store; reader
engines (restarted servers) then serve them from the store, or recompute them, as the
storage tier's planner decides.  Whatever the mix of fetched and recomputed blocks, the
greedy tokens are those of recompute.  The slow store is a real one held to a read rate by
``storage.throttle.ThrottledBackend``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Optional

import pytest
from prometheus_client.core import CounterMetricFamily

from fastdeploy_kvcache.core.hashing import storage_key
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.engine.llm_engine import LLMEngine
from fastdeploy_kvcache.entrypoints.openai.storage_metrics import StorageStatsCollector
from fastdeploy_kvcache.storage.config import StorageConfig
from fastdeploy_kvcache.storage.throttle import ThrottledBackend
from fastdeploy_kvcache.storage.mooncake_local import LocalMooncake
from shutdown_helpers import wait_until
from skip_helpers import needs_cpu_capi, needs_mooncake
from tests.engine.conftest import Collector, greedy
from tests.engine_args import engine_args

pytestmark = needs_cpu_capi()

BS = 16
BLOCKS = 8
PROMPTS = 4  # A..D


def _prompt(i: int) -> list[int]:
    return [3 + (i * 37 + j * 11) % 500 for j in range(BLOCKS * BS + 3)]


def _engine(monkeypatch: pytest.MonkeyPatch, tiny_model: Any, store: Optional[Path],
            wrapper: Optional[Any] = None, arrival_blocks: int = 0) -> LLMEngine:
    """A reader or writer engine over the file store at ``store`` (None: Mooncake, MOONCAKE_*
    from the environment)."""
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1")
    if store is None:
        storage = StorageConfig(backend="mooncake", prefetch_policy="wait_complete", fetch_plan="on",
                                backend_wrapper=wrapper)
    else:
        storage = StorageConfig(backend="file", path=str(store), min_free=0, prefetch_policy="wait_complete",
                                fetch_plan="on", backend_wrapper=wrapper)
    args = dict(model="tiny-llama-random", block_size=BS, max_model_len=512, max_num_batched_tokens=1024,
                max_num_seqs=2, swap_space=0.05, storage=storage, arrival_prefetch_host_blocks=arrival_blocks)
    return LLMEngine(engine_args(**args), loaded_model=tiny_model)


def _run(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
    """One request on its own (nothing else runs): its tokens and its timing record."""
    col = Collector()
    engine.add_request(rid, prompt, greedy(4), col)
    assert engine.wait_idle(120), f"{rid} did not finish"
    timings = {t["request_id"]: t for t in engine.get_stats()["request_timings"]}
    return col.tokens(rid), timings[rid]


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory, tiny_model: Any) -> tuple[Path, dict[int, list[int]], int]:
    """A store holding prompts 0..PROMPTS-1, their recomputed tokens, and one block's bytes."""
    mp = pytest.MonkeyPatch()
    store = tmp_path_factory.mktemp("kv")
    writer = _engine(mp, tiny_model, store)
    try:
        writer.start()
        expected = {i: _run(writer, f"w{i}", _prompt(i))[0] for i in range(PROMPTS)}
    finally:
        writer.shutdown()  # its graceful stop writes the prompts' blocks
        mp.undo()
    block_bytes = max(f.stat().st_size for f in store.glob("*.kv"))
    assert len(list(store.glob("*.kv"))) >= PROMPTS * BLOCKS and block_bytes > 0
    return store, expected, block_bytes


def _copy_store(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        if f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_a_slow_store_is_recomputed_and_a_mixed_prefix_gives_the_tokens_of_recompute(
        monkeypatch: pytest.MonkeyPatch, tiny_model: Any, tmp_path: Path, written: Any) -> None:
    src, expected, block_bytes = written
    store = _copy_store(src, tmp_path / "kv")
    # 4 blocks/s: a block takes ~250 ms to read, far longer than the tiny model recomputes it,
    # even on a loaded machine (at 16 blocks/s a CI runner under heavy load measured a prefill
    # slow enough for the planner to fetch).
    reader = _engine(monkeypatch, tiny_model, store, ThrottledBackend.at(4 * block_bytes))
    try:
        reader.start()
        _run(reader, "miss", [7] * (BLOCKS * BS + 3))  # a miss: the prefill rate is measured
        # Read rate unknown: the planner fetches all (the documented default) and measures it.
        tokens, t = _run(reader, "a", _prompt(0))
        assert tokens == expected[0] and t["cached_tokens"]["storage"] == BLOCKS * BS, t
        tier = reader.get_stats()["storage"]["tier"]
        assert tier["plan_unknown"] == 1 and tier["plan_rates"]["read_bytes_per_s"] < 20 * block_bytes, tier
        # Now both rates are known: the slow store's prefix is recomputed whole.
        tokens, t = _run(reader, "b", _prompt(1))
        assert tokens == expected[1], "a recomputed stored prefix must give the tokens of recompute"
        assert t["cached_tokens"]["storage"] == 0, t
        tier = reader.get_stats()["storage"]["tier"]
        assert tier["plan_recompute_all"] == 1 and tier["plan_blocks_recomputed"] == BLOCKS, tier
        assert tier["plan_predicted_s"] > 0 and tier["plan_fetch_predicted_s"] == 0, tier
        # A probe of the slow store: the last block fetched while the other seven are recomputed.
        reader.pool.tier.planner.probe_interval_s = 0.0
        tokens, t = _run(reader, "c", _prompt(2))
        assert tokens == expected[2], "recomputed head + fetched tail must give the tokens of recompute"
        assert t["cached_tokens"]["storage"] == BS, t["fetch"]
        plan = t["fetch"]["plan"]
        assert plan["reason"] == "probe" and plan["head"] == BLOCKS - 1 and plan["attached"] == 1, plan
        stats = reader.get_stats()
        tier = stats["storage"]["tier"]
        assert tier["plan_probes"] == 1 and tier["plan_partial"] == 1, tier
        # The probe's one block: predicted from the measured rate, and its job timed.
        assert tier["plan_fetch_predicted_s"] > 0.03 and tier["plan_fetch_actual_s"] > 0.03, tier
        assert tier["plan_blocks_fetched"] == BLOCKS + 1 and tier["plan_blocks_recomputed"] == 2 * BLOCKS - 1, tier
        # The choices reach /metrics.
        families = {f.name: f for f in StorageStatsCollector(lambda: stats).families(stats["storage"])}
        requests = {s.labels["choice"]: s.value for s in families["fastdeploy:storage_plan_requests"].samples}
        assert requests == {"fetch_all": 0.0, "recompute_all": 1.0, "partial": 1.0, "unknown": 1.0}
        blocks = {s.labels["action"]: s.value for s in families["fastdeploy:storage_plan_blocks"].samples}
        assert blocks == {"fetched": BLOCKS + 1.0, "recomputed": 2.0 * BLOCKS - 1, "attached": 1.0}
        tails = {s.labels["outcome"]: s.value for s in families["fastdeploy:storage_plan_tails"].samples}
        assert tails == {"attached": 1.0, "late": 0.0, "failed": 0.0}
        assert isinstance(families["fastdeploy:storage_plan_seconds"], CounterMetricFamily)
        rates = {s.labels["rate"] for s in families["fastdeploy:storage_plan_rate"].samples}
        assert rates == {"read_bytes_per_s", "link_bytes_per_s", "prefill_tokens_per_s"}
        counts = reader.pool.check_invariants()
        assert counts["device_owned"] == 0 and counts["host_owned"] == 0, counts
    finally:
        reader.shutdown()


def test_a_fast_store_is_fetched_whole(monkeypatch: pytest.MonkeyPatch, tiny_model: Any, tmp_path: Path,
                                       written: Any) -> None:
    src, expected, _ = written
    store = _copy_store(src, tmp_path / "kv")
    reader = _engine(monkeypatch, tiny_model, store)
    try:
        reader.start()
        _run(reader, "miss", [7] * (BLOCKS * BS + 3))
        for i in range(2):
            tokens, t = _run(reader, f"r{i}", _prompt(i))
            assert tokens == expected[i] and t["cached_tokens"]["storage"] == BLOCKS * BS, t
        tier = reader.get_stats()["storage"]["tier"]
        # The first was fetched on the default (read rate unknown); the second by the model.
        assert tier["plan_unknown"] == 1 and tier["plan_fetch_all"] == 1, tier
        assert tier["plan_blocks_recomputed"] == 0, tier
    finally:
        reader.shutdown()


def test_a_fetch_failing_midway_recomputes_the_rest_with_the_same_tokens(
        monkeypatch: pytest.MonkeyPatch, tiny_model: Any, tmp_path: Path, written: Any) -> None:
    src, expected, _ = written
    store = _copy_store(src, tmp_path / "kv")
    # Block 5 of prompt 3 is corrupt (cut short): the fetch reads blocks 0-4, then fails.
    h = Request("h", _prompt(3)).block_hashes(BS)[5]
    found = list(store.glob(f"*={storage_key(h)}.kv"))
    assert len(found) == 1, found
    data = found[0].read_bytes()
    found[0].write_bytes(data[: len(data) // 2])
    reader = _engine(monkeypatch, tiny_model, store)
    try:
        reader.start()
        tokens, t = _run(reader, "r", _prompt(3))
        assert tokens == expected[3], "a fetch that failed midway must recompute the rest, same tokens"
        assert t["cached_tokens"]["storage"] == 5 * BS, t
        tier = reader.get_stats()["storage"]["tier"]
        assert tier["prefetch_blocks_loaded"] == 5 and tier["prefetch_blocks_failed"] == BLOCKS - 5, tier
        counts = reader.pool.check_invariants()
        assert counts["device_owned"] == 0 and counts["host_owned"] == 0, counts
    finally:
        reader.shutdown()


def _seed(engine: LLMEngine, fetch_block_s: float, recompute_block_s: float) -> None:
    """Give the reader's planner rates (one block read in ``fetch_block_s``, recomputed in
    ``recompute_block_s``), fed as the engine and the tier feed it; the engine is idle."""
    tier = engine.pool.tier
    planner = tier.planner
    block_bytes = planner.block_bytes or 1
    planner.read.clear()
    planner.prefill.clear()
    planner.observe_read(tier.backend_name, block_bytes, fetch_block_s, 1)
    planner.observe_prefill([(4 * BS, 0)], 4 * recompute_block_s)


def _settled(engine: LLMEngine) -> dict[str, Any]:
    """The tier's stats once nothing is in flight, after the invariants held with nothing owned."""
    counts = engine.pool.check_invariants()
    assert counts["device_owned"] == 0 and counts["host_owned"] == 0, counts
    tier = engine.get_stats()["storage"]["tier"]
    assert tier["held_tail_host_blocks"] == 0 and tier["splits_pending"] == 0, tier
    return tier


@pytest.mark.parametrize("arrival_blocks", [0, 64], ids=["at-admission", "on-arrival"])
def test_a_split_recomputes_the_head_while_the_tail_is_read_and_gives_the_tokens_of_recompute(
        monkeypatch: pytest.MonkeyPatch, tiny_model: Any, tmp_path: Path, written: Any, arrival_blocks: int) -> None:
    src, expected, block_bytes = written
    store = _copy_store(src, tmp_path / "kv")
    reader = _engine(monkeypatch, tiny_model, store, arrival_blocks=arrival_blocks)
    try:
        reader.start()
        _run(reader, "miss", [7] * (BLOCKS * BS + 3))
        reader.pool.tier.planner.block_bytes = block_bytes
        _seed(reader, 0.1, 0.1)  # equal costs: recompute four blocks while four are read
        tokens, t = _run(reader, "s", _prompt(0))
        assert tokens == expected[0], "recomputed head + fetched tail must give the tokens of recompute"
        plan = t["fetch"]["plan"]
        assert plan["choice"] == "partial" and plan["head"] == BLOCKS // 2, plan
        assert plan["fetched"] == BLOCKS // 2 and plan["attached"] == BLOCKS // 2, plan
        assert 0 < plan["actual_s"] and plan["predicted_s"] > 0.3, plan
        assert t["fetch"]["on_arrival"] == (arrival_blocks > 0), t["fetch"]
        assert t["cached_tokens"]["storage"] == BLOCKS // 2 * BS, t
        stats = reader.get_stats()
        tier = _settled(reader)
        assert tier["plan_splits"] == 1 and tier["plan_tails_attached"] == 1, tier
        assert tier["plan_tail_blocks_attached"] == BLOCKS // 2 and tier["plan_actual_requests"] == 1, tier
        assert tier["storage_hit_tokens"] == BLOCKS // 2 * BS, tier
        families = {f.name: f for f in StorageStatsCollector(lambda: stats).families(stats["storage"])}
        seconds = {s.labels["kind"]: s.value for s in families["fastdeploy:storage_plan_seconds"].samples}
        assert seconds["actual"] == pytest.approx(plan["actual_s"]) and seconds["predicted"] > 0.3, seconds
        actual = families["fastdeploy:storage_plan_actual_requests"].samples[0].value
        assert actual == 1.0
        # The head was recomputed and the tail loaded: the whole prompt is cached now, and a
        # second request for it is a device hit with the same tokens.
        tokens, t = _run(reader, "again", _prompt(0))
        assert tokens == expected[0] and t["cached_tokens"]["device"] == BLOCKS * BS, t
    finally:
        reader.shutdown()


def test_a_split_tail_failing_midway_recomputes_the_rest_with_the_same_tokens(
        monkeypatch: pytest.MonkeyPatch, tiny_model: Any, tmp_path: Path, written: Any) -> None:
    src, expected, block_bytes = written
    store = _copy_store(src, tmp_path / "kv")
    # Block 6 of prompt 1 is corrupt: the tail (blocks 4-7) reads 4 and 5, then fails.
    h = Request("h", _prompt(1)).block_hashes(BS)[6]
    (found,) = store.glob(f"*={storage_key(h)}.kv")
    found.write_bytes(found.read_bytes()[:100])
    reader = _engine(monkeypatch, tiny_model, store)
    try:
        reader.start()
        _run(reader, "miss", [7] * (BLOCKS * BS + 3))
        reader.pool.tier.planner.block_bytes = block_bytes
        _seed(reader, 0.1, 0.1)
        tokens, t = _run(reader, "f", _prompt(1))
        assert tokens == expected[1], "a split whose tail failed midway must recompute the rest, same tokens"
        plan = t["fetch"]["plan"]
        assert plan["head"] == BLOCKS // 2 and plan["attached"] == 2, plan
        assert t["cached_tokens"]["storage"] == 2 * BS, t
        tier = _settled(reader)
        assert tier["prefetch_blocks_loaded"] == 2 and tier["prefetch_blocks_failed"] == 2, tier
        # Every tail block corrupt (present, unreadable): the split is dropped and the request
        # recomputes everything.
        for i in range(BLOCKS // 2, BLOCKS):
            h = Request("h", _prompt(2)).block_hashes(BS)[i]
            (found,) = store.glob(f"*={storage_key(h)}.kv")
            found.write_bytes(found.read_bytes()[:100])
        _seed(reader, 0.1, 0.1)
        tokens, t = _run(reader, "g", _prompt(2))
        assert tokens == expected[2] and t["cached_tokens"]["storage"] == 0, t
        assert t["fetch"]["plan"]["dropped"] == "failed", t["fetch"]
        assert _settled(reader)["plan_tails_failed"] == 1
    finally:
        reader.shutdown()


def test_a_slow_store_gets_a_split_from_the_measured_rates(
        monkeypatch: pytest.MonkeyPatch, tiny_model: Any, tmp_path: Path, written: Any) -> None:
    src, expected, block_bytes = written
    store = _copy_store(src, tmp_path / "kv")
    # 100 blocks/s: a block reads in ~10 ms, near what the tiny model takes to recompute one
    # on a CPU (a few ms), so neither pure choice is best.
    reader = _engine(monkeypatch, tiny_model, store, ThrottledBackend.at(100 * block_bytes))
    try:
        reader.start()
        _run(reader, "miss", [7] * (BLOCKS * BS + 3))
        tokens, _ = _run(reader, "a", _prompt(0))  # read rate unknown: fetched whole, and measured
        assert tokens == expected[0]
        tokens, t = _run(reader, "b", _prompt(1))
        assert tokens == expected[1], "a split must give the tokens of recompute"
        plan = t["fetch"]["plan"]
        assert plan["reason"] == "model" and 0 < plan["head"] < BLOCKS and plan["fetched"] == BLOCKS - plan["head"]
        # The tail is loaded, or (a loaded machine) it came late and was recomputed: either
        # way the choice is exported.
        assert plan.get("attached") == plan["fetched"] or plan.get("dropped") == "late", plan
        assert t["cached_tokens"]["storage"] == plan.get("attached", 0) * BS, t
        tier = _settled(reader)
        assert tier["plan_splits"] == 1 and tier["plan_tails_attached"] + tier["plan_tails_late"] == 1, tier
    finally:
        reader.shutdown()


def test_an_aborted_request_releases_its_split_tail(monkeypatch: pytest.MonkeyPatch, tiny_model: Any,
                                                    tmp_path: Path, written: Any) -> None:
    src, expected, block_bytes = written
    store = _copy_store(src, tmp_path / "kv")
    # 4 blocks/s: the four-block tail takes about a second; the head is recomputed in a few ms.
    reader = _engine(monkeypatch, tiny_model, store, ThrottledBackend.at(4 * block_bytes))
    try:
        reader.start()
        _run(reader, "miss", [7] * (BLOCKS * BS + 3))
        reader.pool.tier.planner.block_bytes = block_bytes
        _seed(reader, 0.1, 0.1)  # a 4 + 4 split whose tail the request waits for (until ~0.8 s)
        col = Collector()
        reader.add_request("x", _prompt(3), greedy(4), col)
        deadline = time.monotonic() + 5
        while reader.pool.tier.split_tail_status("x") is None and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.1)  # the head is recomputed; the request waits for its tail
        assert reader.pool.tier.split_tail_status("x") == "waiting"
        reader.abort("x")
        assert reader.wait_idle(30)
        assert col.final("x").finish_reason == "abort"
        tier = _settled(reader)  # the tail's host blocks went back when its job did
        assert tier["prefetch_host_blocks"] == 0 and tier["plan_splits"] == 1, tier
        assert tier["plan_tails_attached"] == 0 and tier["prefetch_blocks_unused"] >= BLOCKS // 2, tier
        # The store is still served after it.
        _seed(reader, 0.1, 0.1)
        tokens, _ = _run(reader, "y", _prompt(3))
        assert tokens == expected[3]
        _settled(reader)
    finally:
        reader.shutdown()


@pytest.mark.parametrize("when", ["in-flight", "held"])
def test_a_preempted_request_releases_its_split_tail(monkeypatch: pytest.MonkeyPatch, tiny_model: Any,
                                                     tmp_path: Path, written: Any, when: str) -> None:
    """The pool driven step by step (the engine's thread not started): a split request is
    preempted while its tail is read, or once the tail is held for it."""
    src, _, block_bytes = written
    store = _copy_store(src, tmp_path / "kv")
    reader = _engine(monkeypatch, tiny_model, store, ThrottledBackend.at(20 * block_bytes))
    pool = reader.pool
    try:
        pool.tier.planner.block_bytes = block_bytes
        _seed(reader, 0.1, 0.1)
        req = Request("p", _prompt(0))
        assert pool.prefetch_ready(req), "a split never holds admission"
        head_end = pool.compute_limit(req)
        assert head_end == BLOCKS // 2 * BS
        pool.admit(req)
        pool.ensure_resident(req, head_end)
        req.num_computed_tokens = head_end  # as if the head was computed (no forward pass here)
        if when == "held":
            deadline = time.monotonic() + 10
            while pool.tier.split_tail_status("p") == "waiting" and time.monotonic() < deadline:
                pool.complete_finished(wait=True)
            assert pool.tier.split_tail_status("p") == "ready"
            assert pool.tier.get_stats()["held_tail_host_blocks"] == BLOCKS // 2
        else:
            assert pool.tier.split_tail_status("p") == "waiting"
        pool.preempt(req)
        assert pool.tier.split_head_end("p") is None
        deadline = time.monotonic() + 10
        while pool.copies_in_flight and time.monotonic() < deadline:
            pool.complete_finished(wait=True)
        counts = pool.check_invariants()
        assert counts["device_owned"] == 0 and counts["host_owned"] == 0, counts
        stats = pool.tier.get_stats()
        assert stats["held_tail_host_blocks"] == 0 and stats["prefetch_host_blocks"] == 0, stats
        assert stats["prefetch_blocks_unused"] == BLOCKS // 2, stats
    finally:
        reader.shutdown()


@needs_mooncake()
def test_a_split_on_mooncake_gives_the_tokens_of_recompute(monkeypatch: pytest.MonkeyPatch, tiny_model: Any,
                                                           tmp_path: Path, written: Any) -> None:
    """The same split through a real mooncake_master and holder: nothing in it is file-only."""
    _, expected, block_bytes = written
    local = LocalMooncake(segment="256MB", log_dir=tmp_path / "logs").start()
    try:
        for k, v in local.env().items():
            monkeypatch.setenv(k, v)
        writer = _engine(monkeypatch, tiny_model, None)
        try:
            writer.start()
            wait_until(lambda: writer.storage_health()["available"], 30, "mooncake set-up")
            assert _run(writer, "w", _prompt(0))[0] == expected[0]
        finally:
            writer.shutdown()  # its graceful stop writes the prompt's blocks to the holder
        reader = _engine(monkeypatch, tiny_model, None)
        try:
            reader.start()
            wait_until(lambda: reader.storage_health()["available"], 30, "mooncake set-up")
            _run(reader, "miss", [7] * (BLOCKS * BS + 3))
            reader.pool.tier.planner.block_bytes = block_bytes
            _seed(reader, 0.1, 0.1)
            tokens, t = _run(reader, "s", _prompt(0))
            assert tokens == expected[0], "a split on Mooncake must give the tokens of recompute"
            plan = t["fetch"]["plan"]
            assert plan["head"] == BLOCKS // 2 and plan["attached"] == BLOCKS // 2, plan
            assert t["cached_tokens"]["storage"] == BLOCKS // 2 * BS, t
            assert _settled(reader)["plan_tails_attached"] == 1
        finally:
            reader.shutdown()
    finally:
        local.stop()
