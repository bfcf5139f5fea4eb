"""CacheController + TransferManager on the CPU backends, with real bytes.

Covers allocation (names, shapes, quantized scales, extra draft layers), round trips,
statistics, id validation, injected failures, reset/free, and one deterministic race test
per ordering rule: a paused host-thread stream widens the race window the way a spin kernel
does on a GPU, and each test shows the corruption without the rule's fence and its absence
with it.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, CopyDirection, TransferKind
from fastdeploy_kvcache.worker import LayerSwapError
from fastdeploy_kvcache.worker.backends.faulty import CopyCall, FaultInjectingBackend

from worker_helpers import block_seed, device_block_bytes, fill_block, host_block_bytes


def evict(dev: list[int], host: list[int], kind: TransferKind = TransferKind.EVICT) -> CacheSwapMetadata:
    return CacheSwapMetadata(list(dev), list(host), CacheLevel.DEVICE, CacheLevel.HOST, kind=kind)


def backup(dev: list[int], host: list[int]) -> CacheSwapMetadata:
    return evict(dev, host, TransferKind.BACKUP)


def swap_in(host: list[int], dev: list[int]) -> CacheSwapMetadata:
    return CacheSwapMetadata(list(host), list(dev), CacheLevel.HOST, CacheLevel.DEVICE, kind=TransferKind.SWAP_IN)


# ---------------------------------------------------------------------- allocation
def test_names_shapes_and_extra_draft_layers(make_controller) -> None:
    ctrl = make_controller(num_layers=2, num_extra_layers=1)
    assert ctrl.num_layers == 3
    names = ctrl.cache_names(2)
    assert names["key"] == "key_caches_2_rank0.device0"
    assert names["value"] == "value_caches_2_rank0.device0"
    caches = ctrl.get_kv_caches()
    assert set(caches) == {ctrl.cache_names(l)[k] for l in range(3) for k in ("key", "value")}
    assert tuple(caches[names["key"]].shape) == (8, 2, 4, 8)
    assert len(ctrl.host_cache_kvs_map) == 6


@pytest.mark.parametrize("backend", ["cpu", "paddle"])
def test_quantized_cache_has_fp32_scales_that_travel(make_controller, backend: str) -> None:
    ctrl = make_controller(backend=backend, dtype="uint8", kv_cache_quant="int8", num_extra_layers=1)
    names = ctrl.cache_names(0)
    scale = ctrl.get_kv_caches()[names["key_scale"]]
    assert tuple(scale.shape) == (8, 2, 4) and "float32" in str(scale.dtype)
    assert names["value_scale"] == "value_cache_scales_0_rank0.device0"
    fill_block(ctrl, 1, seed=11)
    ctrl.submit_swap_tasks(backup([1], [5]), None)
    assert [m.success for m in ctrl.collect_finished(wait=True)] == [True]
    counter = ctrl.submit_swap_tasks(None, swap_in([5], [6]))
    counter.wait_all()
    assert block_seed(ctrl, 6) == 11  # K, V and both scales of all 3 layers
    assert device_block_bytes(ctrl, 6) == device_block_bytes(ctrl, 1)


@pytest.mark.parametrize("quantized,head_dim", [(False, 8), (True, 8), (False, 3)])
def test_host_buffers_are_one_slab_in_lane_order(make_controller, monkeypatch, quantized: bool,
                                                 head_dim: int) -> None:
    """The host buffers sit back to back in one allocation, in the all-layer call's tensor
    order (the copy op's 2D rows need one pitch), each 256-byte aligned (head_dim 3: 384-byte
    buffers), and free_cache() frees that one allocation."""
    cfg = {"dtype": "uint8", "kv_cache_quant": "int8"} if quantized else {}
    ctrl = make_controller(num_layers=3, head_dim=head_dim, **cfg)
    kinds = ("key", "value", "key_scale", "value_scale") if quantized else ("key", "value")
    order = [ctrl.cache_names(layer)[kind] for layer in range(3) for kind in kinds]
    ptrs = [ctrl.host_cache_kvs_map[name] for name in order]
    sizes = [ctrl._host_nbytes[name] for name in order]
    padded = [-(-n // 256) * 256 for n in sizes]  # each buffer 256-byte aligned
    assert [b - a for a, b in zip(ptrs, ptrs[1:])] == padded[:-1]  # back to back, in lane order
    assert all(p % 256 == 0 for p in ptrs)
    if not quantized:
        assert len(set(sizes)) == 1  # every key/value buffer at one pitch
    freed: list[int] = []
    real_free = ctrl.backend.host_free
    monkeypatch.setattr(ctrl.backend, "host_free", lambda p: (freed.append(p), real_free(p)))
    ctrl.free_cache()
    assert freed == [ptrs[0]] and ctrl.host_cache_kvs_map == {}
    ctrl.initialize_host_cache()  # and a fresh one can be made after
    assert len(ctrl.host_cache_kvs_map) == len(order)


def test_paddle_caches_of_one_shape_are_views_of_one_slab_the_ops_write_through(make_controller) -> None:
    """The Paddle backends carve an unquantized model's key/value caches out of one tensor
    (views at one pitch); the custom ops must write the views in place, not copies of them:
    a backup then a load into another block has to land in the slab."""
    ctrl = make_controller(backend="paddle", num_layers=3)
    caches = [ctrl.get_kv_caches()[ctrl.cache_names(l)[k]] for l in range(3) for k in ("key", "value")]
    ptrs = [c.data_ptr() for c in caches]
    assert len({b - a for a, b in zip(ptrs, ptrs[1:])}) == 1
    assert ptrs[1] - ptrs[0] == int(caches[0].numel()) * caches[0].element_size()  # packed
    assert [int(c.offset) for c in caches] == [i * (ptrs[1] - ptrs[0]) for i in range(6)]  # views of one tensor
    fill_block(ctrl, 2, seed=5)
    ctrl.submit_swap_tasks(backup([2], [4]), None)
    assert [m.success for m in ctrl.collect_finished(wait=True)] == [True]
    counter = ctrl.submit_swap_tasks(None, swap_in([4], [7]))
    counter.wait_all()
    assert [m.success for m in ctrl.collect_finished(wait=True)] == [True]
    assert block_seed(ctrl, 7) == 5
    assert device_block_bytes(ctrl, 7) == device_block_bytes(ctrl, 2)
    assert [c.data_ptr() for c in caches] == ptrs  # still the slab's views


def test_rank_in_names_is_modulo_tensor_parallel(make_controller) -> None:
    from fastdeploy_kvcache.worker import CacheController
    from worker_helpers import capi_or_skip, small_config

    capi_or_skip()
    ctrl = CacheController(small_config(tensor_parallel_size=2), local_rank=3, device_id=1, backend="cpu")
    assert ctrl.cache_names(0)["key"] == "key_caches_0_rank1.device1"
    ctrl.close()


# ---------------------------------------------------------------------- round trips
@pytest.mark.parametrize("launch", [False, True])
@pytest.mark.parametrize("threaded", [False, True])
@pytest.mark.parametrize("backend", ["cpu", "paddle"])
def test_evict_then_load_round_trip_and_stats(make_controller, backend: str, threaded: bool, launch: bool) -> None:
    ctrl = make_controller(backend=backend, threaded=threaded, async_launch=launch)
    for block, seed in ((0, 3), (2, 4), (3, 5)):
        fill_block(ctrl, block, seed)
    ctrl.submit_swap_tasks(evict([0, 2, 3], [7, 1, 2]), None)
    done = ctrl.collect_finished(wait=True)
    assert [m.success for m in done] == [True]
    assert host_block_bytes(ctrl, 7) == device_block_bytes(ctrl, 0)
    counter = ctrl.submit_swap_tasks(None, swap_in([1, 2, 7], [5, 6, 4]))
    for layer in range(ctrl.num_layers):
        counter.wait_for_layer(layer)
    assert [block_seed(ctrl, b) for b in (5, 6, 4)] == [4, 5, 3]
    done = ctrl.collect_finished(wait=True)
    assert [m.success for m in done] == [True]
    stats = ctrl.get_stats()
    per_block = ctrl.config.bytes_per_block
    assert stats["d2h"]["bytes"] == 3 * per_block and stats["h2d"]["bytes"] == 3 * per_block
    assert stats["d2h"]["tasks"] == 1 and stats["h2d"]["blocks"] == 3
    assert stats["in_flight"] == 0 and stats["d2h"]["seconds"] >= 0


def test_nothing_is_reported_before_its_bytes_moved(make_controller) -> None:
    ctrl = make_controller()
    ctrl.transfer_manager.output_stream.pause()
    meta = backup([1], [1])
    ctrl.submit_swap_tasks(meta, None)
    assert ctrl.collect_finished() == [] and not meta.success
    assert ctrl.get_stats()["in_flight_tasks"] == [meta.task_id]
    ctrl.transfer_manager.output_stream.resume()
    assert ctrl.collect_finished(wait=True) == [meta] and meta.success


def test_empty_metadata_completes_without_a_counter(make_controller) -> None:
    ctrl = make_controller()
    assert ctrl.submit_swap_tasks(evict([], []), swap_in([], [])) is None
    assert all(m.success for m in ctrl.collect_finished(wait=True))


# ---------------------------------------------------------------------- failures
@pytest.mark.parametrize(
    "meta, match",
    [
        (swap_in([8], [0]), "host block id 8 at index 0 is out of range"),
        (swap_in([0, 1], [3, 3]), "duplicate destination block id 3 at index 1"),
        # A bool is an int to Python (and to array('q')): block True is a bug, not block 1.
        (swap_in([0, True], [1, 2]), "host block id True at index 1 is out of range"),
        (swap_in([2, 3], [1.0, 2]), "device block id 1.0 at index 0 is out of range"),
        (evict([9], [0]), "device block id 9 at index 0"),
        (CacheSwapMetadata([0], [0], CacheLevel.HOST, CacheLevel.HOST), "expects"),
    ],
)
def test_bad_ids_fail_the_metadata_and_write_nothing(make_controller, meta, match) -> None:
    ctrl = make_controller()
    fill_block(ctrl, 3, seed=9)
    before = [device_block_bytes(ctrl, b) for b in range(8)]
    if meta.dst_type is CacheLevel.DEVICE:
        counter = ctrl.submit_swap_tasks(None, meta)
        with pytest.raises(LayerSwapError, match=match):
            counter.wait_for_layer(0)
    else:
        ctrl.submit_swap_tasks(meta, None)
    done = ctrl.collect_finished(wait=True)
    assert done == [meta] and meta.success is False and match.split(" at")[0] in meta.error_message
    assert [device_block_bytes(ctrl, b) for b in range(8)] == before
    assert ctrl.get_stats()["d2h" if meta.dst_type is CacheLevel.HOST else "h2d"]["failed"] == 1


@pytest.mark.parametrize("backend", ["cpu", "paddle"])
def test_injected_op_failure_on_a_load_layer(make_controller, backend: str) -> None:
    ctrl = make_controller(backend=backend, num_layers=3, async_launch=backend == "paddle")
    fill_block(ctrl, 0, seed=1)
    ctrl.submit_swap_tasks(backup([0], [0]), None)
    ctrl.collect_finished(wait=True)

    def inject(call: CopyCall) -> None:
        if call.direction is CopyDirection.HOST_TO_DEVICE and call.layer == 1:
            raise RuntimeError("injected CUDA error: an illegal memory access was encountered")

    faults = ctrl.transfer_manager.wrap_backend(FaultInjectingBackend)
    faults.rule = inject
    bad = swap_in([0], [4])
    counter = ctrl.submit_swap_tasks(None, bad)
    with pytest.raises(LayerSwapError, match="illegal memory access"):
        counter.wait_for_layer(2)
    done = ctrl.collect_finished(wait=True)
    assert done == [bad] and not bad.success and "illegal memory access" in bad.error_message
    # Later tasks are unaffected.
    faults.rule = None
    good = swap_in([0], [5])
    ctrl.submit_swap_tasks(None, good).wait_all()
    assert ctrl.collect_finished(wait=True) == [good] and good.success and block_seed(ctrl, 5) == 1


def test_injected_op_failure_on_an_eviction(make_controller) -> None:
    ctrl = make_controller()

    def inject(call: CopyCall) -> None:
        if call.direction is CopyDirection.DEVICE_TO_HOST:
            raise MemoryError("injected")

    ctrl.transfer_manager.wrap_backend(FaultInjectingBackend).rule = inject
    meta = evict([1, 2], [3, 4])
    ctrl.submit_swap_tasks(meta, None)
    assert ctrl.collect_finished(wait=True) == [meta]
    assert meta.success is False and "MemoryError: injected" in meta.error_message


def test_a_failed_copy_is_reported_failed_even_if_the_op_ran_partly(make_controller) -> None:
    ctrl = make_controller()
    calls = []

    def inject(call: CopyCall) -> None:
        calls.append(call.layer)
        if call.layer == 1:
            raise RuntimeError("second layer")

    ctrl.transfer_manager.wrap_backend(FaultInjectingBackend).rule = inject
    meta = swap_in([0], [1])
    ctrl.submit_swap_tasks(None, meta)
    ctrl.collect_finished(wait=True)
    assert calls == [0, 1] and not meta.success


# ---------------------------------------------------------------------- lifecycle
@pytest.mark.parametrize("backend", ["cpu", "paddle"])
def test_reset_zeroes_and_free_releases(make_controller, backend: str) -> None:
    ctrl = make_controller(backend=backend)
    fill_block(ctrl, 2, seed=4)
    ctrl.submit_swap_tasks(backup([2], [2]), None)
    ctrl.reset_cache()
    assert all(not np.frombuffer(x, np.uint8).any() for x in device_block_bytes(ctrl, 2))
    assert all(not np.frombuffer(x, np.uint8).any() for x in host_block_bytes(ctrl, 2))
    assert ctrl.get_stats()["d2h"]["bytes"] == 0
    ctrl.free_cache()
    assert ctrl.get_kv_caches() == {} and ctrl.host_cache_kvs_map == {}
    meta = swap_in([0], [0])
    counter = ctrl.submit_swap_tasks(None, meta)
    with pytest.raises(LayerSwapError, match="not initialized"):
        counter.wait_for_layer(0)


def test_unknown_disabled_rules_are_refused() -> None:
    from fastdeploy_kvcache.worker import CacheController
    from worker_helpers import capi_or_skip, small_config

    capi_or_skip()
    with pytest.raises(ValueError, match="unknown ordering rule 6"):
        CacheController(small_config(), backend="cpu", disabled_rules={1, 6})


# ---------------------------------------------------------------------- ordering rules
# Each test builds the race with paused streams and runs twice: with the rule's fence (data
# correct) and with it disabled (the corruption the fence prevents must appear).
ENFORCED = [pytest.param(True, id="enforced"), pytest.param(False, id="disabled")]
# Copies launched on the calling thread, or by the launcher thread the GPU backends use.
LAUNCH = [pytest.param(False, id="inline-launch"), pytest.param(True, id="launcher-thread")]


def _race(ctrl, enforced: bool, paused, victim, *others) -> None:
    """Let the race play out: ``paused`` holds the copy the fence orders ``victim`` after.

    With the fence, work on ``victim`` cannot get past the paused stream; without it, it runs
    ahead (we wait until it has), and only then is ``paused`` released.
    """
    backend = ctrl.backend
    ctrl.transfer_manager.flush_launches(10)  # the launcher thread has enqueued everything
    victim_reached = backend.record_event(victim)
    if enforced:
        assert not victim_reached.wait(0.05), "the fence did not hold the victim stream back"
    else:
        assert victim_reached.wait(10), "without the fence the victim should run ahead"
    paused.resume()
    ctrl.collect_finished(wait=True)
    for stream in (paused, victim, *others):
        assert backend.record_event(stream).wait(10)


@pytest.mark.parametrize("launch", LAUNCH)
@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule1_copy_waits_for_the_compute_that_wrote_the_block(make_controller, enforced, launch) -> None:
    ctrl = make_controller(disabled_rules=set() if enforced else {1}, async_launch=launch)
    backend = ctrl.backend
    compute = backend.create_stream()
    backend.use_compute_stream(compute)
    try:
        fill_block(ctrl, 1, seed=1)
        compute.pause()
        compute.submit(lambda: fill_block(ctrl, 1, seed=2))  # this step's compute writes block 1
        ctrl.submit_swap_tasks(backup([1], [4]), None)
        _race(ctrl, enforced, compute, ctrl.transfer_manager.output_stream)
    finally:
        backend.use_compute_stream(None)
    host_seed = host_block_bytes(ctrl, 4) == device_block_bytes(ctrl, 1)
    assert host_seed is enforced  # disabled: the copy read the block before compute wrote it


@pytest.mark.parametrize("launch", LAUNCH)
@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule2_compute_does_not_overwrite_a_block_being_evicted(make_controller, enforced, launch) -> None:
    ctrl = make_controller(disabled_rules=set() if enforced else {2}, async_launch=launch)
    backend = ctrl.backend
    compute = backend.create_stream()
    backend.use_compute_stream(compute)
    try:
        fill_block(ctrl, 1, seed=1)
        expected = device_block_bytes(ctrl, 1)
        ctrl.transfer_manager.output_stream.pause()
        ctrl.submit_swap_tasks(evict([1], [4]), None)  # block 1 is freed ...
        compute.submit(lambda: fill_block(ctrl, 1, seed=2))  # ... and reused in the same step
        _race(ctrl, enforced, ctrl.transfer_manager.output_stream, compute)
    finally:
        backend.use_compute_stream(None)
    assert (host_block_bytes(ctrl, 4) == expected) is enforced
    assert block_seed(ctrl, 1) == 2


@pytest.mark.parametrize("launch", LAUNCH)
@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule2_fences_compute_behind_a_merged_backup_and_eviction(make_controller, enforced, launch) -> None:
    """A step's device->host metadata merges backups and evictions: one eviction in it fences."""
    ctrl = make_controller(disabled_rules=set() if enforced else {2}, async_launch=launch)
    backend = ctrl.backend
    compute = backend.create_stream()
    backend.use_compute_stream(compute)
    try:
        fill_block(ctrl, 1, seed=1)
        fill_block(ctrl, 2, seed=3)
        expected = device_block_bytes(ctrl, 1)
        merged = CacheSwapMetadata.merged([backup([2], [5]), evict([1], [4])])
        ctrl.transfer_manager.output_stream.pause()
        ctrl.submit_swap_tasks(merged, None)  # block 1 is freed by the eviction ...
        compute.submit(lambda: fill_block(ctrl, 1, seed=2))  # ... and reused in the same step
        _race(ctrl, enforced, ctrl.transfer_manager.output_stream, compute)
    finally:
        backend.use_compute_stream(None)
    assert (host_block_bytes(ctrl, 4) == expected) is enforced
    assert block_seed(ctrl, 1) == 2 and merged.success


@pytest.mark.parametrize("launch", LAUNCH)
@pytest.mark.parametrize("frees", [True, False])
@pytest.mark.parametrize("kind", [TransferKind.EVICT, TransferKind.BACKUP])
def test_the_compute_fence_follows_frees_device_blocks_not_the_kind(make_controller, kind, frees, launch) -> None:
    """Rule 2's fence reads CacheSwapMetadata.frees_device_blocks; the kind is informational."""
    ctrl = make_controller(async_launch=launch)
    backend = ctrl.backend
    compute = backend.create_stream()
    backend.use_compute_stream(compute)
    try:
        fill_block(ctrl, 1, seed=1)
        meta = CacheSwapMetadata([1], [4], CacheLevel.DEVICE, CacheLevel.HOST, kind=kind, frees_device_blocks=frees)
        ctrl.transfer_manager.output_stream.pause()
        ctrl.submit_swap_tasks(meta, None)
        compute.submit(lambda: fill_block(ctrl, 3, seed=2))
        _race(ctrl, frees, ctrl.transfer_manager.output_stream, compute)  # held back only if it frees
    finally:
        backend.use_compute_stream(None)
    assert meta.success and block_seed(ctrl, 3) == 2


@pytest.mark.parametrize("launch", LAUNCH)
def test_a_backup_alone_does_not_hold_compute_back(make_controller, launch) -> None:
    """Backed-up blocks stay cached and are never rewritten, so compute need not wait for them."""
    ctrl = make_controller(async_launch=launch)
    backend = ctrl.backend
    compute = backend.create_stream()
    backend.use_compute_stream(compute)
    try:
        fill_block(ctrl, 1, seed=1)
        ctrl.transfer_manager.output_stream.pause()
        ctrl.submit_swap_tasks(backup([1], [4]), None)
        compute.submit(lambda: fill_block(ctrl, 3, seed=2))  # unrelated compute of the same step
        _race(ctrl, False, ctrl.transfer_manager.output_stream, compute)  # runs ahead: no fence
    finally:
        backend.use_compute_stream(None)
    assert block_seed(ctrl, 3) == 2 and block_seed(ctrl, 1) == 1


@pytest.mark.parametrize("launch", LAUNCH)
@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule2_load_does_not_overwrite_a_block_being_evicted(make_controller, enforced, launch) -> None:
    ctrl = make_controller(disabled_rules=set() if enforced else {2}, async_launch=launch)
    fill_block(ctrl, 0, seed=3)
    ctrl.submit_swap_tasks(backup([0], [6]), None)
    ctrl.collect_finished(wait=True)
    fill_block(ctrl, 1, seed=1)
    expected = device_block_bytes(ctrl, 1)
    ctrl.transfer_manager.output_stream.pause()
    # write_back eviction of block 1, and a load into the freed block 1, in one step.
    ctrl.submit_swap_tasks(backup([1], [4]), swap_in([6], [1]))
    _race(ctrl, enforced, ctrl.transfer_manager.output_stream, ctrl.transfer_manager.input_stream)
    assert (host_block_bytes(ctrl, 4) == expected) is enforced
    assert block_seed(ctrl, 1) == 3


@pytest.mark.parametrize("launch", LAUNCH)
@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule3_compute_reads_a_layer_only_after_its_load(make_controller, enforced, launch) -> None:
    ctrl = make_controller(disabled_rules=set() if enforced else {3}, async_launch=launch)
    backend = ctrl.backend
    fill_block(ctrl, 0, seed=5)
    ctrl.submit_swap_tasks(backup([0], [2]), None)
    ctrl.collect_finished(wait=True)
    compute = backend.create_stream()
    seen: list = []
    ctrl.transfer_manager.input_stream.pause()
    backend.use_compute_stream(compute)
    try:
        counter = ctrl.submit_swap_tasks(None, swap_in([2], [3]))
        for layer in range(ctrl.num_layers):
            counter.wait_for_layer(layer)  # on the compute stream: the caller never blocks
            compute.submit(lambda layer=layer: seen.append(ctrl.layer_caches(layer)[0][3].copy()))
        _race(ctrl, enforced, ctrl.transfer_manager.input_stream, compute)
    finally:
        backend.use_compute_stream(None)
    read_loaded = all(np.array_equal(s, ctrl.layer_caches(l)[0][3]) for l, s in enumerate(seen))
    assert read_loaded is enforced


@pytest.mark.parametrize("launch", LAUNCH)
@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule4_host_block_read_by_a_load_is_not_overwritten(make_controller, enforced, launch) -> None:
    ctrl = make_controller(disabled_rules=set() if enforced else {4}, async_launch=launch)
    fill_block(ctrl, 0, seed=6)
    ctrl.submit_swap_tasks(backup([0], [3]), None)
    ctrl.collect_finished(wait=True)
    fill_block(ctrl, 1, seed=7)
    ctrl.transfer_manager.input_stream.pause()
    ctrl.submit_swap_tasks(None, swap_in([3], [5]))  # step k: load reads host block 3
    ctrl.submit_swap_tasks(backup([1], [3]), None)  # step k+1: host block 3 written again
    _race(ctrl, enforced, ctrl.transfer_manager.input_stream, ctrl.transfer_manager.output_stream)
    assert (block_seed(ctrl, 5) == 6) is enforced


@pytest.mark.parametrize("launch", LAUNCH)
@pytest.mark.parametrize("enforced", ENFORCED)
def test_rule5_load_reads_host_blocks_after_the_eviction_into_them(make_controller, enforced, launch) -> None:
    ctrl = make_controller(disabled_rules=set() if enforced else {5}, async_launch=launch)
    fill_block(ctrl, 1, seed=8)
    ctrl.transfer_manager.output_stream.pause()
    # write_back: block 1 is evicted to host 4 and, in the same step, host 4 loaded into 2.
    ctrl.submit_swap_tasks(backup([1], [4]), swap_in([4], [2]))
    _race(ctrl, enforced, ctrl.transfer_manager.output_stream, ctrl.transfer_manager.input_stream)
    assert (block_seed(ctrl, 2) == 8) is enforced


def test_unrelated_copies_do_not_wait_on_each_other(make_controller) -> None:
    ctrl = make_controller()
    fill_block(ctrl, 0, seed=2)
    ctrl.submit_swap_tasks(backup([0], [0]), None)
    ctrl.collect_finished(wait=True)
    ctrl.transfer_manager.output_stream.pause()
    ctrl.submit_swap_tasks(backup([1], [1]), None)  # stuck behind the paused output stream
    counter = ctrl.submit_swap_tasks(None, swap_in([0], [2]))  # shares no block: not fenced
    counter.wait_all(timeout_s=10)
    assert block_seed(ctrl, 2) == 2
    ctrl.transfer_manager.output_stream.resume()


AFTER_LOADS = [pytest.param(True, id="backups-after-loads"), pytest.param(False, id="backups-beside-loads")]


@pytest.mark.parametrize("launch", LAUNCH)
@pytest.mark.parametrize("after_loads", AFTER_LOADS)
def test_a_backup_starts_after_the_same_steps_load(make_controller, after_loads, launch) -> None:
    """backups_after_loads: a backup sharing no block with the step's load waits for it
    (the output stream cannot get past the paused load); off, it runs beside the load."""
    ctrl = make_controller(async_launch=launch, backups_after_loads=after_loads)
    tm = ctrl.transfer_manager
    assert tm.backups_after_loads is after_loads
    fill_block(ctrl, 0, seed=3)
    fill_block(ctrl, 1, seed=9)
    ctrl.submit_swap_tasks(backup([0], [0]), None)
    ctrl.collect_finished(wait=True)
    host_before = host_block_bytes(ctrl, 1)
    tm.input_stream.pause()
    back, load = backup([1], [1]), swap_in([0], [2])
    counter = ctrl.submit_swap_tasks(back, load)
    _race(ctrl, after_loads, tm.input_stream, tm.output_stream)
    counter.wait_all(timeout_s=10)
    assert back.success and load.success
    assert block_seed(ctrl, 2) == 3 and host_block_bytes(ctrl, 1) == device_block_bytes(ctrl, 1) != host_before


@pytest.mark.parametrize("launch", LAUNCH)
def test_an_eviction_never_waits_for_the_same_steps_load(make_controller, launch) -> None:
    """An eviction frees device blocks this step's compute may write (rule 2 fences the
    compute behind it): it keeps its place ahead of the load, policy or not."""
    ctrl = make_controller(async_launch=launch)
    tm = ctrl.transfer_manager
    assert tm.backups_after_loads
    fill_block(ctrl, 1, seed=5)
    tm.input_stream.pause()
    out = evict([1], [1])
    ctrl.submit_swap_tasks(out, swap_in([0], [2]))
    tm.flush_launches(10)
    assert ctrl.backend.record_event(tm.output_stream).wait(10), "the eviction waited for the paused load"
    assert host_block_bytes(ctrl, 1) == device_block_bytes(ctrl, 1)
    tm.input_stream.resume()
    done = ctrl.collect_finished(wait=True)
    assert out in done and all(m.success for m in done)


def test_a_backup_sharing_a_block_with_the_load_keeps_its_place(make_controller) -> None:
    """A backup into the host block the same step's load reads goes first (rule 5 orders the
    load after it), so the load reads the backed-up bytes, with the policy on."""
    ctrl = make_controller(async_launch=True)
    assert ctrl.transfer_manager.backups_after_loads
    fill_block(ctrl, 1, seed=6)
    ctrl.submit_swap_tasks(backup([1], [4]), swap_in([4], [2])).wait_all(timeout_s=10)
    assert all(m.success for m in ctrl.collect_finished(wait=True))
    assert block_seed(ctrl, 2) == 6


def test_worker_import_loads_no_framework() -> None:
    """Importing the worker package is cheap: Paddle and CuPy load only with a backend."""
    import subprocess
    import sys

    code = ("import sys, fastdeploy_kvcache.worker; "
            "print(sorted(m for m in ('paddle', 'cupy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_unknown_backend_is_rejected() -> None:
    from fastdeploy_kvcache.worker.backends import make_backend

    with pytest.raises(ValueError, match="unknown worker backend 'tpu'"):
        make_backend("tpu")


def test_cuda_error_surfacing_at_completion_fails_the_metadata(make_controller, monkeypatch) -> None:
    """An asynchronous device error shows up when the done event is queried: the task fails."""
    ctrl = make_controller()
    fill_block(ctrl, 1, seed=3)
    meta = backup([1], [2])
    ctrl.submit_swap_tasks(meta, None)
    ctrl.transfer_manager.flush_launches(10)
    real_done = ctrl.backend.event_done

    def poisoned(event):
        if event is ctrl.transfer_manager._inflight[0].done_event:
            raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")
        return real_done(event)

    monkeypatch.setattr(ctrl.backend, "event_done", poisoned)
    assert ctrl.collect_finished() == [meta]
    assert meta.success is False and "unspecified launch failure" in meta.error_message
    assert ctrl.get_stats()["d2h"]["failed"] == 1


def test_free_cache_waits_for_a_copy_whose_task_already_failed() -> None:
    """A task reported failed (its done event raised) while its copy is still queued on a
    host-thread stream: free_cache must wait for that copy before releasing the memory it
    writes.  Runs in a child process: the old code freed the host cache under the copy,
    which then wrote into unmapped memory (SIGSEGV)."""
    import subprocess
    import sys
    from pathlib import Path

    from worker_helpers import capi_or_skip

    capi_or_skip()
    code = f"""
import sys, threading, time
sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parent.parent)!r}]
from worker_helpers import fill_block, small_config
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, TransferKind
from fastdeploy_kvcache.worker import CacheController
ctrl = CacheController(small_config(), backend="cpu", threaded=True)
ctrl.initialize_kv_cache(); ctrl.initialize_host_cache()
fill_block(ctrl, 1, seed=3)
out = ctrl.transfer_manager.output_stream
out.pause()
meta = CacheSwapMetadata([1], [2], CacheLevel.DEVICE, CacheLevel.HOST, kind=TransferKind.BACKUP)
ctrl.submit_swap_tasks(meta, None)
ctrl.transfer_manager.flush_launches(10)
task = ctrl.transfer_manager._inflight[0]
real_done = ctrl.backend.event_done
def poisoned(event):
    if event is task.done_event:
        raise RuntimeError("cudaErrorLaunchFailure: unspecified launch failure")
    return real_done(event)
ctrl.backend.event_done = poisoned
assert ctrl.collect_finished() == [meta] and meta.success is False
threading.Timer(0.3, out.resume).start()
t0 = time.monotonic()
ctrl.free_cache()
print(f"waited {{time.monotonic() - t0:.3f}}")
ctrl.close()
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"child exited {proc.returncode}: {proc.stderr[-2000:]}"
    waited = float(proc.stdout.split()[-1])
    assert waited >= 0.25, f"free_cache returned after {waited:.3f} s, before the queued copy ran"


def test_failed_device_allocation_leaves_nothing_behind(monkeypatch) -> None:
    """An allocation failure midway (OOM at some layer) frees what was allocated and can be retried."""
    from fastdeploy_kvcache.worker import CacheController

    from worker_helpers import capi_or_skip, small_config

    capi_or_skip()
    ctrl = CacheController(small_config(num_layers=3), backend="cpu", threaded=False)
    try:
        real_alloc = ctrl.backend.alloc_device
        calls = []

        def flaky(shape, dtype):
            calls.append(shape)
            if len(calls) == 4:
                raise MemoryError("out of device memory")
            return real_alloc(shape, dtype)

        import gc
        import weakref

        allocated = []  # weak references: the test must not keep the arrays alive itself
        live_at_release = []

        def tracked(shape, dtype):
            array = flaky(shape, dtype)
            allocated.append(weakref.ref(array))
            return array

        def release() -> None:
            gc.collect()
            live_at_release.append(sum(ref() is not None for ref in allocated))

        monkeypatch.setattr(ctrl.backend, "alloc_device", tracked)
        monkeypatch.setattr(ctrl.backend, "release_device", release)
        with pytest.raises(MemoryError):
            ctrl.initialize_kv_cache()
        assert ctrl.get_kv_caches() == {} and ctrl.num_gpu_blocks == 0
        assert len(allocated) == 3  # three arrays were allocated before the failure
        # The pool can only return memory no live array holds: none may survive to release.
        assert live_at_release == [0]
        monkeypatch.setattr(ctrl.backend, "alloc_device", real_alloc)
        assert len(ctrl.initialize_kv_cache()) == 6  # a retry works
    finally:
        ctrl.close()


def test_close_stops_the_stream_threads_even_when_the_drain_times_out() -> None:
    """close() keeps the memory (a copy may still use it) but never leaks the stream threads."""
    from fastdeploy_kvcache.worker import CacheController, LayerSwapTimeoutError

    from worker_helpers import capi_or_skip, small_config

    capi_or_skip()
    ctrl = CacheController(small_config(), backend="cpu", threaded=True)
    ctrl.initialize_kv_cache()
    ctrl.initialize_host_cache()
    tm = ctrl.transfer_manager
    threads = [tm.input_stream._thread, tm.output_stream._thread]
    assert all(t is not None and t.is_alive() for t in threads)
    tm.timeout_s = 0.2
    tm.output_stream.pause()
    meta = backup([1], [2])
    ctrl.submit_swap_tasks(meta, None)
    with pytest.raises(LayerSwapTimeoutError):
        ctrl.close()
    assert ctrl.host_cache_kvs_map  # not freed under a copy that may still run
    assert not any(t.is_alive() for t in threads)
    ctrl.close()  # the copy finished when its stream was stopped: now everything is released
    assert ctrl.host_cache_kvs_map == {} and ctrl.get_kv_caches() == {}
    assert meta.success


def test_free_cache_drops_every_device_reference_before_release(monkeypatch) -> None:
    """free_cache() must leave no live array when it asks the framework to return memory."""
    import gc
    import weakref

    from fastdeploy_kvcache.worker import CacheController

    from worker_helpers import capi_or_skip, small_config

    capi_or_skip()
    ctrl = CacheController(small_config(num_layers=2), backend="cpu", threaded=False)
    try:
        refs = [weakref.ref(a) for a in ctrl.initialize_kv_cache()]
        ctrl.initialize_host_cache()
        live_at_release = []

        def release() -> None:
            gc.collect()
            live_at_release.append(sum(ref() is not None for ref in refs))

        monkeypatch.setattr(ctrl.backend, "release_device", release)
        ctrl.free_cache()
        assert live_at_release == [0]
        assert ctrl.get_kv_caches() == {} and ctrl.num_gpu_blocks == 0
    finally:
        ctrl.close()


# ---------------------------------------------------------------------- closed controller
def _closed_controller() -> tuple:
    """A controller that was initialized, used once and closed, with a 2 s wait limit."""
    from fastdeploy_kvcache.worker import CacheController

    from worker_helpers import capi_or_skip, small_config

    capi_or_skip()
    ctrl = CacheController(small_config(), backend="cpu", threaded=True)
    ctrl.initialize_kv_cache()
    ctrl.initialize_host_cache()
    fill_block(ctrl, 1, seed=2)
    ctrl.submit_swap_tasks(backup([1], [1]), None)
    assert [m.success for m in ctrl.collect_finished(wait=True)] == [True]
    ctrl.close()
    return ctrl


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda c: c.initialize_kv_cache(), id="initialize_kv_cache"),
        pytest.param(lambda c: c.initialize_host_cache(), id="initialize_host_cache"),
        pytest.param(lambda c: c.submit_swap_tasks(evict([1], [2]), None), id="submit-evict"),
        pytest.param(lambda c: c.submit_swap_tasks(None, swap_in([1], [2])), id="submit-load"),
        pytest.param(lambda c: c.submit_swap_tasks(None, None), id="submit-nothing"),
        pytest.param(lambda c: c.reset_cache(), id="reset_cache"),
    ],
)
def test_a_closed_controller_refuses_work_at_once(call, monkeypatch: pytest.MonkeyPatch) -> None:
    """Defect 4: after close() every call that needs the streams raises at once, never hangs."""
    import time

    from fastdeploy_kvcache.worker import ControllerClosedError

    monkeypatch.setenv("FDKV_LAYER_WAIT_TIMEOUT_S", "2")
    ctrl = _closed_controller()
    start = time.monotonic()
    with pytest.raises(ControllerClosedError, match="closed"):
        call(ctrl)
    assert time.monotonic() - start < 1.0
    assert ctrl.get_kv_caches() == {} and ctrl.host_cache_kvs_map == {}  # nothing re-allocated
    ctrl.close()  # closing again is harmless
    assert ctrl.collect_finished() == [] and ctrl.get_stats()["in_flight"] == 0


def test_an_eviction_fence_timeout_names_the_device_to_host_direction(make_controller) -> None:
    """Defect 4: the rule-2 fence waits on an eviction; its timeout must not say host->device."""
    from fastdeploy_kvcache.core.metadata import CopyDirection
    from fastdeploy_kvcache.worker import LayerSwapTimeoutError

    ctrl = make_controller(async_launch=False)
    ctrl.transfer_manager.timeout_s = 0.2
    ctrl.transfer_manager.output_stream.pause()
    meta = evict([1], [2])
    with pytest.raises(LayerSwapTimeoutError, match=r"device->host") as info:
        ctrl.submit_swap_tasks(meta, None)
    assert "host->device" not in str(info.value)
    assert info.value.direction is CopyDirection.DEVICE_TO_HOST and info.value.task_id == meta.task_id
    ctrl.transfer_manager.output_stream.resume()
    assert ctrl.collect_finished(wait=True) == [meta] and meta.success


def test_a_drain_timeout_names_the_direction_of_the_stuck_copy(make_controller) -> None:
    from fastdeploy_kvcache.core.metadata import CopyDirection
    from fastdeploy_kvcache.worker import LayerSwapTimeoutError

    ctrl = make_controller()
    for stream, meta, direction in (
        (ctrl.transfer_manager.output_stream, backup([1], [2]), CopyDirection.DEVICE_TO_HOST),
        (ctrl.transfer_manager.input_stream, swap_in([3], [4]), CopyDirection.HOST_TO_DEVICE),
    ):
        stream.pause()
        if direction is CopyDirection.DEVICE_TO_HOST:
            ctrl.submit_swap_tasks(meta, None)
        else:
            ctrl.submit_swap_tasks(None, meta)
        with pytest.raises(LayerSwapTimeoutError) as info:
            ctrl.collect_finished(wait=True, timeout_s=0.2)
        assert info.value.direction is direction and info.value.task_id == meta.task_id
        other = "host->device" if direction is CopyDirection.DEVICE_TO_HOST else "device->host"
        assert other not in str(info.value) and direction.short in str(info.value)
        stream.resume()
        assert ctrl.collect_finished(wait=True) == [meta] and meta.success


# ---------------------------------------------------------------------- argument checks (defect 10)
def _bare_controller(**cfg):
    """An uninitialized controller on the synchronous CPU backend."""
    from fastdeploy_kvcache.worker import CacheController

    from worker_helpers import capi_or_skip, small_config

    capi_or_skip()
    return CacheController(small_config(**cfg), backend="cpu", threaded=False)


def test_the_config_must_be_a_valid_cache_config() -> None:
    from fastdeploy_kvcache.worker import CacheController

    from worker_helpers import capi_or_skip, small_config

    capi_or_skip()
    with pytest.raises(TypeError, match=r"config must be a CacheConfig, got dict"):
        CacheController({"num_layers": 2}, backend="cpu")
    config = small_config()
    config.head_dim = -3  # mutated after construction: checked again
    with pytest.raises(ValueError, match=r"CacheConfig\.head_dim must be an int >= 1, got -3"):
        CacheController(config, backend="cpu")
    ctrl = CacheController(small_config(), backend="cpu", threaded=False)
    try:
        ctrl.config.num_kv_heads = 0  # ... and again before allocating
        with pytest.raises(ValueError, match=r"CacheConfig\.num_kv_heads"):
            ctrl.initialize_kv_cache()
        with pytest.raises(ValueError, match=r"CacheConfig\.num_kv_heads"):
            ctrl.initialize_host_cache()
        assert ctrl.get_kv_caches() == {} and ctrl.host_cache_kvs_map == {}
    finally:
        ctrl.close()


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        ({"local_rank": -1}, ValueError, r"local_rank must be an int >= 0, got -1"),
        ({"local_rank": 1.0}, TypeError, r"local_rank must be an int >= 0, got 1.0 \(float\)"),
        ({"device_id": "0"}, TypeError, r"device_id must be an int >= 0, got '0' \(str\)"),
        ({"device_id": True}, TypeError, r"device_id must be an int >= 0, got True \(bool\)"),
    ],
)
def test_rank_and_device_must_be_non_negative_ints(kwargs, error, match) -> None:
    from fastdeploy_kvcache.worker import CacheController

    from worker_helpers import capi_or_skip, small_config

    capi_or_skip()
    with pytest.raises(error, match=match):
        CacheController(small_config(), backend="cpu", **kwargs)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda c: c.initialize_host_cache(2.5), TypeError, r"num_host_blocks must be an int, got 2.5 \(float\)"),
        (lambda c: c.initialize_host_cache("8"), TypeError, r"num_host_blocks must be an int, got '8' \(str\)"),
        (lambda c: c.initialize_host_cache(True), TypeError, r"num_host_blocks must be an int, got True"),
        (lambda c: c.initialize_host_cache(-1), ValueError, r"num_host_blocks > 0, got -1"),
        (lambda c: c.initialize_kv_cache(2.5), TypeError, r"num_gpu_blocks must be an int, got 2.5 \(float\)"),
        (lambda c: c.initialize_kv_cache(False), TypeError, r"num_gpu_blocks must be an int, got False"),
        (lambda c: c.initialize_kv_cache(0), ValueError, r"num_gpu_blocks > 0, got 0"),
    ],
)
def test_block_counts_must_be_positive_ints(call, error, match) -> None:
    ctrl = _bare_controller()
    try:
        with pytest.raises(error, match=match):
            call(ctrl)
        assert ctrl.get_kv_caches() == {} and ctrl.host_cache_kvs_map == {}
    finally:
        ctrl.close()


@pytest.mark.parametrize(
    "cfg, call, match",
    [
        # head_dim 2**40: 2**48 bytes per array, far past any machine's memory.
        ({"head_dim": 2**40}, lambda c: c.initialize_host_cache(), r"host cache: .* exceeds .*physical memory"),
        ({"head_dim": 2**40}, lambda c: c.initialize_kv_cache(), r"device cache: .* exceeds .*memory"),
        # 2**62 blocks of 256 bytes: the byte count does not fit a 64-bit size.
        ({}, lambda c: c.initialize_host_cache(2**62), r"host cache: .* overflows"),
        ({}, lambda c: c.initialize_kv_cache(2**62), r"device cache: .* overflows"),
    ],
)
def test_oversized_caches_are_refused_before_allocating(cfg, call, match) -> None:
    """Defect 10: a size that cannot fit is a clear ValueError, not 'out of host memory'."""
    ctrl = _bare_controller(**cfg)
    try:
        with pytest.raises(ValueError, match=match):
            call(ctrl)
        assert ctrl.get_kv_caches() == {} and ctrl.host_cache_kvs_map == {}
        assert ctrl.num_gpu_blocks == 0 and ctrl.num_host_blocks == 0
    finally:
        ctrl.close()


def test_layer_caches_checks_the_layer_and_the_state() -> None:
    ctrl = _bare_controller(num_layers=2)
    try:
        with pytest.raises(RuntimeError, match=r"device KV cache is not initialized"):
            ctrl.layer_caches(0)
        ctrl.initialize_kv_cache()
        assert len(ctrl.layer_caches(1)) == 2
        with pytest.raises(IndexError, match=r"layer 5 is out of range \[0, 2\)"):
            ctrl.layer_caches(5)
        with pytest.raises(IndexError, match=r"layer -1 is out of range \[0, 2\)"):
            ctrl.layer_caches(-1)
        with pytest.raises(TypeError, match=r"layer must be an int, got '1' \(str\)"):
            ctrl.layer_caches("1")
        with pytest.raises(IndexError, match=r"layer 2 is out of range"):
            ctrl.cache_names(2)
    finally:
        ctrl.close()


@pytest.mark.parametrize(
    "args, match",
    [
        (("x", None), r"evict_metadata must be a CacheSwapMetadata or None, got str"),
        ((None, [1, 2]), r"swap_in_metadata must be a CacheSwapMetadata or None, got list"),
    ],
)
def test_submit_rejects_arguments_that_are_not_metadata(make_controller, args, match) -> None:
    """Defect 10: submit_swap_tasks('x', None) is a TypeError naming the argument; nothing runs.

    (Metadata of the wrong direction is data, not a type: it comes back failed, see
    test_bad_ids_fail_the_metadata_and_write_nothing.)
    """
    ctrl = make_controller()
    with pytest.raises(TypeError, match=match):
        ctrl.submit_swap_tasks(*args)
    stats = ctrl.get_stats()
    assert stats["d2h"]["tasks"] == stats["h2d"]["tasks"] == 0 and stats["in_flight"] == 0


@pytest.mark.parametrize("bad, error", [(-1, ValueError), (float("inf"), ValueError), ("10", TypeError)])
def test_wait_limits_must_be_finite_non_negative_numbers(make_controller, bad, error) -> None:
    ctrl = make_controller()
    match = r"timeout_s must be a finite number of seconds >= 0"
    with pytest.raises(error, match=match):
        ctrl.collect_finished(wait=True, timeout_s=bad)
    with pytest.raises(error, match=match):
        ctrl.synchronize(timeout_s=bad)
    with pytest.raises(error, match=match):
        ctrl.transfer_manager.flush_launches(bad)
