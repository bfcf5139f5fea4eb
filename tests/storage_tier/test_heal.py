"""The stored-set heals: a block the store lost (evicted by the byte cap, deleted by someone
else, corrupt, or gone with a restarted Mooncake master) is written again the next time it is
computed.  Real CacheManager, real StorageTransfer and worker threads, a real directory (and
a real ``mooncake_master`` for the restart)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.storage_tier import PREFETCH_READY
from fastdeploy_kvcache.storage.file_format import HEADER
from skip_helpers import needs_mooncake

from .test_tier import BS, TOKENS, Rig, rigs, store_tokens  # noqa: F401 - rigs is a fixture

OTHER = list(range(900, 900 + 4 * BS + 1))


def object_path(rig: Rig, h: int) -> Path:
    return Path(rig.backend.path) / (rig.tier.ns.key(h).replace(":", "=") + ".kv")


def recompute(rig: Rig, rid: str, tokens: list[int]) -> None:
    """The tree lost the blocks (as after device and host eviction): compute them again, with
    the prefetch round trip a real admission makes, then back them up."""
    rig.manager.reset_cache()
    req = Request(rid, tokens)
    while rig.tier.prefetch_state(req) != PREFETCH_READY:
        rig.submit()
        rig.drain()
    rig.manager.match_prefix(req)
    rig.manager.ensure_resident(req, len(tokens))
    for meta in req.cache_swap_metadata:  # the host hits' loads to the device land
        meta.mark_done(True)
        rig.manager.complete_swap(meta)
    req.cache_swap_metadata.clear()
    rig.tier.admitted(req)
    req.num_computed_tokens = len(tokens)
    rig.manager.request_finish(req)
    rig.run_backups()
    rig.submit()
    rig.drain()


def test_blocks_evicted_by_the_byte_cap_are_stored_again(rigs: Any) -> None:
    rig = rigs(capacity_bytes=0)
    obj = rig.layout.object_bytes + HEADER.size
    rig.backend.capacity_bytes = 5 * obj  # room for 5 of the 8 blocks below
    hashes = store_tokens(rig, TOKENS)
    other = Request("o", OTHER).block_hashes(BS)[:4]
    rig.manager.reset_cache()
    rig.serve("other", OTHER)
    rig.run_backups()
    rig.submit()
    rig.drain()
    gone = [h for h in hashes if not object_path(rig, h).exists()]
    assert len(gone) == 3 and rig.backend.stats()["evicted"] == 3
    assert [h for h in hashes if not rig.tier.is_stored(h)] == gone, "the tier must forget evicted blocks"
    assert all(rig.tier.is_stored(h) for h in other)
    rig.backend.capacity_bytes = 8 * obj  # room again: nothing else is evicted now
    recompute(rig, "again", TOKENS)
    assert all(object_path(rig, h).exists() for h in hashes), "evicted blocks were not stored again"
    assert all(rig.tier.is_stored(h) for h in hashes)
    rig.tier.check_invariants()


def test_a_block_deleted_behind_our_back_is_stored_again_after_the_miss(rigs: Any) -> None:
    rig = rigs()
    hashes = store_tokens(rig, TOKENS)
    object_path(rig, hashes[2]).unlink()  # another process's eviction: we are not told
    assert rig.tier.is_stored(hashes[2])
    recompute(rig, "again", TOKENS)  # exists stops at block 2: a miss, forgotten, recomputed
    assert rig.tier.stats["stored_forgotten"] >= 1
    assert object_path(rig, hashes[2]).exists(), "the block storage lacked was not stored again"
    assert rig.tier.stats["prefetch_blocks_inserted"] == 2


def test_a_run_deleted_behind_our_back_is_stored_again_whole_in_one_recompute(rigs: Any) -> None:
    """The lookup probes a run's first and last block: a miss there must forget the whole
    run, not the probed block alone, or each recompute heals one block."""
    rig = rigs()
    hashes = store_tokens(rig, TOKENS)
    for h in hashes:
        object_path(rig, h).unlink()
    recompute(rig, "again", TOKENS)
    assert [h for h in hashes if not object_path(rig, h).exists()] == [], "one recompute must store the run again"
    assert rig.tier.stats["stored_forgotten"] == len(hashes)
    recompute(rig, "third", TOKENS)
    assert rig.tier.stats["prefetch_blocks_inserted"] == len(hashes)


def test_the_tail_of_a_run_deleted_behind_our_back_is_stored_again(rigs: Any) -> None:
    rig = rigs()
    hashes = store_tokens(rig, TOKENS)
    for h in hashes[1:]:
        object_path(rig, h).unlink()
    recompute(rig, "again", TOKENS)  # the probe finds the first and not the last: a full check
    assert all(object_path(rig, h).exists() for h in hashes)
    assert rig.tier.stats["prefetch_blocks_inserted"] == 1


def test_a_hole_inside_a_run_is_stored_again_and_the_blocks_after_it_stay_known(rigs: Any) -> None:
    """First and last there: the fetch finds the hole; it forgets the blocks it could not read
    and keeps the ones it read (they are on storage)."""
    rig = rigs()
    hashes = store_tokens(rig, TOKENS)
    for h in hashes[1:3]:
        object_path(rig, h).unlink()
    recompute(rig, "again", TOKENS)
    assert all(object_path(rig, h).exists() for h in hashes)
    assert all(rig.tier.is_stored(h) for h in hashes)
    recompute(rig, "third", TOKENS)
    assert rig.tier.stats["prefetch_blocks_inserted"] == 1 + 4


def test_the_stop_flush_checks_the_blocks_it_counts_as_stored(rigs: Any) -> None:
    """Objects deleted behind our back while their blocks are still cached: the flush asks
    the store and writes them, where it used to trust the stored-set and write nothing."""
    rig = rigs()
    hashes = store_tokens(rig, TOKENS)
    for h in hashes[::2]:
        object_path(rig, h).unlink()
    assert rig.tier.flush_candidates() == ([], [])
    rig.tier.begin_flush()
    host, device = rig.tier.flush_candidates()
    assert sorted(n.hash_value for n in host + device) == sorted(hashes[::2])
    assert rig.tier.queue_flush_puts(host) == len(host)
    rig.submit()
    rig.drain()
    assert all(object_path(rig, h).exists() for h in hashes)
    assert rig.tier.flush_candidates() == ([], [])


def test_a_corrupt_object_is_deleted_and_stored_again(rigs: Any) -> None:
    rig = rigs()
    hashes = store_tokens(rig, TOKENS)
    path = object_path(rig, hashes[1])
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0xFF
    path.write_bytes(bytes(raw))
    recompute(rig, "again", TOKENS)  # the prefetch reads it: corrupt, deleted, forgotten
    assert rig.tier.errors["corrupt"] == 1
    assert path.exists() and path.read_bytes() != bytes(raw), "the corrupt block was not rewritten"
    out = rig.backend.stats()
    assert out["corrupt_objects"] == 1
    assert all(rig.tier.is_stored(h) for h in hashes)


def test_an_oversized_object_is_deleted_and_stored_again(rigs: Any) -> None:
    """A header that claims more payload than the buffer holds: read once, deleted, rewritten."""
    import struct

    rig = rigs()
    hashes = store_tokens(rig, TOKENS)
    path = object_path(rig, hashes[0])
    raw = bytearray(path.read_bytes())
    raw[8:16] = struct.pack("<Q", 1 << 20)
    path.write_bytes(bytes(raw))
    recompute(rig, "again", TOKENS)
    assert path.exists() and path.read_bytes()[8:16] != raw[8:16]
    recompute(rig, "third", TOKENS)  # now all four come from storage
    assert rig.tier.stats["prefetch_blocks_inserted"] == 4


@needs_mooncake()
def test_a_restarted_mooncake_master_makes_the_tier_store_again(tmp_path: Path, rigs: Any) -> None:
    from fastdeploy_kvcache.storage.mooncake_backend import MooncakeBackend, MooncakeConfig
    from fastdeploy_kvcache.storage.mooncake_local import LocalMooncake

    local = LocalMooncake(segment="64MB", log_dir=tmp_path / "logs").start()
    try:
        backend = MooncakeBackend(
            MooncakeConfig(master_server_addr=local.master.addr, master_metrics_addr=local.master.metrics_addr,
                           local_hostname="127.0.0.1", metadata_server="P2PHANDSHAKE", protocol="tcp",
                           global_segment_size=0),
            restart_check_s=0.2)
        rig = rigs(backend=backend)
        assert backend.wait_ready(30)
        hashes = store_tokens(rig, TOKENS)
        deadline = time.monotonic() + 15
        while not backend._master_requests and time.monotonic() < deadline:  # read once
            time.sleep(0.1)
        local.master.stop()
        local.master.start()
        deadline = time.monotonic() + 30
        while backend.generation == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert backend.generation > 0
        assert not any(rig.tier.is_stored(h) for h in hashes), "a restarted master holds nothing"
        assert rig.tier.stats["store_generation_changes"] == 1
        assert backend.wait_ready(30)
        deadline = time.monotonic() + 30  # the holder re-mounts its segment; until then puts are FULL
        while not all(rig.tier.is_stored(h) for h in hashes) and time.monotonic() < deadline:
            recompute(rig, f"again-{time.monotonic()}", TOKENS)
            time.sleep(0.3)
        assert all(rig.tier.is_stored(h) for h in hashes)
        assert backend.batch_exists(rig.tier.ns.keys(hashes)) == 4
    finally:
        local.stop()


def test_the_stop_flush_does_not_write_again_what_the_store_lost_after_the_flush_wrote_it(rigs: Any) -> None:
    """A store that evicts on its own (Mooncake's master, another process) may take the flush's
    own puts: writing them again would take the next ones, until the flush's time ran out."""
    rig = rigs()
    rig.backend.delete(rig.tier.ns.keys(store_tokens(rig, TOKENS)))
    rig.tier.begin_flush()
    host, _ = rig.tier.flush_candidates()
    assert host and rig.tier.queue_flush_puts(host) == len(host)
    rig.submit()
    rig.drain()
    hashes = [n.hash_value for n in host]
    rig.backend.delete(rig.tier.ns.keys(hashes))  # reported lost to the tier
    assert not any(rig.tier.is_stored(h) for h in hashes)
    assert rig.tier.flush_candidates() == ([], [])
    assert rig.tier.flush_lost_blocks == len(hashes)
