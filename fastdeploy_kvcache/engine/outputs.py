"""What the engine hands back to its caller, once per step that produced tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass
class RequestOutput:
    """One request's progress in one step (``finished=True`` exactly once, last).

    ``new_token_ids`` and ``text`` are this step's delta; ``text`` has stop strings removed.
    ``num_cached_tokens`` counts prompt tokens whose KV was reused from any tier
    (``cached_tokens_by_tier`` splits it: "device", "host", "storage").
    """

    request_id: str
    new_token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finished: bool = False
    finish_reason: Optional[str] = None  # "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    cached_tokens_by_tier: dict[str, int] = field(default_factory=lambda: {"device": 0, "host": 0, "storage": 0})
    first_token_time: Optional[float] = None  # time.monotonic()
    arrival_time: float = 0.0
    error: Optional[str] = None
