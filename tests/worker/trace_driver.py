"""Scheduler-driven random traces with real bytes, shared by the CPU and GPU integration tests.

The scheduler's ``CacheManager`` drives a ``CacheController``.  Each computed full block is
filled, per layer and per cache (K, V, and the fp32 scales of a quantized cache), with a
pattern derived from the block's chained hash.  Random traces (admissions with prefix
sharing, decoding, finishes, preemptions; computed prompt blocks made reusable while their
request runs, loads in flight shared by requests admitted in the same step) run under a
write policy; after each layer's
``wait_for_layer`` and after every step, every running request's computed blocks must hold
exactly its prefix's pattern.  Injected copy failures must come back as failed metadata,
make the scheduler recompute, and never be served.
"""

from __future__ import annotations

import functools
import random
from typing import Any

import numpy as np

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.metadata import CacheSwapMetadata
from fastdeploy_kvcache.worker.backends.faulty import FaultInjectingBackend

from skip_helpers import env_switch
from trace_steps import ArrayIO, compute_layers, scheduler_step

BS = 4
SOAK = env_switch("FDKV_SOAK")


@functools.lru_cache(maxsize=None)
def pattern(key: int, layer: int, kind: int, shape: tuple[int, ...]) -> np.ndarray:
    """KV bytes of a block: unique per (hash, layer, cache), exact in uint8 and float32."""
    rng = np.random.default_rng([key & (2**63 - 1), layer, kind])
    return rng.integers(0, 251, size=shape).astype(np.float32)


class Model:
    """The "forward pass": verifies what it reads and writes KV for new tokens."""

    def __init__(self, ctrl: Any, backend: str) -> None:
        self.io = ArrayIO(backend)
        self.ctrl = ctrl
        self.layers = ctrl.num_layers

    def _write(self, block: int, key: int, layer: int) -> None:
        for kind, array in enumerate(self.ctrl.layer_caches(layer)):
            data = pattern(key, layer, kind, tuple(array.shape[1:]))
            self.io.write(array, block, data)

    def _check(self, req: Any, layer: int, upto_tokens: int, where: str) -> None:
        hashes = req.block_hashes(BS, upto_tokens)
        for i in range(upto_tokens // BS):
            block = req.block_tables[i]
            for kind, array in enumerate(self.ctrl.layer_caches(layer)):
                got = self.io.read(array, block).astype(np.float32)
                want = pattern(hashes[i], layer, kind, tuple(array.shape[1:]))
                assert np.array_equal(got, want), (
                    f"{where}: request {req.request_id} block {i} (device {block}) layer {layer} cache {kind} "
                    f"does not hold its prefix's KV"
                )

    def forward(self, batch: Any, counter: Any) -> bool:
        """One step; False if a load failed (nothing is advanced, the step is redone)."""
        if not compute_layers(batch, counter, self.layers, BS, self._check, self._write):
            return False
        for req in batch:
            req.num_computed_tokens = req.num_total_tokens
        return True

    def check_all(self, requests: list[Any]) -> None:
        for req in requests:
            for layer in range(self.layers):
                self._check(req, layer, req.num_computed_tokens, "after step")


def run_trace(
    policy: str,
    seed: int,
    steps: int,
    fail_p: float,
    quant: bool,
    async_launch: bool = False,
    backend: str = "paddle",
) -> dict[str, int]:
    """Run one random trace; returns counts of what it exercised (asserts on any mismatch)."""
    from fastdeploy_kvcache.core.cache_manager import CacheManager
    from fastdeploy_kvcache.core.request import BatchRequest
    from fastdeploy_kvcache.worker import CacheController

    rng = random.Random(seed)
    cfg_kwargs: dict[str, Any] = dict(
        block_size=BS, num_layers=2, num_extra_layers=1, num_kv_heads=2, head_dim=4,
        num_gpu_blocks=14, num_host_blocks=10, write_policy=policy, write_through_threshold=1,
    )
    if quant:
        cfg_kwargs.update(dtype="uint8", kv_cache_quant="int8")
    else:
        cfg_kwargs.update(dtype="float32")
    cfg = CacheConfig(**cfg_kwargs)
    mgr = CacheManager(cfg)
    ctrl = CacheController(cfg, backend=backend, threaded=True, async_launch=async_launch)
    ctrl.initialize_kv_cache()
    ctrl.initialize_host_cache()
    model = Model(ctrl, backend)
    faults = ctrl.transfer_manager.wrap_backend(FaultInjectingBackend)
    families = [[rng.randrange(1000) for _ in range(20)] for _ in range(2)]
    running: list[Any] = []
    counts = {"steps": 0, "swap_in_blocks": 0, "d2h_blocks": 0, "failed": 0, "redone": 0, "committed_blocks": 0,
              "shared_load_blocks": 0}
    next_id = 0

    def complete(metas: list[CacheSwapMetadata]) -> None:
        for meta in metas:
            counts["failed"] += 0 if meta.success else 1
            mgr.complete_swap(meta)

    try:
        for _ in range(steps):
            next_id = scheduler_step(mgr, rng, families, running, next_id, BS)
            batch = BatchRequest(running)
            batch.append_evict_metadata(mgr.issue_pending_backup_to_batch_request())
            evict, swap = batch.cache_evict_metadata, batch.cache_swap_metadata
            for meta, layers in ((evict, [-1]), (swap, list(range(ctrl.num_layers)))):
                if meta is not None and rng.random() < fail_p:
                    faults.fail_task(meta, rng.choice(layers))  # -1: the eviction's one call
            counts["swap_in_blocks"] += len(swap) if swap else 0
            counts["d2h_blocks"] += len(evict) if evict else 0
            # --- worker
            counter = ctrl.submit_swap_tasks(evict, swap)
            if not model.forward(batch, counter):
                counts["redone"] += 1
                complete(ctrl.collect_finished(wait=True))
            else:
                complete(ctrl.collect_finished(wait=rng.random() < 0.3))
            if rng.random() < 0.5:  # what an engine with in-batch prefix sharing does after a step
                for req in running:
                    mgr.commit_computed_blocks(req)
            mgr.check_invariants()
            model.check_all(running)
            counts["steps"] += 1
        complete(ctrl.collect_finished(wait=True))
        mgr.check_invariants()
        model.check_all(running)
        stats = ctrl.get_stats()
        counts["committed_blocks"] = mgr.stats.committed_blocks
        counts["shared_load_blocks"] = mgr.stats.shared_load_blocks
        assert stats["in_flight"] == 0
        assert stats["d2h"]["failed"] + stats["h2d"]["failed"] == counts["failed"]
    finally:
        ctrl.close()
    return counts
