import pytest

from fastdeploy_kvcache.core.block_pool import BlockPool, BlockPoolError, NoFreeBlocksError, consecutive_share
from fastdeploy_kvcache.core.metadata import CacheLevel


def test_allocates_lowest_ids_ascending():
    pool = BlockPool(200)
    assert pool.allocate(3) == [0, 1, 2]
    assert pool.allocate(70) == list(range(3, 73))  # crosses a 64-id bucket
    pool.free([5, 1, 70])
    assert pool.allocate(4) == [1, 5, 70, 73]
    assert pool.num_free == 200 - 74


def test_free_then_allocate_is_consecutive_again():
    pool = BlockPool(128)
    ids = pool.allocate(128)
    pool.free(ids[40:50][::-1])  # freed in reverse: a LIFO list would hand them back reversed
    assert pool.allocate(10) == list(range(40, 50))


def test_double_free_and_foreign_id_raise_without_change():
    pool = BlockPool(10, CacheLevel.HOST)
    ids = pool.allocate(4)
    with pytest.raises(BlockPoolError, match="twice"):
        pool.free([ids[0], 7])  # 7 is free already
    assert pool.num_free == 6 and not pool.is_free(ids[0])
    with pytest.raises(BlockPoolError, match="twice"):
        pool.free([ids[1], ids[1]])
    with pytest.raises(BlockPoolError, match="not in this pool"):
        pool.free([ids[2], 10])
    with pytest.raises(BlockPoolError):
        pool.free([-1])
    assert pool.num_free == 6
    pool.free(ids)
    assert pool.num_free == 10 and pool.free_ids() == list(range(10))


def test_exhaustion_takes_nothing():
    pool = BlockPool(5)
    pool.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(3)
    assert pool.num_free == 2
    with pytest.raises(ValueError):
        pool.allocate(-1)


def test_empty_pool_and_bad_size():
    assert BlockPool(0).num_free == 0
    with pytest.raises(ValueError):
        BlockPool(-1)


def test_invariant_under_random_traffic():
    import random

    rng = random.Random(0)
    pool = BlockPool(300)
    held: set[int] = set()
    for _ in range(3000):
        if held and rng.random() < 0.5:
            out = rng.sample(sorted(held), rng.randint(1, min(5, len(held))))
            pool.free(out)
            held.difference_update(out)
        else:
            n = rng.randint(0, min(7, pool.num_free))
            got = pool.allocate(n)
            assert got == sorted(got) and not held & set(got)
            free_before = set(pool.free_ids()) | set(got)
            assert got == sorted(free_before)[:n]  # the lowest free ids
            held.update(got)
        assert pool.num_free + len(held) == 300


def test_consecutive_share():
    assert consecutive_share([]) == 1.0
    assert consecutive_share([1, 2, 3, 7]) == pytest.approx(2 / 3)


def test_contiguous_allocation_prefers_whole_buckets_when_plenty_is_free():
    pool = BlockPool(1024)
    pool.allocate(3)
    got = pool.allocate(100, contiguous=True)
    assert got[:64] == list(range(64, 128))  # a wholly free bucket, not 3..66
    assert len(set(got)) == 100 and pool.num_free == 1024 - 103


def test_contiguous_allocation_prefers_a_run():
    pool = BlockPool(256)
    ids = pool.allocate(256)
    # free a scattered set in bucket 0 and a 10-run in bucket 1, and all of bucket 3
    pool.free([1, 3, 5, 7, 9])
    pool.free(list(range(70, 80)))
    pool.free(list(range(192, 256)))
    assert pool.allocate(4, contiguous=True) == [70, 71, 72, 73]
    # a nearly full pool: the longest runs win over the lowest ids (the scattered 1..9 stay)
    assert pool.allocate(70, contiguous=True, longest_runs=True) == list(range(74, 80)) + list(range(192, 256))
    assert pool.num_free == 5 + 10 + 64 - 4 - 70
    assert pool.allocate(2) == [1, 3]  # the default stays lowest-first
    rest = pool.free_ids()
    pool.free([i for i in ids if i not in rest and i not in (1, 3)])
    assert pool.num_free == 254


def test_contiguous_falls_back_and_keeps_counts():
    import random

    rng = random.Random(1)
    pool = BlockPool(500)
    held: set[int] = set()
    for _ in range(2000):
        if held and rng.random() < 0.5:
            out = rng.sample(sorted(held), rng.randint(1, min(40, len(held))))
            pool.free(out)
            held.difference_update(out)
        else:
            n = rng.randint(0, min(100, pool.num_free))
            got = pool.allocate(n, contiguous=rng.random() < 0.5, longest_runs=rng.random() < 0.5)
            assert len(got) == len(set(got)) == n and not held & set(got)
            held.update(got)
        assert pool.num_free + len(held) == 500
        assert set(pool.free_ids()) == set(range(500)) - held


def test_longest_run_allocation_prunes_emptied_buckets_from_the_heap():
    """Under pressure the heap must not keep every bucket ever emptied (cost stays O(live))."""
    pool = BlockPool(64 * 64, CacheLevel.HOST)
    taken = pool.allocate(64 * 64 - 40, contiguous=True)  # whole buckets leave stale entries
    assert pool.num_free == 40
    out = pool.allocate(16, contiguous=True, longest_runs=True)
    assert len(out) == 16 and len(set(out)) == 16
    live_buckets = {b for b in range(64) if any(pool.is_free(b * 64 + i) for i in range(64))}
    assert len(pool._heap) <= len(live_buckets)
    pool.free(out + taken)
    assert pool.num_free == 64 * 64


def test_ids_not_landed_are_neither_free_nor_allocated():
    """A pool with part of its ids ready (a host tier still pinning) hands out only those."""
    pool = BlockPool(150, CacheLevel.HOST, num_ready=70)  # a bucket and a part of the next
    assert (pool.num_free, pool.num_used, pool.num_ready) == (70, 0, 70)
    with pytest.raises(NoFreeBlocksError):
        pool.allocate(71)
    ids = pool.allocate(70, contiguous=True)
    assert ids == list(range(70))
    assert pool.num_free == 0 and pool.usage() == 1.0
    with pytest.raises(BlockPoolError, match="not landed"):
        pool.free([100])
    with pytest.raises(NoFreeBlocksError):
        pool.allocate_one()
    # Landing: new ids join the free set, ascending; a smaller count is a no-op.
    assert pool.extend_ready(130) == 60
    assert pool.extend_ready(100) == 0 and pool.num_ready == 130
    assert pool.free_ids() == list(range(70, 130))
    assert pool.allocate(60, contiguous=True) == list(range(70, 130))
    pool.free(ids)
    assert pool.extend_ready(150) == 20
    assert pool.num_free == 90 and pool.free_ids() == list(range(70)) + list(range(130, 150))
    # Wholly landed buckets take part in run allocation again.
    assert pool.allocate(64, contiguous=True) == list(range(64))
    pool.reset()
    assert pool.num_free == 150 and pool.free_ids() == list(range(150))
    with pytest.raises(ValueError):
        pool.extend_ready(151)
    with pytest.raises(ValueError):
        BlockPool(10, num_ready=11)


def test_landing_in_single_ids_matches_a_fully_ready_pool():
    """However the ids land, once all have, allocation behaves as a pool built ready."""
    grown, ready = BlockPool(200, num_ready=0), BlockPool(200)
    for n in range(1, 201, 7):
        grown.extend_ready(n)
    grown.extend_ready(200)
    for n in (3, 70, 1, 64, 10):
        assert grown.allocate(n, contiguous=True) == ready.allocate(n, contiguous=True)
    assert grown.free_ids() == ready.free_ids()
