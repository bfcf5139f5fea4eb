"""The mooncake backend against a real ``mooncake_master`` and a real holder on 127.0.0.1.

Faults are real too: the master is killed (SIGTERM), paused (SIGSTOP) and restarted on the
same ports; the store is filled with a small holder segment.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from fastdeploy_kvcache.storage import Status, StorageError
from fastdeploy_kvcache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig, parse_size
from fastdeploy_kvcache.storage.mooncake_local import (
    LocalMooncake,
    MooncakeHolder,
    MooncakeMaster,
)
from skip_helpers import needs_mooncake

from .conftest import HostArena

pytestmark = needs_mooncake()

NS = "fdkv1-test-fedcba9876543210-tp0of1"
MiB = 1 << 20


def key(i: int) -> str:
    return f"{NS}:{i:032x}"


def backend_for(local_master: MooncakeMaster, arena: HostArena, **kw) -> MooncakeBackend:
    config = MooncakeConfig(
        master_server_addr=local_master.addr, master_metrics_addr=local_master.metrics_addr,
        local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="tcp",
        local_buffer_size=16 * MiB, global_segment_size=0,
    )
    backend = MooncakeBackend(config, **kw)
    backend.register_buffer(arena.ptr, arena.nbytes)
    return backend


@pytest.fixture
def store(tmp_path: Path):
    local = LocalMooncake(segment="64MB", log_dir=tmp_path / "logs").start()
    yield local
    local.stop()


@pytest.fixture
def marena() -> HostArena:
    return HostArena(16, 256 << 10)


def test_config_from_env_and_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOONCAKE_MASTER_SERVER_ADDR", "10.1.2.3:50051")
    monkeypatch.setenv("MOONCAKE_PROTOCOL", "rdma")
    monkeypatch.setenv("MOONCAKE_GLOBAL_SEGMENT_SIZE", "2GB")
    cfg = MooncakeConfig(protocol="tcp")
    assert cfg.master_server_addr == "10.1.2.3:50051" and cfg.protocol == "tcp"
    assert cfg.metadata_server == "P2PHANDSHAKE" and cfg.global_segment_size == 2 << 30
    assert cfg.master_metrics_addr == "10.1.2.3:9003"
    assert parse_size("512MiB") == 512 << 20 and parse_size(4096) == 4096 and parse_size("0") == 0
    with pytest.raises(ValueError, match="size"):
        parse_size("lots")
    monkeypatch.delenv("MOONCAKE_MASTER_SERVER_ADDR")
    with pytest.raises(ValueError, match="MOONCAKE_MASTER_SERVER_ADDR"):
        MooncakeConfig()


def test_put_get_exists_delete_and_partial_batch(store: LocalMooncake, marena: HostArena) -> None:
    backend = backend_for(store.master, marena)
    assert backend.wait_ready(15), backend.health()
    size = marena.slot_bytes
    data = [marena.fill(i, seed=40 + i) for i in range(3)]
    assert backend.batch_put_from([key(i) for i in range(3)], [marena.slot_ptr(i) for i in range(3)], [size] * 3) == [0] * 3
    assert backend.batch_exists([key(0), key(1), key(2), key(3)]) == 3
    assert backend.batch_exists([key(0), key(7), key(2)]) == 1
    got = backend.batch_get_into([key(2), key(0)], [marena.slot_ptr(8), marena.slot_ptr(9)], [size, size])
    assert got == [size, size]
    np.testing.assert_array_equal(marena.slot(8), data[2])
    np.testing.assert_array_equal(marena.slot(9), data[0])
    # One batch: a hit, a miss and a buffer smaller than the object.
    mixed = backend.batch_get_into([key(1), key(9), key(0)], [marena.slot_ptr(10), marena.slot_ptr(11), marena.slot_ptr(12)], [size, size, 1000])
    assert mixed == [size, Status.MISSING, Status.INVALID]
    np.testing.assert_array_equal(marena.slot(10), data[1])
    # A key missing after a positive existence check (removed in between) is a miss.
    assert backend.batch_exists([key(1)]) == 1
    assert backend.delete([key(1)]) == 1  # force: the get above leased it for 10 s
    assert backend.batch_get_into([key(1)], [marena.slot_ptr(13)], [size]) == [Status.MISSING]
    # Writing a key again keeps it (same bytes by construction) and reports OK.
    assert backend.batch_put_from([key(0)], [marena.slot_ptr(5)], [size]) == [0]
    stats = backend.stats()
    assert stats["write_bytes"] == 4 * size and stats["read_bytes"] == 3 * size
    assert stats["errors"]["invalid"] == 1 and stats["misses"] == 3 and stats["breaker_state"] == "closed"
    with pytest.raises(StorageError, match="not inside a registered buffer"):
        backend.batch_put_from([key(5)], [int(np.zeros(8).ctypes.data)], [8])
    backend.close()


def test_overwrite_uses_upsert(store: LocalMooncake, marena: HostArena) -> None:
    backend = backend_for(store.master, marena, overwrite=True)
    assert backend.wait_ready(15)
    size = marena.slot_bytes
    marena.fill(0, seed=1)
    second = marena.fill(1, seed=2)
    assert backend.batch_put_from([key(0)], [marena.slot_ptr(0)], [size]) == [0]
    assert backend.batch_put_from([key(0)], [marena.slot_ptr(1)], [size]) == [0]
    assert backend.batch_get_into([key(0)], [marena.slot_ptr(2)], [size]) == [size]
    np.testing.assert_array_equal(marena.slot(2), second)
    backend.close()


WRITER = textwrap.dedent(
    """
    import sys, numpy as np
    from fastdeploy_kvcache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig
    addr, metrics = sys.argv[1], sys.argv[2]
    b = MooncakeBackend(MooncakeConfig(master_server_addr=addr, master_metrics_addr=metrics, global_segment_size=0,
                                       local_hostname="127.0.0.1", local_buffer_size=16 << 20))
    buf = np.arange(4 * 65536, dtype=np.uint32).view(np.uint8)
    b.register_buffer(int(buf.ctypes.data), int(buf.nbytes))
    assert b.wait_ready(15), b.health()
    keys = [f"{sys.argv[3]}:{i:032x}" for i in range(4)]
    r = b.batch_put_from(keys, [int(buf.ctypes.data) + i * 262144 for i in range(4)], [262144] * 4)
    assert r == [0, 0, 0, 0], r
    b.close()
    """
)


def test_bytes_outlive_the_writer_process(store: LocalMooncake, marena: HostArena) -> None:
    """A second process (a restarted server) reads what the first wrote: the holder keeps them."""
    proc = subprocess.run([sys.executable, "-c", WRITER, store.master.addr, store.master.metrics_addr, NS],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    backend = backend_for(store.master, marena)
    assert backend.wait_ready(15)
    assert backend.batch_exists([key(i) for i in range(4)]) == 4
    assert backend.batch_get_into([key(i) for i in range(4)], [marena.slot_ptr(i) for i in range(4)], [262144] * 4) == [262144] * 4
    expected = np.arange(4 * 65536, dtype=np.uint32).view(np.uint8)
    np.testing.assert_array_equal(marena.array[: 4 * 262144], expected)
    backend.close()


def test_master_down_at_start_is_bounded_and_recovers(tmp_path: Path, marena: HostArena) -> None:
    master = MooncakeMaster(log_dir=tmp_path / "logs")  # ports chosen, nothing started yet
    start = time.monotonic()
    backend = backend_for(master, marena)
    assert time.monotonic() - start < 1.0  # the constructor never waits for the master
    health = backend.health()
    assert not health.available and health.breaker != "closed"
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        backend.batch_exists([key(0)])
    assert info.value.kind == "unreachable" and time.monotonic() - t0 < 0.5
    with pytest.raises(StorageError):
        backend.batch_put_from([key(0)], [marena.slot_ptr(0)], [marena.slot_bytes])
    time.sleep(1.0)  # the background set-up keeps retrying
    assert not backend.health().available
    master.start()
    holder = MooncakeHolder(master, "64MB", tmp_path / "logs").start()
    try:
        assert backend.wait_ready(20), backend.health()
        assert backend.stats()["setup_attempts"] >= 2
        marena.fill(0, seed=9)
        assert backend.batch_put_from([key(0)], [marena.slot_ptr(0)], [marena.slot_bytes]) == [0]
        assert backend.batch_get_into([key(0)], [marena.slot_ptr(1)], [marena.slot_bytes]) == [marena.slot_bytes]
        np.testing.assert_array_equal(marena.slot(0), marena.slot(1))
    finally:
        backend.close()
        holder.stop()
        master.stop()


def test_master_killed_mid_run_breaker_opens_then_closes(store: LocalMooncake, marena: HostArena) -> None:
    backend = backend_for(store.master, marena, failure_threshold=2, reset_timeout_s=2.0, call_timeout_s=8.0)
    assert backend.wait_ready(15)
    size = marena.slot_bytes
    marena.fill(0, seed=11)
    assert backend.batch_put_from([key(0)], [marena.slot_ptr(0)], [size]) == [0]
    store.master.stop()
    # A data call with the master dead is bounded (Mooncake gives up after ~4.3 s).
    t0 = time.monotonic()
    with pytest.raises(StorageError) as info:
        backend.batch_get_into([key(0)], [marena.slot_ptr(1)], [size])
    assert info.value.kind in ("unreachable", "timeout") and time.monotonic() - t0 < 8.5
    with pytest.raises(StorageError):
        backend.batch_exists([key(0)])  # answers at once; the second failure opens the breaker
    assert backend.health().breaker in ("open", "half_open") and not backend.health().available
    # With the breaker open, calls fail at once instead of costing seconds each.
    t0 = time.monotonic()
    for _ in range(5):
        with pytest.raises(StorageError) as info:
            backend.batch_get_into([key(0)], [marena.slot_ptr(1)], [size])
        assert info.value.kind == "unreachable"
    assert time.monotonic() - t0 < 0.5
    assert backend.stats()["breaker_opens"] >= 1
    # The master comes back (empty): the probe closes the breaker, old keys are misses.
    store.master.start()
    assert backend.wait_ready(30), backend.health()
    assert backend.batch_exists([key(0)]) == 0
    deadline = time.monotonic() + 20
    while True:  # the holder re-mounts its segment on the new master; until then puts are FULL
        result = backend.batch_put_from([key(1)], [marena.slot_ptr(0)], [size])
        if result == [0] or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert result == [0]
    assert backend.batch_get_into([key(1)], [marena.slot_ptr(2)], [size]) == [size]
    np.testing.assert_array_equal(marena.slot(2), marena.slot(0))
    assert backend.stats()["breaker_state"] == "closed"
    backend.close()


def test_hung_master_call_times_out_with_pending_future(store: LocalMooncake, marena: HostArena) -> None:
    """SIGSTOP: the call hangs; the caller gets "timeout" and a future of the real call."""
    backend = backend_for(store.master, marena, call_timeout_s=0.5, exists_timeout_s=0.2, failure_threshold=5)
    assert backend.wait_ready(15)
    marena.fill(0, seed=12)
    assert backend.batch_put_from([key(0)], [marena.slot_ptr(0)], [marena.slot_bytes]) == [0]
    store.master.pause()
    try:
        t0 = time.monotonic()
        with pytest.raises(StorageError) as info:
            backend.batch_get_into([key(0)], [marena.slot_ptr(1)], [marena.slot_bytes])
        assert info.value.kind == "timeout" and time.monotonic() - t0 < 1.5
        pending = info.value.pending  # type: ignore[attr-defined]
        assert not pending.done()  # the buffer is still in use: the caller must wait for this
        # The scheduler's inline existence check has its own, shorter limit.
        t0 = time.monotonic()
        with pytest.raises(StorageError) as info2:
            backend.batch_exists([key(0)])
        assert info2.value.kind == "timeout" and time.monotonic() - t0 < 0.5
    finally:
        store.master.resume()
    pending.result(timeout=30)  # the real call ends once the master runs again
    assert backend.stats()["errors"]["timeout"] == 2
    backend.close()


def test_store_full_is_a_soft_failure(tmp_path: Path) -> None:
    local = LocalMooncake(segment="16MB", log_dir=tmp_path / "logs").start()
    arena = HostArena(4, 1 * MiB)
    backend = backend_for(local.master, arena)
    try:
        assert backend.wait_ready(15)
        results: list[int] = []
        for batch in range(6):  # 48 MiB into a 16 MiB segment
            keys = [key(batch * 8 + i) for i in range(8)]
            results += backend.batch_put_from(keys, [arena.slot_ptr(i % 4) for i in range(8)], [MiB] * 8)
        assert Status.FULL in results, results
        # Eviction runs in the background above 90 % full, so more than 16 puts may succeed
        # in all, but never more than the segment holds at once.
        present = sum(backend.batch_exists([key(i)]) for i in range(len(results)))
        assert present <= 16
        assert set(results) <= {Status.OK, Status.FULL}
        full_keys = [key(i) for i, r in enumerate(results) if r == Status.FULL]
        assert backend.batch_exists(full_keys[:1]) == 0  # a FULL put never counts as stored
        stats = backend.stats()
        assert stats["errors"]["full"] == results.count(Status.FULL)
        assert stats["breaker_state"] == "closed"  # full is not an outage
        assert backend.health().available
    finally:
        backend.close()
        local.stop()


def test_not_installed_message_names_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    import fastdeploy_kvcache.storage.mooncake_backend as mb

    monkeypatch.setattr(mb, "mooncake_available", lambda: "ImportError: no module named mooncake")
    with pytest.raises(StorageError, match="bash build.sh"):
        mb.MooncakeBackend(mb.MooncakeConfig(master_server_addr="127.0.0.1:1"))


def test_the_backend_takes_a_mooncake_config_and_nothing_else() -> None:
    """The store's settings come as one MooncakeConfig (or from MOONCAKE_*), not re-declared
    keyword arguments: a dict of them is refused by name before anything connects."""
    with pytest.raises(TypeError, match="MooncakeConfig"):
        MooncakeBackend({"master_server_addr": "127.0.0.1:1"})  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        MooncakeBackend(master_server_addr="127.0.0.1:1")  # type: ignore[call-arg]


def test_transfer_moves_host_blocks_through_mooncake(store: LocalMooncake) -> None:
    """StorageTransfer over Mooncake: staging registered with the store, whole blocks move."""
    import ctypes

    from fastdeploy_kvcache.config import CacheConfig
    from fastdeploy_kvcache.storage import KeyNamespace
    from fastdeploy_kvcache.storage.transfer import HostTierLayout, StorageTransfer
    from fastdeploy_kvcache.worker.cache_controller import CacheController

    cfg = CacheConfig(block_size=16, num_layers=4, num_kv_heads=2, head_dim=32, dtype="bfloat16", num_host_blocks=8)
    ctl = CacheController(cfg, backend="cpu", threaded=False)
    ctl.initialize_host_cache()
    layout = HostTierLayout.from_controller(ctl)

    def block(b: int) -> bytes:
        return b"".join(ctypes.string_at(p + b * bb, bb) for p, bb in zip(layout.ptrs, layout.block_bytes))

    rng = np.random.default_rng(3)
    for p, bb in zip(layout.ptrs, layout.block_bytes):
        ctypes.memmove(p, rng.integers(0, 256, bb * 8, dtype=np.uint8).tobytes(), bb * 8)
    backend = MooncakeBackend(MooncakeConfig(master_server_addr=store.master.addr,
                                             master_metrics_addr=store.master.metrics_addr, local_hostname="127.0.0.1",
                                             global_segment_size=0, local_buffer_size=16 * MiB))
    transfer = StorageTransfer(layout, backend, staging_blocks=2)
    try:
        assert backend.wait_ready(15)
        keys = KeyNamespace("m", "fp", "bfloat16", 16, layout.describe()).keys([1, 2, 3])
        assert transfer.put_blocks(keys, [0, 1, 2]) == [0, 0, 0]
        assert backend.batch_exists(keys) == 3
        assert transfer.get_blocks(keys, [5, 6, 7]) == [layout.object_bytes] * 3
        assert [block(b) for b in (5, 6, 7)] == [block(b) for b in (0, 1, 2)]
        missing = KeyNamespace("m", "fp", "bfloat16", 16, layout.describe()).key(99)
        before = block(4)
        assert transfer.get_blocks([keys[0], missing], [3, 4]) == [layout.object_bytes, Status.MISSING]
        assert block(4) == before and block(3) == block(0)
    finally:
        transfer.close()
        backend.close()
        ctl.close()


def test_local_launcher_cli_serves_and_stops_cleanly(tmp_path: Path) -> None:
    """docs/storage.md's one-machine command: prints the env, serves, stops on SIGTERM."""
    import signal

    proc = subprocess.Popen([sys.executable, "-m", "fastdeploy_kvcache.storage.mooncake_local", "--segment", "32MB",
                             "--log-dir", str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        env = {}
        for _ in range(6):
            line = proc.stdout.readline().strip()
            name, value = line.removeprefix("export ").split("=", 1)
            env[name] = value
        arena = HostArena(2, 64 << 10)
        backend = MooncakeBackend(MooncakeConfig(master_server_addr=env["MOONCAKE_MASTER_SERVER_ADDR"],
                                                 master_metrics_addr=env["MOONCAKE_MASTER_METRICS_ADDR"],
                                                 local_hostname=env["MOONCAKE_LOCAL_HOSTNAME"],
                                                 global_segment_size=env["MOONCAKE_GLOBAL_SEGMENT_SIZE"],
                                                 local_buffer_size=16 * MiB))
        backend.register_buffer(arena.ptr, arena.nbytes)
        assert backend.wait_ready(15)
        arena.fill(0, seed=1)
        assert backend.batch_put_from([key(0)], [arena.slot_ptr(0)], [arena.slot_bytes]) == [0]
        assert backend.batch_get_into([key(0)], [arena.slot_ptr(1)], [arena.slot_bytes]) == [arena.slot_bytes]
        backend.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(8) == 0  # a master ignoring SIGTERM would cost 10 s before SIGKILL
    flag = f"--rpc_port={env['MOONCAKE_MASTER_SERVER_ADDR'].rsplit(':', 1)[1]}".encode()
    leftover = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
            status = (cmdline.parent / "stat").read_text().split()[2]
        except OSError:
            continue
        if flag in args and status != "Z":  # a zombie is already dead
            leftover.append(cmdline.parent.name)
    assert leftover == [], f"mooncake_master still running: {leftover}"


def test_transfer_retires_staging_while_a_timed_out_call_runs(store: LocalMooncake) -> None:
    """A get that outlives its time limit keeps writing its staging buffer: the transfer must
    not reuse that buffer (it would mix two batches), so it takes a fresh one."""
    import ctypes

    from fastdeploy_kvcache.config import CacheConfig
    from fastdeploy_kvcache.storage import KeyNamespace
    from fastdeploy_kvcache.storage.transfer import StorageTransfer
    from fastdeploy_kvcache.worker.cache_controller import CacheController

    cfg = CacheConfig(block_size=16, num_layers=2, num_kv_heads=2, head_dim=32, dtype="bfloat16", num_host_blocks=8)
    ctl = CacheController(cfg, backend="cpu", threaded=False)
    ctl.initialize_host_cache()
    config = MooncakeConfig(master_server_addr=store.master.addr, master_metrics_addr=store.master.metrics_addr,
                            local_hostname="127.0.0.1", global_segment_size=0, local_buffer_size=16 * MiB)
    backend = MooncakeBackend(config, call_timeout_s=0.5, failure_threshold=10)
    transfer = StorageTransfer.from_controller(ctl, backend, staging_blocks=2)
    layout = transfer.layout

    def block(b: int) -> bytes:
        return b"".join(ctypes.string_at(p + b * bb, bb) for p, bb in zip(layout.ptrs, layout.block_bytes))

    rng = np.random.default_rng(5)
    for p, bb in zip(layout.ptrs, layout.block_bytes):
        ctypes.memmove(p, rng.integers(0, 256, bb * 8, dtype=np.uint8).tobytes(), bb * 8)
    try:
        assert backend.wait_ready(15)
        keys = KeyNamespace("m", "fp", "bfloat16", 16, layout.describe()).keys([7, 8])
        assert transfer.put_blocks(keys, [0, 1]) == [0, 0]
        old_ptr = transfer._get.staging.ptr
        store.master.pause()
        try:
            with pytest.raises(StorageError) as info:
                transfer.get_blocks(keys, [4, 5])
            assert info.value.kind == "timeout"
            assert {k: v for k, v in transfer.stats().items() if k.startswith("retired")} == {
                "retired_staging_buffers": 1, "retired_staging_buffers_live": 1}
            assert transfer._get.staging.ptr != old_ptr
        finally:
            store.master.resume()
        info.value.pending.result(timeout=30)  # type: ignore[attr-defined]
        deadline = time.monotonic() + 5  # done-callbacks run just after result() wakes us
        while transfer.stats()["retired_staging_buffers_live"] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert transfer.stats()["retired_staging_buffers_live"] == 0  # freed once the late call ended
        assert backend.wait_ready(15)
        assert transfer.get_blocks(keys, [4, 5]) == [layout.object_bytes] * 2
        assert block(4) == block(0) and block(5) == block(1)
    finally:
        transfer.close()
        backend.close()
        ctl.close()


def test_a_restarted_master_bumps_the_generation_even_without_a_failed_call(
        store: LocalMooncake, marena: HostArena) -> None:
    """No data call runs while the master restarts: its request counters starting over tell."""
    backend = backend_for(store.master, marena, restart_check_s=0.2)
    assert backend.wait_ready(15)
    assert backend.batch_exists([key(0)]) == 0  # some requests on the master's counters
    deadline = time.monotonic() + 15
    while backend._master_requests is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend._master_requests, "the master's /metrics were never read"
    before = backend.health().generation
    time.sleep(1.0)
    assert backend.health().generation == before, "nothing was lost: the generation must not move"
    store.master.stop()
    store.master.start()
    deadline = time.monotonic() + 30
    while backend.health().generation == before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert backend.health().generation > before, backend.health()
    assert backend.stats()["generation"] == backend.health().generation
    backend.close()
