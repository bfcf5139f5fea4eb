"""The router's event subscriber against a real ZMQ publisher on 127.0.0.1 (tests/router/publisher.py).

Covers the sequence rules of ``router/events.py``: in-order batches, a lost batch fetched
from the replay socket, a subscriber that starts late (a restarted router) rebuilding from
replay, a publisher restart, a replay buffer too short (counted as missed), and the tier
bookkeeping of stored/removed/cleared events per medium.
"""

from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable

import pytest

pytest.importorskip("zmq", reason="needs pyzmq (installed by `bash build.sh`)")

from fastdeploy_kvcache.entrypoints.router.events import EventSubscriber  # noqa: E402
from fastdeploy_kvcache.entrypoints.router.view import DEVICE, HOST, STORAGE, WorkerView  # noqa: E402

from .publisher import AllBlocksCleared, FakeWorkerPublisher, h, removed, stored  # noqa: E402


async def _until(cond: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.01)


def _run(scenario: Callable[[FakeWorkerPublisher, EventSubscriber], Awaitable[None]], buffer: int = 1000,
         replay: bool = True, before: Callable[[FakeWorkerPublisher], None] = lambda pub: None
         ) -> tuple[EventSubscriber, list[int]]:
    """Run ``scenario`` against a subscriber; the subscriber and the replay requests it sent.
    ``before`` publishes while no subscriber exists yet (a router started late)."""
    pub = FakeWorkerPublisher(buffer=buffer)
    before(pub)

    async def main() -> EventSubscriber:
        sub = EventSubscriber("w0", WorkerView(), pub.endpoint, pub.replay_endpoint if replay else None, "kv-events")
        sub.start()
        try:
            await scenario(pub, sub)
        finally:
            await sub.stop()
        return sub

    try:
        return asyncio.run(main()), pub.replay_requests
    finally:
        pub.close()


async def _connected(pub: FakeWorkerPublisher, sub: EventSubscriber) -> None:
    """Publish a first batch until the SUB socket has joined (ZMQ's slow joiner)."""
    await asyncio.sleep(0.2)
    pub.publish(stored([0]))
    await _until(lambda: sub.last_seq is not None)


def test_in_order_batches_build_the_view_per_tier() -> None:
    async def scenario(pub: FakeWorkerPublisher, sub: EventSubscriber) -> None:
        await _connected(pub, sub)
        pub.publish(stored([1, 2, 3]), stored([1, 2], medium="CPU"))
        pub.publish(stored([4], medium="MOONCAKE"), removed([2]))  # 2 leaves the device, stays on the host
        last = pub.publish(removed([3], medium="GPU"))
        await _until(lambda: sub.last_seq == last)

    sub, replays = _run(scenario)
    v = sub.view
    assert v.blocks == {h(0): DEVICE, h(1): DEVICE | HOST, h(2): HOST, h(4): STORAGE}
    assert v.block_size == 16
    assert (sub.stats.gaps, sub.stats.missed) == (0, 0)
    assert replays == [0]  # the start-up replay only


def test_a_lost_batch_is_fetched_from_the_replay_socket() -> None:
    async def scenario(pub: FakeWorkerPublisher, sub: EventSubscriber) -> None:
        await _connected(pub, sub)
        pub.publish(stored([1]), live=False)  # lost on the live stream
        last = pub.publish(stored([2]))
        await _until(lambda: sub.last_seq == last)

    sub, replays = _run(scenario)
    assert set(sub.view.blocks) == {h(0), h(1), h(2)}
    assert (sub.stats.gaps, sub.stats.missed) == (1, 0)
    assert replays == [0, 1]


def test_a_late_subscriber_rebuilds_from_replay() -> None:
    """A router (re)started after an idle worker published: the view comes from the replay buffer."""
    def before(pub: FakeWorkerPublisher) -> None:
        for i in range(5):
            pub.publish(stored([i]), live=False)
        pub.publish(removed([0]), live=False)

    async def scenario(pub: FakeWorkerPublisher, sub: EventSubscriber) -> None:
        await _until(lambda: sub.last_seq == 5)  # nothing live: the start-up replay did it
        await asyncio.sleep(0.2)
        last = pub.publish(stored([5]))
        await _until(lambda: sub.last_seq == last)

    sub, replays = _run(scenario, before=before)
    assert set(sub.view.blocks) == {h(i) for i in range(1, 6)}
    assert replays == [0] and sub.stats.missed == 0


def test_without_replay_a_late_subscriber_counts_what_it_missed() -> None:
    def before(pub: FakeWorkerPublisher) -> None:
        for i in range(3):
            pub.publish(stored([i]), live=False)

    async def scenario(pub: FakeWorkerPublisher, sub: EventSubscriber) -> None:
        await asyncio.sleep(0.2)
        last = pub.publish(stored([3]))
        await _until(lambda: sub.last_seq == last)

    sub, _ = _run(scenario, replay=False, before=before)
    assert set(sub.view.blocks) == {h(3)}
    assert sub.stats.missed == 3


def test_a_replay_buffer_too_short_counts_the_rest_as_missed() -> None:
    async def scenario(pub: FakeWorkerPublisher, sub: EventSubscriber) -> None:
        await _connected(pub, sub)
        for i in range(1, 6):
            pub.publish(stored([i]), live=False)  # the buffer keeps the last 2 only
        last = pub.publish(stored([6]))
        await _until(lambda: sub.last_seq == last)

    sub, _ = _run(scenario, buffer=2)
    # Buffered when asked: seqs 5 and 6 (block 5 and the live block 6); 1..4 are gone.
    assert set(sub.view.blocks) == {h(0), h(5), h(6)}
    assert sub.stats.missed == 4


def test_a_publisher_restart_empties_the_view() -> None:
    async def scenario(pub: FakeWorkerPublisher, sub: EventSubscriber) -> None:
        await _connected(pub, sub)
        pub.publish(stored([1]))
        pub.publish(stored([2]))
        await _until(lambda: sub.last_seq == 2)
        pub.restart_sequence()
        pub.publish(stored([7]))
        await _until(lambda: h(7) in sub.view.blocks)

    sub, _ = _run(scenario)
    assert set(sub.view.blocks) == {h(7)}
    assert sub.stats.restarts == 1


def test_all_blocks_cleared_empties_the_view() -> None:
    async def scenario(pub: FakeWorkerPublisher, sub: EventSubscriber) -> None:
        await _connected(pub, sub)
        pub.publish(stored([1]), stored([1], medium="CPU"))
        pub.publish(AllBlocksCleared(), stored([9]))
        await _until(lambda: sub.last_seq == 2)

    assert set(_run(scenario)[0].view.blocks) == {h(9)}


def test_a_bad_batch_is_skipped_whole_and_counted() -> None:
    async def scenario(pub: FakeWorkerPublisher, sub: EventSubscriber) -> None:
        await _connected(pub, sub)
        pub.publish(payload=b"\xc1 not msgpack")
        pub.publish(stored([1]), stored([2], medium="TAPE"))  # unknown medium: none of it applies
        last = pub.publish(stored([3], medium="DISK"))
        await _until(lambda: sub.last_seq == last)

    sub, _ = _run(scenario)
    assert sub.view.blocks == {h(0): DEVICE, h(3): STORAGE}
    assert sub.stats.bad_batches == 2 and sub.stats.missed == 0
