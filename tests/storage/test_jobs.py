"""Storage jobs through the runner: one result per job, failures included, and jobs pickle."""

from __future__ import annotations

import ctypes
import pickle
from pathlib import Path

import numpy as np
import pytest

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.storage import KeyNamespace, Status
from fastdeploy_kvcache.storage.file_backend import FileBackend
from fastdeploy_kvcache.storage.jobs import StorageJob, StorageJobKind, StorageJobResult, StorageJobRunner
from fastdeploy_kvcache.storage.transfer import StorageTransfer

from .test_transfer import _NO_CAPI

pytestmark = pytest.mark.skipif(_NO_CAPI is not None, reason=f"CPU C ABI library missing ({_NO_CAPI}): run `bash build.sh`")


@pytest.fixture
def setup(tmp_path: Path):
    from fastdeploy_kvcache.worker.cache_controller import CacheController

    cfg = CacheConfig(block_size=4, num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16", num_host_blocks=8)
    ctl = CacheController(cfg, backend="cpu", threaded=False)
    ctl.initialize_host_cache()
    backend = FileBackend(tmp_path, min_free_bytes=0)
    transfer = StorageTransfer.from_controller(ctl, backend, staging_blocks=2, max_pending=1)
    layout = transfer.layout
    rng = np.random.default_rng(11)
    for p, bb in zip(layout.ptrs, layout.block_bytes):
        ctypes.memmove(p, rng.integers(0, 256, bb * 8, dtype=np.uint8).tobytes(), bb * 8)
    ns = KeyNamespace("m", "fp", "float16", 4, layout.describe())
    yield transfer, backend, ns
    transfer.close()
    backend.close()
    ctl.close()


def test_backup_then_prefetch_with_a_hole(setup) -> None:
    transfer, backend, ns = setup
    runner = StorageJobRunner(transfer)
    keys = ns.keys([1, 2, 3])
    runner.submit([StorageJob(1, StorageJobKind.BACKUP, (keys[0], keys[2]), (0, 2))])
    (backup,) = runner.collect_finished(wait=True, timeout_s=10)
    assert backup.success and backup.stored_keys == [keys[0], keys[2]] and backup.arrived_prefix == 0
    runner.submit([StorageJob(2, StorageJobKind.PREFETCH, tuple(keys), (4, 5, 6))])
    (pre,) = runner.collect_finished(wait=True, timeout_s=10)
    assert pre.results == (transfer.object_bytes, Status.MISSING, transfer.object_bytes)
    assert pre.arrived_prefix == 1 and not pre.success and pre.error is None
    assert runner.in_flight == 0 and runner.collect_finished() == []


def test_failures_still_yield_exactly_one_result(setup) -> None:
    transfer, backend, ns = setup
    runner = StorageJobRunner(transfer)
    with pytest.raises(TypeError):
        runner.submit(["not a job"])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="same, non-zero"):
        StorageJob(9, StorageJobKind.BACKUP, ("a",), (1, 2))
    # Bad host ids: refused at submit, reported as a failed result (never raised at the worker).
    runner.submit([StorageJob(3, StorageJobKind.BACKUP, tuple(ns.keys([5])), (99,))])
    (bad,) = runner.collect_finished()
    assert bad.error == "invalid" and bad.results == (Status.INVALID,) and bad.stored_keys == []
    # Tier gone: every later job fails with "unreachable", one result each.
    transfer.close()
    runner.submit([StorageJob(4, StorageJobKind.PREFETCH, tuple(ns.keys([1])), (1,)),
                   StorageJob(5, StorageJobKind.BACKUP, tuple(ns.keys([1])), (1,))])
    results = runner.collect_finished(wait=True, timeout_s=5)
    assert sorted(r.job_id for r in results) == [4, 5]
    assert {r.error for r in results} == {"unreachable"} and all(r.arrived_prefix == 0 for r in results)


def test_jobs_and_results_pickle(setup) -> None:
    _, _, ns = setup
    job = StorageJob(7, StorageJobKind.PREFETCH, tuple(ns.keys([1, 2])), (3, 4))
    assert pickle.loads(pickle.dumps(job)) == job
    result = StorageJobResult(job, (10, -1), None, 0.5)
    back = pickle.loads(pickle.dumps(result))
    assert back == result and back.arrived_prefix == 1
