"""block_wise_fp8 KV through the storage tier: real uvicorn servers (tiny-llama-random on the
CPU), a real directory, a real ``mooncake_master`` and holder.

An fp8 server's objects carry the 8-bit bytes and their scales (the header records the KV
format); a restarted fp8 server reuses them with the greedy text of recomputing with fp8 KV
(the switch on: the cold server; the switch off: ENABLE_V1_KVCACHE_MANAGER=0, no reuse at
all).  A server of another KV dtype never reads them: a miss, with one log line naming both
formats, whatever the backend.
"""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess
from fastdeploy_kvcache.storage.file_format import HEADER, kv_format_code
from server_helpers import BASE_ARGS, mooncake_store_args
from shutdown_helpers import wait_until
from skip_helpers import needs_mooncake, needs_server_modules

from .helpers import (BLOCK_SIZE, assert_no_leak, block_hashes, complete, file_store_args, object_file, prompt_ids,
                      start_server, storage_stats, wait_storage_quiet)

pytestmark = needs_server_modules()

FP8 = ["--quantization", '{"kv_cache_quant_type": "block_wise_fp8"}']
P = prompt_ids(21, 200)  # 12 full blocks
FOREIGN_LINE = "holds this prefix as uint8/block_wise_fp8 KV"


def _log(server: ServerProcess) -> str:
    return Path(server.log_path).read_text(errors="replace")


def test_fp8_objects_reused_from_a_directory_give_the_tokens_of_fp8_recompute(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    # Recompute with fp8 KV and the switch off: the plain allocator, nothing reused.
    off = ServerProcess([*BASE_ARGS, *FP8], env={"ENABLE_V1_KVCACHE_MANAGER": "0"}).start()
    try:
        want, tiers = complete(off, P)
        assert sum(tiers.values()) == 0
    finally:
        off.stop()
    first = start_server(file_store_args(store), extra=FP8)
    try:
        cold, tiers = complete(first, P)
        assert cold == want and tiers["storage"] == 0
        stats = wait_storage_quiet(first)["storage"]
        assert stats["tier"]["put_blocks_ok"] >= 12, stats["tier"]
    finally:
        first.stop()
    # Each object is one block's uint8 K and V of every layer plus their fp32 scales, and says so.
    obj = object_file(store, block_hashes(P)[0]).read_bytes()
    layers, heads, dim = 4, 2, 64  # tiny-llama-random
    per_layer = 2 * heads * BLOCK_SIZE * dim + 2 * heads * BLOCK_SIZE * 4  # K, V bytes; K, V scales
    assert len(obj) == HEADER.size + layers * per_layer, len(obj)
    assert (layers * 2 * heads * BLOCK_SIZE * dim * 4) / (layers * per_layer) == 4 * dim / (dim + 4)  # vs float32
    assert struct.unpack_from("<Q", obj, 24)[0] == kv_format_code("uint8", "block_wise_fp8")
    second = start_server(file_store_args(store), extra=FP8)
    try:
        text, tiers = complete(second, P)
        assert text == want, "fp8 KV from storage must give the greedy output of recomputing with fp8 KV"
        assert tiers["storage"] == 12 * BLOCK_SIZE, tiers
        assert_no_leak(second)
    finally:
        second.stop()
    # A float32 server (the CPU's default KV) over the same directory: a miss, said once.
    other = start_server(file_store_args(store))
    try:
        for _ in range(2):
            _, tiers = complete(other, P)
            assert tiers["storage"] == 0, tiers
        wait_until(lambda: FOREIGN_LINE in _log(other), 10, "the foreign-format line")
        log = _log(other)
        assert log.count(FOREIGN_LINE) == 1, log
        assert "this server's KV is float32" in log
    finally:
        other.stop()


@pytest.mark.parametrize("written,wanted", [("bfloat16", "uint8/block_wise_fp8"),
                                            ("uint8/block_wise_int8", "uint8/block_wise_fp8"),
                                            ("uint8/block_wise_fp8", "uint8/block_wise_int8")])
def test_an_object_of_another_kv_format_under_ones_own_key_is_a_miss(tmp_path: Path, written: str,
                                                                     wanted: str) -> None:
    """The header check behind the namespaces: bytes of the right size under the right key,
    written as another KV format, are deleted and missed, never read.  The two 8-bit
    encodings have the same layout and sizes: only the recorded format tells them apart."""
    import ctypes
    import logging

    from fastdeploy_kvcache.storage import Status
    from fastdeploy_kvcache.storage.file_backend import FileBackend

    fp8, bf16 = kv_format_code(*wanted.split("/")), kv_format_code(*written.split("/"))
    key = "fdkv1-m-0123456789abcdef-tp0of1:" + "ab" * 16
    data = (ctypes.c_char * 4096).from_buffer(bytearray(b"\x11" * 4096))
    out = (ctypes.c_char * 4096).from_buffer(bytearray(4096))
    writer = FileBackend(tmp_path, min_free_bytes=0, kv_format=bf16)
    writer.register_buffer(ctypes.addressof(data), 4096)
    assert writer.batch_put_from([key], [ctypes.addressof(data)], [4096]) == [Status.OK]
    writer.close()
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger("fastdeploy_kvcache.storage.file_backend").addHandler(handler)
    try:
        same = FileBackend(tmp_path, min_free_bytes=0, kv_format=bf16)
        same.register_buffer(ctypes.addressof(out), 4096)
        assert same.batch_get_into([key], [ctypes.addressof(out)], [4096]) == [4096]
        assert bytes(out) == b"\x11" * 4096
        same.close()
        reader = FileBackend(tmp_path, min_free_bytes=0, kv_format=fp8)
        reader.register_buffer(ctypes.addressof(out), 4096)
        assert reader.batch_get_into([key], [ctypes.addressof(out)], [4096]) == [Status.MISSING]
        assert reader.batch_exists([key]) == 0, "the foreign object was not deleted"
        reader.close()
    finally:
        logging.getLogger("fastdeploy_kvcache.storage.file_backend").removeHandler(handler)
    lines = [r.getMessage() for r in records if "KV" in r.getMessage()]
    assert len(lines) == 1 and f"holds {written}" in lines[0] and f"is {wanted}" in lines[0], lines


@needs_mooncake()
def test_mooncake_fp8_store_is_reused_by_fp8_and_missed_by_another_dtype(tmp_path: Path) -> None:
    from fastdeploy_kvcache.storage.mooncake_local import LocalMooncake

    local = LocalMooncake(segment="256MB", log_dir=tmp_path / "logs").start()
    try:
        first = start_server(mooncake_store_args(), env=local.env(), extra=FP8)
        try:
            wait_until(lambda: storage_stats(first)["available"], 30, "mooncake set-up")
            want, tiers = complete(first, P)
            assert tiers["storage"] == 0
            wait_until(lambda: storage_stats(first)["tier"]["put_blocks_ok"] >= 12
                       and storage_stats(first)["pending_work"] == 0, 60, "12 blocks stored")
        finally:
            first.stop()
        second = start_server(mooncake_store_args(), env=local.env(), extra=FP8)
        try:
            wait_until(lambda: storage_stats(second)["available"], 30, "mooncake set-up")
            text, tiers = complete(second, P)
            assert text == want and tiers["storage"] == 12 * BLOCK_SIZE, tiers
            assert_no_leak(second)
        finally:
            second.stop()
        other = start_server(mooncake_store_args(), env=local.env())
        try:
            wait_until(lambda: storage_stats(other)["available"], 30, "mooncake set-up")
            _, tiers = complete(other, P)
            assert tiers["storage"] == 0, tiers
            wait_until(lambda: FOREIGN_LINE in _log(other), 10, "the foreign-format line")
            assert "(mooncake)" in _log(other)
        finally:
            other.stop()
    finally:
        local.stop()
