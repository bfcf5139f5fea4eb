"""The storage tier through the server, mooncake backend: a real ``mooncake_master`` and a
real holder (``mooncake_client``) on 127.0.0.1, real uvicorn servers, tiny-llama-random on
the CPU.  Faults are real: the master is not there at start, is stopped mid-run and comes
back; the holder's segment is too small (-200)."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

from fastdeploy_kvcache.storage import Status
from fastdeploy_kvcache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig
from fastdeploy_kvcache.storage.mooncake_local import LocalMooncake, MooncakeHolder, MooncakeMaster
from server_helpers import mooncake_store_args
from shutdown_helpers import wait_until
from skip_helpers import needs_mooncake, needs_server_modules

from .helpers import BLOCK_SIZE, assert_no_leak, complete, prompt_ids, scrape, start_server, storage_stats

pytestmark = [needs_server_modules(), needs_mooncake()]

MC_ARGS = mooncake_store_args()
P = prompt_ids(11, 200)
Q = prompt_ids(12, 200)
R = prompt_ids(13, 200)
S = prompt_ids(14, 200)


def mc_env(master: MooncakeMaster) -> dict[str, str]:
    return {
        "MOONCAKE_MASTER_SERVER_ADDR": master.addr,
        "MOONCAKE_MASTER_METRICS_ADDR": master.metrics_addr,
        "MOONCAKE_METADATA_SERVER": "P2PHANDSHAKE",
        "MOONCAKE_PROTOCOL": "tcp",
        "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
        "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
        "MC_STORE_CLIENT_SETUP_RETRIES": "1",
    }



def wait_stored(server, n: int, timeout_s: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    wait_until(lambda: storage_stats(server)["tier"]["put_blocks_ok"] >= n
             and storage_stats(server)["pending_work"] == 0, timeout_s, f"{n} blocks stored")


@pytest.fixture
def baseline_texts() -> dict[str, str]:
    """Greedy text of each prompt from a server with no storage tier (recompute)."""
    server = start_server([])
    try:
        return {name: complete(server, p)[0] for name, p in (("P", P), ("Q", Q), ("R", R), ("S", S))}
    finally:
        server.stop()


def test_a_second_server_process_reuses_the_store(tmp_path: Path, baseline_texts: dict[str, str]) -> None:
    local = LocalMooncake(segment="256MB", log_dir=tmp_path / "logs").start()
    try:
        first = start_server(MC_ARGS, env=local.env())
        try:
            wait_until(lambda: storage_stats(first)["available"], 30, "mooncake set-up")
            text, tiers = complete(first, P)
            assert text == baseline_texts["P"] and tiers["storage"] == 0
            wait_stored(first, 12)
            assert_no_leak(first)
        finally:
            first.stop()  # its segment is 0: the bytes live in the holder
        second = start_server(MC_ARGS, env=local.env())
        try:
            wait_until(lambda: storage_stats(second)["available"], 30, "mooncake set-up")
            text, tiers = complete(second, P)
            assert text == baseline_texts["P"], "Mooncake KV must give the same greedy output as recompute"
            assert tiers["storage"] == 12 * BLOCK_SIZE, tiers
            assert scrape(second)["fastdeploy:prefix_storage_cache_token_num_total"] == 12 * BLOCK_SIZE
            assert_no_leak(second)
        finally:
            second.stop()
    finally:
        local.stop()


def test_master_down_at_start_then_dies_mid_run(tmp_path: Path, baseline_texts: dict[str, str]) -> None:
    master = MooncakeMaster(log_dir=tmp_path / "logs")  # ports chosen; not started
    holder = None
    t0 = time.monotonic()
    server = start_server(MC_ARGS, env=mc_env(master))
    try:
        # Up without the master (start-up is bounded by model loading, not by Mooncake).
        assert time.monotonic() - t0 < 120
        stats = storage_stats(server)
        assert not stats["available"]
        t0 = time.monotonic()
        text, tiers = complete(server, P)
        assert text == baseline_texts["P"] and tiers["storage"] == 0
        assert time.monotonic() - t0 < 30, "a request must not wait for a master that is not there"
        # The master and a holder appear: the background set-up turns the tier on.
        master.start()
        holder = MooncakeHolder(master, "256MB", tmp_path / "logs").start()
        wait_until(lambda: storage_stats(server)["available"], 60, "the tier turning on")
        text, _ = complete(server, Q)
        assert text == baseline_texts["Q"]
        wait_stored(server, 12)
        # The master dies mid-run: requests stay right, calls are bounded, the breaker opens.
        master.stop()
        t0 = time.monotonic()
        text, tiers = complete(server, R)
        assert text == baseline_texts["R"] and tiers["storage"] == 0
        assert time.monotonic() - t0 < 30
        wait_until(lambda: storage_stats(server)["pending_work"] == 0, 60, "failed puts to come back")
        # Each request's existence check fails at once; a few consecutive failures open it.
        for i in range(10):
            if not storage_stats(server)["available"]:
                break
            t0 = time.monotonic()
            complete(server, prompt_ids(200 + i, 40), max_tokens=1)
            assert time.monotonic() - t0 < 30
        wait_until(lambda: not storage_stats(server)["available"], 30, "the breaker opening")
        assert storage_stats(server)["store"]["breaker_opens"] >= 1
        metrics = scrape(server)
        assert metrics["fastdeploy:storage_breaker_state"] > 0 and metrics["fastdeploy:storage_available"] == 0
        assert metrics['fastdeploy:storage_errors_total{kind="unreachable"}'] > 0
        assert_no_leak(server)
        # It comes back (empty): the probe closes the breaker and puts work again.
        master.start()
        wait_until(lambda: storage_stats(server)["available"], 60, "the breaker closing")
        assert scrape(server)["fastdeploy:storage_breaker_state"] == 0
        before = storage_stats(server)["tier"]["put_blocks_ok"]
        deadline = time.monotonic() + 60
        text, _ = complete(server, S)
        assert text == baseline_texts["S"]
        # The holder re-mounts its segment on the new master; until then puts are FULL.
        while storage_stats(server)["tier"]["put_blocks_ok"] == before and time.monotonic() < deadline:
            complete(server, prompt_ids(int(time.monotonic() * 1000) % 100000 + 100, 40), max_tokens=1)
            time.sleep(0.5)
        assert storage_stats(server)["tier"]["put_blocks_ok"] > before
        assert_no_leak(server)
    finally:
        server.stop()
        if holder is not None:
            holder.stop()
        master.stop()


def fill_and_lease(master: MooncakeMaster) -> tuple[MooncakeBackend, list[str]]:
    """Fill the holder with 1 MiB objects from this process, then lease them all.

    Mooncake evicts in the background above 90 % full, but never a leased key (gets and
    existence checks lease a key for 10 s), so for the next seconds a put gets -200.
    """
    arena = np.zeros(1 << 20, dtype=np.uint8)
    filler = MooncakeBackend(MooncakeConfig(master_server_addr=master.addr, master_metrics_addr=master.metrics_addr,
                                            local_hostname="127.0.0.1", global_segment_size=0))
    filler.register_buffer(int(arena.ctypes.data), arena.nbytes)
    assert filler.wait_ready(30), filler.health()
    ptr = int(arena.ctypes.data)
    results: list[int] = []
    leased: list[str] = []
    deadline = time.monotonic() + 30
    for i in range(64):  # put and lease one by one until the store says full
        k = f"fdkv1-filler-0000000000000000-tp0of1:{i:032x}"
        results += filler.batch_put_from([k], [ptr], [arena.nbytes])
        while results[-1] == int(Status.FULL) and len(leased) < 8 and time.monotonic() < deadline:
            # -200 before the holder's segment is mounted (a loaded machine) is not "full"
            time.sleep(0.2)
            results[-1:] = filler.batch_put_from([k], [ptr], [arena.nbytes])
        if results[-1] == int(Status.FULL):
            break
        filler.batch_exists([k])  # leases it: eviction cannot take it for 10 s
        leased.append(k)
    assert results[-1] == int(Status.FULL), f"the store took {len(results)} MiB without -200"
    filler._fdkv_arena = arena  # type: ignore[attr-defined]  # keep the registered memory alive
    return filler, leased


def test_store_full_is_recomputed_and_counted(tmp_path: Path, baseline_texts: dict[str, str]) -> None:
    master = MooncakeMaster(log_dir=tmp_path / "logs").start()
    holder = MooncakeHolder(master, "16MB", tmp_path / "logs")
    filler = None
    try:
        holder.start()
        server = start_server(MC_ARGS, env=mc_env(master))
        try:
            wait_until(lambda: storage_stats(server)["available"], 30, "mooncake set-up")
            filler, leased = fill_and_lease(master)
            for name, p in (("P", P), ("Q", Q), ("R", R), ("S", S)):
                for k in leased:
                    filler.batch_exists([k])  # renew the leases (10 s) before each request
                assert complete(server, p)[0] == baseline_texts[name]
                wait_until(lambda: storage_stats(server)["pending_work"] == 0, 60, "puts to come back")
                if storage_stats(server)["tier"]["errors"].get("full", 0):
                    break
            tier = storage_stats(server)["tier"]
            assert tier["errors"].get("full", 0) > 0, (tier, storage_stats(server)["store"])
            assert tier["put_blocks_ok"] + tier["put_blocks_failed"] == tier["put_blocks_issued"]
            assert scrape(server)['fastdeploy:storage_errors_total{kind="full"}'] > 0
            assert storage_stats(server)["available"]  # full is not an outage
            assert_no_leak(server)
        finally:
            server.stop()
    finally:
        if filler is not None:
            filler.close()
        holder.stop()
        master.stop()
