"""A fetch-or-recompute split on the transformers runner: the check shared by
tests/engine_torch (torch on the CPU) and tests/gpu (a CUDA device).

A writer engine computes two prompts and its graceful stop writes them to a file store in a
real directory; a reader engine is given equal read and recompute rates, so it recomputes the
head of each stored prefix while it reads the tail, and its greedy tokens must equal the
writer's (recompute).  The second prompt's tail has a corrupt object in the middle: the
blocks before it are loaded and the rest recomputed, with the same tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastdeploy_kvcache.core.hashing import storage_key
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.engine.llm_engine import LLMEngine
from fastdeploy_kvcache.storage.config import StorageConfig
from tests.engine_args import engine_args, wait_for_the_host_tier
from tests.reuse_workloads import Collector, greedy

BS = 16
BLOCKS = 8


def _prompt(i: int) -> list[int]:
    return [3 + (i * 37 + j * 11) % 500 for j in range(BLOCKS * BS + 3)]


def _engine(loaded: Any, device: str, store: Path) -> LLMEngine:
    storage = StorageConfig(backend="file", path=str(store), min_free=0, prefetch_policy="wait_complete",
                            fetch_plan="on")
    args = dict(model="tiny-llama-random", model_impl="transformers", device=device, model_dtype="float32",
                block_size=BS, max_model_len=512, max_num_batched_tokens=1024, max_num_seqs=2, swap_space=0.05,
                kv_cache_memory_gib=0.25, storage=storage)
    return LLMEngine(engine_args(**args), loaded_model=loaded)


def _run(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[list[int], dict[str, Any]]:
    col = Collector()
    engine.add_request(rid, prompt, greedy(6), col)
    assert engine.wait_idle(120), f"{rid} did not finish"
    timings = {t["request_id"]: t for t in engine.get_stats()["request_timings"]}
    return col.tokens(rid), timings[rid]


def _equal_rates(engine: LLMEngine, block_bytes: int) -> None:
    """The planner's rates, as the engine and the tier feed them: a block read in 0.1 s or
    recomputed in 0.1 s, so a stored prefix splits in half."""
    tier = engine.pool.tier
    planner = tier.planner
    planner.block_bytes = block_bytes
    planner.read.clear()
    planner.prefill.clear()
    planner.observe_read(tier.backend_name, block_bytes, 0.1, 1)
    planner.observe_prefill([(4 * BS, 0)], 0.4)


def check_split_gives_the_tokens_of_recompute(monkeypatch: Any, loaded: Any, device: str, tmp: Path) -> None:
    """Raise AssertionError where the split's tokens, blocks or counters are wrong."""
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1")
    store = tmp / "kv"
    store.mkdir()
    writer = _engine(loaded, device, store)
    try:
        writer.start()
        wait_for_the_host_tier(writer)
        expected = {i: _run(writer, f"w{i}", _prompt(i))[0] for i in range(2)}
    finally:
        writer.shutdown()  # its graceful stop writes the prompts' blocks
    block_bytes = max(f.stat().st_size for f in store.glob("*.kv"))
    # Prompt 1's block 6 is cut short: its tail (blocks 4-7) reads 4 and 5, then fails.
    (bad,) = store.glob(f"*={storage_key(Request('h', _prompt(1)).block_hashes(BS)[6])}.kv")
    bad.write_bytes(bad.read_bytes()[:100])
    reader = _engine(loaded, device, store)
    try:
        reader.start()
        wait_for_the_host_tier(reader)
        _run(reader, "miss", [7] * (BLOCKS * BS + 3))
        _equal_rates(reader, block_bytes)
        tokens, t = _run(reader, "s0", _prompt(0))
        assert tokens == expected[0], "recomputed head + fetched tail must give the tokens of recompute"
        plan = t["fetch"]["plan"]
        assert plan["choice"] == "partial" and plan["head"] == BLOCKS // 2, plan
        assert plan["attached"] == BLOCKS // 2 and t["cached_tokens"]["storage"] == BLOCKS // 2 * BS, t
        _equal_rates(reader, block_bytes)  # the first split's measured rates replaced
        tokens, t = _run(reader, "s1", _prompt(1))
        assert t["fetch"]["plan"]["head"] == BLOCKS // 2, t["fetch"]
        assert tokens == expected[1], "a tail failing midway must recompute the rest, same tokens"
        assert t["cached_tokens"]["storage"] == 2 * BS, t
        counts = reader.pool.check_invariants()
        assert counts["device_owned"] == 0 and counts["host_owned"] == 0, counts
        stats = reader.get_stats()["storage"]["tier"]
        assert stats["held_tail_host_blocks"] == 0 and stats["splits_pending"] == 0, stats
    finally:
        reader.shutdown()
