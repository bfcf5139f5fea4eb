"""Circuit breaker: turns a failing remote tier off, and lets one probe turn it back on.

Why: with the Mooncake master dead, every batch call costs ~4.3 s before it fails
(docs/storage.md, "`mooncake`").  Paying that on every scheduler step would stall serving; after
``failure_threshold`` consecutive failures the breaker *opens* and calls fail at once with
``StorageError("unreachable")``.  After ``reset_timeout_s`` it goes *half open*: one call
(or the backend's background probe) is let through; success closes it, failure re-opens it
and doubles the wait (capped), so a long outage costs one probe per ``max_reset_timeout_s``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Callable

logger = logging.getLogger(__name__)

__all__ = ["CircuitBreaker", "CLOSED", "OPEN", "HALF_OPEN", "BREAKER_STATE_VALUE"]

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"
BREAKER_STATE_VALUE = {CLOSED: 0, HALF_OPEN: 1, OPEN: 2}
"""Gauge values for metrics: 0 closed (tier on), 1 half open (probing), 2 open (tier off)."""


class CircuitBreaker:
    def __init__(
        self,
        name: str,
        failure_threshold: int = 3,
        reset_timeout_s: float = 2.0,
        max_reset_timeout_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        self.name = name
        self.failure_threshold = failure_threshold
        self.base_reset_s = reset_timeout_s
        self.max_reset_s = max_reset_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._opened_at = 0.0
        self._reset_s = reset_timeout_s
        self._probe_in_flight = False
        self.opens = 0  # times it went from closed to open (a counter for metrics)

    @property
    def state(self) -> str:
        with self._lock:
            return self._state_locked()

    def _state_locked(self) -> str:
        if self._state == OPEN and self._clock() - self._opened_at >= self._reset_s:
            self._state = HALF_OPEN
        return self._state

    @property
    def consecutive_failures(self) -> int:
        return self._failures

    def allow(self) -> bool:
        """May a call go to the store now?  In half-open state only one probe at a time."""
        with self._lock:
            state = self._state_locked()
            if state == CLOSED:
                return True
            if state == HALF_OPEN and not self._probe_in_flight:
                self._probe_in_flight = True
                return True
            return False

    def record_success(self) -> None:
        with self._lock:
            if self._state != CLOSED:
                logger.info("storage breaker %s: closed (tier on)", self.name)
            self._state = CLOSED
            self._failures = 0
            self._reset_s = self.base_reset_s
            self._probe_in_flight = False

    def record_failure(self) -> None:
        with self._lock:
            self._failures += 1
            state = self._state_locked()
            if state == HALF_OPEN:
                self._reset_s = min(self._reset_s * 2, self.max_reset_s)
                self._trip()
            elif state == CLOSED and self._failures >= self.failure_threshold:
                self.opens += 1
                self._trip()
                logger.warning(
                    "storage breaker %s: open after %d consecutive failures (tier off, probe in %.1fs)",
                    self.name, self._failures, self._reset_s,
                )
            self._probe_in_flight = False

    def force_open(self) -> None:
        """Turn the tier off now (not set up yet, or closed); not counted in ``opens``."""
        with self._lock:
            self._trip()
            self._probe_in_flight = False

    def _trip(self) -> None:
        self._state = OPEN
        self._opened_at = self._clock()
