"""Storage flags and the key namespace."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fastdeploy_kvcache.core.hashing import BlockHasher, compute_block_hashes
from fastdeploy_kvcache.storage import KeyNamespace, block_key, weights_fingerprint
from fastdeploy_kvcache.storage.breaker import CircuitBreaker
from fastdeploy_kvcache.storage.config import StorageConfig, add_storage_cli_args
from fastdeploy_kvcache.storage.file_backend import FileBackend
from fastdeploy_kvcache.storage.keys import KEY_RE


def ns(**kw) -> KeyNamespace:
    base = dict(model="org/Model-7B", weights_fingerprint="abc", dtype="bfloat16", block_size=64,
                layout="blockmajor-L32-t2-131072-131072", tp_rank=0, tp_size=2)
    base.update(kw)
    return KeyNamespace(**base)


def test_every_namespace_field_changes_the_key() -> None:
    h = compute_block_hashes(list(range(128)), 64)[-1]
    base = ns().key(h)
    assert KEY_RE.match(base) and base.startswith("fdkv1-Model-7B-") and "-tp0of2:" in base
    for change in [dict(model="org/Model-8B"), dict(weights_fingerprint="abd"), dict(dtype="float16"),
                   dict(block_size=32), dict(layout="blockmajor-L32-t4-1-1"), dict(tp_rank=1),
                   dict(tp_size=4), dict(kv_cache_quant="int8")]:
        assert ns(**change).key(h) != base, change
    assert ns().key(h) == base  # deterministic (no per-process seed)
    assert ns().keys([h]) == [base]


def test_partial_block_key_matches_the_hasher() -> None:
    tokens = list(range(70))
    hasher = BlockHasher(64)
    partial = hasher.partial_key(tokens)  # "<hash>:partial:6"
    n = ns()
    key = block_key(n, int(partial.split(":")[0], 16), 6)
    assert key == f"{n.prefix}:{partial}" and KEY_RE.match(key)
    with pytest.raises(ValueError, match="num_tokens"):
        block_key(n, 1, 65)
    assert block_key(n, 1, 64) == n.key(1)  # a full block is never "partial"


def test_bad_namespace_is_refused() -> None:
    with pytest.raises(ValueError, match="tp_rank"):
        ns(tp_rank=2)
    with pytest.raises(ValueError, match="weights_fingerprint"):
        ns(weights_fingerprint="")


def test_weights_fingerprint_sees_content_and_names(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"layers": 2}')
    big = tmp_path / "model.safetensors"
    big.write_bytes(bytes(range(256)) * (5 << 12))  # 5 MiB: sampled head and tail
    fp = weights_fingerprint(tmp_path)
    assert fp == weights_fingerprint(tmp_path) and len(fp) == 32
    data = bytearray(big.read_bytes())
    data[-1] ^= 1
    big.write_bytes(bytes(data))
    assert weights_fingerprint(tmp_path) != fp
    fp2 = weights_fingerprint(tmp_path)
    (tmp_path / "config.json").write_text('{"layers": 3}')  # small files are hashed whole
    assert weights_fingerprint(tmp_path) != fp2
    with pytest.raises(FileNotFoundError):
        weights_fingerprint(tmp_path / "nope")


def test_storage_flags(tmp_path: Path) -> None:
    parser = add_storage_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(["--kvcache-storage-backend", "file", "--kvcache-storage-path", str(tmp_path),
                              "--kvcache-storage-size", "2GB", "--kvcache-storage-prefetch-policy", "best_effort"])
    cfg = StorageConfig.from_cli_args(args)
    assert cfg.enabled and cfg.size == 2 << 30 and cfg.prefetch_policy == "best_effort"
    assert cfg.put_policy == "write_through"
    backend = cfg.make_backend(min_free_bytes=0)
    assert isinstance(backend, FileBackend) and backend.capacity_bytes == 2 << 30
    backend.close()
    assert not StorageConfig.from_cli_args(parser.parse_args([])).enabled
    assert StorageConfig().prefetch_timeout_s(8000) > StorageConfig().prefetch_timeout_s(1000)
    with pytest.raises(ValueError, match="--kvcache-storage-path"):
        StorageConfig(backend="file")
    with pytest.raises(ValueError, match="prefetch-policy"):
        StorageConfig(prefetch_policy="sometimes")


def test_read_threads_flag_default_and_bad_values(tmp_path: Path) -> None:
    """--kvcache-storage-read-threads reaches the file backend (and the native read's thread
    option where it is built); unset, the machine's default; bad values are refused by name."""
    import os

    from fastdeploy_kvcache.storage import file_backend

    parser = add_storage_cli_args(argparse.ArgumentParser())
    base = ["--kvcache-storage-backend", "file", "--kvcache-storage-path", str(tmp_path)]
    cpus = len(os.sched_getaffinity(0))
    assert file_backend.default_read_threads() == max(1, min(16, cpus // 2))
    default = StorageConfig.from_cli_args(parser.parse_args(base))
    assert default.read_threads == 0
    backend = default.make_backend(min_free_bytes=0)
    assert backend.read_threads == file_backend.default_read_threads()
    backend.close()
    cfg = StorageConfig.from_cli_args(parser.parse_args(base + ["--kvcache-storage-read-threads", "3"]))
    native = file_backend._native_reader()
    native = native if native is not None and native.has_read_objects else None
    before = native.get_option("read_threads") if native is not None else None
    backend = cfg.make_backend(min_free_bytes=0)
    try:
        assert backend.read_threads == 3
        if native is not None:  # the native read threads itself: the process-wide option
            assert native.get_option("read_threads") == 3
    finally:
        backend.close()
        if native is not None:
            native.set_option("read_threads", before)
    for bad in (-1, 257, 2.0, True, "4"):
        with pytest.raises(ValueError, match="--kvcache-storage-read-threads must be an int from 0"):
            StorageConfig(backend="file", path=str(tmp_path), read_threads=bad)
    for bad in (0, 257, None.__class__):
        with pytest.raises(ValueError, match="read_threads must be an int from 1 to 256"):
            FileBackend(tmp_path, min_free_bytes=0, read_threads=bad)
    with pytest.raises(SystemExit):
        parser.parse_args(base + ["--kvcache-storage-read-threads", "many"])


def test_breaker_opens_probes_and_backs_off() -> None:
    now = [0.0]
    br = CircuitBreaker("t", failure_threshold=2, reset_timeout_s=1.0, max_reset_timeout_s=4.0, clock=lambda: now[0])
    assert br.allow()
    br.record_failure()
    assert br.state == "closed"
    br.record_failure()
    assert br.state == "open" and not br.allow() and br.opens == 1
    now[0] = 1.0
    assert br.state == "half_open" and br.allow() and not br.allow()  # one probe at a time
    br.record_failure()  # probe failed: open again, the wait doubles
    now[0] = 2.5
    assert not br.allow()
    now[0] = 3.0
    assert br.allow()
    br.record_success()
    assert br.state == "closed" and br.consecutive_failures == 0 and br.allow()
