"""The engine's per-step flush (KVEventStream) over a real cache manager and a real publisher:
a batch the full queue drops makes the next one a resynchronisation, and a subscriber that
missed the dropped batches is right again after it."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("zmq", reason="the KV event publisher needs pyzmq (bash build.sh installs it)")
pytest.importorskip("msgpack", reason="the test subscriber decodes with msgpack (bash build.sh installs it)")

from core import test_cache_manager as tcm  # noqa: E402
from fastdeploy_kvcache.core.kv_event_recorder import KVEventRecorder, cache_contents  # noqa: E402
from fastdeploy_kvcache.engine.kv_event_stream import KVEventStream  # noqa: E402
from fastdeploy_kvcache.engine.kv_events_config import KVEventsConfig  # noqa: E402
from fastdeploy_kvcache.engine.kv_events_publisher import ZmqEventPublisher  # noqa: E402
from fastdeploy_kvcache.entrypoints.server_process import free_port  # noqa: E402

from .subscriber import Subscriber, rebuild  # noqa: E402

MASK = (1 << 64) - 1


def wait_published(pub: ZmqEventPublisher, n: int) -> None:
    deadline = time.monotonic() + 10
    while pub.stats()["published_batches"] < n:
        assert time.monotonic() < deadline, pub.stats()
        time.sleep(0.01)


def test_dropped_batches_heal_with_a_resync():
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}",
                         replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv", max_queue_size=1)
    mgr, shadow = tcm.make("write_back", dev=8, host=16)
    recorder = KVEventRecorder(tcm.BS)
    mgr.tree.events = recorder
    stream = KVEventStream(recorder, ZmqEventPublisher(cfg, start=False))
    sub = Subscriber(cfg.endpoint, "kv", cfg.replay_endpoint)
    try:
        for i in range(4):  # each prompt evicts the previous ones to host (write_back)
            tcm.cache_prompt(mgr, shadow, f"r{i}", list(range(100 * i, 100 * i + 13)))
            stream.flush()
        # The first batch waits in the queue; the next three were dropped and counted, and
        # the recorder owes a resync.
        stats = stream.stats()
        assert stats["dropped_batches"] == 3 and stats["queued_batches"] == 1 and stats["next_seq"] == 4
        stream.publisher.start()
        wait_published(stream.publisher, 1)
        tcm.cache_prompt(mgr, shadow, "r4", list(range(900, 913)))
        stream.flush()
        wait_published(stream.publisher, 2)
        replayed = dict(sub.replay(0))
        assert sorted(replayed) == [0, 4]  # seq 1-3 were dropped: the gap shows, replay cannot fill it
        resync = replayed[4][1]
        assert resync[0] == ["AllBlocksCleared"]
        # Applying what the subscriber has (0, then the resync) gives the cache exactly.
        truth = {m: {h & MASK for h in s} for m, s in cache_contents(mgr).items() if s}
        assert set(truth) == {"GPU", "CPU"}
        assert rebuild(replayed) == truth
        assert rebuild({4: replayed[4]}) == truth  # the resync alone is the whole state
    finally:
        sub.close()
        stream.close()
