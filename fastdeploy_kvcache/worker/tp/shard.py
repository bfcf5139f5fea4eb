"""What each tensor-parallel rank holds: its KV-head shard, its storage namespace, who writes.

Under tensor parallelism each rank computes attention for ``num_kv_heads / tp_size`` of the
KV heads, so its cache holds only those heads: the same block ids as every other rank (one
scheduler drives them all), a smaller block.  MLA-style caches (one latent vector per token,
no head axis to split) are the exception: every rank holds the whole cache, byte for byte
the same.

Storage follows from that:

* sharded caches: each rank stores and loads its own shard under its own namespace
  (``...-tp<rank>of<size>``), so every rank writes;
* MLA caches: the bytes do not depend on the rank, so one namespace serves every rank and
  every TP degree (``tp0of1``), and only rank 0 writes (:func:`writes_storage`); the others
  read what it stored.  Writing from every rank would put the same object ``tp_size`` times
  and race on it for nothing.

Pure Python: nothing here imports a framework.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import TYPE_CHECKING, Any

from fastdeploy_kvcache.config import CacheConfig

if TYPE_CHECKING:
    from fastdeploy_kvcache.storage.keys import KeyNamespace


def _check_rank(rank: Any, tp_size: Any) -> None:
    for name, value in (("rank", rank), ("tp_size", tp_size)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in [0, {tp_size}), got {rank}")


def check_divisible(num_kv_heads: int, tp_size: int) -> None:
    """ValueError unless ``tp_size`` ranks can split ``num_kv_heads`` heads evenly."""
    if num_kv_heads % tp_size != 0:
        raise ValueError(
            f"num_kv_heads={num_kv_heads} is not divisible by tensor_parallel_size={tp_size}: each rank "
            f"must hold the same number of KV heads (use a tp size that divides {num_kv_heads}, or "
            f"mla=True for a cache every rank holds whole)"
        )


def head_range(num_kv_heads: int, rank: int, tp_size: int, mla: bool = False) -> range:
    """The KV heads rank ``rank`` holds: a contiguous slice, or all of them with MLA."""
    _check_rank(rank, tp_size)
    if mla:
        return range(num_kv_heads)
    check_divisible(num_kv_heads, tp_size)
    per_rank = num_kv_heads // tp_size
    return range(rank * per_rank, (rank + 1) * per_rank)


def shard_config(config: CacheConfig, rank: int, mla: bool = False) -> CacheConfig:
    """Rank ``rank``'s CacheConfig: its head shard (``tp_size`` is the config's).

    Block counts stay as given: every rank indexes the same block ids.  A host tier sized by
    ``swap_space`` is pinned to an explicit block count first (see
    :func:`host_blocks_per_rank`), so that a rank's smaller blocks do not buy it more host
    blocks than the scheduler knows of.
    """
    tp_size = config.tensor_parallel_size
    _check_rank(rank, tp_size)
    heads = len(head_range(config.num_kv_heads, rank, tp_size, mla))
    return dataclasses.replace(
        config, num_kv_heads=heads, num_host_blocks=host_blocks_per_rank(config, mla), extra=dict(config.extra)
    )


def host_blocks_per_rank(config: CacheConfig, mla: bool = False) -> int:
    """Host blocks every rank (and the scheduler) uses.

    ``--swap-space`` is GiB per worker: a rank's block is ``1/tp_size`` of the full block
    (or all of it with MLA), so the same GiB holds ``tp_size`` times more blocks.  An
    explicit ``num_host_blocks`` is taken as is.
    """
    if config.num_host_blocks is not None:
        return config.num_host_blocks
    tp_size = config.tensor_parallel_size
    heads = len(head_range(config.num_kv_heads, 0, tp_size, mla))
    rank_cfg = dataclasses.replace(config, num_kv_heads=heads, extra=dict(config.extra))
    return rank_cfg.host_block_count


def scheduler_config(config: CacheConfig, mla: bool = False) -> CacheConfig:
    """The CacheConfig the one ``CacheManager`` of a TP group is built with.

    The same shape as ``config``, with the host block count every rank uses spelled out.
    """
    if not mla:
        check_divisible(config.num_kv_heads, config.tensor_parallel_size)
    return dataclasses.replace(config, num_host_blocks=host_blocks_per_rank(config, mla), extra=dict(config.extra))


def writes_storage(rank: int, tp_size: int, mla: bool) -> bool:
    """Does rank ``rank`` write KV to the storage tier?

    Every rank writes its own shard of a sharded cache; only rank 0 writes an MLA cache,
    whose bytes are the same on every rank.  Every rank reads in both cases.
    """
    _check_rank(rank, tp_size)
    return rank == 0 if mla else True


def storage_namespace(ns: "KeyNamespace", rank: int, tp_size: int, mla: bool) -> "KeyNamespace":
    """The key namespace rank ``rank`` stores and loads under.

    Sharded caches: ``ns`` with this rank and ``tp_size`` (keys ``...-tp<rank>of<size>``), so
    another rank or another TP degree never reads bytes of a different shard.  MLA caches:
    ``tp0of1`` on every rank, since the object is the same whatever the rank.
    """
    _check_rank(rank, tp_size)
    if mla:
        return dataclasses.replace(ns, tp_rank=0, tp_size=1)
    return dataclasses.replace(ns, tp_rank=rank, tp_size=tp_size)
