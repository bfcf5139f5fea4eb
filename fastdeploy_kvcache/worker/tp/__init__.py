"""Tensor parallelism: one cache controller per rank, each in its own process on its own device.

* :mod:`.shard`: what a rank holds (its KV-head shard, or the whole MLA cache), its storage
  namespace, and whether it writes to storage (:func:`writes_storage`);
* :mod:`.rank`: the rank process (a ``CacheController`` driven by messages);
* :mod:`.merge`: per-rank completions merged into one verdict (done when every rank is,
  failed if any rank failed), usable without the process host;
* :mod:`.coordinator`: starts the ranks, sends each step's ``BatchRequest`` to all of them,
  and merges their completions through :mod:`.merge`.

See docs/architecture.md, "Tensor parallelism".
"""

from fastdeploy_kvcache.worker.tp.coordinator import RankFailedError, RankTimeoutError, StepResult, TPCoordinator
from fastdeploy_kvcache.worker.tp.merge import CompletionMerger
from fastdeploy_kvcache.worker.tp.rank import RankSpec, StepReply
from fastdeploy_kvcache.worker.tp.shard import (
    check_divisible,
    head_range,
    host_blocks_per_rank,
    scheduler_config,
    shard_config,
    storage_namespace,
    writes_storage,
)

__all__ = [
    "CompletionMerger",
    "RankFailedError",
    "RankSpec",
    "RankTimeoutError",
    "StepReply",
    "StepResult",
    "TPCoordinator",
    "check_divisible",
    "head_range",
    "host_blocks_per_rank",
    "scheduler_config",
    "shard_config",
    "storage_namespace",
    "writes_storage",
]
