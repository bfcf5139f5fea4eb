"""Reuse changes nothing on the paddleformers runner: greedy outputs with the tiered cache
equal recompute without it.

The workloads and checks are ``tests/reuse_workloads.py`` (shared with the transformers
runner's tests); each runs on the seeded tiny Llama under each write policy, in the situation
named (device hits, host hits, write_back evictions, failed loads, preemption).
"""

from __future__ import annotations

import threading
import time
from typing import Any

from tests.reuse_workloads import ReuseChecks, check_idle_backup
from tests.reuse_workloads import BS as BS  # noqa: F401 - re-exported for tests added here
from tests.reuse_workloads import assert_no_leak as assert_no_leak  # noqa: F401
from tests.reuse_workloads import doc as _doc  # noqa: F401
from tests.reuse_workloads import run_waves as run_waves  # noqa: F401
from tests.reuse_workloads import Collector, greedy
from fastdeploy_kvcache.core.metadata import CopyDirection
from fastdeploy_kvcache.worker.backends.faulty import CopyCall, FaultInjectingBackend


class TestReuse(ReuseChecks):
    """The shared reuse checks under every write policy."""


def test_last_request_is_backed_up_while_idle(engine_factory: Any) -> None:
    check_idle_backup(engine_factory)


def test_a_request_arriving_during_idle_backups_starts_without_waiting_for_them(engine_factory: Any) -> None:
    """write_through: while the engine is idle, the last request's backups are in flight; a
    request arriving then (a miss) must run at once, not after those copies (the cache must
    cost nothing on a miss).  The backup is held on its copy stream until the new request
    has finished; the copies still complete afterwards and nothing leaks."""
    eng = engine_factory(v1=True, write_policy="write_through", write_through_threshold=1,
                         num_gpu_blocks=16, num_host_blocks=64, max_num_seqs=1)
    backup_started, release = threading.Event(), threading.Event()

    def hold_backups(call: CopyCall) -> None:
        if call.direction is CopyDirection.DEVICE_TO_HOST:
            backup_started.set()
            release.wait(60)

    eng.pool.controller.transfer_manager.wrap_backend(FaultInjectingBackend).rule = hold_backups
    col = Collector()
    try:
        eng.add_request("first", _doc(0), greedy(2), col)
        assert backup_started.wait(60), "no backup was issued: the test does not test what it says"
        # A prefilled chunk's blocks are backed up while their request still runs (in-batch
        # prefix sharing commits them after each chunk), so the held backup may start first.
        deadline = time.monotonic() + 30
        while not (col.outputs.get("first") and col.outputs["first"][-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert col.final("first").finish_reason == "length"
        eng.add_request("second", _doc(1), greedy(2), col)
        deadline = time.monotonic() + 30
        while not (col.outputs.get("second") and col.outputs["second"][-1].finished) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert col.outputs.get("second") and col.outputs["second"][-1].finished, (
            "the new request waited for the idle engine's backups")
        assert not release.is_set() and eng.pool.copies_in_flight > 0, "the backup was not held in flight"
    finally:
        release.set()
    assert eng.wait_idle(60)
    deadline = time.monotonic() + 30
    while eng.pool.copies_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.get_stats()["cache"]["backup_blocks"] >= 4, eng.get_stats()["cache"]
    assert_no_leak(eng)
