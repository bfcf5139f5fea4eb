"""What a tensor-parallel rank holds, its storage namespace, and which ranks write storage."""

from __future__ import annotations

import pytest

from fastdeploy_kvcache.config import GiB, CacheConfig
from fastdeploy_kvcache.storage.keys import KeyNamespace
from fastdeploy_kvcache.worker.tp import (
    TPCoordinator,
    head_range,
    scheduler_config,
    shard_config,
    storage_namespace,
    writes_storage,
)


def _cfg(**kw: object) -> CacheConfig:
    base: dict = dict(num_layers=2, num_kv_heads=8, head_dim=16, block_size=4, dtype="float16",
                      num_gpu_blocks=8, num_host_blocks=8, tensor_parallel_size=2)
    base.update(kw)
    return CacheConfig(**base)


def test_each_rank_holds_its_contiguous_head_shard() -> None:
    assert [list(head_range(8, r, 4)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert list(head_range(8, 1, 2, mla=True)) == list(range(8))
    cfg = _cfg()
    shard = shard_config(cfg, 1)
    assert shard.num_kv_heads == 4 and shard.tensor_parallel_size == 2
    assert shard.bytes_per_block * 2 == cfg.bytes_per_block
    assert (shard.num_gpu_blocks, shard.num_host_blocks) == (cfg.num_gpu_blocks, cfg.num_host_blocks)
    assert shard_config(cfg, 1, mla=True).num_kv_heads == 8
    assert cfg.num_kv_heads == 8  # the caller's config is not touched


def test_indivisible_heads_are_refused_with_a_clear_error() -> None:
    cfg = _cfg(num_kv_heads=6, tensor_parallel_size=4)
    with pytest.raises(ValueError, match=r"num_kv_heads=6 is not divisible by tensor_parallel_size=4"):
        shard_config(cfg, 0)
    with pytest.raises(ValueError, match="not divisible"):
        TPCoordinator(cfg, backend="cpu")  # before any process starts
    assert shard_config(cfg, 3, mla=True).num_kv_heads == 6  # MLA: nothing is split
    with pytest.raises(ValueError, match=r"rank must be in \[0, 4\)"):
        shard_config(cfg, 4)
    with pytest.raises(ValueError, match="devices names 1 devices"):
        TPCoordinator(_cfg(), devices=[0], backend="cpu")
    with pytest.raises(ValueError, match="distinct"):
        TPCoordinator(_cfg(), devices=[1, 1], backend="cpu")


def test_swap_space_buys_every_rank_and_the_scheduler_the_same_host_blocks() -> None:
    cfg = _cfg(num_host_blocks=None, swap_space=1.0, tensor_parallel_size=4)
    sched = scheduler_config(cfg)
    per_rank = [shard_config(cfg, r) for r in range(4)]
    # GiB per worker: a quarter-size block, four times the blocks of the unsharded cache.
    assert sched.num_host_blocks == GiB // (cfg.bytes_per_block // 4)
    assert {c.host_block_count for c in per_rank} == {sched.host_block_count}
    assert scheduler_config(cfg, mla=True).num_host_blocks == GiB // cfg.bytes_per_block


def test_only_rank_zero_writes_an_mla_cache_every_rank_writes_its_shard() -> None:
    assert [writes_storage(r, 4, mla=False) for r in range(4)] == [True] * 4
    assert [writes_storage(r, 4, mla=True) for r in range(4)] == [True, False, False, False]
    assert writes_storage(0, 1, mla=True)
    with pytest.raises(ValueError, match="rank"):
        writes_storage(2, 2, mla=False)
    with pytest.raises(TypeError):
        writes_storage(True, 2, mla=False)


def test_storage_keys_carry_rank_and_tp_size() -> None:
    base = KeyNamespace(model="m", weights_fingerprint="f" * 32, dtype="bfloat16", block_size=64,
                        layout="block-major/L2/kv/h4/d16")
    h = 0x1234_5678_9ABC_DEF0_1234_5678_9ABC_DEF0
    sharded = [storage_namespace(base, r, 2, mla=False).key(h) for r in range(2)]
    assert sharded[0] != sharded[1]
    assert "-tp0of2:" in sharded[0] and "-tp1of2:" in sharded[1]
    # Another TP degree never reads a shard of this one (different bytes).
    assert storage_namespace(base, 0, 4, mla=False).key(h) not in sharded
    assert base.key(h) not in sharded
    # MLA: one object whatever the rank or TP degree; only rank 0 writes it.
    mla = {storage_namespace(base, r, n, mla=True).key(h) for n in (1, 2, 4) for r in range(n)}
    assert len(mla) == 1 and "-tp0of1:" in mla.pop()
    with pytest.raises(ValueError, match="rank"):
        storage_namespace(base, 2, 2, mla=False)
