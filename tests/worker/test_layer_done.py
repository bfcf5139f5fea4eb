"""LayerDoneCounter on the host-thread backend: waits, late events, failures, timeouts."""

from __future__ import annotations

import threading

import pytest

from fastdeploy_kvcache import ops
from fastdeploy_kvcache.worker.backends.base import CALLER_STREAM, HostEvent, HostStream, HostThreadBackend
from fastdeploy_kvcache.worker.layer_done import LayerDoneCounter, LayerSwapError, LayerSwapTimeoutError


class _Backend(HostThreadBackend):
    """Host-thread streams and events only; these tests never copy."""

    name = "test"

    def alloc_device(self, shape, dtype):  # pragma: no cover - unused
        raise NotImplementedError

    def fill_zero(self, array):  # pragma: no cover - unused
        raise NotImplementedError

    def host_alloc(self, nbytes):  # pragma: no cover - unused
        raise NotImplementedError

    def host_free(self, ptr):  # pragma: no cover - unused
        raise NotImplementedError

    def swap_blocks(self, *args, **kwargs):  # pragma: no cover - unused
        raise NotImplementedError


@pytest.fixture
def backend():
    b = _Backend()
    yield b
    b.close_streams()


def test_wait_for_layer_returns_only_after_that_layer_is_done(backend) -> None:
    stream = backend.create_stream()
    stream.pause()
    counter = LayerDoneCounter(task_id=7, num_layers=3, backend=backend, timeout_s=10)
    events = [backend.record_event(stream) for _ in range(3)]
    for i, ev in enumerate(events):
        counter.set_layer_event(i, ev)
    assert not counter.is_layer_done(0)
    order: list[str] = []

    def consumer() -> None:
        counter.wait_for_layer(2)  # the caller thread is the compute stream: it blocks
        order.append("layer2 consumed")

    thread = threading.Thread(target=consumer)
    thread.start()
    thread.join(0.05)
    assert order == [] and thread.is_alive()
    stream.resume()
    thread.join(10)
    assert order == ["layer2 consumed"]
    assert counter.all_done()
    counter.wait_all()


def test_wait_on_a_compute_host_stream_does_not_block_the_caller(backend) -> None:
    loads, compute = backend.create_stream(), backend.create_stream()
    loads.pause()
    counter = LayerDoneCounter(task_id=1, num_layers=1, backend=backend, timeout_s=10)
    counter.set_layer_event(0, backend.record_event(loads))
    seen: list[int] = []
    counter.wait_for_layer(0, stream=compute)  # enqueues a wait on the compute stream
    compute.submit(lambda: seen.append(1))
    done = backend.record_event(compute)
    assert not done.wait(0.05) and seen == []
    loads.resume()
    assert done.wait(10) and seen == [1]


def test_event_attached_later_is_waited_for(backend) -> None:
    counter = LayerDoneCounter(task_id=3, num_layers=2, backend=backend, timeout_s=10)
    timer = threading.Timer(0.02, lambda: counter.set_layer_event(1, HostEvent(already_set=True)))
    timer.start()
    counter.wait_for_layer(1)  # blocks on the condition until the producer attaches it
    assert counter.is_layer_done(1)
    timer.join()


def test_timeout_names_layer_and_task(backend) -> None:
    stream = backend.create_stream()
    stream.pause()
    counter = LayerDoneCounter(task_id=42, num_layers=2, backend=backend, timeout_s=0.01)
    counter.set_layer_event(0, backend.record_event(stream))
    with pytest.raises(LayerSwapTimeoutError, match=r"layer 0 .*task 42") as info:
        counter.wait_for_layer(0)
    assert info.value.layer == 0 and info.value.task_id == 42
    # A layer whose event never arrives times out too (no silent skip).
    with pytest.raises(LayerSwapTimeoutError, match=r"layer 1 .*task 42"):
        counter.wait_for_layer(1)
    with pytest.raises(LayerSwapTimeoutError):
        counter.wait_all(timeout_s=0.01)
    stream.resume()


def test_failed_load_is_never_served(backend) -> None:
    counter = LayerDoneCounter(task_id=5, num_layers=3, backend=backend, timeout_s=10)
    counter.set_layer_event(0, HostEvent(already_set=True))
    counter.fail(1, "injected")
    for layer in range(3):  # even layer 0, whose bytes landed: the task is void as a whole
        with pytest.raises(LayerSwapError, match="task 5 failed .*injected"):
            counter.wait_for_layer(layer)
    with pytest.raises(LayerSwapError):
        counter.wait_all()
    assert counter.failed and not counter.is_layer_done(0)


def test_failure_while_waiting_wakes_the_waiter(backend) -> None:
    counter = LayerDoneCounter(task_id=9, num_layers=1, backend=backend, timeout_s=10)
    threading.Timer(0.02, lambda: counter.fail(0, "boom")).start()
    with pytest.raises(LayerSwapError, match="boom"):
        counter.wait_for_layer(0)


def test_layer_out_of_range(backend) -> None:
    counter = LayerDoneCounter(task_id=1, num_layers=2, backend=backend, timeout_s=1)
    with pytest.raises(IndexError, match="layer 2 out of range"):
        counter.wait_for_layer(2)


def test_synchronous_host_stream_runs_inline() -> None:
    stream = HostStream("s", synchronous=True)
    ran: list[int] = []
    stream.submit(lambda: ran.append(1))
    assert ran == [1]
    with pytest.raises(RuntimeError, match="synchronous HostStream cannot be paused"):
        stream.pause()


def test_host_stream_is_idle_only_once_every_task_has_run() -> None:
    """idle() counts a task from submit until it has run (queued, or held by pause())."""
    stream = HostStream("idle-check")
    try:
        assert stream.idle()
        stream.pause()
        done = HostEvent()
        stream.submit(done.set)
        assert not stream.idle()  # queued behind the pause
        stream.resume()
        assert done.wait(10.0)
        stream.submit(lambda: None)  # a task after done.set: once it ran, the stream is idle
        finished = HostEvent()
        stream.submit(finished.set)
        assert finished.wait(10.0)
        for _ in range(1000):
            if stream.idle():
                break
            threading.Event().wait(0.001)
        assert stream.idle()
    finally:
        stream.close()
    assert HostStream("sync", synchronous=True).idle()


def test_caller_stream_events_are_complete_at_once(backend) -> None:
    event = backend.record_event(CALLER_STREAM)
    assert backend.event_done(event)


def test_timeout_error_reports_the_limit_the_wait_used(backend) -> None:
    """A host wait given its own limit reports that limit, whether the event was missing or late."""
    stream = backend.create_stream()
    stream.pause()
    counter = LayerDoneCounter(task_id=7, num_layers=2, backend=backend, timeout_s=30.0)
    counter.set_layer_event(0, backend.record_event(stream))
    with pytest.raises(LayerSwapTimeoutError) as late:
        counter.synchronize_layer(0, timeout_s=0.02)
    with pytest.raises(LayerSwapTimeoutError) as missing:  # layer 1's event never attached
        counter.synchronize_layer(1, timeout_s=0.02)
    assert late.value.timeout_s == missing.value.timeout_s == 0.02
    assert "0.020s" in str(missing.value)
    stream.resume()


def test_layer_must_be_an_int(backend) -> None:
    counter = LayerDoneCounter(task_id=1, num_layers=2, backend=backend, timeout_s=1)
    for bad in ("1", 1.0, True, None):
        with pytest.raises(TypeError, match=r"layer must be an int, got"):
            counter.wait_for_layer(bad)
        with pytest.raises(TypeError, match=r"layer must be an int, got"):
            counter.is_layer_done(bad)


@pytest.mark.parametrize("bad, error", [(-1.0, ValueError), (float("nan"), ValueError), ("5", TypeError),
                                        (True, TypeError)])
def test_timeouts_must_be_finite_non_negative_numbers(backend, bad, error) -> None:
    with pytest.raises(error, match=r"timeout_s must be a finite number of seconds >= 0"):
        LayerDoneCounter(task_id=1, num_layers=1, backend=backend, timeout_s=bad)
    counter = LayerDoneCounter(task_id=1, num_layers=1, backend=backend, timeout_s=1)
    counter.set_layer_event(0, HostEvent(already_set=True))
    with pytest.raises(error, match=r"timeout_s must be a finite number of seconds >= 0"):
        counter.synchronize_layer(0, timeout_s=bad)
    with pytest.raises(error, match=r"timeout_s must be a finite number of seconds >= 0"):
        counter.wait_all(timeout_s=bad)


class _Progress:
    """Stands in for ops.GroupProgress (tested on the C ABI in tests/ops): a count the test
    advances, or -1 once the call "failed" (at a group, with a message)."""

    def __init__(self) -> None:
        self.done = 0
        self.cond = threading.Condition()
        self.waits = 0
        self.failed_group = -1
        self.message = ""

    def advance(self, done: int) -> None:
        with self.cond:
            self.done = done
            self.cond.notify_all()

    def fail(self, group: int, message: str) -> None:
        with self.cond:
            self.failed_group, self.message, self.done = group, message, -1
            self.cond.notify_all()

    def error(self) -> str:
        return self.message

    def state(self) -> ops.ProgressState:
        return ops.ProgressState(self.done, self.done < 0, self.done < 0, 0, self.failed_group)

    def wait(self, at_least: int, timeout_s: float) -> int:
        self.waits += 1
        with self.cond:
            self.cond.wait_for(lambda: self.done < 0 or self.done >= at_least, timeout_s)
            return self.done


def test_layer_groups_hand_out_each_event_once_its_group_is_enqueued(backend) -> None:
    """A one-call load (attach_layer_groups): a wait for layer 1 blocks until the call's
    progress passes layer 1, then gets layer 1's event; layer 0's came with it."""
    counter = LayerDoneCounter(task_id=3, num_layers=3, backend=backend, timeout_s=10)
    events = [HostEvent(already_set=True) for _ in range(3)]
    progress = _Progress()
    counter.attach_layer_groups(events, progress)
    got: list[object] = []
    thread = threading.Thread(target=lambda: got.append(counter._event_for(1)))
    thread.start()
    progress.advance(1)
    thread.join(0.05)
    assert thread.is_alive() and got == []  # layer 1 is not enqueued yet
    progress.advance(2)
    thread.join(10)
    assert got == [events[1]]
    assert counter._event_for(0) is events[0]
    assert counter._events[2] is None  # not handed out before its group is enqueued


def test_layer_groups_failure_reaches_waiters(backend) -> None:
    """The call failed (progress -1): the waiter raises with the progress's own error, and
    no launcher needs to call fail() (a launched stack has none)."""
    counter = LayerDoneCounter(task_id=4, num_layers=2, backend=backend, timeout_s=10)
    progress = _Progress()
    counter.attach_layer_groups([HostEvent(True), HostEvent(True)], progress)
    errors: list[BaseException] = []

    def waiter() -> None:
        try:
            counter.wait_for_layer(1)
        except BaseException as exc:  # noqa: BLE001 - checked below
            errors.append(exc)

    thread = threading.Thread(target=waiter)
    thread.start()
    progress.fail(1, "load: group 1 of 2: invalid resource handle")
    thread.join(10)
    assert not thread.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], LayerSwapError)
    assert "group 1 of 2: invalid resource handle" in str(errors[0])
    assert counter.failed and counter.error == "load: group 1 of 2: invalid resource handle"


def test_layer_groups_wait_times_out(backend) -> None:
    counter = LayerDoneCounter(task_id=5, num_layers=2, backend=backend, timeout_s=0.05)
    counter.attach_layer_groups([HostEvent(True), HostEvent(True)], _Progress())
    with pytest.raises(LayerSwapTimeoutError):
        counter.wait_for_layer(0)
