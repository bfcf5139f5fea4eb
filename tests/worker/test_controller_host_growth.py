"""A host cache pinned in the background: blocks land in ascending order, block by block
addressing never changes, data in landed blocks survives the pinning of later ones, and
freeing the cache mid-growth stops the pinning."""

from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from fastdeploy_kvcache.worker.cache_controller import CacheController
from worker_helpers import small_config


def _host_block(ctrl: CacheController, name: str, block: int) -> np.ndarray:
    nbytes = ctrl.config.bytes_per_layer_block
    addr = ctrl.get_host_cache_kvs_map()[name] + block * nbytes
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))


def test_blocks_land_in_order_and_keep_their_data() -> None:
    # 3 heads x 4 tokens x 5 dims x fp32 = 240-byte layer blocks: block ranges do not fall on
    # page boundaries, so a piece pinned later shares its first page with landed blocks.
    cfg = small_config(num_kv_heads=3, head_dim=5, num_host_blocks=60)
    ctrl = CacheController(cfg, backend="cpu", threaded=False)
    try:
        ctrl.initialize_kv_cache()
        ctrl.initialize_host_cache(grow_chunk_bytes=7 * cfg.bytes_per_block, grow_pace_s=0.02)
        names = list(ctrl.get_host_cache_kvs_map())
        written = 0
        seen: list[int] = []
        deadline = time.monotonic() + 60
        while written < 60:
            assert time.monotonic() < deadline, f"growth stalled at {ctrl.host_blocks_ready}"
            ready = ctrl.host_blocks_ready
            seen.append(ready)
            for b in range(written, ready):  # fill each block as soon as it landed
                for i, name in enumerate(names):
                    _host_block(ctrl, name, b)[:] = (b * 7 + i) % 251
            written = ready
            time.sleep(0.005)
        assert seen == sorted(seen) and all(r % 7 == 0 or r == 60 for r in seen)
        assert len(set(seen)) > 3, "the cache grew in pieces, not at once"
        for b in range(60):
            for i, name in enumerate(names):
                assert (_host_block(ctrl, name, b) == (b * 7 + i) % 251).all(), (b, name)
        assert ctrl.host_pin_seconds is not None and ctrl.get_stats()["host_blocks_ready"] == 60
        # reset_cache zeroes the landed blocks; the cache stays complete
        ctrl.reset_cache()
        assert not _host_block(ctrl, names[-1], 59).any()
    finally:
        ctrl.close()


def test_close_during_growth_stops_the_pinning() -> None:
    cfg = small_config(num_host_blocks=50)
    ctrl = CacheController(cfg, backend="cpu", threaded=False)
    ctrl.initialize_kv_cache()
    ctrl.initialize_host_cache(grow_chunk_bytes=cfg.bytes_per_block, grow_pace_s=30.0)
    deadline = time.monotonic() + 30
    while ctrl.host_blocks_ready == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    started = time.monotonic()
    ctrl.close()
    assert time.monotonic() - started < 5, "close waited for the pinning to finish"
    assert ctrl.host_blocks_ready == 0 and ctrl.get_stats()["num_host_blocks"] == 0


def test_one_piece_growth_lands_whole_and_keeps_addresses() -> None:
    """In one piece (what CUDA copies need: one registration), the cache lands all at once in
    the background: no partial count is ever published, and the data written after it
    landed is read back at the same addresses."""
    cfg = small_config(num_kv_heads=3, head_dim=5, num_host_blocks=60)
    ctrl = CacheController(cfg, backend="cpu", threaded=False)
    try:
        ctrl.initialize_kv_cache()
        ctrl.initialize_host_cache(grow_chunk_bytes=cfg.bytes_per_block, grow_pace_s=30.0, grow_in_pieces=False)
        addresses = dict(ctrl.get_host_cache_kvs_map())
        seen = set()
        deadline = time.monotonic() + 30
        while ctrl.host_blocks_ready < 60:
            assert time.monotonic() < deadline, "the one piece never landed (a 30 s pace between pieces would show)"
            seen.add(ctrl.host_blocks_ready)
            time.sleep(0.001)
        assert seen <= {0}, f"partial counts published: {sorted(seen)}"
        assert ctrl.host_pin_seconds is not None and ctrl.get_host_cache_kvs_map() == addresses
        names = list(addresses)
        for b in (0, 31, 59):
            _host_block(ctrl, names[-1], b)[:] = b + 1
        assert all((_host_block(ctrl, names[-1], b) == b + 1).all() for b in (0, 31, 59))
    finally:
        ctrl.close()


@pytest.mark.parametrize("grow", [0, None], ids=["zero", "default"])
def test_synchronous_pinning_is_complete_at_once(grow) -> None:
    """0, and the default with CPU copies (None), pin before returning."""
    ctrl = CacheController(small_config(), backend="cpu", threaded=False)
    try:
        ctrl.initialize_kv_cache()
        ctrl.initialize_host_cache(grow_chunk_bytes=grow)
        assert ctrl.host_blocks_ready == 8 and ctrl.host_pin_seconds is not None
    finally:
        ctrl.close()


@pytest.mark.parametrize("kw", [dict(grow_chunk_bytes=-1), dict(grow_chunk_bytes=1.5), dict(grow_pace_s=-1.0),
                                dict(grow_pace_s=float("nan"))])
def test_bad_growth_arguments_raise_before_allocating(kw) -> None:
    ctrl = CacheController(small_config(), backend="cpu", threaded=False)
    try:
        ctrl.initialize_kv_cache()
        with pytest.raises(ValueError, match="grow_"):
            ctrl.initialize_host_cache(**kw)
        assert ctrl.get_host_cache_kvs_map() == {}
    finally:
        ctrl.close()
