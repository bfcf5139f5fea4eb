"""Worker side on a real GPU (CuPy backend + the CUDA C ABI library).

* One race test per ordering rule, each run twice: with the rule's fence the data is right;
  with the fence switched off (``disabled_rules``) the corruption the fence prevents appears.
  A spin kernel on the stream that must go first widens the race window to ~20 ms, so the
  unfenced order is what actually happens.
* A random multi-step trace of evictions, backups and loads concurrent with a "compute"
  stream that reads loaded blocks (after ``wait_for_layer``) and writes fresh blocks, checked
  against a shadow model, plus random spin kernels on every stream.
* Injected failures: a failed copy is reported failed and never served.

Run on the device tool: ``bash build.sh gpu && python -m pytest -q tests/gpu``.
"""

from __future__ import annotations

import ctypes
import os
import random
import shutil
import subprocess
import sys
from typing import Any, Optional

import numpy as np
import pytest

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, CopyDirection, TransferKind

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy", reason="needs CuPy and a CUDA GPU (run on the device tool)")


def _gpu_ready() -> Optional[str]:
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU visible"
    except Exception as exc:  # noqa: BLE001
        return f"no usable CUDA GPU ({exc})"
    from fastdeploy_kvcache import ops

    try:
        capi = ops.load_capi(variant="cuda")
    except ops.OpsNotBuiltError as exc:
        return f"CUDA C ABI library missing: {exc}"
    if not capi.is_cuda:
        return "the loaded libfdkv_capi is the CPU build; run `bash build.sh gpu`"
    return None


_reason = _gpu_ready()
if _reason is not None:
    pytest.skip(f"needs a CUDA GPU, CuPy and `bash build.sh gpu` (device tool): {_reason}", allow_module_level=True)

from fastdeploy_kvcache.worker import CacheController, LayerSwapError  # noqa: E402
from fastdeploy_kvcache.worker.transfer_manager import _CheckedIds  # noqa: E402
from fastdeploy_kvcache.worker.backends.faulty import CopyCall, FaultInjectingBackend  # noqa: E402

SPIN_SRC = r"""
extern "C" __global__ void spin(long long cycles) {
    long long start = clock64();
    while (clock64() - start < cycles) { }
}
"""
_spin_kernel = cp.RawKernel(SPIN_SRC, "spin")


def _clock_khz() -> int:
    try:
        return int(cp.cuda.Device(0).attributes["ClockRate"])
    except Exception:  # noqa: BLE001 - CUDA 13 dropped cudaDeviceProp.clockRate
        return int(cp.cuda.runtime.getDeviceProperties(0).get("clockRate", 1_700_000))


_CLOCK_KHZ = _clock_khz()


def spin(stream: Any, ms: float = 20.0) -> None:
    """Occupy ``stream`` for about ``ms`` milliseconds (one thread, so other streams run)."""
    clock_khz = _CLOCK_KHZ
    with stream:
        _spin_kernel((1,), (1,), (np.int64(int(ms * clock_khz)),))


def value(seed: int, layer: int, kind: int) -> int:
    return (seed * 7 + layer * 3 + kind + 1) % 251


def make_ctrl(disabled: set[int] = frozenset(), layers: int = 4, blocks: int = 16, **cfg: Any) -> CacheController:
    config = CacheConfig(num_layers=layers, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16",
                         num_gpu_blocks=blocks, num_host_blocks=blocks, **cfg)
    # The race tests pass their rule; the random test passes the rules it runs without.
    ctrl = CacheController(config, backend="cupy", disabled_rules=set(disabled) if disabled else None)
    ctrl.initialize_kv_cache()
    ctrl.initialize_host_cache()
    return ctrl


@pytest.fixture
def compute():
    """A non-blocking compute stream, made current for the test's duration."""
    stream = cp.cuda.Stream(non_blocking=True)
    with stream:
        yield stream
    cp.cuda.runtime.deviceSynchronize()


def fill(ctrl: CacheController, block: int, seed: int) -> None:
    """Compute-side write on the current stream: every layer/kind of ``block``."""
    for layer in range(ctrl.num_layers):
        for kind, array in enumerate(ctrl.layer_caches(layer)):
            array[block] = value(seed, layer, kind)


def device_seed(ctrl: CacheController, block: int) -> Optional[int]:
    cp.cuda.runtime.deviceSynchronize()
    seeds = set()
    for layer in range(ctrl.num_layers):
        for kind, array in enumerate(ctrl.layer_caches(layer)):
            vals = set(cp.unique(array[block]).get().tolist())
            if len(vals) != 1:
                return None
            seeds.add(_inverse(int(vals.pop()), layer, kind))
    return seeds.pop() if len(seeds) == 1 else None


def host_seed(ctrl: CacheController, hblock: int) -> Optional[int]:
    cp.cuda.runtime.deviceSynchronize()
    seeds = set()
    nbytes = ctrl.config.bytes_per_layer_block
    for layer in range(ctrl.num_layers):
        names = ctrl.cache_names(layer)
        for kind, name in enumerate(("key", "value")):
            raw = ctypes.string_at(ctrl.host_cache_kvs_map[names[name]] + hblock * nbytes, nbytes)
            vals = set(np.unique(np.frombuffer(raw, np.float16)).tolist())
            if len(vals) != 1:
                return None
            seeds.add(_inverse(int(vals.pop()), layer, kind))
    return seeds.pop() if len(seeds) == 1 else None


def _inverse(v: int, layer: int, kind: int) -> Optional[int]:
    for seed in range(251):
        if value(seed, layer, kind) == v:
            return seed
    return None


def evict(dev, host, kind=TransferKind.EVICT) -> CacheSwapMetadata:
    return CacheSwapMetadata(list(dev), list(host), CacheLevel.DEVICE, CacheLevel.HOST, kind=kind)


def swap_in(host, dev) -> CacheSwapMetadata:
    return CacheSwapMetadata(list(host), list(dev), CacheLevel.HOST, CacheLevel.DEVICE)


def settle(ctrl: CacheController) -> None:
    ctrl.collect_finished(wait=True)
    cp.cuda.runtime.deviceSynchronize()


ENFORCED = [pytest.param(True, id="enforced"), pytest.param(False, id="disabled")]


# ---------------------------------------------------------------------- ordering rules
@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule1_copy_waits_for_compute_that_wrote_the_block(compute, enforced) -> None:
    ctrl = make_ctrl(set() if enforced else {1})
    fill(ctrl, 1, seed=1)
    settle(ctrl)
    spin(compute)
    fill(ctrl, 1, seed=2)  # this step's compute, still behind the spin
    ctrl.submit_swap_tasks(evict([1], [4], TransferKind.BACKUP), None)
    settle(ctrl)
    assert (host_seed(ctrl, 4) == 2) is enforced
    ctrl.close()


@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule2_compute_waits_for_the_eviction_reading_a_freed_block(compute, enforced) -> None:
    ctrl = make_ctrl(set() if enforced else {2})
    fill(ctrl, 1, seed=1)
    settle(ctrl)
    spin(ctrl.transfer_manager.output_stream)
    ctrl.submit_swap_tasks(evict([1], [4]), None)  # write_back: block 1 freed ...
    fill(ctrl, 1, seed=2)  # ... and rewritten by this step's compute
    settle(ctrl)
    assert (host_seed(ctrl, 4) == 1) is enforced
    assert device_seed(ctrl, 1) == 2
    ctrl.close()


@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule2_load_waits_for_the_eviction_reading_its_destination(compute, enforced) -> None:
    ctrl = make_ctrl(set() if enforced else {2})
    fill(ctrl, 0, seed=3)
    fill(ctrl, 1, seed=1)
    ctrl.submit_swap_tasks(evict([0], [6], TransferKind.BACKUP), None)
    settle(ctrl)
    spin(ctrl.transfer_manager.output_stream)
    ctrl.submit_swap_tasks(evict([1], [4], TransferKind.BACKUP), swap_in([6], [1]))
    settle(ctrl)
    assert (host_seed(ctrl, 4) == 1) is enforced
    assert device_seed(ctrl, 1) == 3
    ctrl.close()


@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule3_layer_compute_reads_after_its_load(compute, enforced) -> None:
    ctrl = make_ctrl(set() if enforced else {3})
    fill(ctrl, 0, seed=5)
    ctrl.submit_swap_tasks(evict([0], [2], TransferKind.BACKUP), None)
    settle(ctrl)
    spin(ctrl.transfer_manager.input_stream)
    counter = ctrl.submit_swap_tasks(None, swap_in([2], [3]))
    seen = []
    for layer in range(ctrl.num_layers):
        counter.wait_for_layer(layer)  # device-side wait on the compute stream
        seen.append(ctrl.layer_caches(layer)[0][3].copy())  # the "attention" read
    settle(ctrl)
    expect = [ctrl.layer_caches(layer)[0][3] for layer in range(ctrl.num_layers)]
    assert all(bool((s == e).all()) for s, e in zip(seen, expect)) is enforced
    ctrl.close()


@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule4_host_block_read_by_a_load_is_not_overwritten(compute, enforced) -> None:
    ctrl = make_ctrl(set() if enforced else {4})
    fill(ctrl, 0, seed=6)
    fill(ctrl, 1, seed=7)
    ctrl.submit_swap_tasks(evict([0], [3], TransferKind.BACKUP), None)
    settle(ctrl)
    spin(ctrl.transfer_manager.input_stream)
    ctrl.submit_swap_tasks(None, swap_in([3], [5]))  # step k: load reads host 3
    ctrl.submit_swap_tasks(evict([1], [3], TransferKind.BACKUP), None)  # step k+1 rewrites host 3
    settle(ctrl)
    assert (device_seed(ctrl, 5) == 6) is enforced
    ctrl.close()


@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule5_load_reads_host_blocks_after_the_eviction_into_them(compute, enforced) -> None:
    ctrl = make_ctrl(set() if enforced else {5})
    fill(ctrl, 1, seed=8)
    settle(ctrl)
    spin(ctrl.transfer_manager.output_stream)
    ctrl.submit_swap_tasks(evict([1], [4], TransferKind.BACKUP), swap_in([4], [2]))
    settle(ctrl)
    assert (device_seed(ctrl, 2) == 8) is enforced
    ctrl.close()


@pytest.mark.parametrize("after_loads", [True, False], ids=["backups-after-loads", "backups-beside-loads"])
def test_a_backup_starts_after_the_same_steps_load_on_gpu(compute, after_loads) -> None:
    """A spin kernel holds the load; the backup of the same step (no shared block) ends after
    the load with backups_after_loads, while the spin still runs without it."""
    ctrl = make_ctrl()
    tm = ctrl.transfer_manager
    tm.backups_after_loads = after_loads
    fill(ctrl, 0, seed=3)
    fill(ctrl, 1, seed=9)
    ctrl.submit_swap_tasks(evict([0], [0], TransferKind.BACKUP), None)
    settle(ctrl)
    spin(tm.input_stream)
    ctrl.submit_swap_tasks(evict([1], [1], TransferKind.BACKUP), swap_in([0], [2]))
    tm.flush_launches()
    backup_done = cp.cuda.Event(disable_timing=True)
    backup_done.record(tm.output_stream)
    load_done = cp.cuda.Event(disable_timing=True)
    load_done.record(tm.input_stream)
    backup_done.synchronize()
    assert load_done.done is after_loads
    settle(ctrl)
    assert device_seed(ctrl, 2) == 3 and host_seed(ctrl, 1) == 9
    ctrl.close()


def test_layer_events_serve_one_live_counter_only(compute) -> None:
    """No event object is handed to two loads whose counters are alive (an old counter's
    waits stay its own); once a counter is gone its events serve a later load."""
    import gc

    ctrl = make_ctrl()
    fill(ctrl, 0, seed=4)
    ctrl.submit_swap_tasks(evict([0], [0], TransferKind.BACKUP), None)
    settle(ctrl)
    counters: list = []
    for dst in (1, 2, 3):
        counter = ctrl.submit_swap_tasks(None, swap_in([0], [dst]))
        counter.wait_all()
        counters.append(counter)
        assert device_seed(ctrl, dst) == 4
    events = [[c._event_for(layer) for layer in range(ctrl.num_layers)] for c in counters]
    ids = [id(e) for layer_events in events for e in layer_events]
    assert len(set(ids)) == 3 * ctrl.num_layers
    settle(ctrl)  # the tasks are finished: only our list holds the counters
    first = {id(e) for e in events[0]}
    del counters[0], events[0]
    gc.collect()
    reused = ctrl.submit_swap_tasks(None, swap_in([0], [5]))
    reused.wait_all()
    assert {id(reused._event_for(layer)) for layer in range(ctrl.num_layers)} == first
    assert device_seed(ctrl, 5) == 4
    settle(ctrl)
    ctrl.close()


@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule5_fence_of_a_load_launched_from_the_submitting_thread(compute, enforced) -> None:
    """The eviction is launched before the load is submitted, so the load's stack goes out
    from the submitting thread with the eviction's done event among its waits."""
    ctrl = make_ctrl(set() if enforced else {5})
    tm = ctrl.transfer_manager
    fill(ctrl, 1, seed=8)
    settle(ctrl)
    spin(tm.output_stream)
    ctrl.submit_swap_tasks(evict([1], [4], TransferKind.BACKUP), None)
    tm.flush_launches()  # the backup is launched: the load needs no Python launcher
    python_launcher = tm._launchers[CopyDirection.HOST_TO_DEVICE]
    python_launcher.pause()  # a load handed to it would never be launched
    try:
        counter = ctrl.submit_swap_tasks(None, swap_in([4], [2]))
        counter.wait_all(timeout_s=10.0)  # launched here, not handed to the Python thread
    finally:
        python_launcher.resume()
    settle(ctrl)
    assert (device_seed(ctrl, 2) == 8) is enforced
    ctrl.close()


def test_a_layer_stack_failing_mid_way_fails_its_load_only(compute) -> None:
    """A CUDA failure at layer 2 of a launched stack (the test-only stack_fail_group
    option): waits on the counter raise with the group named, the metadata comes back
    failed, a backup fenced on the failed load still runs, and the next load is fine."""
    from fastdeploy_kvcache import ops

    capi = ops.load_capi(variant="cuda")
    ctrl = make_ctrl()
    fill(ctrl, 0, seed=9)
    fill(ctrl, 6, seed=11)
    ctrl.submit_swap_tasks(evict([0], [0], TransferKind.BACKUP), None)
    settle(ctrl)
    capi.set_option("stack_fail_group", 2)
    try:
        bad = swap_in([0], [3])
        backup = evict([6], [7], TransferKind.BACKUP)
        # The backup starts behind the load (backups after loads): it waits for the failed
        # stack to close and for its done event.
        counter = ctrl.submit_swap_tasks(backup, bad)
        with pytest.raises(LayerSwapError, match="group 2 of 4: injected failure"):
            for layer in range(ctrl.num_layers):
                counter.wait_for_layer(layer)
    finally:
        capi.set_option("stack_fail_group", -1)
    finished = ctrl.collect_finished(wait=True)
    assert bad in finished and backup in finished
    assert bad.success is False and "group 2 of 4" in (bad.error_message or "")
    assert backup.success and host_seed(ctrl, 7) == 11
    good = swap_in([0], [4])
    ctrl.submit_swap_tasks(None, good).wait_all()
    assert ctrl.collect_finished(wait=True) == [good] and good.success
    assert device_seed(ctrl, 4) == 9
    stats = ctrl.transfer_manager.get_stats()
    assert stats["h2d"]["failed"] == 1 and stats["in_flight"] == 0
    ctrl.close()


def test_a_queued_load_keeps_its_fence_events_alive(compute) -> None:
    """The native launcher is kept busy by a stack of 4096 one-block groups launched on it
    directly, so the load queues: its waits are enqueued after submit returned and after
    Python let go of its own references (collected here).  The task keeps its fence events
    (rule 1's compute event) alive until the stack is closed; a collected event made the
    queued wait fail (cudaErrorContextIsDestroyed)."""
    import gc

    from fastdeploy_kvcache import ops

    capi = ops.load_capi(variant="cuda")
    ctrl = make_ctrl()
    tm = ctrl.transfer_manager
    fill(ctrl, 0, seed=13)
    ctrl.submit_swap_tasks(evict([0], [0], TransferKind.BACKUP), None)
    settle(ctrl)
    groups = 4096
    busy_dev = cp.zeros((1, 256), np.uint8)
    busy_host = capi.host_alloc(256)
    busy_stream = cp.cuda.Stream(non_blocking=True)
    busy = capi.group_progress()
    try:
        capi.layer_stack_call(tm._stack_launcher, [busy_dev.data.ptr] * groups, [busy_host] * groups, 1, 1, 256, 1,
                              ops.CopyDirection.HOST_TO_DEVICE, stream=busy_stream.ptr,
                              inline_groups=0).launch([0], [0], busy)
        meta = swap_in([0], [5])
        counter = ctrl.submit_swap_tasks(None, meta)
        assert not busy.is_closed()  # the load is queued behind the busy stack
        gc.collect()
        counter.wait_all()
        assert ctrl.collect_finished(wait=True) == [meta] and meta.success, meta.error_message
        assert device_seed(ctrl, 5) == 13
    finally:
        assert busy.wait_closed(30.0)
        busy_stream.synchronize()
        capi.host_free(busy_host)
    ctrl.close()


def test_drain_waits_for_every_launched_stack(compute) -> None:
    """Loads submitted back to back behind a stream held busy: drain returns only once every
    one is enqueued by the native launcher and done (most of them queue behind the busy
    launcher)."""
    ctrl = make_ctrl(blocks=64)
    tm = ctrl.transfer_manager
    fill(ctrl, 0, seed=12)
    ctrl.submit_swap_tasks(evict([0], [0], TransferKind.BACKUP), None)
    settle(ctrl)
    spin(tm.input_stream, ms=50)
    metas = [swap_in([0], [dst]) for dst in range(1, 64)]
    for meta in metas:
        ctrl.submit_swap_tasks(None, meta)
    finished = ctrl.collect_finished(wait=True)
    assert set(map(id, finished)) == set(map(id, metas))
    assert [m.error_message for m in metas if not m.success] == []
    assert all(device_seed(ctrl, dst) == 12 for dst in range(1, 64))
    ctrl.close()


# ---------------------------------------------------------------------- random trace
CHECK_SRC = r"""
extern "C" __global__ void check(const unsigned short* a, const long long* blocks, const unsigned short* want,
                                 int nblocks, long long elems, unsigned int* errors) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < nblocks * elems;
         i += (long long)gridDim.x * blockDim.x) {
        long long b = i / elems;
        if (a[blocks[b] * elems + (i % elems)] != want[b]) atomicAdd(errors, 1u);
    }
}
"""
_check_kernel = cp.RawKernel(CHECK_SRC, "check")


def _bits(v: int) -> int:
    return int(np.array([v], np.float16).view(np.uint16)[0])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_swaps_concurrent_with_compute_keep_data_correct(compute, seed: int) -> None:
    """Shadow-checked random steps: evictions (write_back), backups, loads and compute.

    Per step, in the order the rules promise: device->host copies see the device as it was
    before the step's compute; loads see host blocks after this step's device->host copies;
    compute verifies each loaded layer on the GPU after ``wait_for_layer`` and then writes
    fresh blocks, some of them blocks freed by this step's evictions.
    """
    rng = random.Random(seed)
    nblocks = 24
    ctrl = make_ctrl(layers=6, blocks=nblocks)
    tm = ctrl.transfer_manager
    dev: dict[int, int] = {}  # device block -> seed it holds (absent: garbage/free)
    host: dict[int, int] = {}
    backing_up: set[int] = set()  # device blocks an unconfirmed backup reads (not writable)
    errors = cp.zeros(1, dtype=cp.uint32)
    next_seed = 1
    for b in range(nblocks):
        fill(ctrl, b, next_seed)
        dev[b] = next_seed
        next_seed = next_seed % 250 + 1
    pending: dict[int, CacheSwapMetadata] = {}
    for step in range(40):
        for meta in ctrl.collect_finished():
            assert meta.success, meta.error_message
            if meta.kind == TransferKind.BACKUP:
                backing_up.difference_update(meta.src_block_ids)
            pending.pop(meta.task_id, None)
        # --- device -> host: evictions (freed now) or backups (kept, not writable until done)
        src_pool = [b for b in dev if b not in backing_up]
        rng.shuffle(src_pool)
        n_out = rng.randint(0, 4)
        out_dev = src_pool[:n_out]
        out_host = rng.sample(range(nblocks), len(out_dev))
        kind = rng.choice([TransferKind.EVICT, TransferKind.BACKUP])
        ev_meta = evict(out_dev, out_host, kind) if out_dev else None
        # --- host -> device: loads into blocks nobody reads (free or evicted this step)
        new_host = dict(host)
        for d, h in zip(out_dev, out_host):
            new_host[h] = dev[d]
        freed = set(out_dev) if kind == TransferKind.EVICT else set()
        writable = [b for b in range(nblocks) if b not in backing_up and (b not in dev or b in freed or rng.random() < 0.3)]
        writable = [b for b in writable if not (kind == TransferKind.BACKUP and b in out_dev)]
        rng.shuffle(writable)
        load_src = [h for h in new_host if rng.random() < 0.3][: rng.randint(0, 5)]
        load_dst = writable[: len(load_src)]
        load_src = load_src[: len(load_dst)]
        in_meta = swap_in(load_src, load_dst) if load_dst else None
        # random spins so the streams interleave differently each step
        for stream in (tm.output_stream, tm.input_stream, compute):
            if rng.random() < 0.3:
                spin(stream, ms=rng.choice([0.05, 0.5, 2.0]))
        counter = ctrl.submit_swap_tasks(ev_meta, in_meta)
        for m in (ev_meta, in_meta):
            if m is not None:
                pending[m.task_id] = m
        if ev_meta is not None and kind == TransferKind.BACKUP:
            backing_up.update(out_dev)
        host = new_host
        for d in freed:
            dev.pop(d, None)
        for h, d in zip(load_src, load_dst):
            dev[d] = host[h]
        # --- compute: verify loaded blocks layer by layer, then write fresh blocks
        if counter is not None:
            ids = cp.asarray(load_dst, dtype=cp.int64)
            for layer in range(ctrl.num_layers):
                counter.wait_for_layer(layer)
                for kind_i, array in enumerate(ctrl.layer_caches(layer)):
                    want = cp.asarray([_bits(value(dev[d], layer, kind_i)) for d in load_dst], dtype=cp.uint16)
                    elems = array[0].size
                    _check_kernel((32,), (256,), (array.view(cp.uint16), ids, want, np.int32(len(load_dst)),
                                                  np.int64(elems), errors))
        loaded = set(load_dst)
        for b in [b for b in writable[len(load_dst):] if b not in loaded][: rng.randint(0, 4)]:
            fill(ctrl, b, next_seed)
            dev[b] = next_seed
            next_seed = next_seed % 250 + 1
    for meta in ctrl.collect_finished(wait=True):
        assert meta.success, meta.error_message
    cp.cuda.runtime.deviceSynchronize()
    assert int(errors.get()[0]) == 0, "compute read a loaded block before its bytes were right"
    for b, s in dev.items():
        assert device_seed(ctrl, b) == s, f"device block {b}"
    for h, s in host.items():
        assert host_seed(ctrl, h) == s, f"host block {h}"
    stats = ctrl.get_stats()
    assert stats["in_flight"] == 0 and stats["d2h"]["failed"] == 0 and stats["h2d"]["failed"] == 0
    ctrl.close()


# ---------------------------------------------------------------------- failures
@pytest.mark.parametrize("seed", [3])
def test_paced_launcher_keeps_data_correct(compute, seed: int) -> None:
    """The shadow-checked random steps with the launcher paced at every group
    (``launch_lead_bytes`` 1: each group waits until the one before it landed): pacing may
    only delay enqueues, never reorder a group against its event or fence."""
    from fastdeploy_kvcache import ops

    capi = ops.load_capi(variant="cuda")
    before = capi.get_option("launch_lead_bytes")
    capi.set_option("launch_lead_bytes", 1)
    try:
        test_random_swaps_concurrent_with_compute_keep_data_correct(compute, seed)
    finally:
        capi.set_option("launch_lead_bytes", before)


def test_injected_failure_is_reported_and_never_served(compute) -> None:
    ctrl = make_ctrl()
    fill(ctrl, 0, seed=9)
    ctrl.submit_swap_tasks(evict([0], [0], TransferKind.BACKUP), None)
    settle(ctrl)

    def inject(call: CopyCall) -> None:
        if call.direction.short == "h2d" and call.layer == 2:
            raise RuntimeError("injected: cudaErrorIllegalAddress")

    # The fault comes from below the transfer manager: the load still takes the native
    # layer-stack launch, whose one call then fails (nothing of it is enqueued).
    faults = ctrl.transfer_manager.wrap_backend(FaultInjectingBackend)
    faults.rule = inject
    assert faults.has_layer_groups, "the load would not take the native layer-stack launch"
    bad = swap_in([0], [3])
    counter = ctrl.submit_swap_tasks(None, bad)
    with pytest.raises(LayerSwapError, match="cudaErrorIllegalAddress"):
        for layer in range(ctrl.num_layers):  # layers before 2 may pass; 2 must raise
            counter.wait_for_layer(layer)
    assert ctrl.collect_finished(wait=True) == [bad] and bad.success is False
    faults.rule = None
    good = swap_in([0], [4])
    ctrl.submit_swap_tasks(None, good).wait_all()
    assert ctrl.collect_finished(wait=True) == [good] and good.success
    assert device_seed(ctrl, 4) == 9
    ctrl.close()


def test_op_validation_error_fails_the_metadata(compute) -> None:
    """The op's own id check (bypassing the worker's) surfaces as a failed metadata."""
    ctrl = make_ctrl()
    tm = ctrl.transfer_manager
    # Let the op see the bad id: the worker's check passes it through as it converts ids.
    tm._validate = lambda meta, direction: _CheckedIds(
        None, tm.backend.prepare_ids(meta.dst_block_ids), tm.backend.prepare_ids(meta.src_block_ids)
    )
    bad = swap_in([99], [1])
    counter = ctrl.submit_swap_tasks(None, bad)
    with pytest.raises(LayerSwapError):
        counter.wait_for_layer(0)
    assert ctrl.collect_finished(wait=True) == [bad] and not bad.success
    assert "SwapOpError" in (bad.error_message or ""), bad.error_message
    ctrl.close()


def test_short_run_for_sanitizers(compute) -> None:
    """A few real copies both ways with compute in between (run under compute-sanitizer)."""
    ctrl = make_ctrl(layers=2, blocks=8, num_extra_layers=1)
    for b in range(4):
        fill(ctrl, b, seed=b + 1)
    ctrl.submit_swap_tasks(evict([0, 1, 2, 3], [4, 5, 6, 7], TransferKind.BACKUP), None)
    counter = ctrl.submit_swap_tasks(evict([0], [0]), swap_in([4, 5, 6], [5, 6, 7]))
    for layer in range(ctrl.num_layers):
        counter.wait_for_layer(layer)
        _ = ctrl.layer_caches(layer)[1][5:8].sum()
    fill(ctrl, 0, seed=20)
    settle(ctrl)
    assert [device_seed(ctrl, b) for b in (5, 6, 7)] == [1, 2, 3]
    assert host_seed(ctrl, 0) == 1
    ctrl.close()


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_compute_sanitizer_on_a_short_worker_run(tool: str) -> None:
    """compute-sanitizer finds no error on a short worker run (worker_sanitizer_smoke.py)."""
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        pytest.skip("needs compute-sanitizer (CUDA toolkit) on PATH or in /usr/local/cuda/bin")
    script = os.path.join(os.path.dirname(__file__), "worker_sanitizer_smoke.py")
    proc = subprocess.run([exe, "--tool", tool, "--error-exitcode", "99", sys.executable, script],
                          capture_output=True, text=True, timeout=500)
    out = proc.stdout + proc.stderr
    log_dir = os.environ.get("FDKV_SANITIZER_LOG_DIR")
    if log_dir:
        with open(os.path.join(log_dir, f"worker_sanitizer_{tool}.log"), "w") as fh:
            fh.write(out)
    assert proc.returncode == 0, out[-4000:]
    assert "worker sanitizer smoke: ok" in out
    if tool == "memcheck":
        assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
    else:
        assert "RACECHECK SUMMARY: 0 hazards" in out or "hazard" not in out.lower(), out[-4000:]


def test_host_cache_pinned_in_the_background_as_one_piece_serves_cuda_copies(compute) -> None:
    """The default with CUDA copies (FDKV_HOST_GROW_CHUNK_MIB unset): the whole host cache lands at once (one
    registration), no partial count is published, and all-layer copies in both directions
    through it keep the data (a copy across two registrations fails with
    cudaErrorInvalidValue, so pieces are refused)."""
    import time

    config = CacheConfig(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16, dtype="float16",
                         num_gpu_blocks=16, num_host_blocks=16)
    ctrl = CacheController(config, backend="cupy")
    try:
        ctrl.initialize_kv_cache()
        with pytest.raises(ValueError, match="grow_in_pieces=True with CUDA copies"):
            ctrl.initialize_host_cache(grow_chunk_bytes=config.bytes_per_block, grow_in_pieces=True)
        ctrl.initialize_host_cache(grow_chunk_bytes=None, grow_pace_s=30.0)  # the default with CUDA copies
        seen = set()
        deadline = time.monotonic() + 30
        while ctrl.host_blocks_ready < 16:
            assert time.monotonic() < deadline, "the one piece never landed"
            seen.add(ctrl.host_blocks_ready)
            time.sleep(0.001)
        assert seen <= {0}
        for b in range(4):
            fill(ctrl, b, seed=10 + b)
        ctrl.submit_swap_tasks(evict(range(4), range(8, 12), TransferKind.BACKUP), None)
        settle(ctrl)
        assert [host_seed(ctrl, h) for h in range(8, 12)] == [10, 11, 12, 13]
        ctrl.submit_swap_tasks(None, swap_in(range(8, 12), range(12, 16)))
        settle(ctrl)
        assert [device_seed(ctrl, d) for d in range(12, 16)] == [10, 11, 12, 13]
    finally:
        ctrl.close()
