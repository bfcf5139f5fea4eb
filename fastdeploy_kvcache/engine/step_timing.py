"""Where an engine step's time goes, on the host: accumulated per phase for the engine's stats.

Phases of one step (``LLMEngine._step``):

* ``schedule``: the scheduler and the cache manager (``match_prefix``, ``ensure_resident``,
  evictions, preemptions);
* ``submit``: the step's batch and the worker's ``submit_swap_tasks`` (copies enqueued);
* ``launch``: the model's forward pass enqueued on the device (the host's share of it);
* ``gpu_wait``: the host waiting for the device to finish the step (reading its logits back);
  on a CPU runner the forward pass runs on the host and this stays 0;
* ``complete``: finished copies handed back to the cache manager;
* ``sample``: sampling, detokenizing and emitting the step's tokens.

``load_wait_gpu`` is device time, not host time: how long the compute stream sat waiting
for a layer's host->device load (measured with CUDA events around each wait that was not
already satisfied).  Steps with at least ``busy_threshold`` running requests are also summed
on their own (``busy``), where the cache manager's and worker's share of a step is judged.
"""

from __future__ import annotations

import threading
from typing import Any

PHASES = ("schedule", "submit", "launch", "gpu_wait", "complete", "sample")
_KEYS = {p: f"{p}_s" for p in PHASES}  # built once: add() runs every step


class StepTimes:
    """Sums of seconds per phase over steps (thread-safe snapshot)."""

    def __init__(self, busy_threshold: int = 32) -> None:
        self.busy_threshold = busy_threshold
        self._lock = threading.Lock()
        self._all = self._empty()
        self._busy = self._empty()

    @staticmethod
    def _empty() -> dict[str, Any]:
        return {"steps": 0, "step_s": 0.0, "load_wait_gpu_s": 0.0, **{f"{p}_s": 0.0 for p in PHASES}}

    def add(self, phases: dict[str, float], load_wait_gpu_s: float, running: int) -> None:
        """One step's phase seconds (keys of :data:`PHASES`), with ``running`` requests."""
        targets = (self._all, self._busy) if running >= self.busy_threshold else (self._all,)
        total = sum(phases.values())
        keys = _KEYS
        with self._lock:
            for t in targets:
                t["steps"] += 1
                t["step_s"] += total
                t["load_wait_gpu_s"] += load_wait_gpu_s
                for p, s in phases.items():
                    t[keys[p]] += s

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"all": dict(self._all), "busy": dict(self._busy), "busy_threshold": self.busy_threshold}
