"""LoopHandoff: outputs from the engine thread reach the server's event loop, all of them,
in order, on the loop's thread, with one wake-up per burst; a closed loop drops them
without raising (the engine thread must never crash on a server that is shutting down)."""

from __future__ import annotations

import asyncio
import threading

from fastdeploy_kvcache.entrypoints.openai.engine_client import LoopHandoff


class _CountingLoop(asyncio.SelectorEventLoop):
    """A real event loop that counts its thread-safe wake-ups."""

    def __init__(self) -> None:
        super().__init__()
        self.threadsafe_calls = 0

    def call_soon_threadsafe(self, *args, **kwargs):  # type: ignore[override]
        self.threadsafe_calls += 1
        return super().call_soon_threadsafe(*args, **kwargs)


def test_calls_from_another_thread_run_on_the_loop_in_order_with_one_wakeup_per_burst() -> None:
    loop = _CountingLoop()
    seen: list[tuple[int, int, bool]] = []  # (burst, item, ran on the loop's thread)
    loop_thread = threading.get_ident()
    done = asyncio.Event()

    def record(burst: int, item: int) -> None:
        seen.append((burst, item, threading.get_ident() == loop_thread))
        if (burst, item) == (2, 199):
            done.set()

    handoff = LoopHandoff.of(loop)
    assert LoopHandoff.of(loop) is handoff  # one per loop: every request of the server shares it

    async def main() -> None:
        for burst in range(3):
            # The loop is busy in this coroutine while the engine thread emits a burst.
            t = threading.Thread(target=lambda b=burst: [handoff.call(record, b, i) for i in range(200)])
            t.start()
            t.join()
            await asyncio.sleep(0)
            await asyncio.sleep(0)
        await asyncio.wait_for(done.wait(), 10)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    assert seen == [(b, i, True) for b in range(3) for i in range(200)]
    assert loop.threadsafe_calls == 3  # one drain per burst, not 600 wake-ups


def test_a_failing_call_does_not_drop_the_others() -> None:
    loop = asyncio.new_event_loop()
    seen: list[int] = []

    def call(i: int) -> None:
        if i == 1:
            raise ValueError("a broken consumer")
        seen.append(i)

    handoff = LoopHandoff.of(loop)
    try:
        for i in range(4):
            assert handoff.call(call, i)
        loop.run_until_complete(asyncio.sleep(0.01))
    finally:
        loop.close()
    assert seen == [0, 2, 3]


def test_a_closed_loop_drops_calls_without_raising() -> None:
    loop = asyncio.new_event_loop()
    handoff = LoopHandoff.of(loop)
    assert handoff.call(print, "queued before the loop closed")  # its drain never runs
    loop.close()
    assert handoff.call(print, "after close") is False
    # A loop closed before its first call.
    other = asyncio.new_event_loop()
    other.close()
    assert LoopHandoff(other).call(print, "x") is False


def test_waiting_for_flush_wakes_the_loop_once_per_flush_and_loses_nothing() -> None:
    loop = _CountingLoop()
    handoff = LoopHandoff(loop)
    handoff.wait_for_flush()
    seen: list[int] = []
    try:
        for i in range(50):
            assert handoff.call(seen.append, i)
        loop.run_until_complete(asyncio.sleep(0.01))
        assert seen == [] and loop.threadsafe_calls == 0  # nothing until the engine flushes
        handoff.flush()
        handoff.flush()  # a drain is already pending: no second wake-up
        loop.run_until_complete(asyncio.sleep(0.01))
        assert seen == list(range(50)) and loop.threadsafe_calls == 1
        handoff.flush()  # nothing queued: nothing to wake
        assert loop.threadsafe_calls == 1
    finally:
        loop.close()
    assert handoff.call(seen.append, 99) is False
