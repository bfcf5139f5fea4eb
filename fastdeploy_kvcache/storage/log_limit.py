"""A WARNING that repeats at most once per interval, with how often it happened meanwhile.

A full disk fails every put; one line per put flooded the log (thousands of lines a minute)
and hid everything else.  :class:`ThrottledLog` keeps one line per kind of fault and
interval and says how many were folded into it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

__all__ = ["ThrottledLog", "DEFAULT_INTERVAL_S"]

DEFAULT_INTERVAL_S = 60.0


class ThrottledLog:
    """``warning(kind, msg, *args)``: logged the first time a ``kind`` happens, then at most
    once per ``interval_s``, with the count of the ones not logged since.

    Thread-safe (backends log from their I/O threads).
    """

    def __init__(self, logger: logging.Logger, interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if interval_s < 0:
            raise ValueError(f"interval_s must be >= 0, got {interval_s}")
        self.logger = logger
        self.interval_s = interval_s
        self.clock = clock
        self._lock = threading.Lock()
        self._state: dict[str, tuple[float, int]] = {}  # kind -> (last logged at, folded since)
        self.counts: dict[str, int] = {}  # kind -> every occurrence (for stats and tests)

    def warning(self, kind: str, msg: str, *args: Any) -> bool:
        """Log or fold one occurrence; True when a line was written."""
        now = self.clock()
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            last, folded = self._state.get(kind, (float("-inf"), 0))
            if now - last < self.interval_s:
                self._state[kind] = (last, folded + 1)
                return False
            self._state[kind] = (now, 0)
        if folded:
            self.logger.warning(msg + " (and %d more like it in the last %.0f s)", *args, folded, now - last)
        else:
            self.logger.warning(msg, *args)
        return True
