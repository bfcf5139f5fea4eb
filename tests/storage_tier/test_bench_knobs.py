"""The benchmark knobs that reach servers started as subprocesses (environment variables):
a throttled store (FDKV_STORAGE_THROTTLE_BYTES_PER_S) and a forced fetch-or-recompute split
(FDKV_STORAGE_FORCE_FETCH_BLOCKS).  Real uvicorn servers on 127.0.0.1, tiny-llama-random on
the CPU, a real directory; the effects are read from the servers' counters, not timed."""

from __future__ import annotations

from pathlib import Path

import pytest

from fastdeploy_kvcache.storage.config import StorageConfig
from skip_helpers import needs_server_modules

from .helpers import BLOCK_SIZE, assert_no_leak, complete, file_store_args, prompt_ids, start_server
from .test_server_file import segment_reads_built

pytestmark = needs_server_modules()

P = prompt_ids(11, 200)  # 12 full blocks
RATE = 200_000  # bytes/s: far below any disk, so every read is held


def test_a_throttled_store_and_a_forced_split_answer_right_and_show_in_the_counters(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    first = start_server(file_store_args(store))
    try:
        want, tiers = complete(first, P)
        assert tiers["storage"] == 0
        assert_no_leak(first)
    finally:
        first.stop()

    # A restarted server whose store is held to RATE: a storage hit, the same text, and the
    # throttle in its backend's stats.  The prefetch path is counted too: straight into the
    # host tier where the library reads segments, else through staging.
    slow = start_server(file_store_args(store), env={"FDKV_STORAGE_THROTTLE_BYTES_PER_S": str(RATE)})
    try:
        text, tiers = complete(slow, P)
        assert text == want and tiers["storage"] == 12 * BLOCK_SIZE, tiers
        st = assert_no_leak(slow)["storage"]
        store_stats, transfer = st["store"], st["transfer"]
        assert store_stats["throttle_read_bytes_per_s"] == RATE, store_stats
        assert store_stats["read_bytes"] > 0 and store_stats["throttled_seconds"] > 0, store_stats
        path = "direct_read_blocks" if segment_reads_built() else "staged_read_blocks"
        other = "staged_read_blocks" if path == "direct_read_blocks" else "direct_read_blocks"
        assert transfer[path] == 12 and transfer[other] == 0, transfer
    finally:
        slow.stop()

    # A forced split (the offline sweep's oracle points): 5 blocks fetched, 7 recomputed by
    # the plan, same text; 0 fetches nothing.
    for forced, fetched in (("5", 5), ("0", 0)):
        split = start_server(file_store_args(store, "--kvcache-storage-fetch-plan", "on"),
                             env={"FDKV_STORAGE_FORCE_FETCH_BLOCKS": forced})
        try:
            text, tiers = complete(split, P)
            assert text == want and tiers["storage"] == fetched * BLOCK_SIZE, (forced, tiers)
            tier = assert_no_leak(split)["storage"]["tier"]
            assert tier["plan_blocks_fetched"] == fetched and tier["plan_blocks_recomputed"] == 12 - fetched, tier
            assert "throttle_read_bytes_per_s" not in split.engine_stats()["storage"]["store"]
        finally:
            split.stop()


def test_a_bad_throttle_value_is_refused_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = StorageConfig(backend="file", path=str(tmp_path), min_free=0)
    for bad in ("-1", "fast", "inf"):
        monkeypatch.setenv("FDKV_STORAGE_THROTTLE_BYTES_PER_S", bad)
        with pytest.raises(ValueError, match="FDKV_STORAGE_THROTTLE_BYTES_PER_S"):
            cfg.make_backend()
    monkeypatch.setenv("FDKV_STORAGE_THROTTLE_BYTES_PER_S", "0")
    backend = cfg.make_backend()
    assert backend.name == "file"
    backend.close()
    monkeypatch.setenv("FDKV_STORAGE_THROTTLE_BYTES_PER_S", "1e9")
    backend = cfg.make_backend()
    assert backend.name == "file-throttled" and backend.stats()["throttle_read_bytes_per_s"] == 1e9
    backend.close()
