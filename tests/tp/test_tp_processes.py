"""Tensor-parallel ranks as real processes on the cpu backend, driven by one scheduler.

Each rank is a spawned process with its own CacheController holding its head shard; every
step's BatchRequest goes to all of them.  The shadow-memory oracle runs per rank (each
rank's bytes against its shard of the expected KV), with copy failures injected in one rank
only.  A rank that dies or hangs is a failure within a bounded time, never a hang.
"""

from __future__ import annotations

import functools
import time

import pytest

from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata
from fastdeploy_kvcache.core.request import BatchRequest
from fastdeploy_kvcache.worker.tp import CompletionMerger, RankFailedError, RankTimeoutError, TPCoordinator
from tp_trace import FULL_HEADS, ControlHook, run_tp_trace, tp_config

pytestmark = pytest.mark.usefixtures("capi_cpu")


TRACES = [
    (2, "write_back", 0, False, False),
    (2, "write_through", 3, True, False),
    (4, "write_through_selective", 5, False, False),
    (4, "write_back", 6, False, True),
]
TRACE_IDS = ["tp2-write_back", "tp2-write_through-int8", "tp4-selective", "tp4-mla-write_back"]


@pytest.mark.parametrize("tp_size, policy, seed, quant, mla", TRACES, ids=TRACE_IDS)
def test_random_trace_keeps_every_ranks_shard_right_with_one_rank_failing(
    tp_size: int, policy: str, seed: int, quant: bool, mla: bool
) -> None:
    """Copies on stream threads, concurrent with each rank's forward (what serving runs).

    Completion timing steers the scheduler, so what a seed exercises varies from run to
    run; run_tp_trace asserts the bytes and the merged verdicts whatever it was.
    """
    counts = run_tp_trace(policy, seed, steps=45, tp_size=tp_size, fail_p=0.3, quant=quant, mla=mla)
    assert counts["d2h_blocks"] > 0, counts


@pytest.mark.parametrize("tp_size, policy, seed, quant, mla", TRACES, ids=TRACE_IDS)
def test_inline_trace_voids_steps_whose_load_failed_on_one_rank(
    tp_size: int, policy: str, seed: int, quant: bool, mla: bool
) -> None:
    """The same traces with copies run inline: deterministic, so what they cover is asserted.

    Loads fail on one rank only; each such step is void on every rank (``redone``), the
    scheduler recomputes, and every rank's shard stays right.
    """
    counts = run_tp_trace(policy, seed, steps=45, tp_size=tp_size, fail_p=0.3, quant=quant, mla=mla,
                          threaded=False)
    assert counts["swap_in_blocks"] > 0 and counts["d2h_blocks"] > 0, counts
    assert counts["redone"] > 0 and counts["failed"] > counts["redone"], counts


class _RankZeroMerger(CompletionMerger):
    """The merge this package must not do: take rank 0's verdict for the whole group."""

    def _resolve(self, pending) -> None:  # type: ignore[no-untyped-def]
        for rank in list(pending.verdicts):
            if rank != 0:
                pending.verdicts[rank] = None
        super()._resolve(pending)


class _RankZeroDecides(TPCoordinator):
    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._merger = _RankZeroMerger(self.tp_size)


def test_the_per_rank_oracle_notices_a_merge_that_ignores_a_failed_rank() -> None:
    """Sensitivity: if a load that failed on rank 1 were reported done, rank 1 would serve
    blocks its load never filled, and its shard check says so."""
    with pytest.raises(RankFailedError, match="does not hold its prefix's KV shard"):
        # NOTE: 90 steps, so that some armed failure lands on a load (the check is about loads;
        # a failed eviction is only a lost backup). At 45 steps, seeds 0, 2 and 4 armed
        # evictions only once in-flight loads were shared between requests.
        run_tp_trace("write_back", 0, steps=90, tp_size=2, fail_p=0.3, threaded=False,
                     coordinator_cls=_RankZeroDecides)


def _coordinator(tp_size: int = 2, **kw: object) -> TPCoordinator:
    cfg = tp_config("write_back", tp_size, quant=False)
    return TPCoordinator(cfg, backend="cpu", hook=ControlHook, timeout_s=kw.pop("timeout_s", 30.0), **kw)


def _load(src: list[int], dst: list[int]) -> BatchRequest:
    batch = BatchRequest()
    batch.append_swap_metadata(CacheSwapMetadata(src, dst, CacheLevel.HOST, CacheLevel.DEVICE))
    return batch


def test_each_rank_allocates_its_shard_in_its_own_process() -> None:
    with _coordinator(2) as coord:
        assert [i["rank"] for i in coord.rank_info] == [0, 1]
        assert [i["device_id"] for i in coord.rank_info] == [0, 1]
        assert len({i["pid"] for i in coord.rank_info}) == 2
        assert [i["num_kv_heads"] for i in coord.rank_info] == [FULL_HEADS // 2] * 2
        shapes = coord.call("shapes")
        assert shapes[0] == shapes[1] and shapes[0][0] == (14, FULL_HEADS // 2, 4, 4)


def test_a_load_that_fails_on_one_rank_fails_for_all() -> None:
    with _coordinator(2) as coord:
        batch = _load([0, 1, 2], [5, 6, 7])
        meta = batch.cache_swap_metadata
        result = coord.step(batch, payloads=[{}, {meta.task_id: 1}], wait=True)
        assert result.outcomes == [True, False]  # rank 0's forward ran, rank 1's load failed
        assert result.finished == [meta]  # the scheduler's own object, marked
        assert meta.success is False
        assert meta.error_message.startswith("rank 1: ") and "rank 0:" not in meta.error_message
        stats = coord.call("stats")
        assert [s["h2d"]["failed"] for s in stats] == [0, 1]


def test_a_copy_is_done_only_when_every_rank_has_done_it() -> None:
    with _coordinator(2) as coord:
        coord.call("pause_input", ranks=[1])
        batch = _load([0, 1], [3, 4])
        meta = batch.cache_swap_metadata
        result = coord.step(batch, payloads=["no-forward", "no-forward"])
        deadline = time.monotonic() + 10
        while coord.pending_tasks().get(meta.task_id) != [0] and time.monotonic() < deadline:
            assert coord.collect_finished() == [] and result.finished == []
            time.sleep(0.02)
        assert coord.pending_tasks() == {meta.task_id: [0]}  # rank 0 finished, rank 1 has not
        assert meta.success is False and meta.error_message is None  # not marked yet
        coord.call("resume_input", ranks=[1])
        assert coord.collect_finished(wait=True) == [meta]
        assert meta.success is True and coord.pending_tasks() == {}


def test_a_rank_that_dies_is_a_failure_not_a_hang() -> None:
    coord = _coordinator(2)
    try:
        coord.call("pause_input", ranks=[1])
        batch = _load([0], [2])
        meta = batch.cache_swap_metadata
        coord.step(batch, payloads=["no-forward", "no-forward"])
        start = time.monotonic()
        with pytest.raises(RankFailedError, match=r"rank 1 .*died.*exit code 7") as info:
            coord.call("die", 7, ranks=[1])
        assert time.monotonic() - start < 10
        assert info.value.rank == 1 and info.value.exitcode == 7
        # The load still pending on the dead rank comes back failed, for the scheduler.
        assert coord.collect_finished() == [meta]
        assert meta.success is False and "rank 1: rank failed" in meta.error_message
        with pytest.raises(RankFailedError, match="broken"):
            coord.step(_load([1], [3]))
    finally:
        start = time.monotonic()
        coord.close()
        assert time.monotonic() - start < 30


def test_a_rank_that_hangs_times_out() -> None:
    coord = _coordinator(2, timeout_s=1.5)
    try:
        start = time.monotonic()
        with pytest.raises(RankTimeoutError, match=r"rank 0 .*did not answer"):
            coord.call("hang", 120.0, ranks=[0])
        assert time.monotonic() - start < 10
    finally:
        start = time.monotonic()
        coord.close()  # the hung process is terminated
        assert time.monotonic() - start < 30
        assert not any(p.is_alive() for p in coord._procs)


def test_a_hook_error_is_raised_and_the_group_stays_usable() -> None:
    with _coordinator(2) as coord:
        with pytest.raises(RankFailedError, match="a hook error on purpose"):
            coord.call("fail", ranks=[1])
        with pytest.raises(RankFailedError, match="no method 'nope'"):
            coord.call("nope")
        assert coord.broken is None
        batch = _load([0], [1])
        assert coord.step(batch, wait=True, payloads=["no-forward"] * 2).finished[0].success


def test_a_rank_that_cannot_start_is_reported() -> None:
    cfg = tp_config("write_back", 2, quant=False, num_gpu_blocks=0)  # nothing to allocate
    start = time.monotonic()
    with pytest.raises(RankFailedError, match=r"(?s)failed to start.*num_gpu_blocks > 0"):
        TPCoordinator(cfg, backend="cpu", hook=functools.partial(ControlHook), timeout_s=30.0)
    assert time.monotonic() - start < 60


def test_an_unpicklable_hook_fails_at_start_and_leaves_no_process() -> None:
    import multiprocessing

    before = {p.pid for p in multiprocessing.active_children()}
    cfg = tp_config("write_back", 2, quant=False)
    with pytest.raises(Exception, match="pickle|Pickl"):
        TPCoordinator(cfg, backend="cpu", hook=lambda ctrl, rank, size: None, timeout_s=30.0)
    assert {p.pid for p in multiprocessing.active_children()} <= before


def test_inline_trace_on_the_paddle_backend_per_rank() -> None:
    """The same per-rank oracle with Paddle tensors and the Paddle custom ops in each rank."""
    pytest.importorskip("paddle", reason="needs paddlepaddle (CPU) installed: `bash build.sh`")
    from fastdeploy_kvcache import ops

    if not ops.paddle_ops_available():
        pytest.skip("needs the Paddle custom ops (run `bash build.sh`, which runs setup_ops.py)")
    counts = run_tp_trace("write_back", 0, steps=30, tp_size=2, fail_p=0.3, backend="paddle", threaded=False)
    assert counts["swap_in_blocks"] > 0 and counts["redone"] > 0, counts
