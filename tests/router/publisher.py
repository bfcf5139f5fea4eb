"""A KV-event publisher written in the tests from vLLM's published schema (not the package's).

PUB socket: ``[topic, seq (8 bytes, big-endian), msgpack KVEventBatch]``; ROUTER replay
socket: a request ``[empty, start seq]`` is answered with ``[empty, seq, payload]`` per
buffered batch from ``start`` on, then ``[empty, -1, empty]``.  Tests drive it by hand so
they can drop a batch from the live stream, start late, or restart the sequence.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Optional, Union

import msgspec
import zmq

from fastdeploy_kvcache.entrypoints.server_process import free_port


class BlockStored(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(msgspec.Struct, array_like=True, omit_defaults=True, tag=True):
    pass


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


def h(i: int) -> int:
    """A test block hash: an unsigned 64-bit int, as the events carry them."""
    return (i * 0x9E3779B97F4A7C15 + 7) & ((1 << 64) - 1)


class FakeWorkerPublisher:
    def __init__(self, buffer: int = 1000, topic: bytes = b"kv-events") -> None:
        self.ctx = zmq.Context()
        self.port, self.replay_port = free_port(), free_port()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.bind(f"tcp://127.0.0.1:{self.port}")
        self.replay = self.ctx.socket(zmq.ROUTER)
        self.replay.bind(f"tcp://127.0.0.1:{self.replay_port}")
        self.topic = topic
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer)
        self.seq = 0
        self.replay_requests: list[int] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.replay_port}"

    def publish(self, *events: object, live: bool = True, payload: Optional[bytes] = None) -> int:
        """Encode and buffer one batch; send it on PUB unless ``live`` is False (a lost batch)."""
        if payload is None:
            payload = msgspec.msgpack.encode(KVEventBatch(time.time(), list(events)))
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer.append((seq, payload))
            if live:
                self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        return seq

    def restart_sequence(self) -> None:
        """What a restarted worker looks like: seq from 0 again, an empty buffer."""
        with self._lock:
            self.seq = 0
            self.buffer.clear()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.replay, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(50):
                continue
            ident, empty, start_b = self.replay.recv_multipart()
            start = int.from_bytes(start_b, "big")
            self.replay_requests.append(start)
            with self._lock:
                items = [(s, p) for s, p in self.buffer if s >= start]
            for s, p in items:
                self.replay.send_multipart([ident, b"", s.to_bytes(8, "big"), p])
            self.replay.send_multipart([ident, b"", (-1).to_bytes(8, "big", signed=True), b""])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.pub.close(0)
        self.replay.close(0)
        self.ctx.term()


def stored(ids: list[int], medium: str = "GPU", block_size: int = 16) -> BlockStored:
    return BlockStored([h(i) for i in ids], None, [1] * (block_size * len(ids)), block_size, None, medium)


def removed(ids: list[int], medium: str = "GPU") -> BlockRemoved:
    return BlockRemoved([h(i) for i in ids], medium)
