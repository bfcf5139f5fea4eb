"""A graceful stop leaves the cache in the store: a real uvicorn server on 127.0.0.1
(tiny-llama-random on the CPU), a real directory, a real signal.  Under every write policy
the restarted server finds the prompt in storage and answers with the same greedy tokens."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from fastdeploy_kvcache.entrypoints.server_process import stop_child
from skip_helpers import needs_server_modules

from .helpers import BLOCK_SIZE, assert_no_leak, complete, file_store_args, prompt_ids, start_server, storage_stats

pytestmark = needs_server_modules()

P = prompt_ids(31, 200)  # 12 full blocks
Q = prompt_ids(32, 120)  # 7


def graceful_stop(server) -> str:  # type: ignore[no-untyped-def]
    """SIGINT (the engine's shutdown path; SIGTERM takes the same one where uvicorn keeps
    its handler); returns the server's log."""
    assert server.proc is not None
    stop_child(server.proc, signal.SIGINT, wait_s=120)
    with open(server.log_path, errors="replace") as f:
        return f.read()


@pytest.mark.parametrize("cache_policy,storage_policy", [
    ("write_through_selective", "write_through"),  # blocks hit less than twice stay device-only
    ("write_through", "write_back"),  # on host, never evicted from it: not stored while running
    ("write_back", "write_back"),  # device-only until evicted
])
def test_a_graceful_stop_writes_what_the_store_lacks_and_the_restart_is_warm(
        tmp_path: Path, cache_policy: str, storage_policy: str) -> None:
    store = tmp_path / "kv"
    args = file_store_args(store, "--kvcache-storage-put-policy", storage_policy)
    extra = ["--write-policy", cache_policy]
    first = start_server(args, extra=extra)
    try:
        cold = {name: complete(first, p) for name, p in (("P", P), ("Q", Q))}
        assert all(tiers["storage"] == 0 for _, tiers in cold.values())
        assert_no_leak(first)
        before = storage_stats(first)["tier"]["put_blocks_ok"]
        assert before < 12 + 7, f"the policy stored everything while running ({before}): nothing to test"
    finally:
        log = graceful_stop(first)
    flush = [line for line in log.splitlines() if "storage flush at stop" in line]
    assert len(flush) == 1, log[-3000:]
    assert "left 0 unstored" in flush[0] and "complete" in flush[0], flush[0]
    assert len(list(store.glob("*.kv"))) >= 12 + 7
    second = start_server(args, extra=extra)
    try:
        for name, p, blocks in (("P", P, 12), ("Q", Q, 7)):
            text, tiers = complete(second, p)
            assert text == cold[name][0], "KV from storage must give the same greedy tokens as recompute"
            assert tiers["storage"] == blocks * BLOCK_SIZE, (name, tiers)
        assert_no_leak(second)
    finally:
        second.stop()


def test_shutdown_flush_zero_writes_nothing_more(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    args = file_store_args(store, "--kvcache-storage-shutdown-flush", "0")
    first = start_server(args, extra=["--write-policy", "write_through_selective"])
    try:
        complete(first, P)
        assert_no_leak(first)
        stored = storage_stats(first)["tier"]["put_blocks_ok"]
    finally:
        log = graceful_stop(first)
    assert len(list(store.glob("*.kv"))) == stored
    assert "storage flush at stop: wrote 0 blocks" in log and "off (--kvcache-storage-shutdown-flush 0)" in log


def test_a_stop_into_a_store_smaller_than_the_cache_fills_it_once_and_says_so(tmp_path: Path) -> None:
    """A byte cap far below the cached blocks: the flush writes until the store is full, never
    evicts what it wrote, stops at once and says so in one line (it used to evict its own
    puts and write them again until --kvcache-storage-shutdown-flush ran out)."""
    import time

    store = tmp_path / "kv"
    args = file_store_args(store, "--kvcache-storage-put-policy", "write_back", "--kvcache-storage-size", "256KiB")
    server = start_server(args, extra=["--write-policy", "write_through"])
    try:
        for seed in range(40, 44):
            complete(server, prompt_ids(seed, 300), max_tokens=2)
        assert_no_leak(server)
        blocks = server.engine_stats()["cache"]["num_cached_nodes"]
        assert blocks > 40
        assert storage_stats(server)["tier"]["put_blocks_issued"] == 0, "write_back stores nothing while running"
    finally:
        t0 = time.monotonic()
        log = graceful_stop(server)
        seconds = time.monotonic() - t0
    flush = [line for line in log.splitlines() if "storage flush at stop" in line]
    assert len(flush) == 1, log[-3000:]
    assert "store full" in flush[0], flush[0]
    assert len([line for line in log.splitlines() if "store full" in line]) == 1
    written = int(flush[0].split("wrote ")[1].split()[0])
    objects = list(store.glob("*.kv"))
    assert 0 < written == len(objects), (written, len(objects), flush[0])
    assert sum(p.stat().st_size for p in objects) <= 256 << 10
    assert seconds < 10, f"the stop took {seconds:.1f} s"
    assert written < blocks, "the store holds less than the cache: the flush must stop short"
