"""The ZMQ publisher on real sockets (127.0.0.1, free ports): framing, replay, dropping.

Decoded by tests/kv_events/subscriber.py (plain msgpack, not our structs).
"""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq", reason="the KV event publisher needs pyzmq (bash build.sh installs it)")
pytest.importorskip("msgpack", reason="the test subscriber decodes with msgpack (bash build.sh installs it)")

from fastdeploy_kvcache.core.kv_events import BlockRemoved, BlockStored, KVEventBatch  # noqa: E402
from fastdeploy_kvcache.engine.kv_events_config import KVEventsConfig  # noqa: E402
from fastdeploy_kvcache.engine.kv_events_publisher import ZmqEventPublisher  # noqa: E402
from fastdeploy_kvcache.entrypoints.server_process import free_port  # noqa: E402

from .subscriber import Subscriber  # noqa: E402


def batch(i: int) -> KVEventBatch:
    return KVEventBatch(float(i), [BlockStored([i + 1], None, [], 16, None, "GPU"), BlockRemoved([i], "GPU")], 0)


def config(**kw) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}",
                          replay_endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv-events", **kw)


def connected(pub: ZmqEventPublisher, sub: Subscriber) -> int:
    """Publish warm-up batches until the subscriber sees one (PUB drops before the SUB joins);
    the seq of the first batch the test sends after."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pub.publish(KVEventBatch(0.0, [], 0))
        if sub.recv(0.1) is not None:
            sub.drain(0.2)
            return pub.stats()["next_seq"]
    raise AssertionError("the subscriber never received a batch")


def test_pub_frames_and_replay():
    cfg = config()
    pub = ZmqEventPublisher(cfg)
    sub = Subscriber(cfg.endpoint, "kv-events", cfg.replay_endpoint)
    try:
        first = connected(pub, sub)
        for i in range(5):
            assert pub.publish(batch(i))
        got = [sub.recv(5.0) for _ in range(5)]
        assert [seq for seq, _ in got] == list(range(first, first + 5))
        assert got[0][1] == [0.0, [["BlockStored", [1], None, [], 16, None, "GPU"], ["BlockRemoved", [0], "GPU"]], 0]
        # Replay from the middle: exactly the later batches, then the end marker.
        replayed = sub.replay(first + 2)
        assert [seq for seq, _ in replayed] == [first + 2, first + 3, first + 4]
        assert [b for _, b in replayed] == [b for _, b in got[2:]]
        assert sub.replay(first + 5) == []  # nothing newer: just the end marker
        assert pub.stats()["replay_requests"] == 2
    finally:
        sub.close()
        pub.shutdown()


def test_replay_buffer_is_bounded():
    cfg = config(buffer_steps=3)
    pub = ZmqEventPublisher(cfg)
    sub = Subscriber(cfg.endpoint, "kv-events", cfg.replay_endpoint)
    try:
        for i in range(6):
            pub.publish(batch(i))
        deadline = time.monotonic() + 10
        while pub.stats()["published_batches"] < 6 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [seq for seq, _ in sub.replay(0)] == [3, 4, 5]  # the oldest three are gone
    finally:
        sub.close()
        pub.shutdown()


def test_full_queue_drops_and_counts_and_the_gap_shows():
    cfg = config(max_queue_size=2)
    pub = ZmqEventPublisher(cfg, start=False)  # nothing drains the queue yet
    sub = Subscriber(cfg.endpoint, "kv-events", cfg.replay_endpoint)
    try:
        # publish never waits: the third and later batches are dropped and counted.
        assert [pub.publish(batch(i)) for i in range(5)] == [True, True, False, False, False]
        assert pub.stats()["dropped_batches"] == 3 and pub.stats()["queued_batches"] == 2
        pub.start()
        deadline = time.monotonic() + 10
        while pub.stats()["published_batches"] < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert pub.stats()["queued_batches"] == 0
        assert pub.publish(batch(5))
        deadline = time.monotonic() + 10
        while pub.stats()["published_batches"] < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        # The dropped batches spent their sequence numbers: replay shows the gap 2..4.
        assert [seq for seq, _ in sub.replay(0)] == [0, 1, 5]
    finally:
        sub.close()
        pub.shutdown()


def test_malformed_replay_request_gets_the_end_marker():
    cfg = config()
    pub = ZmqEventPublisher(cfg)
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(cfg.replay_endpoint)
    try:
        pub.publish(batch(0))
        dealer.send_multipart([b"", b"abc"])  # not 8 bytes
        assert dealer.poll(5000)
        assert dealer.recv_multipart() == [b"", (-1).to_bytes(8, "big", signed=True), b""]
        assert pub.stats()["replay_requests"] == 0
    finally:
        dealer.close(linger=0)
        ctx.term()
        pub.shutdown()


def test_busy_endpoint_is_a_clear_error():
    cfg = config()
    pub = ZmqEventPublisher(cfg)
    try:
        with pytest.raises(ValueError, match=r"--kv-events-config endpoint 'tcp://127\.0\.0\.1:\d+': Address already in use"):
            ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, endpoint=cfg.endpoint))
    finally:
        pub.shutdown()


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not valid JSON"),
        ("[1]", "must be a JSON object"),
        ('{"enable_kv_cache_events": true, "port": 1}', r"unknown key\(s\) \['port'\]"),
        ('{"enable_kv_cache_events": "yes"}', "enable_kv_cache_events: must be true or false"),
        ('{"publisher": "kafka"}', "publisher: must be one of"),
        ('{"endpoint": 5557}', "endpoint: must be a ZMQ address"),
        ('{"max_queue_size": 0}', "max_queue_size: must be a positive integer"),
        ('{"endpoint": "tcp://*:1", "replay_endpoint": "tcp://*:1"}', "replay_endpoint: must differ"),
    ],
)
def test_malformed_config_is_one_line(text, message):
    with pytest.raises(ValueError, match=message) as info:
        KVEventsConfig.from_json(text)
    assert "\n" not in str(info.value)


def test_config_defaults_follow_vllm():
    assert KVEventsConfig.from_json('{"enable_kv_cache_events": true}').publisher == "zmq"
    off = KVEventsConfig.from_json("{}")
    assert off.publisher == "null" and not off.active


def test_closing_removes_its_ipc_socket_files_and_only_its_own(tmp_path):
    """ZMQ leaves a bound ipc socket's file behind; the publisher's shutdown removes it."""
    pub_path, replay_path = tmp_path / "events", tmp_path / "replay"
    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{pub_path}",
                         replay_endpoint=f"ipc://{replay_path}")
    pub = ZmqEventPublisher(cfg)
    assert pub_path.is_socket() and replay_path.is_socket()
    pub.shutdown()
    assert not pub_path.exists() and not replay_path.exists()

    # A file that another publisher bound since (a newer server on the same path) stays.
    first = ZmqEventPublisher(cfg)
    second = ZmqEventPublisher(cfg)  # ZMQ replaces the file: the path is now second's
    first.shutdown()
    assert pub_path.is_socket() and replay_path.is_socket()
    second.shutdown()
    assert not pub_path.exists() and not replay_path.exists()
