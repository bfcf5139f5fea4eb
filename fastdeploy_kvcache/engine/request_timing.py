"""Where one request's time to first token went: queued, storage fetch, first step, prefill.

The engine's step timing (``engine/step_timing.py``) sums phases over steps; a storage hit's
extra cost is a property of one request (how long it waited for its fetch, and whether it
was admitted as soon as the fetch landed), so the engine also keeps, per request:

* ``queued_s``: arrival to admission (its first blocks);
* ``fetch``: the storage fetch it waited for, if any (its own or one it shared), with times
  since arrival: ``started_s`` (planned and handed to the worker), ``landed_s`` (the
  backend call and the copy into host blocks ended), ``in_tree_s`` (the engine thread took
  it back and its blocks became host hits), ``job_s``, ``bytes``, ``blocks``, ``shared``;
  ``plan``: the request's fetch-or-recompute choice (``choice``, ``reason``, blocks
  ``fetched`` and ``recomputed``, ``head``: blocks recomputed while the tail was read,
  ``predicted_s`` against ``actual_s``: plan to stored prefix ready; ``attached`` or
  ``dropped`` for a split's tail); ``admit_after_fetch_s`` is the gap from ``in_tree_s``
  to admission;
* ``first_step``: the step that admitted it (``schedule_s``, ``submit_s``: where the host ->
  device loads are issued, ``forward_s``, ``batch``: requests in it, ``tokens``: its own);
* ``prefill_s``: admission to first token; ``ttft_s``: arrival to first token.

The last :data:`KEEP` finished requests are in the engine's stats
(``request_timings``; ``GET /health?verbose=1``), where benchmarks read them.
"""

from __future__ import annotations

import collections
import threading
from typing import Any, Optional

__all__ = ["KEEP", "RecentTimings", "request_timing"]

# Finished requests whose timings the stats keep (a bounded window, newest last).
KEEP = 64


def request_timing(request_id: str, arrival: float, admitted: Optional[float], first_token: Optional[float],
                   fetch: Optional[dict[str, Any]], first_step: Optional[dict[str, Any]],
                   cached: dict[str, int]) -> dict[str, Any]:
    """One request's timings (see the module docstring) from monotonic timestamps."""

    def since(t: Optional[float]) -> Optional[float]:
        return None if not t else t - arrival

    out: dict[str, Any] = {"request_id": request_id, "queued_s": since(admitted), "ttft_s": since(first_token),
                           "prefill_s": first_token - admitted if admitted and first_token else None,
                           "cached_tokens": dict(cached), "first_step": first_step, "fetch": None,
                           "admit_after_fetch_s": None}
    if fetch is not None:
        out["fetch"] = {"started_s": since(fetch["started"]), "landed_s": since(fetch["landed"]),
                        "in_tree_s": since(fetch["completed"]), "job_s": fetch["job_s"], "bytes": fetch["bytes"],
                        "blocks": fetch["blocks"], "shared": fetch["shared"], "on_arrival": fetch["on_arrival"],
                        "plan": dict(fetch["plan"]) if fetch.get("plan") else None}
        if fetch["completed"] and admitted:
            out["admit_after_fetch_s"] = admitted - fetch["completed"]
    return out


class RecentTimings:
    """The last ``keep`` requests' timings (thread-safe snapshot, newest last)."""

    def __init__(self, keep: int = KEEP) -> None:
        self._lock = threading.Lock()
        self._recent: "collections.deque[dict[str, Any]]" = collections.deque(maxlen=keep)

    def add(self, timing: dict[str, Any]) -> None:
        with self._lock:
            self._recent.append(timing)

    def snapshot(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._recent)
