"""What the engine hands a model runner each step, and what it reads back: :class:`ModelRunner`.

Two runners satisfy it: ``PaddleModelRunner`` (paddleformers, ``engine/paddleformers_runner/paddle_runner.py``) and
``TorchModelRunner`` (transformers, ``engine/transformers_runner/torch_runner.py``).  A step is the list of
:class:`ScheduledSeq` (one per scheduled request, in the engine's order), the pool's per-layer
caches and the step's layer counter (the host->device loads each layer waits for, or None).
After each step the engine reads the ``last_*`` figures into its step timings; every runner
declares them, one that has nothing to report keeps the zero default.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Protocol, Sequence

import numpy as np

from fastdeploy_kvcache.engine.sampling import StepSampling

__all__ = ["ModelRunner", "ScheduledSeq", "RUNNER_ATTRIBUTES", "RUNNER_METHODS"]


@dataclass
class ScheduledSeq:
    """One request's share of a step."""

    token_ids: Sequence[int]  # the tokens computed this step
    context_len: int  # tokens already in the cache
    block_ids: list[int]
    wants_logits: bool  # sample a token after this step


class ModelRunner(Protocol):
    """One forward pass per engine step over the paged KV cache."""

    # Layers of the last step that waited for a host->device load (the engine counts them).
    last_layers_waited: int
    # Host seconds the last step spent waiting for the device (its "gpu_wait" phase; 0 where
    # the forward pass is not asynchronous).
    last_gpu_wait_s: float
    # Device seconds the last step's compute stream waited for loads (0 where not measured).
    last_load_wait_gpu_s: float
    # Whether the last step was a CUDA-graph replay (counted as cudagraph_replays).
    last_step_replayed: bool

    def forward(self, seqs: list[ScheduledSeq], kv_caches: Sequence[Sequence[Any]],
                layer_done: Optional[Any]) -> np.ndarray:
        """Run the step; float32 logits, one row per seq with ``wants_logits``, in ``seqs`` order."""
        ...

    def forward_sample(self, seqs: list[ScheduledSeq], kv_caches: Sequence[Sequence[Any]],
                       layer_done: Optional[Any], sampling: StepSampling) -> np.ndarray:
        """Run the step and pick each sampling row's token; int64 ids, one per seq with ``wants_logits``."""
        ...


# The protocol's members by kind, for checks that a class provides them without building one.
RUNNER_ATTRIBUTES = ("last_layers_waited", "last_gpu_wait_s", "last_load_wait_gpu_s", "last_step_replayed")
RUNNER_METHODS = ("forward", "forward_sample")
