"""Round trips of every C ABI op on numpy memory (CPU build: host memory plays device)."""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_kvcache import ops

from swap_reference import PATTERNS, expected_after_swap, id_patterns, run_stack

NUM_DEV, NUM_HOST = 12, 16
# 16-byte multiples take the vector path on a GPU; the others the narrower fallback.
BLOCK_BYTES = [4096, 256, 24, 6, 1, 4100]


def _rand(shape: tuple[int, ...], seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, shape, dtype=np.uint8)


@pytest.mark.parametrize("block_bytes", BLOCK_BYTES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_per_layer_round_trip(capi_cpu: ops.CApi, block_bytes: int, pattern: str, mode: int) -> None:
    rng = np.random.default_rng(block_bytes * 7 + mode)
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, rng)[pattern]
    dev = _rand((NUM_DEV, block_bytes), 1)
    host = _rand((NUM_HOST, block_bytes), 2)
    want_dev, want_host = expected_after_swap(dev, host, dev_ids, host_ids, mode)
    capi_cpu.swap_per_layer(dev.ctypes.data, NUM_DEV, block_bytes, host.ctypes.data, NUM_HOST,
                            dev_ids, host_ids, mode)
    np.testing.assert_array_equal(dev, want_dev)
    np.testing.assert_array_equal(host, want_host)
    assert capi_cpu.last_path() == (ops.PATH_CPU if dev_ids else 0)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_per_layer_d2h_then_h2d_restores_blocks(capi_cpu: ops.CApi, pattern: str) -> None:
    """Evict blocks, clobber them on the device, load them back: the originals return."""
    rng = np.random.default_rng(5)
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, rng)[pattern]
    dev = _rand((NUM_DEV, 64), 3)
    host = np.zeros((NUM_HOST, 64), np.uint8)
    original = dev.copy()
    capi_cpu.swap_per_layer(dev.ctypes.data, NUM_DEV, 64, host.ctypes.data, NUM_HOST, dev_ids, host_ids, 0)
    dev[:] = 0xAB
    capi_cpu.swap_per_layer(dev.ctypes.data, NUM_DEV, 64, host.ctypes.data, NUM_HOST, dev_ids, host_ids, 1)
    np.testing.assert_array_equal(dev[dev_ids], original[dev_ids])


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_all_layers_mixed_block_sizes(capi_cpu: ops.CApi, pattern: str, mode: int) -> None:
    """K/V caches (256 B blocks) and their scale caches (12 B blocks) in one call."""
    rng = np.random.default_rng(11 + mode)
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, rng)[pattern]
    sizes = [256, 256, 12, 12, 256, 256]
    devs = [_rand((NUM_DEV, b), 10 + i) for i, b in enumerate(sizes)]
    hosts = [_rand((NUM_HOST, b), 20 + i) for i, b in enumerate(sizes)]
    want_devs, want_hosts = zip(*(expected_after_swap(d, h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts)))
    capi_cpu.swap_all_layers([d.ctypes.data for d in devs], [h.ctypes.data for h in hosts], NUM_DEV, sizes,
                             NUM_HOST, np.asarray(dev_ids, np.int64), np.asarray(host_ids, np.int64), mode)
    for got, want in zip(devs + hosts, want_devs + want_hosts):
        np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_layer_groups_move_every_group_like_swap_all_layers(capi_cpu: ops.CApi, pattern: str, mode: int) -> None:
    """Three layers of K, V and a scale cache (12 B blocks) in one layer-stack call."""
    rng = np.random.default_rng(31 + mode)
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, rng)[pattern]
    sizes = [256, 256, 12] * 3
    devs = [_rand((NUM_DEV, b), 40 + i) for i, b in enumerate(sizes)]
    hosts = [_rand((NUM_HOST, b), 60 + i) for i, b in enumerate(sizes)]
    want_devs, want_hosts = zip(*(expected_after_swap(d, h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts)))
    run_stack(capi_cpu, [d.ctypes.data for d in devs], [h.ctypes.data for h in hosts], 3, NUM_DEV, sizes,
              NUM_HOST, dev_ids, host_ids, mode, events=None)
    for got, want in zip(devs + hosts, list(want_devs) + list(want_hosts)):
        np.testing.assert_array_equal(got, want)
    assert capi_cpu.last_path() == (ops.PATH_CPU if dev_ids else 0)


@pytest.mark.parametrize(
    "group_size, events, argument, index",
    [
        (4, None, "group_size", None),  # 6 tensors do not split into groups of 4
        (0, None, "group_size", None),
        (-2, None, "group_size", None),
        (2, [0, 0], "events", None),  # 3 groups, 2 events
        (2, [0, 123, 0], "events", 1),  # the CPU build records no events
        (2, [0, -1, 0], "events", None),  # not an address
    ],
)
def test_layer_groups_bad_groups_and_events_move_nothing(capi_cpu: ops.CApi, group_size, events, argument,
                                                          index) -> None:
    devs = [_rand((NUM_DEV, 64), 80 + i) for i in range(6)]
    hosts = [np.zeros((NUM_HOST, 64), np.uint8) for _ in range(6)]
    with pytest.raises(ops.SwapOpError) as err:
        run_stack(capi_cpu, [d.ctypes.data for d in devs], [h.ctypes.data for h in hosts], group_size,
                  NUM_DEV, 64, NUM_HOST, [1, 2], [3, 4], ops.CopyDirection.DEVICE_TO_HOST, events=events)
    assert (err.value.op, err.value.argument, err.value.index) == ("layer_stack_call.run", argument, index)
    assert not any(h.any() for h in hosts)


def test_layer_groups_check_every_tensor_before_the_first_group(capi_cpu: ops.CApi) -> None:
    """A device id out of range for the last layer's (smaller) device tensor fails the whole
    call: the first layer is not copied either."""
    devs = [_rand((NUM_DEV, 64), 90 + i) for i in range(4)]
    hosts = [np.zeros((NUM_HOST, 64), np.uint8) for _ in range(4)]
    with pytest.raises(ops.SwapOpError) as err:
        run_stack(capi_cpu, [d.ctypes.data for d in devs], [h.ctypes.data for h in hosts], 2,
                  [NUM_DEV, NUM_DEV, NUM_DEV, 3], 64, NUM_HOST, [1, 5], [3, 4], ops.CopyDirection.DEVICE_TO_HOST)
    assert err.value.argument == "dev_ids" and err.value.index == 1
    assert not any(h.any() for h in hosts)


def test_tensor_table_moves_what_the_lists_move(capi_cpu: ops.CApi) -> None:
    """A TensorTable (addresses and sizes converted once) in place of dev_ptrs: the same
    bytes move as with the lists; a bad entry is refused when the table is made."""
    sizes = [256, 256, 12, 12]
    devs = [_rand((NUM_DEV, b), 120 + i) for i, b in enumerate(sizes)]
    hosts = [np.zeros((NUM_HOST, b), np.uint8) for b in sizes]
    table = ops.TensorTable([d.ctypes.data for d in devs], NUM_DEV, sizes)
    capi_cpu.swap_all_layers(table, [h.ctypes.data for h in hosts], 0, 0, NUM_HOST, [4, 7], [1, 2], ops.CopyDirection.DEVICE_TO_HOST)
    for d, h in zip(devs, hosts):
        np.testing.assert_array_equal(h[[1, 2]], d[[4, 7]])
    run_stack(capi_cpu, table, [h.ctypes.data for h in hosts], 2, 0, 0, NUM_HOST, [5], [3], ops.CopyDirection.DEVICE_TO_HOST)
    for d, h in zip(devs, hosts):
        np.testing.assert_array_equal(h[3], d[5])
    with_hosts = ops.TensorTable([d.ctypes.data for d in devs], NUM_DEV, sizes, [h.ctypes.data for h in hosts])
    capi_cpu.swap_all_layers(with_hosts, None, 0, 0, NUM_HOST, [9], [0], ops.CopyDirection.DEVICE_TO_HOST)
    for d, h in zip(devs, hosts):
        np.testing.assert_array_equal(h[0], d[9])
    with pytest.raises(ops.SwapOpError) as err:  # no host buffers anywhere
        capi_cpu.swap_all_layers(table, None, 0, 0, NUM_HOST, [9], [0], ops.CopyDirection.DEVICE_TO_HOST)
    assert err.value.argument == "host_ptrs"
    with pytest.raises(ops.SwapOpError) as err:
        ops.TensorTable([devs[0].ctypes.data, -5], NUM_DEV, 256)
    assert err.value.argument == "dev_ptrs"
    with pytest.raises(ops.SwapOpError) as err:
        ops.TensorTable([devs[0].ctypes.data], NUM_DEV, 256, [hosts[0].ctypes.data] * 2)
    assert err.value.argument == "host_ptrs"
    with pytest.raises(ops.SwapOpError) as err:
        ops.TensorTable([devs[0].ctypes.data], NUM_DEV, [256, 256])
    assert err.value.argument == "block_bytes"


def test_layer_group_progress_counts_groups_and_reports_failure(capi_cpu: ops.CApi) -> None:
    """The progress object reaches the number of groups after a call, a wait for more times
    out with the count so far, and a refused call marks it failed (-1) so no waiter hangs."""
    devs = [_rand((NUM_DEV, 64), 100 + i) for i in range(6)]
    hosts = [np.zeros((NUM_HOST, 64), np.uint8) for _ in range(6)]
    args = ([d.ctypes.data for d in devs], [h.ctypes.data for h in hosts], 2, NUM_DEV, 64, NUM_HOST, [1, 2], [3, 4],
            ops.CopyDirection.DEVICE_TO_HOST)
    progress = capi_cpu.group_progress()
    assert progress.wait(1, 0.0) == 0  # nothing enqueued yet: the timeout passes at once
    run_stack(capi_cpu, *args, progress=progress)
    assert progress.wait(3, 5.0) == 3
    assert progress.wait(4, 0.01) == 3  # never more than the groups there are
    failed = capi_cpu.group_progress()
    with pytest.raises(ops.SwapOpError):
        run_stack(capi_cpu, *args[:6], [1, NUM_DEV], [3, 4], ops.CopyDirection.DEVICE_TO_HOST, progress=failed)
    assert failed.wait(1, 5.0) == -1
    failed.close()
    with pytest.raises(ValueError, match="closed"):
        failed.wait(1, 0.0)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_layout_gather_scatter_round_trip(capi_cpu: ops.CApi, pattern: str) -> None:
    """Gather into [block][tensor][bytes], check the layout, scatter into fresh tensors."""
    rng = np.random.default_rng(17)
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, rng)[pattern]
    sizes = [128, 128, 8, 8]  # k0 v0 and two scale tensors
    stride = sum(sizes)
    devs = [_rand((NUM_DEV, b), 30 + i) for i, b in enumerate(sizes)]
    host = _rand((NUM_HOST, stride), 40)
    want_host = host.copy()
    offsets = np.cumsum([0] + sizes[:-1])
    for d, off, b in zip(devs, offsets, sizes):
        want_host[host_ids, off:off + b] = d[dev_ids]
    capi_cpu.swap_layout([d.ctypes.data for d in devs], NUM_DEV, sizes, host.ctypes.data, NUM_HOST,
                         dev_ids, host_ids, ops.CopyDirection.DEVICE_TO_HOST)
    np.testing.assert_array_equal(host, want_host)

    fresh = [_rand((NUM_DEV, b), 50 + i) for i, b in enumerate(sizes)]
    want_fresh = [f.copy() for f in fresh]
    for wf, d in zip(want_fresh, devs):
        wf[dev_ids] = d[dev_ids]
    capi_cpu.swap_layout([f.ctypes.data for f in fresh], NUM_DEV, sizes, host.ctypes.data, NUM_HOST,
                         dev_ids, host_ids, ops.CopyDirection.HOST_TO_DEVICE)
    for got, want in zip(fresh, want_fresh):
        np.testing.assert_array_equal(got, want)


def test_sync_flag_and_stream_are_accepted_on_cpu(capi_cpu: ops.CApi) -> None:
    dev = _rand((4, 32), 1)
    host = np.zeros((4, 32), np.uint8)
    capi_cpu.swap_per_layer(dev.ctypes.data, 4, 32, host.ctypes.data, 4, [0, 1], [1, 0], 0, stream=0, sync=True)
    np.testing.assert_array_equal(host[[1, 0]], dev[[0, 1]])
    capi_cpu.stream_synchronize(0)


def test_options_round_trip_and_reject_bad_values(capi_cpu: ops.CApi) -> None:
    names = ("copy_grid", "copy_path", "dma_min_bytes", "merge_min_bytes", "dma_slice_bytes", "copy_kernel",
             "kernel_tables", "rows_d2h_min_bytes", "stack_span_min_bytes", "launch_lead_bytes")
    before = {k: capi_cpu.get_option(k) for k in names}
    assert before["copy_grid"] >= 1
    # The defaults docs/ops.md gives: device-to-host rows from 256 KiB, stack spans of 16 MiB,
    # a launcher at most 64 MiB ahead of the copies that landed.
    assert (before["rows_d2h_min_bytes"], before["stack_span_min_bytes"], before["launch_lead_bytes"]) == \
        (256 << 10, 16 << 20, 64 << 20)
    try:
        capi_cpu.set_option("copy_grid", 4)
        assert capi_cpu.get_option("copy_grid") == 4
        with pytest.raises(ops.SwapOpError) as info:
            capi_cpu.set_option("copy_grid", 0)
        assert (info.value.op, info.value.argument) == ("set_option", "name")
        with pytest.raises(ops.SwapOpError, match="out of its range"):
            capi_cpu.set_option("copy_path", 7)
        with pytest.raises(ops.SwapOpError) as info:
            capi_cpu.get_option("no_such_option")
        assert (info.value.op, info.value.argument) == ("get_option", "name")
        for name, good, bad in (("copy_kernel", 3, 4), ("kernel_tables", 0, 2), ("dma_slice_bytes", 1 << 20, 0),
                                ("rows_d2h_min_bytes", 0, -1), ("stack_span_min_bytes", 0, -1),
                                ("launch_lead_bytes", 0, -1)):
            capi_cpu.set_option(name, good)
            assert capi_cpu.get_option(name) == good
            with pytest.raises(ops.SwapOpError, match=f"'{name}' is unknown or value {bad} is out of its range"):
                capi_cpu.set_option(name, bad)
    finally:
        for k, v in before.items():
            capi_cpu.set_option(k, v)


def test_set_options_from_strings_sets_all_or_none(capi_cpu: ops.CApi) -> None:
    """The benchmarks' --option NAME=VALUE flags: every assignment is parsed before any is
    set, so a malformed one leaves the options as they were."""
    before = {k: capi_cpu.get_option(k) for k in ("copy_grid", "dma_rows_min_lanes")}
    assert before["dma_rows_min_lanes"] == 16  # the default
    try:
        capi_cpu.set_options(["copy_grid=5", " dma_rows_min_lanes = 0x2 "])
        assert (capi_cpu.get_option("copy_grid"), capi_cpu.get_option("dma_rows_min_lanes")) == (5, 2)
        for bad in ("copy_grid", "copy_grid=four", "=3"):
            with pytest.raises(ops.SwapOpError, match="is not NAME=INTEGER"):
                capi_cpu.set_options(["copy_grid=7", bad])
            assert capi_cpu.get_option("copy_grid") == 5
        with pytest.raises(ops.SwapOpError, match="'dma_rows_min_lanes' is unknown or value 0 is out of its range"):
            capi_cpu.set_options(["dma_rows_min_lanes=0"])
    finally:
        for k, v in before.items():
            capi_cpu.set_option(k, v)


def test_capi_is_cpu_build(capi_cpu: ops.CApi) -> None:
    assert capi_cpu.is_cuda is False


def test_missing_library_raises_clear_error(tmp_path) -> None:
    with pytest.raises(ops.OpsNotBuiltError, match="build.sh"):
        ops.load_capi(path=str(tmp_path / "nope.so"))
