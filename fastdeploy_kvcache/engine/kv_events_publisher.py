"""ZMQ publisher of KV cache events: a PUB socket, a ROUTER replay socket, never blocking.

The engine thread calls :meth:`ZmqEventPublisher.publish` once per step with the step's
batch; that only gives the batch its sequence number and puts it on a bounded queue.  A
background thread encodes it (msgspec msgpack), sends it on the PUB socket as
``[topic, seq as 8 bytes big-endian, payload]``, keeps ``(seq, payload)`` in a bounded
replay buffer, and answers replay requests on the ROUTER socket: a request is one frame,
the first wanted ``seq`` as 8 bytes big-endian; the answer is one ``[seq, payload]``
message per buffered batch from there on, then ``[-1 as 8 bytes, b""]``.  This is the
framing of vLLM's publisher, so its subscribers work unchanged.

When the queue is full the batch is dropped and counted, never waited for.  Its sequence
number is spent all the same, so a subscriber sees the gap (and no replay fills it); the
engine then asks the recorder for a resynchronisation (``AllBlocksCleared`` and the
whole current contents) in the next batch, so a subscriber's view heals.

Sockets are created and bound in the caller's thread (a bad or busy endpoint fails the
server's start-up) and used only by the publisher thread afterwards.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import stat
import threading
from typing import Any, Optional

import zmq

from fastdeploy_kvcache.core.kv_events import KVEventBatch, encode_batch
from fastdeploy_kvcache.engine.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)

__all__ = ["ZmqEventPublisher", "END_SEQ"]

END_SEQ = (-1).to_bytes(8, "big", signed=True)  # the replay answer's end marker
_IDLE_POLL_MS = 20  # how long the thread waits for a replay request when nothing is queued


_LOOPBACK_HOSTS = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:")


def binds(endpoint: str) -> bool:
    """Whether the PUB socket binds ``endpoint`` (else it connects to it).

    vLLM's rule (wildcard, IPv6 any, ipc and inproc addresses are bound), plus loopback
    addresses, which vLLM connects to: a single-host fleet (and every test) can then
    publish on 127.0.0.1 without listening on every interface.
    """
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith(("ipc://", "inproc://"))
        or endpoint.startswith(_LOOPBACK_HOSTS)
    )


class ZmqEventPublisher:
    """Publishes ``KVEventBatch`` objects; see the module docstring for the wire contract.

    ``start=False`` leaves the thread unstarted until :meth:`start` (tests fill the queue
    to see a batch dropped).
    """

    def __init__(self, config: KVEventsConfig, start: bool = True) -> None:
        self.config = config
        self._queue: "queue.Queue[Optional[tuple[int, KVEventBatch]]]" = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: "collections.deque[tuple[int, bytes]]" = collections.deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode("utf-8")
        self._ctx = zmq.Context()
        self._pub: Optional[zmq.Socket] = None
        self._replay: Optional[zmq.Socket] = None
        # (path, inode) of each ipc socket file this publisher bound: ZMQ leaves the file
        # behind when the socket closes, so closing removes it (if it is still ours).
        self._ipc_files: list[tuple[str, int]] = []
        try:
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.setsockopt(zmq.SNDHWM, config.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            self._attach(self._pub, config.endpoint, "endpoint")
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._attach(self._replay, config.replay_endpoint, "replay_endpoint", bind_only=True)
        except BaseException:
            self._close_sockets()
            raise
        self._next_seq = 0  # engine thread only
        self.published_batches = 0  # publisher thread only
        self.dropped_batches = 0  # engine thread only
        self.replay_requests = 0  # publisher thread only
        self.last_error: Optional[str] = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fdkv-kv-events", daemon=True)
        self._closed = False
        if start:
            self.start()
        logger.info("KV cache events on %s (replay %s, topic %r)", config.endpoint, config.replay_endpoint,
                    config.topic)

    def _attach(self, sock: zmq.Socket, endpoint: str, key: str, bind_only: bool = False) -> None:
        try:
            if bind_only or binds(endpoint):
                sock.bind(endpoint)
                self._remember_ipc_file(endpoint)
            else:
                sock.connect(endpoint)
        except zmq.ZMQError as exc:
            raise ValueError(f"--kv-events-config {key} {endpoint!r}: {exc}") from None

    # ------------------------------------------------------------------ engine side
    def start(self) -> None:
        if not self._thread.is_alive() and not self._closed:
            self._thread.start()

    def publish(self, batch: KVEventBatch) -> bool:
        """Queue ``batch`` under the next sequence number; False if the queue was full (dropped)."""
        seq = self._next_seq
        self._next_seq += 1
        try:
            self._queue.put_nowait((seq, batch))
            return True
        except queue.Full:
            self.dropped_batches += 1
            if self.dropped_batches == 1 or self.dropped_batches % 1000 == 0:
                logger.warning("KV event queue full (%d batches): dropped batch %d (%d dropped so far)",
                               self.config.max_queue_size, seq, self.dropped_batches)
            return False

    def stats(self) -> dict[str, Any]:
        return {
            "published_batches": self.published_batches,
            "dropped_batches": self.dropped_batches,
            "queued_batches": self._queue.qsize(),
            "replay_requests": self.replay_requests,
            "next_seq": self._next_seq,
        }

    def shutdown(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (up to ``timeout_s``), stop the thread, close the sockets."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("KV event publisher thread did not stop within %.1f s", timeout_s)
                return  # it owns the sockets; the process is going away anyway
        self._close_sockets()

    def _remember_ipc_file(self, endpoint: str) -> None:
        if not endpoint.startswith("ipc://") or endpoint.startswith("ipc://@"):  # @: abstract, no file
            return
        path = endpoint[len("ipc://"):]
        try:
            self._ipc_files.append((path, os.stat(path).st_ino))
        except OSError:
            pass

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()
        for path, inode in self._ipc_files:
            try:
                st = os.lstat(path)
                if stat.S_ISSOCK(st.st_mode) and st.st_ino == inode:  # not a newer server's socket
                    os.unlink(path)
            except OSError:
                pass
        self._ipc_files.clear()

    # ------------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    if self._stop.is_set():
                        return
                    if self._replay is not None:
                        self._replay.poll(_IDLE_POLL_MS)
                    else:
                        try:
                            item = self._queue.get(timeout=_IDLE_POLL_MS / 1000)
                        except queue.Empty:
                            continue
                        self._send(*item)
                    continue
                self._send(*item)
        except Exception as exc:  # noqa: BLE001 - never take the server down; say why it stopped
            self.last_error = f"{type(exc).__name__}: {exc}"
            logger.exception("KV event publisher thread stopped")

    def _send(self, seq: int, batch: KVEventBatch) -> None:
        payload = encode_batch(batch)
        assert self._pub is not None
        # PUB never blocks: past the high-water mark ZMQ drops for the slow subscriber, which
        # then sees a gap and asks the replay socket.
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        self._buffer.append((seq, payload))
        self.published_batches += 1

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        # [identity, b"", start] from a REQ client; [identity, start] from a DEALER.
        ident, start = frames[0], frames[-1]
        envelope = [ident, b""] if len(frames) == 3 and frames[1] == b"" else [ident]
        if len(frames) not in (2, 3) or len(start) != 8:
            logger.warning("ignoring a malformed replay request (%d frames)", len(frames))
            self._replay.send_multipart(envelope + [END_SEQ, b""])
            return
        self.replay_requests += 1
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart(envelope + [seq.to_bytes(8, "big"), payload])
        self._replay.send_multipart(envelope + [END_SEQ, b""])
