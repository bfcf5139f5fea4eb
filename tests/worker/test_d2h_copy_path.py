"""The worker's per-direction copy path, on the CPU backends.

Device->host copies (write_back evictions, write-through backups) name their copy path per
call, the worker's ``d2h_copy_path`` argument (default dma); loads pass "use the process-wide option".  The
CPU build ignores the path, so here we check what reaches the op and that the bytes are
right; tests/gpu/test_copy_path_gpu.py checks that the DMA batch really runs on a GPU.
"""

from __future__ import annotations

from typing import Any, Optional

import pytest

from fastdeploy_kvcache import ops
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, CopyDirection, TransferKind

from worker_helpers import block_seed, capi_or_skip, fill_block, paddle_ops_or_skip, small_config


def _controller(backend: str, d2h_copy_path: Optional[str] = None, async_launch: bool = True) -> Any:
    from fastdeploy_kvcache.worker import CacheController

    if backend == "cpu":
        capi_or_skip()
    else:
        paddle_ops_or_skip()
    ctrl = CacheController(small_config(), backend=backend, async_launch=async_launch, d2h_copy_path=d2h_copy_path)
    ctrl.initialize_kv_cache()
    ctrl.initialize_host_cache()
    return ctrl


def _spy(ctrl: Any) -> list[tuple[int, Any]]:
    """Record (mode, path) of every swap_blocks call, then run the real one."""
    calls: list[tuple[int, Any]] = []
    real = ctrl.backend.swap_blocks

    def spy(*args: Any, path: Any = None, **kwargs: Any) -> None:
        calls.append((args[5], path))
        real(*args, path=path, **kwargs)

    ctrl.backend.swap_blocks = spy
    return calls


def _step(ctrl: Any) -> None:
    """One eviction, one backup and one load, with real bytes checked."""
    fill_block(ctrl, 1, seed=7)
    fill_block(ctrl, 2, seed=8)
    ctrl.submit_swap_tasks(
        CacheSwapMetadata([1], [4], CacheLevel.DEVICE, CacheLevel.HOST, kind=TransferKind.EVICT), None
    )
    ctrl.submit_swap_tasks(
        CacheSwapMetadata([2], [5], CacheLevel.DEVICE, CacheLevel.HOST, kind=TransferKind.BACKUP), None
    )
    assert all(m.success for m in ctrl.collect_finished(wait=True))
    counter = ctrl.submit_swap_tasks(None, CacheSwapMetadata([4, 5], [6, 7], CacheLevel.HOST, CacheLevel.DEVICE))
    counter.wait_all()
    assert all(m.success for m in ctrl.collect_finished(wait=True))
    assert (block_seed(ctrl, 6), block_seed(ctrl, 7)) == (7, 8)


@pytest.mark.parametrize("backend", ["cpu", "paddle"])
def test_evictions_and_backups_default_to_dma_loads_follow_the_process_option(
    backend: str
) -> None:
    ctrl = _controller(backend)
    try:
        calls = _spy(ctrl)
        _step(ctrl)
        assert [p for m, p in calls if m == CopyDirection.DEVICE_TO_HOST] == [ops.COPY_PATH_DMA] * 2
        assert {p for m, p in calls if m == CopyDirection.HOST_TO_DEVICE} == {ops.COPY_PATH_PROCESS}
        stats = ctrl.get_stats()
        assert stats["d2h_copy_path"] == "dma"
        # the CPU implementation ignores the path and says so
        assert stats["d2h"]["paths"] == ops.PATH_CPU and stats["h2d"]["paths"] == ops.PATH_CPU
    finally:
        ctrl.close()


@pytest.mark.parametrize("name,code", [("kernel", 1), ("auto", 0), ("process", -1), ("DMA", 2)])
def test_the_argument_picks_the_d2h_path(name: str, code: int) -> None:
    ctrl = _controller("cpu", async_launch=False, d2h_copy_path=name)
    try:
        calls = _spy(ctrl)
        _step(ctrl)
        assert {p for m, p in calls if m == CopyDirection.DEVICE_TO_HOST} == {code}
        assert ctrl.get_stats()["d2h_copy_path"] == name.lower()
    finally:
        ctrl.close()


def test_the_environment_does_not_pick_the_d2h_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """The d2h path is the worker's argument only: the old FDKV_D2H_COPY_PATH variable is
    not read (a tuning knob is an option, not an environment variable)."""
    monkeypatch.setenv("FDKV_D2H_COPY_PATH", "kernel")
    ctrl = _controller("cpu")
    try:
        assert ctrl.transfer_manager.d2h_copy_path == "dma"
    finally:
        ctrl.close()


def test_bad_values_are_rejected_naming_the_setting() -> None:
    from fastdeploy_kvcache.worker import CacheController

    capi_or_skip()
    with pytest.raises(ValueError, match="d2h_copy_path"):
        CacheController(small_config(), backend="cpu", d2h_copy_path="sideways")
