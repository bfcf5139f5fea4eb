"""KV cache events: the wire schema, and the block hashes a consumer computes from tokens.

The schema is vLLM's KV event schema (``KVEventBatch`` of ``BlockStored`` /
``BlockRemoved`` / ``AllBlocksCleared``, msgspec msgpack, array-like and tagged), so
consumers written for vLLM (its ``kv_events_subscriber`` example, Dynamo's relay) decode
ours.  Each struct encodes as a msgpack array of its fields in declaration order; an
event's first element is its tag, the class name::

    KVEventBatch  = [ts: float, events: [event, ...], data_parallel_rank: int]
    BlockStored   = ["BlockStored", block_hashes: [uint64], parent_block_hash: uint64 | nil,
                     token_ids: [int], block_size: int, lora_id: int | nil, medium: str]
    BlockRemoved  = ["BlockRemoved", block_hashes: [uint64], medium: str]
    AllBlocksCleared = ["AllBlocksCleared"]

``data_parallel_rank`` is always sent (0: one engine per server), as vLLM's publisher
does; decoders that declare only ``ts`` and ``events`` ignore it.

Block hashes on the wire are the low 64 bits of the 128-bit chained hashes the prefix
tree keys blocks by (:mod:`fastdeploy_kvcache.core.hashing`): msgpack integers stop at 64
bits, and existing consumers decode unsigned 64-bit ints.  :func:`event_block_hashes` is
the reference a consumer (the router) calls to get them from token ids.

This module is the schema only: no ZMQ (the publisher is
``fastdeploy_kvcache.engine.kv_events_publisher``), no Paddle.
"""

from __future__ import annotations

import logging
from typing import Optional, Sequence, Union

import msgspec

from fastdeploy_kvcache.core.hashing import MMItem, compute_block_hashes

logger = logging.getLogger(__name__)

__all__ = [
    "MEDIUM_GPU",
    "MEDIUM_CPU",
    "MEDIUM_DISK",
    "MEDIUM_MOONCAKE",
    "MEDIUMS",
    "KVCacheEvent",
    "BlockStored",
    "BlockRemoved",
    "AllBlocksCleared",
    "KVEventBatch",
    "EVENT_HASH_MASK",
    "event_block_hash",
    "event_block_hashes",
    "encode_batch",
    "decode_batch",
]

# Tier names carried in ``medium``.
MEDIUM_GPU = "GPU"  # the device tier
MEDIUM_CPU = "CPU"  # the pinned host tier
MEDIUM_DISK = "DISK"  # the storage tier on the file backend
MEDIUM_MOONCAKE = "MOONCAKE"  # the storage tier on a Mooncake store
MEDIUMS = (MEDIUM_GPU, MEDIUM_CPU, MEDIUM_DISK, MEDIUM_MOONCAKE)

EVENT_HASH_MASK = (1 << 64) - 1


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of the event structs: each encodes as ``[tag, field, ...]``, tag = class name."""


class BlockStored(KVCacheEvent):
    """Blocks that now hold KV on ``medium``.

    ``block_hashes`` is a chain: each block's parent is the one before it, the first
    one's is ``parent_block_hash`` (None: the first block of a sequence).
    ``token_ids`` holds ``block_size`` tokens per block, in order, or is empty when the
    instance no longer knows them (a storage block it learned of by a lookup).
    """

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    """Blocks that no longer hold KV on ``medium`` (evicted, moved to another tier, lost)."""

    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    """Every block of the instance on every medium is gone from its view (a cache reset).

    Storage blocks the instance still knows are announced again right after, by
    ``BlockStored`` events in the same batch.
    """


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One engine step's events, in the order they happened."""

    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Optional[int] = None


_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(type=KVEventBatch)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload of one batch (what the PUB socket's third frame carries)."""
    return _encoder.encode(batch)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode a payload into the structs; raises ``msgspec.DecodeError`` / ``ValidationError``."""
    return _decoder.decode(payload)


def event_block_hash(tree_hash: int) -> int:
    """The wire form of a tree block hash: its low 64 bits, an unsigned int.

    Equal to ``int.from_bytes(digest[-8:], "big")`` of the block's 16-byte xxh3-128
    digest (the same 64 bits vLLM keeps of its own hashes when it publishes ints).
    """
    return tree_hash & EVENT_HASH_MASK


def event_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    *,
    lora_id: Optional[Union[str, int]] = None,
    cache_salt: Optional[str] = None,
    salt_from_token: int = 0,
    mm_items: Sequence[MMItem] = (),
) -> list[int]:
    """The block hashes our events carry for a sequence of token ids (the reference).

    One hash per *full* block (``len(token_ids) // block_size`` of them); a trailing
    partial block is never cached, so it has none.  ``lora_id``, ``cache_salt`` (from the
    block holding token ``salt_from_token`` on) and ``mm_items`` are the extra keys the
    server folded in (all None/empty for a plain text request); ``block_size`` is the one
    the events carry.
    """
    hashes = compute_block_hashes(token_ids, block_size, mm_items, lora_id, cache_salt, salt_from_token)
    return [h & EVENT_HASH_MASK for h in hashes]
