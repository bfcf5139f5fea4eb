import pickle

import pytest

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.cache_manager import CacheManager
from fastdeploy_kvcache.core.hashing import MMItem, compute_block_hashes
from fastdeploy_kvcache.core.metadata import BlockNode, CacheLevel, CacheSwapMetadata, CopyDirection, TransferKind
from fastdeploy_kvcache.core.request import BatchRequest, Request


def test_request_fields_and_lazy_hashes():
    r = Request("r", list(range(10)), [7, 8], lora_id=2, mm_items=[MMItem(0, 3, "img")], cache_salt="s")
    assert r.block_tables == [] and r.num_cached_tokens == 0 and r.num_computed_tokens == 0
    assert r.cache_swap_metadata == [] and r.cache_evict_metadata == [] and r.match_result is None
    assert r._hasher is None  # nothing hashed before it is needed
    with pytest.raises(RuntimeError):
        r.prompt_hashes
    full = r.block_hashes(4)
    assert full == compute_block_hashes(list(range(10)) + [7, 8], 4, [MMItem(0, 3, "img")], 2, "s")
    assert r.prompt_hashes == full[:2]
    assert r.partial_block_key(4) is None  # 12 tokens: no partial block
    r.output_token_ids.append(9)
    assert r.partial_block_key(4).endswith(":partial:1")
    with pytest.raises(ValueError):
        Request("", [1])
    with pytest.raises(ValueError):
        Request("x", [])


def _meta(src, dst, st=CacheLevel.HOST, dt=CacheLevel.DEVICE, kind=TransferKind.SWAP_IN):
    return CacheSwapMetadata(src, dst, st, dt, [s * 1000 for s in src], kind=kind)


def test_batch_request_merges_and_clears():
    a, b = Request("a", [1, 2]), Request("b", [3])
    a.cache_swap_metadata.append(_meta([1, 2], [10, 11]))
    a.cache_evict_metadata.append(_meta([5], [6], CacheLevel.DEVICE, CacheLevel.HOST, TransferKind.EVICT))
    b.cache_swap_metadata.append(_meta([3], [12]))
    batch = BatchRequest()
    batch.add_request(a)
    batch.add_request(b)
    batch.append_evict_metadata(_meta([7], [8], CacheLevel.DEVICE, CacheLevel.HOST, TransferKind.BACKUP))
    batch.append_evict_metadata(None)
    assert a.cache_swap_metadata == [] and a.cache_evict_metadata == [] and b.cache_swap_metadata == []
    sw, ev = batch.cache_swap_metadata, batch.cache_evict_metadata
    assert (sw.src_block_ids, sw.dst_block_ids, sw.hash_values) == ([1, 2, 3], [10, 11, 12], [1000, 2000, 3000])
    assert (ev.src_block_ids, ev.dst_block_ids, ev.kind) == ([5, 7], [6, 8], TransferKind.EVICT)
    assert [r.request_id for r in batch] == ["a", "b"] and len(batch) == 2 and batch[1] is b
    with pytest.raises(ValueError):
        batch.append_swap_metadata(_meta([1], [2], CacheLevel.DEVICE, CacheLevel.HOST))


def test_empty_batch():
    batch = BatchRequest()
    assert batch.cache_swap_metadata is None and batch.cache_evict_metadata is None
    assert pickle.loads(pickle.dumps(batch)).requests == []


def test_batch_pickles_without_tree_nodes():
    mgr = CacheManager(CacheConfig(block_size=4, num_gpu_blocks=8, num_host_blocks=8))
    a = Request("a", list(range(9)))
    mgr.match_prefix(a)
    mgr.allocate_device_blocks(a, 3)
    a.num_computed_tokens = 9
    mgr.request_finish(a)
    b = Request("b", list(range(9)) + [1])
    mgr.match_prefix(b)
    mgr.allocate_device_blocks(b, 1)
    assert b.match_result is not None and b.match_result.nodes
    batch = BatchRequest([b])
    data = pickle.dumps(batch)
    assert b"BlockNode" not in data and b"MatchResult" not in data
    back = pickle.loads(data)
    assert back[0].match_result is None and back[0].block_tables == b.block_tables
    with pytest.raises(TypeError):
        pickle.dumps(b.match_result.nodes[0])
    assert isinstance(b.match_result.nodes[0], BlockNode)


def test_numpy_prompt_hashes_like_a_list():
    import numpy as np

    toks = list(range(5, 5 + 70))
    a = Request("a", toks, [1, 2, 3])
    b = Request("b", np.asarray(toks, dtype=np.int32), [1, 2, 3])
    assert a.block_hashes(8) == b.block_hashes(8) == compute_block_hashes(toks + [1, 2, 3], 8)
    # incremental across the prompt/output boundary
    c = Request("c", toks)
    c.block_hashes(8)
    c.output_token_ids += [1, 2, 3]
    assert c.block_hashes(8) == a.block_hashes(8)


def test_block_hashes_cover_only_the_tokens_asked_for():
    """Fewer tokens than already hashed: only their full blocks, as the docstring says."""
    r = Request("r", list(range(12)))
    full = r.block_hashes(4, 12)
    assert len(full) == 3
    assert r.block_hashes(4, 4) == full[:1]
    assert r.block_hashes(4, 7) == full[:1]
    assert r.block_hashes(4, 3) == []
    assert r.block_hashes(4) == full


def test_batch_rejects_a_wrong_direction_even_first_and_changes_nothing():
    """The first metadata of a direction is checked too, and a bad request leaves the batch as it was."""
    batch = BatchRequest()
    with pytest.raises(ValueError):
        batch.append_evict_metadata(_meta([1], [2]))  # host -> device is not an eviction
    with pytest.raises(ValueError):
        batch.append_swap_metadata(_meta([1], [2], CacheLevel.DEVICE, CacheLevel.HOST, TransferKind.EVICT))
    assert batch.cache_swap_metadata is None and batch.cache_evict_metadata is None
    good, bad = _meta([1], [10]), _meta([5], [6], CacheLevel.DEVICE, CacheLevel.HOST, TransferKind.EVICT)
    a = Request("a", [1, 2])
    a.cache_swap_metadata += [good, bad]  # an eviction filed as a load
    with pytest.raises(ValueError):
        batch.add_request(a)
    assert batch.requests == [] and batch.cache_swap_metadata is None
    assert a.cache_swap_metadata == [good, bad]


def test_frees_device_blocks_follows_evictions_through_merges():
    """The worker's compute fence reads frees_device_blocks: True as soon as one write_back
    eviction (device block already released) is in a merged device -> host copy."""
    backup = CacheSwapMetadata([1], [2], CacheLevel.DEVICE, CacheLevel.HOST, [7], kind=TransferKind.BACKUP)
    evict = CacheSwapMetadata([3], [4], CacheLevel.DEVICE, CacheLevel.HOST, [8], kind=TransferKind.EVICT)
    assert not backup.frees_device_blocks and evict.frees_device_blocks
    assert backup.direction is CopyDirection.DEVICE_TO_HOST
    assert not CacheSwapMetadata.merged([backup]).frees_device_blocks
    assert CacheSwapMetadata.merged([backup, evict]).frees_device_blocks
    batch = BatchRequest()
    batch.append_evict_metadata(backup)
    assert not batch.cache_evict_metadata.frees_device_blocks
    batch.append_evict_metadata(evict)
    assert batch.cache_evict_metadata.frees_device_blocks
    assert pickle.loads(pickle.dumps(batch)).cache_evict_metadata.frees_device_blocks


def test_a_per_range_salt_shares_the_blocks_before_its_offset():
    shared = list(range(8))  # two blocks of 4
    a = Request("a", shared + [1, 2, 3, 4, 5], cache_salt="tenant-a", salt_from_token=8)
    b = Request("b", shared + [1, 2, 3, 4, 5], cache_salt="tenant-b", salt_from_token=8)
    plain = Request("p", shared + [1, 2, 3, 4, 5])
    assert a.block_hashes(4)[:2] == b.block_hashes(4)[:2] == plain.block_hashes(4)[:2]
    assert a.block_hashes(4)[2] != b.block_hashes(4)[2] != plain.block_hashes(4)[2]


@pytest.mark.parametrize("kw, what", [({"salt_from_token": -1}, "salt_from_token"),
                                      ({"salt_from_token": True}, "salt_from_token"),
                                      ({"tenant": 3}, "tenant must be a str")])
def test_bad_salt_offset_or_tenant_is_refused(kw, what):
    with pytest.raises(ValueError, match=what):
        Request("r", [1, 2, 3], **kw)
