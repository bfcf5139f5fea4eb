"""Tensor parallelism: one cache controller per rank, each in its own process on its own device.

* :mod:`.shard`: what a rank holds (its KV-head shard, or the whole MLA cache), its storage
  namespace, and whether it writes to storage (:func:`writes_storage`);
* :mod:`.rank`: the rank process (a ``CacheController`` driven by messages);
* :mod:`.coordinator`: starts the ranks, sends each step's ``BatchRequest`` to all of them,
  and merges their completions (a copy is done when every rank has done it, and failed if
  any rank failed it).

See docs/architecture.md, "Tensor parallelism".
"""

from fastdeploy_kvcache.worker.tp.coordinator import RankFailedError, RankTimeoutError, StepResult, TPCoordinator
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
