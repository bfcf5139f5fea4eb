"""The store heals, through a real server (tiny-llama-random on the CPU, a real directory):
objects the byte cap evicts leave the scheduler's stored-set and show in /metrics."""

from __future__ import annotations

from pathlib import Path

from skip_helpers import needs_server_modules

from .helpers import assert_no_leak, complete, file_store_args, prompt_ids, scrape, start_server, storage_stats

pytestmark = needs_server_modules()


def test_objects_the_byte_cap_evicts_are_forgotten_and_counted(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    # Room for a few objects only: storing a 12-block prompt evicts its first blocks.
    server = start_server(file_store_args(store, "--kvcache-storage-size", "400KiB"))
    try:
        complete(server, prompt_ids(41, 200))
        complete(server, prompt_ids(42, 200))
        assert_no_leak(server)
        stats = storage_stats(server)
        on_disk = len(list(store.glob("*.kv")))
        tier, backend = stats["tier"], stats["store"]
        assert 0 < on_disk < tier["put_blocks_ok"]
        assert backend["evicted"] == tier["put_blocks_ok"] - on_disk
        assert tier["stored_forgotten"] >= backend["evicted"]
        assert tier["stored_blocks_known"] == on_disk, "the stored-set must hold exactly what is on disk"
        metrics = scrape(server)
        assert metrics["fastdeploy:storage_evicted_objects_total"] == backend["evicted"]
        assert metrics["fastdeploy:storage_forgotten_blocks_total"] == tier["stored_forgotten"]
        assert metrics["fastdeploy:storage_generation_changes_total"] == 0
    finally:
        server.stop()
