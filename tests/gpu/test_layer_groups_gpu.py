"""A layer-stack call (`LayerStackCall.run`) on CuPy memory: one call moves a layer stack group by group and
records one event per group on the stream.  Checked: the bytes of every group on every
path, that each group's event is recorded right behind that group's copies (a stream that
waits on event g sees group g complete even while later groups are still in flight), bad
event arguments, and a CUDA failure mid-stack naming its group.  Skipped off-GPU
(conftest.py says what makes them run)."""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_kvcache import ops
from swap_reference import PATTERNS, expected_after_swap, id_patterns, run_stack

pytestmark = pytest.mark.gpu

NUM_DEV, NUM_HOST = 24, 32
LAYERS, GROUP = 4, 2  # 4 layers of K and V


def _stack(cupy, pinned, block_bytes: int, seed: int):
    rng = np.random.default_rng(seed)
    devs = [cupy.asarray(rng.integers(0, 256, (NUM_DEV, block_bytes), dtype=np.uint8)) for _ in range(LAYERS * GROUP)]
    hosts = [pinned(NUM_HOST * block_bytes).reshape(NUM_HOST, block_bytes) for _ in range(LAYERS * GROUP)]
    return devs, hosts


@pytest.mark.parametrize("path", ["kernel", "dma", "staged", "auto"])
@pytest.mark.parametrize("block_bytes", [4096, 24, 256 << 10])
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_every_group_moves_like_swap_all_layers(cupy, capi, pinned, cuda_stream, path, block_bytes, pattern,
                                                mode) -> None:
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, np.random.default_rng(block_bytes + mode))[pattern]
    devs, hosts = _stack(cupy, pinned, block_bytes, 7)
    want = [expected_after_swap(cupy.asnumpy(d), h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts)]
    stream = cuda_stream()
    events = [cupy.cuda.Event(block=False, disable_timing=True) for _ in range(LAYERS)]
    run_stack(capi, [d.data.ptr for d in devs], [h.ctypes.data for h in hosts], GROUP, NUM_DEV, block_bytes,
              NUM_HOST, dev_ids, host_ids, mode, stream=stream.ptr, events=[e.ptr for e in events],
              path=path)
    used = capi.last_path()
    stream.synchronize()
    for d, h, (want_dev, want_host) in zip(devs, hosts, want):
        np.testing.assert_array_equal(cupy.asnumpy(d), want_dev)
        np.testing.assert_array_equal(h, want_host)
    if dev_ids:
        assert used != 0


@pytest.mark.parametrize("path", ["dma", "staged"])  # staged: the whole stack is one pipeline
def test_each_event_covers_its_group_while_later_groups_still_run(cupy, capi, pinned, cuda_stream, path) -> None:
    """Each group's event sits right behind that group's copies, not at the end of the call:
    the events complete in group order and group 0's well before the last (16 MiB per
    group); a reader stream that waits on event 0 sees all of group 0's blocks, and one
    that waits on the last event all of the last group's (on the staged stack the last
    group's early chunks are scattered on the ring's side stream)."""
    bb = 1 << 20
    n = 16
    devs = [cupy.zeros((n, bb), dtype=np.uint8) for _ in range(LAYERS * GROUP)]
    hosts = [pinned(n * bb).reshape(n, bb) for _ in range(LAYERS * GROUP)]
    ids = np.arange(n, dtype=np.int64)
    stream = cuda_stream()
    events = [cupy.cuda.Event(block=False, disable_timing=False) for _ in range(LAYERS)]
    start = cupy.cuda.Event(block=False, disable_timing=False)
    start.record(stream)
    progress = capi.group_progress()
    run_stack(capi, [d.data.ptr for d in devs], [h.ctypes.data for h in hosts], GROUP, n, bb, n, ids, ids,
              ops.CopyDirection.HOST_TO_DEVICE, stream=stream.ptr, events=[e.ptr for e in events], path=path,
              progress=progress)
    assert progress.wait(LAYERS, 5.0) == LAYERS
    assert capi.last_path() == (ops.PATH_DMA if path == "dma" else ops.PATH_STAGED)
    reader, last_reader = cuda_stream(), cuda_stream()
    reader.wait_event(events[0])
    with reader:
        first = [d.copy() for d in devs[:GROUP]]
    last_reader.wait_event(events[-1])  # the last group's event covers all of its chunks
    with last_reader:
        last = [d.copy() for d in devs[-GROUP:]]
    stream.synchronize()
    reader.synchronize()
    last_reader.synchronize()
    for got, h in zip(first + last, hosts[:GROUP] + hosts[-GROUP:]):
        np.testing.assert_array_equal(cupy.asnumpy(got), h)
    times = [cupy.cuda.get_elapsed_time(start, e) for e in events]
    assert times == sorted(times), times  # complete in group order
    assert times[0] < times[-1] * 0.6, times  # group 0's event is not at the end of the call


def test_bad_events_are_refused_before_any_copy(cupy, capi, pinned, cuda_stream) -> None:
    devs, hosts = _stack(cupy, pinned, 4096, 3)
    before = [h.copy() for h in hosts]
    args = ([d.data.ptr for d in devs], [h.ctypes.data for h in hosts], GROUP, NUM_DEV, 4096, NUM_HOST, [0, 1],
            [2, 3], ops.CopyDirection.DEVICE_TO_HOST)
    with pytest.raises(ops.SwapOpError) as err:
        run_stack(capi, *args, stream=cuda_stream().ptr, events=[0] * (LAYERS - 1))
    assert err.value.argument == "events"
    with pytest.raises(ops.SwapOpError) as err:
        run_stack(capi, *args[:2], 3, *args[3:], stream=cuda_stream().ptr)
    assert err.value.argument == "group_size"
    with pytest.raises(ops.SwapOpError) as err:
        run_stack(capi, *args, stream=cuda_stream().ptr, events=[-1] * LAYERS)
    assert err.value.argument == "events"
    cupy.cuda.runtime.deviceSynchronize()
    for h, b in zip(hosts, before):
        np.testing.assert_array_equal(h, b)


def test_a_fresh_thread_gets_the_staged_path(cupy, capi, pinned, cuda_stream) -> None:
    """A thread that made no CUDA call before (a Python loader thread handed a stream
    handle) still sees pinned memory as pinned: the staged path runs, not the per-run
    memcpy fallback (it did fall back before the thread's context was made current)."""
    import threading

    devs, hosts = _stack(cupy, pinned, 256 << 10, 11)
    stream = cuda_stream()
    ids = list(range(20))
    used: list[int] = []

    def load() -> None:
        run_stack(capi, [d.data.ptr for d in devs], [h.ctypes.data for h in hosts], GROUP, NUM_DEV, 256 << 10,
                  NUM_HOST, ids[::-1], ids, ops.CopyDirection.HOST_TO_DEVICE, stream=stream.ptr, path="staged")
        used.append(capi.last_path())

    thread = threading.Thread(target=load)
    thread.start()
    thread.join()
    stream.synchronize()
    assert used == [ops.PATH_STAGED]
    for d, h in zip(devs, hosts):
        np.testing.assert_array_equal(cupy.asnumpy(d)[ids[::-1]], h[ids])


@pytest.mark.parametrize("mode", [ops.CopyDirection.HOST_TO_DEVICE, ops.CopyDirection.DEVICE_TO_HOST])
@pytest.mark.parametrize("from_group", [1, 0])
def test_auto_stages_a_load_from_its_second_group(cupy, capi, pinned, cuda_stream, mode, from_group) -> None:
    """A stack that auto stages (16 KiB blocks, host ids in one run, 24 MiB in all, 18 MiB
    after group 0): a load sends group 0 through the copy kernel and stages the rest
    (option staged_stack_from_group, default 1); 0 stages every group, and so does a
    device-to-host stack (nothing waits for its first group).  Every byte is checked."""
    n, num_dev, bb = 192, 256, 16 << 10
    rng = np.random.default_rng(from_group * 2 + mode)
    devs = [cupy.asarray(rng.integers(0, 256, (num_dev, bb), dtype=np.uint8)) for _ in range(LAYERS * GROUP)]
    hosts = [pinned(n * bb).reshape(n, bb) for _ in range(LAYERS * GROUP)]
    for h in hosts:
        h[:] = rng.integers(0, 256, h.shape, dtype=np.uint8)
    dev_ids = rng.permutation(num_dev)[:n].tolist()
    host_ids = list(range(n))
    want = [expected_after_swap(cupy.asnumpy(d), h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts)]
    saved = capi.get_option("staged_stack_from_group")
    capi.set_option("staged_stack_from_group", from_group)
    try:
        stream = cuda_stream()
        run_stack(capi, [d.data.ptr for d in devs], [h.ctypes.data for h in hosts], GROUP, num_dev, bb, n,
                  dev_ids, host_ids, mode, stream=stream.ptr, path="auto")
        used = capi.last_path()
        stream.synchronize()
    finally:
        capi.set_option("staged_stack_from_group", saved)
    kernel_first = mode == ops.CopyDirection.HOST_TO_DEVICE and from_group == 1
    assert used == (ops.PATH_KERNEL | ops.PATH_STAGED if kernel_first else ops.PATH_STAGED)
    for d, h, (want_dev, want_host) in zip(devs, hosts, want):
        np.testing.assert_array_equal(cupy.asnumpy(d), want_dev)
        np.testing.assert_array_equal(h, want_host)


def test_a_rest_too_small_to_stage_goes_on_the_calls_own_path(cupy, capi, pinned, cuda_stream) -> None:
    """16 MiB in all but 12 MiB after group 0: the rest is below the staged rule's call
    size, so after the kernel's group 0 it goes group by group on auto's own choice (the
    kernel again at 16 KiB copies), not staged; every byte still lands."""
    n, num_dev, bb = 128, 256, 16 << 10
    rng = np.random.default_rng(5)
    devs = [cupy.zeros((num_dev, bb), dtype=np.uint8) for _ in range(LAYERS * GROUP)]
    hosts = [pinned(n * bb).reshape(n, bb) for _ in range(LAYERS * GROUP)]
    dev_ids = rng.permutation(num_dev)[:n].tolist()
    stream = cuda_stream()
    run_stack(capi, [d.data.ptr for d in devs], [h.ctypes.data for h in hosts], GROUP, num_dev, bb, n,
              dev_ids, list(range(n)), ops.CopyDirection.HOST_TO_DEVICE, stream=stream.ptr, path="auto")
    used = capi.last_path()
    stream.synchronize()
    assert used == ops.PATH_KERNEL
    for d, h in zip(devs, hosts):
        np.testing.assert_array_equal(cupy.asnumpy(d)[dev_ids], h)


# (path, block bytes, blocks, host ids, stack_span_min_bytes (None: the default, 16 MiB), the
# spans after group 0 whose events complete together (None: not timed), the path bits)
SPAN_CASES = {
    "dma_per_group": ("dma", 128 << 10, 8, "run", 0, [[g] for g in range(1, 8)], ops.PATH_DMA),
    "dma_6MiB": ("dma", 128 << 10, 8, "run", 6 << 20, [[1, 2, 3], [4, 5, 6], [7]], ops.PATH_DMA),
    "dma_default": ("dma", 128 << 10, 16, "run", None, [[1, 2, 3, 4], [5, 6, 7]], ops.PATH_DMA),
    "kernel_per_group": ("kernel", 16 << 10, 64, "run", 0, [[g] for g in range(1, 8)], ops.PATH_KERNEL),
    "kernel_8MiB": ("kernel", 16 << 10, 64, "run", 8 << 20, [[1, 2, 3, 4], [5, 6, 7]], ops.PATH_KERNEL),
    "kernel_default": ("kernel", 16 << 10, 128, "run", None, [[1, 2, 3, 4], [5, 6, 7]], ops.PATH_KERNEL),
    # auto, fully scattered host ids, 32 MiB: a load's group 0 takes the kernel ahead of a
    # rest that may stage; the rest cannot (no host runs), so group 1 goes alone on auto's
    # own path (the kernel) and decides the spans after it.  A device-to-host stack tries
    # to stage from group 0, which then decides.
    "auto_scattered": ("auto", 16 << 10, 128, "scattered", 8 << 20,
                       {ops.CopyDirection.HOST_TO_DEVICE: [[2, 3], [4, 5], [6, 7]], ops.CopyDirection.DEVICE_TO_HOST: [[1, 2], [3, 4], [5, 6], [7]]},
                       ops.PATH_KERNEL),
    "staged_per_group": ("auto", 16 << 10, 128, "run", 0, None, None),  # a staged rest chunked per group
    "staged_default": ("auto", 16 << 10, 128, "run", None, None, None),  # chunks cut at span ends
}


@pytest.mark.parametrize("case", sorted(SPAN_CASES))
@pytest.mark.parametrize("mode", [ops.CopyDirection.HOST_TO_DEVICE, ops.CopyDirection.DEVICE_TO_HOST])
def test_small_groups_go_in_spans_and_each_event_covers_its_group(cupy, capi, pinned, cuda_stream, case,
                                                                  mode) -> None:
    """Groups go in spans of >= stack_span_min_bytes once a group on the call's own path went
    as one DMA batch or one copy-kernel launch (one batch or launch per span), and on the
    staged path with one chunk boundary per span.  Every group's event still covers that
    group: a reader stream that waits on event g sees all of group g's blocks, for every g.
    On the DMA and kernel paths the events of one span complete together and the next
    span's come a copy later, where a span per group spaces every event out."""
    path, block_bytes, n, host_pattern, span_min_bytes, spans, want_path = SPAN_CASES[case]
    if isinstance(spans, dict):
        spans = spans[mode]
    layers = 8
    rng = np.random.default_rng(n + mode)
    num_dev = 2 * n
    num_host = 4 * n if host_pattern == "scattered" else n
    devs = [cupy.asarray(rng.integers(0, 256, (num_dev, block_bytes), dtype=np.uint8)) for _ in range(layers * GROUP)]
    hosts = [pinned(num_host * block_bytes).reshape(num_host, block_bytes) for _ in range(layers * GROUP)]
    dev_ids = rng.permutation(num_dev)[:n].tolist()
    host_ids = rng.permutation(num_host)[:n].tolist() if host_pattern == "scattered" else list(range(n))
    want = [expected_after_swap(cupy.asnumpy(d), h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts)]
    saved = capi.get_option("stack_span_min_bytes")
    assert saved == 16 << 20  # the default
    if span_min_bytes is not None:
        capi.set_option("stack_span_min_bytes", span_min_bytes)
    try:
        stream = cuda_stream()
        events = [cupy.cuda.Event(block=False, disable_timing=False) for _ in range(layers)]
        start = cupy.cuda.Event(block=False, disable_timing=False)
        start.record(stream)
        run_stack(capi, [d.data.ptr for d in devs], [h.ctypes.data for h in hosts], GROUP, num_dev,
                  block_bytes, num_host, dev_ids, host_ids, mode, stream=stream.ptr,
                  events=[e.ptr for e in events], path=path)
        used = capi.last_path()
        readers = []
        for g in range(layers):  # each group's bytes as seen behind its own event
            reader = cuda_stream()
            reader.wait_event(events[g])
            if mode == ops.CopyDirection.HOST_TO_DEVICE:
                with reader:
                    readers.append([devs[t][dev_ids].copy() for t in range(g * GROUP, (g + 1) * GROUP)])
            else:
                reader.synchronize()  # event g done: group g's host blocks are written
                for t in range(g * GROUP, (g + 1) * GROUP):
                    np.testing.assert_array_equal(hosts[t], want[t][1], err_msg=f"group {g} behind its event")
        stream.synchronize()
        cupy.cuda.runtime.deviceSynchronize()
    finally:
        capi.set_option("stack_span_min_bytes", saved)
    if mode == ops.CopyDirection.HOST_TO_DEVICE:
        for g, got in enumerate(readers):
            for t, a in zip(range(g * GROUP, (g + 1) * GROUP), got):
                np.testing.assert_array_equal(cupy.asnumpy(a), want[t][0][dev_ids], err_msg=f"group {g} behind its event")
    for d, h, (want_dev, want_host) in zip(devs, hosts, want):
        np.testing.assert_array_equal(cupy.asnumpy(d), want_dev)
        np.testing.assert_array_equal(h, want_host)
    if want_path is None:  # the staged stack: group 0 on the kernel ahead of the rest when loading
        assert used == (ops.PATH_KERNEL | ops.PATH_STAGED if mode == ops.CopyDirection.HOST_TO_DEVICE else ops.PATH_STAGED)
        return
    assert used == want_path, f"last_path()={used}"
    times = [cupy.cuda.get_elapsed_time(start, e) * 1e3 for e in events]  # us
    gaps = [b - a for a, b in zip(times, times[1:])]
    copy_us = n * GROUP * block_bytes / 60e3  # one group's copy at >= 60 GB/s would take this long
    for span in spans:
        for a, b in zip(span, span[1:]):
            assert gaps[a] < copy_us / 4, (span, times)  # one span: complete together
        if span[-1] < layers - 1:
            assert gaps[span[-1]] > copy_us / 2, (span, times)  # the next span comes a copy later


@pytest.mark.parametrize("mode", [ops.CopyDirection.HOST_TO_DEVICE, ops.CopyDirection.DEVICE_TO_HOST])
def test_overlapped_kernel_launches_keep_every_event_behind_its_group(cupy, capi, pinned, cuda_stream,
                                                                      mode) -> None:
    """With a span per group on the copy kernel, every launch after the first may start
    while the one ahead of it drains (programmatic dependent launch).  Each group's event
    must still follow all of that group's copies: over repeated stacks of fresh bytes, a
    reader behind event g sees every block of group g, and the events complete in order."""
    layers, n, bb = 16, 96, 16 << 10
    rng = np.random.default_rng(11 + mode)
    num_dev, num_host = 2 * n, 4 * n
    devs = [cupy.empty((num_dev, bb), dtype=np.uint8) for _ in range(layers * GROUP)]
    hosts = [pinned(num_host * bb).reshape(num_host, bb) for _ in range(layers * GROUP)]
    saved = capi.get_option("stack_span_min_bytes")
    capi.set_option("stack_span_min_bytes", 0)  # a launch per group: 15 overlapped launches
    try:
        for rep in range(8):
            for d in devs:
                d[:] = cupy.asarray(rng.integers(0, 256, (num_dev, bb), dtype=np.uint8))
            for h in hosts:
                h[:] = rng.integers(0, 256, h.shape, dtype=np.uint8)
            dev_ids = rng.permutation(num_dev)[:n].tolist()
            host_ids = rng.permutation(num_host)[:n].tolist()  # fully scattered: the kernel's case
            want = [expected_after_swap(cupy.asnumpy(d), h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts)]
            stream = cuda_stream()
            events = [cupy.cuda.Event(block=False, disable_timing=False) for _ in range(layers)]
            start = cupy.cuda.Event(block=False, disable_timing=False)
            start.record(stream)
            run_stack(capi, [d.data.ptr for d in devs], [h.ctypes.data for h in hosts], GROUP, num_dev, bb,
                      num_host, dev_ids, host_ids, mode, stream=stream.ptr,
                      events=[e.ptr for e in events], path="kernel")
            assert capi.last_path() == ops.PATH_KERNEL
            seen = []
            for g in range(layers):
                if mode == ops.CopyDirection.HOST_TO_DEVICE:
                    reader = cuda_stream()
                    reader.wait_event(events[g])
                    with reader:
                        seen.append([devs[t][dev_ids].copy() for t in range(g * GROUP, (g + 1) * GROUP)])
                else:
                    events[g].synchronize()  # group g's host blocks are written once its event is done
                    seen.append([hosts[t][host_ids].copy() for t in range(g * GROUP, (g + 1) * GROUP)])
            stream.synchronize()
            cupy.cuda.runtime.deviceSynchronize()
            for g, got in enumerate(seen):
                for t, a in zip(range(g * GROUP, (g + 1) * GROUP), got):
                    if mode == ops.CopyDirection.HOST_TO_DEVICE:
                        np.testing.assert_array_equal(cupy.asnumpy(a), want[t][0][dev_ids],
                                                      err_msg=f"stack {rep}, group {g} behind its event")
                    else:
                        np.testing.assert_array_equal(a, want[t][1][host_ids],
                                                      err_msg=f"stack {rep}, group {g} behind its event")
            times = [cupy.cuda.get_elapsed_time(start, e) for e in events]
            assert times == sorted(times), (rep, times)
    finally:
        capi.set_option("stack_span_min_bytes", saved)
