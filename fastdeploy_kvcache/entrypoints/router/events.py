"""Reading one worker's KV cache events: ZMQ SUB for the live stream, the replay socket for gaps.

The wire format is vLLM's: a PUB socket sends ``[topic, seq, payload]`` where ``seq`` is an
8-byte big-endian counter from 0 and ``payload`` a msgpack ``KVEventBatch`` (``ts``,
``events``) of tagged events (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``).
A ROUTER replay socket answers ``[empty, start seq]`` with ``[empty, seq, payload]`` for
every batch it still buffers from ``start`` on, then ``[empty, -1, empty]``.

Payloads are decoded with the schema of :mod:`fastdeploy_kvcache.core.kv_events`; block
hashes are its 64-bit event hashes (``event_block_hashes``), which is what the router
computes from a prompt too.

Sequence rules (per worker):

* the next seq is applied; one past it means batches were lost: the missing ones are
  asked of the replay socket (those it no longer buffers are counted as ``missed``);
* when the subscriber starts, everything from 0 is asked of the replay socket, so a
  (re)started router rebuilds each view from the worker's replay buffer, busy or idle;
  the live batches that queued up meanwhile and were in the replay are skipped;
* the first batch after the worker was marked down, or one the start-up replay did not
  reach, with seq > 0: everything from 0 is asked of the replay socket; without a replay
  socket, or with a buffer that no longer reaches back to 0, the view starts from what
  follows (blocks stored before are not predicted: the router under-predicts, it never
  sends a request to a worker for blocks it lacks);
* otherwise a seq at or below the last applied one means the worker's publisher
  restarted: the view is emptied and rebuilt from the new stream (and its replay buffer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import msgspec

from fastdeploy_kvcache.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_batch
from fastdeploy_kvcache.entrypoints.router.view import WorkerView, medium_bit

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)
REPLAY_TIMEOUT_S = 2.0


def apply_batch(view: WorkerView, batch: KVEventBatch) -> None:
    """Apply one batch's events in order; ValueError (nothing applied) for an unknown medium."""
    for ev in batch.events:
        if isinstance(ev, (BlockStored, BlockRemoved)):
            medium_bit(ev.medium)
    for ev in batch.events:
        if isinstance(ev, BlockStored):
            view.store(ev.block_hashes, ev.medium, ev.block_size)
        elif isinstance(ev, BlockRemoved):
            view.remove(ev.block_hashes, ev.medium)
        elif isinstance(ev, AllBlocksCleared):
            view.clear()


@dataclass
class SubscriberStats:
    batches: int = 0
    events: int = 0
    gaps: int = 0
    replays: int = 0
    missed: int = 0
    restarts: int = 0
    bad_batches: int = 0
    last_event_time: float = 0.0


class EventSubscriber:
    """Keeps one :class:`WorkerView` in step with one worker's event stream (an asyncio task)."""

    def __init__(self, name: str, view: WorkerView, endpoint: str, replay_endpoint: Optional[str],
                 topic: str = "", ctx: Any = None, on_update: Optional[Callable[[], None]] = None) -> None:
        import zmq.asyncio

        self.name = name
        self.view = view
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.ctx = ctx or zmq.asyncio.Context.instance()
        self.stats = SubscriberStats()
        self.last_seq: Optional[int] = None
        self._catching_up = False  # after the start-up replay: live seqs <= last_seq are duplicates
        self._on_update = on_update
        self._task: Optional[asyncio.Task[None]] = None

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - shutting down
                pass

    def reset(self) -> None:
        """Forget the worker's state (it went down): the next batch starts a fresh view."""
        self.view.clear()
        self.last_seq = None
        self._catching_up = False

    # ------------------------------------------------------------------ applying
    def _apply(self, seq: int, payload: bytes) -> None:
        expected = 0 if self.last_seq is None else self.last_seq + 1
        if seq > expected:
            self.stats.missed += seq - expected  # neither live nor in the replay buffer
        self.last_seq = seq
        try:
            batch = decode_batch(payload)
            apply_batch(self.view, batch)
        except (msgspec.DecodeError, ValueError) as exc:
            self.stats.bad_batches += 1
            logger.warning("worker %s: batch %d skipped: %s", self.name, seq, exc)
            return
        self.stats.batches += 1
        self.stats.events += len(batch.events)
        self.stats.last_event_time = time.time()
        if self._on_update is not None:
            self._on_update()

    async def on_message(self, seq: int, payload: bytes) -> None:
        """One live batch, with the sequence rules of the module docstring."""
        last = self.last_seq
        if last is not None and seq <= last:
            if self._catching_up:
                return  # queued while the start-up replay ran: already applied
            logger.info("worker %s: seq went back from %d to %d: its publisher restarted", self.name, last, seq)
            self.stats.restarts += 1
            self.reset()
            last = None
        self._catching_up = False
        expected = 0 if last is None else last + 1
        if seq > expected:
            if last is not None:
                self.stats.gaps += 1
            await self._replay(expected, seq)
        if self.last_seq is None or seq > self.last_seq:
            self._apply(seq, payload)

    async def _replay(self, start: int, live_seq: Optional[int], at_start: bool = False) -> None:
        """Apply the buffered batches from ``start`` (below ``live_seq``, if given) from the replay socket.

        ``at_start``: the subscriber's first replay, which finds no answer while the worker
        is still starting; that is no fault (its first batch asks again), so it logs at debug.
        """
        if not self.replay_endpoint:
            return
        import zmq

        self.stats.replays += 1
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.replay_endpoint)
            await sock.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                if not await sock.poll(REPLAY_TIMEOUT_S * 1000):
                    logger.log(logging.DEBUG if at_start else logging.WARNING,
                               "worker %s: replay from %d timed out", self.name, start)
                    return
                frames = await sock.recv_multipart()
                if len(frames) == 3 and not frames[0]:
                    frames = frames[1:]  # the empty delimiter a DEALER sees
                if len(frames) != 2 or len(frames[0]) != 8:
                    logger.warning("worker %s: replay message of %d frames skipped", self.name, len(frames))
                    continue
                seq_b, payload = frames
                if seq_b == END_SEQ:
                    return
                seq = int.from_bytes(seq_b, "big")
                if seq < start or (live_seq is not None and seq >= live_seq) or \
                        (self.last_seq is not None and seq <= self.last_seq):
                    continue
                self._apply(seq, payload)
        finally:
            sock.close(0)

    async def _run(self) -> None:
        import zmq

        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        logger.info("worker %s: subscribed to %s (replay %s)", self.name, self.endpoint, self.replay_endpoint)
        try:
            # Whatever the worker still buffers, so that a (re)started router sees the cache of
            # an idle worker too; live batches queued meanwhile are skipped as duplicates.
            await self._replay(0, None, at_start=True)
            self._catching_up = self.last_seq is not None
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3 or len(frames[1]) != 8:
                    self.stats.bad_batches += 1
                    logger.warning("worker %s: message of %d frames skipped", self.name, len(frames))
                    continue
                try:
                    await self.on_message(int.from_bytes(frames[1], "big"), frames[2])
                except Exception:  # noqa: BLE001 - one bad batch must not stop the subscriber
                    self.stats.bad_batches += 1
                    logger.exception("worker %s: applying a batch failed", self.name)
        finally:
            sub.close(0)
