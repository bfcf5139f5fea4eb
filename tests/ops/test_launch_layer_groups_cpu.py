"""``LayerStackCall.launch`` and its launcher thread on the CPU build (numpy memory plays the
device; the copies run on whichever thread enqueues them, so the order they ran in is the
order the stream would see).  The CUDA side (fences, events) is in tests/gpu."""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_kvcache import ops

NUM_DEV, NUM_HOST, LAYERS, GROUP, BLOCK = 8, 64, 6, 2, 256


class Stack:
    """A layer stack of LAYERS groups of GROUP tensors, device and host side."""

    def __init__(self, seed: int = 0) -> None:
        rng = np.random.default_rng(seed)
        self.devs = [np.zeros((NUM_DEV, BLOCK), np.uint8) for _ in range(LAYERS * GROUP)]
        self.hosts = [rng.integers(0, 256, (NUM_HOST, BLOCK), dtype=np.uint8) for _ in range(LAYERS * GROUP)]

    def args(self, dev_ids: list[int], host_ids: list[int]) -> tuple:
        return ([d.ctypes.data for d in self.devs], [h.ctypes.data for h in self.hosts], GROUP, NUM_DEV, BLOCK,
                NUM_HOST, dev_ids, host_ids, ops.CopyDirection.HOST_TO_DEVICE)

    def launch(self, capi: ops.CApi, launcher, dev_ids, host_ids, progress, inline_groups: int = 1,
               **launch_kwargs) -> None:
        """One stack through the one entry point: a call bound to ``launcher``, launched."""
        devs, hosts, group, num_dev, block, num_host, _, _, mode = self.args([], [])
        call = capi.layer_stack_call(launcher, devs, hosts, group, num_dev, block, num_host, mode,
                                     inline_groups=inline_groups)
        call.launch(dev_ids, host_ids, progress, **launch_kwargs)

    def loaded(self, dev_ids: list[int], host_ids: list[int], tensors: range = range(LAYERS * GROUP)) -> bool:
        return all(np.array_equal(self.devs[t][dev_ids], self.hosts[t][host_ids]) for t in tensors)


@pytest.fixture
def launcher(capi_cpu: ops.CApi):
    launcher = capi_cpu.stack_launcher()
    yield launcher
    launcher.close()


@pytest.fixture
def fail_group(capi_cpu: ops.CApi):
    """Set the test-only ``stack_fail_group`` option; restored afterwards."""
    saved = capi_cpu.get_option("stack_fail_group")
    yield lambda group: capi_cpu.set_option("stack_fail_group", group)
    capi_cpu.set_option("stack_fail_group", saved)


@pytest.mark.parametrize("inline_groups", [0, 1, LAYERS, 100])
@pytest.mark.parametrize("with_launcher", [True, False], ids=["launcher", "no-launcher"])
def test_a_launched_stack_moves_every_group_and_closes(capi_cpu, launcher, inline_groups, with_launcher) -> None:
    stack = Stack()
    progress = capi_cpu.group_progress()
    stack.launch(capi_cpu, launcher if with_launcher else None, [5, 0, 3], [9, 40, 2], progress=progress,
                 inline_groups=inline_groups)
    assert progress.wait_closed(10.0)
    assert progress.state() == ops.ProgressState(LAYERS, False, True, ops.PATH_CPU, -1)
    assert progress.error() == ""
    assert stack.loaded([5, 0, 3], [9, 40, 2])


def test_stacks_run_in_launch_order(capi_cpu, launcher) -> None:
    """Many stacks write the same device blocks from different host blocks, some launched
    while the launcher is busy (queued), some while it is idle (first group on the caller):
    the device ends up with the last one's bytes."""
    stack = Stack(1)
    dev_ids = [1, 2, 3, 4]
    progresses = []
    for i in range(40):
        host_ids = [4 * (i % 16) + k for k in range(4)]
        progress = capi_cpu.group_progress()
        stack.launch(capi_cpu, launcher, dev_ids, host_ids, progress=progress)
        progresses.append(progress)
    assert launcher.wait_idle(10.0)
    assert all(p.state().closed and not p.state().failed for p in progresses)
    assert stack.loaded(dev_ids, [4 * (39 % 16) + k for k in range(4)])


def test_a_bad_argument_raises_before_anything_moves_and_fails_the_progress(capi_cpu, launcher) -> None:
    stack = Stack()
    progress = capi_cpu.group_progress()
    with pytest.raises(ops.SwapOpError) as err:
        stack.launch(capi_cpu, launcher, [1, NUM_DEV], [3, 4], progress=progress)
    assert err.value.argument == "dev_ids" and err.value.index == 1
    state = progress.state()
    assert state.failed and state.closed and state.done == 0 and state.failed_group == -1
    assert "dev_ids[1] = 8 is out of range [0, 8)" in progress.error()
    assert not any(d.any() for d in stack.devs)  # nothing moved
    progress.abandon("too late")  # closed already: its own outcome stands
    assert "out of range" in progress.error()


def test_events_are_refused_by_the_cpu_build(capi_cpu, launcher) -> None:
    stack = Stack()
    for kwargs, name in (({"waits": [1234]}, "waits"), ({"start_event": 99}, "start_event"),
                         ({"done_event": 99}, "done_event"), ({"events": [7] * LAYERS}, "events")):
        progress = capi_cpu.group_progress()
        with pytest.raises(ops.SwapOpError) as err:
            stack.launch(capi_cpu, launcher, [1], [2], progress=progress, **kwargs)
        assert err.value.argument == name and "CPU" in str(err.value)
        assert progress.state().failed


def test_launch_arguments_are_checked_in_python(capi_cpu, launcher) -> None:
    stack = Stack()
    with pytest.raises(ops.SwapOpError, match="progress must be an open GroupProgress"):
        stack.launch(capi_cpu, launcher, [1], [2], progress=None)
    closed = capi_cpu.group_progress()
    closed.close()
    with pytest.raises(ops.SwapOpError, match="progress must be an open GroupProgress"):
        stack.launch(capi_cpu, launcher, [1], [2], progress=closed)
    with pytest.raises(ops.SwapOpError, match="launcher must be None or an open StackLauncher"):
        stack.launch(capi_cpu, "thread", [1], [2], progress=capi_cpu.group_progress())


@pytest.mark.parametrize("group", [0, 1, LAYERS - 1])
@pytest.mark.parametrize("inline_groups", [0, 1])
def test_a_failure_in_group_g_fails_the_progress_there(capi_cpu, launcher, fail_group, group, inline_groups) -> None:
    """Groups before g are copied, g and later not; the progress names the group and
    closes; the launcher goes on with the next stack."""
    stack = Stack(2)
    fail_group(group)
    progress = capi_cpu.group_progress()
    stack.launch(capi_cpu, launcher, [0, 1], [10, 11], progress=progress,
                 inline_groups=inline_groups)
    assert progress.wait_closed(10.0)
    state = progress.state()
    assert state.failed and state.failed_group == group and state.done == group
    assert progress.wait(1, 0.0) == -1
    assert f"group {group} of {LAYERS}: injected failure" in progress.error()
    assert stack.loaded([0, 1], [10, 11], range(group * GROUP))
    assert not any(stack.devs[t].any() for t in range(group * GROUP, LAYERS * GROUP))
    fail_group(-1)
    after = capi_cpu.group_progress()
    stack.launch(capi_cpu, launcher, [0, 1], [10, 11], progress=after)
    assert after.wait_closed(10.0) and not after.state().failed
    assert stack.loaded([0, 1], [10, 11])


def test_close_enqueues_what_is_still_queued(capi_cpu) -> None:
    """Closing a launcher with stacks queued runs them first; the progress objects they hold
    outlive the caller's handles (each job keeps a reference)."""
    launcher = capi_cpu.stack_launcher()
    stacks = [Stack(10 + i) for i in range(12)]
    progresses = []
    for i, stack in enumerate(stacks):
        progress = capi_cpu.group_progress()
        stack.launch(capi_cpu, launcher, [i % NUM_DEV], [i], progress=progress, inline_groups=0)
        progresses.append(progress)
    progresses[-1].close()  # the caller lets go of one: its job still holds it
    launcher.close()
    assert launcher.wait_idle(0.0)  # a closed launcher has nothing left
    assert all(p.state().closed for p in progresses[:-1])
    assert all(stack.loaded([i % NUM_DEV], [i]) for i, stack in enumerate(stacks))


def test_abandon_closes_a_progress_that_will_never_be_launched(capi_cpu) -> None:
    progress = capi_cpu.group_progress()
    assert not progress.wait_closed(0.0)
    progress.abandon("prior task 7 was never launched")
    assert progress.wait_closed(0.0)
    assert progress.state().failed and progress.wait(1, 0.0) == -1
    assert progress.error() == "prior task 7 was never launched"


def test_a_layer_stack_call_binds_the_fixed_arguments_once(capi_cpu, launcher) -> None:
    """A prepared call (what the worker keeps per layout) launches many stacks, each with its
    own ids, and takes its events as a HandleArray converted once."""
    stack = Stack(2)
    devs, hosts, group, num_dev, block, num_host, _, _, mode = stack.args([], [])
    call = capi_cpu.layer_stack_call(launcher, devs, hosts, group, num_dev, block, num_host, mode)
    events = ops.HandleArray([0] * LAYERS)  # the CPU build takes null events only
    assert len(events) == LAYERS
    for dev_ids, host_ids in (([0, 1], [10, 11]), ([7, 2, 5], [60, 3, 33]), ([4], [63])):
        progress = capi_cpu.group_progress()
        call.launch(np.asarray(dev_ids, np.int64), host_ids, progress, events=events)
        assert progress.wait_closed(10.0)
        assert progress.state() == ops.ProgressState(LAYERS, False, True, ops.PATH_CPU, -1)
        assert stack.loaded(dev_ids, host_ids)


def test_a_layer_stack_call_refuses_bad_ids_and_a_closed_launcher(capi_cpu) -> None:
    stack = Stack(3)
    devs, hosts, group, num_dev, block, num_host, _, _, mode = stack.args([], [])
    own = capi_cpu.stack_launcher()
    call = capi_cpu.layer_stack_call(own, devs, hosts, group, num_dev, block, num_host, mode)
    progress = capi_cpu.group_progress()
    with pytest.raises(ops.SwapOpError, match=r"dev_ids\[1\]"):
        call.launch([0, 2.5], [1, 2], progress)
    assert not stack.loaded([0], [1])
    own.close()
    with pytest.raises(ops.SwapOpError, match="launcher is closed"):
        call.launch([0], [1], capi_cpu.group_progress())
    assert not stack.loaded([0], [1])
    with pytest.raises(ops.SwapOpError, match="launcher"):
        capi_cpu.layer_stack_call(own, devs, hosts, group, num_dev, block, num_host, mode)
    with pytest.raises(ops.SwapOpError, match="group_size"):
        capi_cpu.layer_stack_call(None, devs, hosts, 2.0, num_dev, block, num_host, mode)
