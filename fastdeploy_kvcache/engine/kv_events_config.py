"""``--kv-events-config``: vLLM's flag for KV cache events, parsed and checked.

The value is a JSON object with vLLM's ``KVEventsConfig`` keys; anything else (not
JSON, not an object, an unknown key, a wrong type) is refused with one line saying what
is wrong.  No ZMQ here: the publisher (``engine.kv_events_publisher``) is imported only
when events are on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["KVEventsConfig", "parse_kv_events_config", "PUBLISHERS"]

PUBLISHERS = ("null", "zmq")


@dataclass
class KVEventsConfig:
    """What to publish and where (docs/fleet.md, "Enabling them")."""

    enable_kv_cache_events: bool = False
    # None: "zmq" when events are enabled, else "null" (vLLM's rule).
    publisher: Optional[str] = None
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher is None:
            self.publisher = "zmq" if self.enable_kv_cache_events else "null"
        self.validate()

    @property
    def active(self) -> bool:
        """Whether events are recorded and published at all."""
        return self.enable_kv_cache_events and self.publisher == "zmq"

    def validate(self) -> None:
        """Raise ValueError naming the first bad key."""
        if not isinstance(self.enable_kv_cache_events, bool):
            raise ValueError(f"enable_kv_cache_events: must be true or false, got {self.enable_kv_cache_events!r}")
        if self.publisher not in PUBLISHERS:
            raise ValueError(f"publisher: must be one of {list(PUBLISHERS)}, got {self.publisher!r}")
        if not isinstance(self.endpoint, str) or "://" not in self.endpoint:
            raise ValueError(f"endpoint: must be a ZMQ address such as 'tcp://*:5557', got {self.endpoint!r}")
        if self.replay_endpoint is not None and (
            not isinstance(self.replay_endpoint, str) or "://" not in self.replay_endpoint
        ):
            raise ValueError(
                f"replay_endpoint: must be null or a ZMQ address such as 'tcp://*:5558', got {self.replay_endpoint!r}"
            )
        if self.replay_endpoint is not None and self.replay_endpoint == self.endpoint:
            raise ValueError(f"replay_endpoint: must differ from endpoint ({self.endpoint!r})")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"topic: must be a string, got {self.topic!r}")

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        """Parse the flag's value; ValueError with a one-line message when it is malformed."""
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not valid JSON ({exc.msg} at char {exc.pos}): {text!r}") from None
        if not isinstance(obj, dict):
            raise ValueError(f"must be a JSON object such as '{{\"enable_kv_cache_events\": true}}', got {text!r}")
        names = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(obj) - set(names))
        if unknown:
            raise ValueError(f"unknown key(s) {unknown}; known keys: {names}")
        return cls(**obj)


def parse_kv_events_config(text: str) -> KVEventsConfig:
    """argparse ``type=`` for ``--kv-events-config``: the error becomes argparse's one line."""
    try:
        return KVEventsConfig.from_json(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None

