"""The store heals, through a real server (tiny-llama-random on the CPU, a real directory):
objects the byte cap evicts leave the scheduler's stored-set and show in /metrics."""

from __future__ import annotations

from pathlib import Path

from skip_helpers import needs_server_modules

from .helpers import (BLOCK_SIZE, assert_no_leak, block_hashes, complete, file_store_args, object_file, prompt_ids,
                      scrape, start_server, storage_stats)

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
        assert tier["put_blocks_issued"] <= 2 * 12, "each computed block is put once: no evict-and-rewrite loop"
        assert backend["evicted"] == tier["put_blocks_ok"] - on_disk
        assert tier["stored_forgotten"] >= backend["evicted"]
        assert tier["stored_blocks_known"] == on_disk, "the stored-set must hold exactly what is on disk"
        metrics = scrape(server)
        assert metrics["fastdeploy:storage_evicted_objects_total"] == backend["evicted"]
        assert metrics["fastdeploy:storage_forgotten_blocks_total"] == tier["stored_forgotten"]
        assert metrics["fastdeploy:storage_generation_changes_total"] == 0
    finally:
        server.stop()


def test_a_prompt_whose_objects_vanished_is_stored_again_whole_and_then_read_from_storage(tmp_path: Path) -> None:
    """Objects deleted behind the server's back: the next computation of the prompt writes
    every one of its blocks again (not one per recompute), a later request reads them all
    from storage, and the stop flush finds nothing to repair."""
    from .test_server_flush import graceful_stop

    store = tmp_path / "kv"
    # A host tier of a few blocks: a prompt leaves it after a few other prompts.
    server = start_server(file_store_args(store, "--kvcache-storage-put-policy", "write_through"),
                          extra=["--write-policy", "write_through", "--swap-space", "0.004"])
    a = prompt_ids(61, 452)  # 28 full blocks, 28 matchable
    blocks = (len(a) - 1) // BLOCK_SIZE

    def push_a_out(seed: int) -> None:
        for s in range(seed, seed + 6):
            complete(server, prompt_ids(s, 300), max_tokens=2)
        assert_no_leak(server)

    try:
        text, _ = complete(server, a)
        assert_no_leak(server)
        first = len(list(store.glob("*.kv")))
        assert first >= blocks
        for h in block_hashes(a)[:blocks]:
            object_file(store, h).unlink()
        push_a_out(100)
        before = scrape(server)
        again, tiers = complete(server, a)
        assert again == text
        assert tiers["storage"] == 0, "every object of A was deleted"
        assert sum(tiers.values()) == 0, tiers
        assert_no_leak(server)
        after = scrape(server)

        def delta(name: str) -> float:
            return after[name] - before[name]

        assert delta("fastdeploy:storage_write_block_num_total") >= blocks, (
            "every block of A must be written again", {k: delta(k) for k in after if "storage" in k})
        assert delta("fastdeploy:storage_forgotten_blocks_total") >= blocks
        for h in block_hashes(a)[:blocks]:
            object_file(store, h)  # each one is back
        push_a_out(200)
        third, tiers = complete(server, a)
        assert third == text, "KV from storage must give the same greedy tokens as recompute"
        assert tiers["storage"] == blocks * BLOCK_SIZE, tiers
        assert_no_leak(server)
        for h in block_hashes(a)[:blocks]:  # A is cached again (host): gone from the store once more
            object_file(store, h).unlink()
    finally:
        log = graceful_stop(server)
    flush = [line for line in log.splitlines() if "storage flush at stop" in line]
    assert len(flush) == 1 and "left 0 unstored" in flush[0], flush
    written = int(flush[0].split("wrote ")[1].split()[0])
    assert written >= blocks, f"the flush must check what it counts as stored: {flush[0]}"
    for h in block_hashes(a)[:blocks]:
        object_file(store, h)
