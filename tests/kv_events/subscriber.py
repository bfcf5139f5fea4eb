"""An independent KV event subscriber, written from the published schema (docs/fleet.md).

It imports nothing of fastdeploy_kvcache's events: frames are split by hand, payloads
decoded with plain ``msgpack`` into lists, and the tiers rebuilt from the arrays.  That
is what makes it a check of the wire format rather than of our own decoder.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import msgpack
import zmq

END = (-1).to_bytes(8, "big", signed=True)


class Subscriber:
    """SUB on ``endpoint`` (topic ``topic``), REQ on ``replay`` when given."""

    def __init__(self, endpoint: str, topic: str, replay: Optional[str] = None) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.topic = topic.encode()
        self.replay_endpoint = replay
        self.batches: dict[int, list[Any]] = {}  # seq -> decoded batch

    def close(self) -> None:
        self.sub.close(linger=0)
        self.ctx.term()

    def recv(self, timeout_s: float) -> Optional[tuple[int, list[Any]]]:
        """One message as (seq, decoded batch), or None after ``timeout_s``."""
        if not self.sub.poll(int(timeout_s * 1000)):
            return None
        frames = self.sub.recv_multipart()
        assert len(frames) == 3, f"a PUB message has 3 frames, got {len(frames)}"
        topic, seq_bytes, payload = frames
        assert topic == self.topic and len(seq_bytes) == 8
        seq = int.from_bytes(seq_bytes, "big")
        batch = msgpack.unpackb(payload, raw=False)
        self.batches[seq] = batch
        return seq, batch

    def drain(self, quiet_s: float = 0.3) -> None:
        """Receive until nothing arrives for ``quiet_s``."""
        while self.recv(quiet_s) is not None:
            pass

    def replay(self, start: int, timeout_s: float = 5.0) -> list[tuple[int, list[Any]]]:
        """Ask the replay socket for every batch from ``start``; (seq, batch) up to the end marker.

        A DEALER that sends REQ's envelope (an empty delimiter frame, then the 8-byte start):
        a REQ socket takes only one reply message per request, and the answer is many.
        """
        assert self.replay_endpoint is not None
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            deadline = time.monotonic() + timeout_s
            while True:
                assert dealer.poll(max(1, int((deadline - time.monotonic()) * 1000))), "replay did not answer"
                frames = dealer.recv_multipart()
                assert len(frames) == 3 and frames[0] == b"", f"a replay answer is [b'', seq, payload], got {frames!r}"
                _, seq_bytes, payload = frames
                if seq_bytes == END:
                    assert payload == b""
                    return out
                seq = int.from_bytes(seq_bytes, "big")
                batch = msgpack.unpackb(payload, raw=False)
                self.batches[seq] = batch
                out.append((seq, batch))
        finally:
            dealer.close(linger=0)


def rebuild(batches: dict[int, list[Any]]) -> dict[str, set[int]]:
    """Apply batches in seq order: medium -> set of block hashes."""
    tiers: dict[str, set[int]] = {}
    for seq in sorted(batches):
        ts, events = batches[seq][0], batches[seq][1]
        assert isinstance(ts, float)
        for ev in events:
            if ev[0] == "BlockStored":
                _, hashes, _parent, tokens, block_size, _lora, medium = ev
                assert len(tokens) in (0, len(hashes) * block_size)
                tiers.setdefault(medium, set()).update(hashes)
            elif ev[0] == "BlockRemoved":
                _, hashes, medium = ev
                tiers.setdefault(medium, set()).difference_update(hashes)
            else:
                assert ev == ["AllBlocksCleared"], ev
                tiers.clear()
    return {m: s for m, s in tiers.items() if s}
