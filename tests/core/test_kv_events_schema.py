"""The KV event schema on the wire, checked with plain msgpack (not our structs), and the
reference block hashes against the tree's hashes."""

from __future__ import annotations

import msgpack
import pytest

from fastdeploy_kvcache.core.hashing import compute_block_hashes
from fastdeploy_kvcache.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
    event_block_hash,
    event_block_hashes,
)


def test_batch_encodes_as_vllm_arrays():
    batch = KVEventBatch(
        ts=12.5,
        events=[
            BlockStored([1, 2**64 - 1], None, list(range(8)), 4, None, "GPU"),
            BlockRemoved([7], "CPU"),
            AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )
    raw = msgpack.unpackb(encode_batch(batch), raw=False)
    assert raw == [
        12.5,
        [
            ["BlockStored", [1, 2**64 - 1], None, list(range(8)), 4, None, "GPU"],
            ["BlockRemoved", [7], "CPU"],
            ["AllBlocksCleared"],
        ],
        0,
    ]
    assert decode_batch(encode_batch(batch)) == batch


def test_a_two_field_batch_decoder_reads_ours():
    """vLLM's example subscriber declares the batch as (ts, events) only."""
    import msgspec

    class Batch(msgspec.Struct, array_like=True):
        ts: float
        events: list

    out = msgspec.msgpack.decode(encode_batch(KVEventBatch(1.0, [BlockRemoved([3], "GPU")], 0)), type=Batch)
    assert out.events == [["BlockRemoved", [3], "GPU"]]


def test_hash_over_64_bits_does_not_encode():
    with pytest.raises(OverflowError):
        encode_batch(KVEventBatch(0.0, [BlockRemoved([1 << 64], "GPU")]))


def test_reference_hashes_are_the_tree_hashes_low_64_bits():
    tokens = list(range(100, 150))
    tree = compute_block_hashes(tokens, 16)
    wire = event_block_hashes(tokens, 16)
    assert len(wire) == 3  # 50 tokens: 3 full blocks, the partial one has no hash
    assert wire == [h & (2**64 - 1) for h in tree]
    assert wire == [int.from_bytes(h.to_bytes(16, "big")[-8:], "big") for h in tree]
    assert all(0 <= h < 2**64 for h in wire)
    assert [event_block_hash(h) for h in tree] == wire
    # Chained: a different first block changes every hash after it.
    other = event_block_hashes([1] + tokens[1:], 16)
    assert all(a != b for a, b in zip(wire, other))
    # The extra keys change the hashes.
    assert event_block_hashes(tokens, 16, cache_salt="tenant-a") != wire
