"""CompletionMerger: a copy is done when every rank reported it, failed if any rank failed it."""

from __future__ import annotations

import copy

import pytest

from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, TransferKind
from fastdeploy_kvcache.worker.tp import CompletionMerger


def _rank_copy(meta: CacheSwapMetadata, ok: bool, error: str = "boom") -> CacheSwapMetadata:
    """What a rank sends back: its own (unpickled) copy, marked by its worker."""
    mine = copy.deepcopy(meta)
    mine.mark_done(ok, None if ok else error)
    return mine


def test_done_only_once_every_rank_reported_and_the_schedulers_object_is_marked() -> None:
    merger = CompletionMerger(3)
    load = CacheSwapMetadata([1, 2], [3, 4])
    merger.expect(load)
    merger.report(0, [_rank_copy(load, True)])
    merger.report(2, [_rank_copy(load, True)])
    assert merger.take_ready() == [] and merger.pending() == {load.task_id: [0, 2]}
    assert load.success is False and load.error_message is None  # untouched until complete
    merger.report(1, [_rank_copy(load, True)])
    ready = merger.take_ready()
    assert len(ready) == 1 and ready[0] is load and load.success and load.error_message is None
    assert merger.pending() == {} and merger.take_ready() == []


def test_one_failed_rank_fails_the_copy_for_all_and_is_named() -> None:
    merger = CompletionMerger(4)
    evict = CacheSwapMetadata([5], [6], CacheLevel.DEVICE, CacheLevel.HOST, kind=TransferKind.EVICT)
    merger.expect(evict)
    for rank in range(4):
        merger.report(rank, [_rank_copy(evict, rank not in (1, 3), f"err{rank}")])
    assert merger.take_ready() == [evict]
    assert evict.success is False and evict.error_message == "rank 1: err1; rank 3: err3"


def test_copies_complete_independently_in_the_order_they_become_complete() -> None:
    merger = CompletionMerger(2)
    a, b = CacheSwapMetadata([0], [1]), CacheSwapMetadata([2], [3])
    merger.expect(a)
    merger.expect(b)
    merger.report(0, [_rank_copy(a, True), _rank_copy(b, True)])
    merger.report(1, [_rank_copy(b, True)])
    assert merger.take_ready() == [b]
    merger.report(1, [_rank_copy(a, True)])
    assert merger.take_ready() == [a]


def test_a_lost_rank_fails_every_pending_copy() -> None:
    merger = CompletionMerger(2)
    a, b = CacheSwapMetadata([0], [1]), CacheSwapMetadata([2], [3])
    merger.expect(a)
    merger.expect(b)
    merger.report(0, [_rank_copy(a, True)])
    merger.fail_all(1, "rank failed: died")
    assert merger.take_ready() == [a, b]
    assert not a.success and not b.success and a.error_message == "rank 1: rank failed: died"


def test_unknown_duplicate_and_out_of_range_reports() -> None:
    merger = CompletionMerger(2)
    a = CacheSwapMetadata([0], [1])
    merger.report(0, [_rank_copy(a, True)])  # not expected: logged, ignored
    assert merger.pending() == {} and merger.take_ready() == []
    merger.expect(a)
    with pytest.raises(ValueError, match="already submitted"):
        merger.expect(a)
    merger.report(0, [_rank_copy(a, False)])
    merger.report(0, [_rank_copy(a, True)])  # a second verdict of the same rank: the first stands
    merger.report(1, [_rank_copy(a, True)])
    assert merger.take_ready() == [a] and not a.success
    with pytest.raises(ValueError, match=r"rank 2 is out of range \[0, 2\)"):
        merger.report(2, [])
    with pytest.raises(ValueError, match="tp_size"):
        CompletionMerger(0)
