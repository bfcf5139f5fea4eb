"""The engine's view of KV block management: the tiered manager, or the plain baseline.

``ENABLE_V1_KVCACHE_MANAGER=1`` -> :class:`ManagedKVPool` (``CacheManager`` +
``CacheController``: prefix reuse on device, host tier, write policies, async copies).
``ENABLE_V1_KVCACHE_MANAGER=0`` -> :class:`PlainKVPool`: a device block allocator with no reuse
between requests, the baseline FastDeploy users compare against.  Both own their device caches
through a ``CacheController`` so the attention code is identical; the plain pool never copies.

The engine loop calls the same methods on either (admit, ensure_resident, finish, preempt,
begin_step, complete_finished), so the switch changes nothing else.  Capabilities only some
pools have (the tiered manager, the storage tier and its prefetches) are declared on
:class:`KVPool` with a default that does nothing, so callers never probe for them.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Optional

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.block_pool import BlockPool, NoFreeBlocksError
from fastdeploy_kvcache.core.metadata import CacheLevel, ResidencyPlan
from fastdeploy_kvcache.core.request import BatchRequest, Request

if TYPE_CHECKING:
    from fastdeploy_kvcache.core.cache_manager import CacheManager
    from fastdeploy_kvcache.core.storage_tier import StorageTier

logger = logging.getLogger(__name__)

__all__ = ["KVPool", "ManagedKVPool", "PlainKVPool", "NoFreeBlocksError"]


class KVPool:
    """Common part: the CacheController that owns the device (and host) caches."""

    managed = False
    # The tiered manager (ManagedKVPool) and the storage tier with its configuration
    # (StorageKVPool); None in pools without them.
    manager: Optional["CacheManager"] = None
    tier: Optional["StorageTier"] = None
    storage_config: Optional[Any] = None
    # Whether prefetch_on_arrival does anything: the engine skips choosing the arrivals to
    # look up when it does not.
    prefetches_on_arrival = False

    def __init__(self, config: CacheConfig, backend: str = "paddle") -> None:
        from fastdeploy_kvcache.worker.cache_controller import CacheController

        self.config = config
        self.block_size = config.block_size
        self.num_device_blocks = config.num_gpu_blocks
        self.controller = CacheController(config, local_rank=0, device_id=0, backend=backend)
        self.controller.initialize_kv_cache(config.num_gpu_blocks)
        self.layer_caches = [self.controller.layer_caches(i) for i in range(config.num_layers)]

    # The engine-facing API (overridden below).
    def admit(self, request: Request) -> int:
        """Look up the request's cached prefix; returns the matched token count."""
        raise NotImplementedError

    def ensure_resident(self, request: Request, num_tokens: int) -> ResidencyPlan:
        raise NotImplementedError

    def finish(self, request: Request) -> None:
        raise NotImplementedError

    def commit(self, request: Request) -> int:
        """Make the running request's computed full prompt blocks reusable now; returns how
        many leading blocks of its table are reusable (0: this pool reuses nothing)."""
        return 0

    def preempt(self, request: Request) -> None:
        raise NotImplementedError

    def is_running(self, request: Request) -> bool:
        raise NotImplementedError

    def begin_step(self, requests: list[Request]) -> tuple[BatchRequest, Optional[Any]]:
        """The step's BatchRequest, with its copies submitted; returns (batch, layer counter)."""
        return BatchRequest(requests), None

    def complete_finished(self, wait: bool = False) -> set[str]:
        """Hand finished copies back to the manager; ids of requests that must recompute."""
        return set()

    @property
    def copies_in_flight(self) -> int:
        return 0

    def stats(self) -> dict[str, Any]:
        raise NotImplementedError

    def check_invariants(self) -> dict[str, int]:
        raise NotImplementedError

    # Storage-tier capabilities (StorageKVPool); the defaults are those of a pool without one.
    def storage_health(self) -> Optional[dict[str, Any]]:
        """The storage tier's state now; None without a storage tier."""
        return None

    def prefetch_on_arrival(self, requests: list[Request], engine_idle: bool = False) -> None:
        """Start the storage lookups of requests just queued (nothing without a storage tier)."""

    def prefetch_ready(self, request: Request, engine_idle: bool = False) -> bool:
        """False while a prefetch policy holds ``request`` for its storage hits (never here)."""
        return True

    def forget_request(self, request: Request) -> None:
        """``request`` finished: drop what the pool kept for it beyond its blocks (nothing here)."""

    def compute_limit(self, request: Request) -> Optional[int]:
        """The token ``request`` may compute up to in this step (None: no limit).  A storage
        split caps it at the end of the recomputed head, and at the current position while
        the request waits for its fetched tail (never here)."""
        return None

    def observe_forward(self, seqs: list[Any], seconds: float) -> None:
        """A step's forward pass (``ScheduledSeq`` per request) took ``seconds`` (nothing here;
        the storage tier's fetch-or-recompute planner learns the prefill rate from it)."""

    def close(self, timeout_s: float = 30.0) -> None:
        """Free the caches; ``timeout_s`` bounds what a subclass still writes out first."""
        self.layer_caches = []
        self.controller.close()


class ManagedKVPool(KVPool):
    """Tiered cache: CacheManager (scheduler side) + CacheController (worker side)."""

    managed = True

    def __init__(self, config: CacheConfig, backend: str = "paddle") -> None:
        from fastdeploy_kvcache.core.cache_manager import CacheManager

        from fastdeploy_kvcache import envs

        super().__init__(config, backend)
        self.num_host_blocks = config.host_block_count
        if self.num_host_blocks > 0:
            # Pinned in the background (FDKV_HOST_GROW_CHUNK_MIB; by default with CUDA copies):
            # the manager starts with the blocks that landed, and each step hands it the ones
            # landed since (below).
            self.controller.initialize_host_cache(
                self.num_host_blocks,
                grow_chunk_bytes=envs.host_grow_chunk_bytes(),
                grow_pace_s=float(envs.get("FDKV_HOST_GROW_PACE_S")))
        self._host_ready = self.controller.host_blocks_ready
        self.manager = CacheManager(config, storage=self._make_storage_tier(), host_blocks_ready=self._host_ready)

    def _admit_landed_host_blocks(self) -> None:
        """Hand the manager the host blocks the worker pinned since the last call (one int
        compare while nothing landed)."""
        ready = self.controller.host_blocks_ready
        if ready != self._host_ready:
            self._host_ready = ready
            self.manager.add_landed_host_blocks(ready)

    def _make_storage_tier(self) -> Optional[Any]:
        """The storage tier the manager is built with (None here; ``StorageKVPool`` makes one
        over the controller's host tier)."""
        return None

    def admit(self, request: Request) -> int:
        match = self.manager.match_prefix(request)
        return len(match.nodes) * self.block_size

    def ensure_resident(self, request: Request, num_tokens: int) -> ResidencyPlan:
        return self.manager.ensure_resident(request, num_tokens)

    def finish(self, request: Request) -> None:
        if self.manager.is_running(request.request_id):
            self.manager.request_finish(request)

    def commit(self, request: Request) -> int:
        return self.manager.commit_computed_blocks(request)

    def preempt(self, request: Request) -> None:
        if self.manager.is_running(request.request_id):
            self.manager.preempt_request(request)

    def is_running(self, request: Request) -> bool:
        return self.manager.is_running(request.request_id)

    def begin_step(self, requests: list[Request]) -> tuple[BatchRequest, Optional[Any]]:
        self._admit_landed_host_blocks()
        batch = BatchRequest(requests)
        batch.append_evict_metadata(self.manager.issue_pending_backup_to_batch_request())
        counter = self.controller.submit_swap_tasks(batch.cache_evict_metadata, batch.cache_swap_metadata)
        return batch, counter

    def _flush_idle_backups(self) -> None:
        """Issue queued backups when idle, so finished requests' blocks reach host without traffic.

        NOTE: the engine issues backups with a step's batch; when it goes idle the last
        requests' blocks would wait for the next request, whose own allocation may evict
        them from the device first (a lost backup: the next turn recomputes them).  Nothing
        computes while idle, so the device -> host copies are safe now.
        """
        if self.manager.has_idle_backups:
            meta = self.manager.issue_pending_backup_to_batch_request()
            if meta is not None:
                self.controller.submit_swap_tasks(meta, None)

    def complete_finished(self, wait: bool = False) -> set[str]:
        affected: set[str] = set()
        self._admit_landed_host_blocks()
        self._flush_idle_backups()
        for meta in self.controller.collect_finished(wait=wait):
            affected.update(self.manager.complete_swap(meta))
        return affected

    @property
    def copies_in_flight(self) -> int:
        return self.manager.num_copies_in_flight + int(self.manager.has_idle_backups)

    def stats(self) -> dict[str, Any]:
        m = self.manager.get_stats()
        t = self.controller.get_stats()
        return {
            "cache": m,
            "transfer": {k: v for k, v in t.items() if k in ("d2h", "h2d", "in_flight")},
            "failed_loads": int(t.get("h2d", {}).get("failed", 0)),
            "failed_blocks": int(m.get("failed_blocks", 0)),
            # The worker's count: the manager takes landed blocks at its next step (an idle
            # engine's cache stats lag behind it).
            "host_blocks_pinned": self.controller.host_blocks_ready,
        }

    def check_invariants(self) -> dict[str, int]:
        return self.manager.check_invariants()


class PlainKVPool(KVPool):
    """Baseline: device blocks from a free list, no prefix cache, no host tier, no copies."""

    def __init__(self, config: CacheConfig, backend: str = "paddle") -> None:
        super().__init__(config, backend)
        self.pool = BlockPool(config.num_gpu_blocks, CacheLevel.DEVICE)
        self._tables: dict[str, Request] = {}

    def admit(self, request: Request) -> int:
        request.num_cached_tokens = 0
        return 0

    def ensure_resident(self, request: Request, num_tokens: int) -> ResidencyPlan:
        held = self._tables.get(request.request_id)
        if held is not None and held is not request:
            raise ValueError(f"another request object with id {request.request_id} is running")
        need = max(0, -(-num_tokens // self.block_size) - len(request.block_tables))
        if need > self.pool.num_free:
            raise NoFreeBlocksError(f"need {need} device blocks, {self.pool.num_free} free", retryable=False)
        ids = self.pool.allocate(need, contiguous=True) if need else []
        request.block_tables.extend(ids)
        if held is None:
            self._tables[request.request_id] = request
            request.num_cached_tokens = 0
        return ResidencyPlan(new_block_ids=ids, num_cached_tokens=0)

    def _release(self, request: Request) -> None:
        if self._tables.pop(request.request_id, None) is not None and request.block_tables:
            self.pool.free(request.block_tables)
        request.block_tables = []

    def finish(self, request: Request) -> None:
        self._release(request)

    def preempt(self, request: Request) -> None:
        self._release(request)
        request.num_computed_tokens = 0
        request.num_cached_tokens = 0

    def is_running(self, request: Request) -> bool:
        return request.request_id in self._tables

    def stats(self) -> dict[str, Any]:
        total, free = self.pool.num_blocks, self.pool.num_free
        return {
            "cache": {
                "device_blocks_total": total,
                "device_blocks_free": free,
                "device_blocks_cached": 0,
                "device_blocks_owned": total - free,
                "device_usage": (total - free) / total if total else 0.0,
                "host_blocks_total": 0,
                "host_blocks_free": 0,
                "matched_tokens": 0,
                "matched_tokens_device": 0,
                "matched_tokens_host": 0,
            },
            "transfer": {},
            "failed_loads": 0,
            "failed_blocks": 0,
        }

    def check_invariants(self) -> dict[str, int]:
        owned = sum(len(r.block_tables) for r in self._tables.values())
        ids = [b for r in self._tables.values() for b in r.block_tables]
        assert len(ids) == len(set(ids)), "a device block is in two block tables"
        assert not set(ids) & set(self.pool.free_ids()), "a block is both free and owned"
        assert owned + self.pool.num_free == self.pool.num_blocks, (
            f"device: free {self.pool.num_free} + owned {owned} != {self.pool.num_blocks}"
        )
        return {"device_free": self.pool.num_free, "device_owned": owned, "device_cached": 0}
