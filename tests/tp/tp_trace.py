"""Scheduler-driven random traces across tensor-parallel ranks, with each rank's bytes checked.

One ``CacheManager`` drives a :class:`TPCoordinator`; every rank process runs
:class:`ShardModel`, a "forward pass" that writes, per layer and cache, the rank's slice of a
pattern derived from the block's chained hash (rank ``r`` holds heads
``[r*h, (r+1)*h)`` of the full pattern; an MLA rank holds all of it), and checks after each
layer's ``wait_for_layer`` and after every step that every running request's computed blocks
hold exactly its prefix's KV *for that rank's shard*.  Copy failures are injected in one rank
only: the merged verdict must fail the copy for all ranks, the scheduler recomputes, and the
bytes on every rank stay right.  Shared by tests/tp (cpu backend) and tests/gpu/test_tp_gpu.py.
"""

from __future__ import annotations

import functools
import random
import re
from typing import Any, Optional

import numpy as np

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.metadata import CacheSwapMetadata
from fastdeploy_kvcache.worker.backends.faulty import FaultInjectingBackend

from trace_steps import ArrayIO, compute_layers, scheduler_step

BS = 4
FULL_HEADS = 4


@functools.lru_cache(maxsize=4096)
def full_pattern(key: int, layer: int, kind: int, shape: tuple[int, ...]) -> np.ndarray:
    """The block's KV for ALL heads (``shape[0]`` is the full head count)."""
    rng = np.random.default_rng([key & (2**63 - 1), layer, kind])
    return rng.integers(0, 251, size=shape).astype(np.float32)


class ShardModel:
    """Rank-side hook: the rank's forward pass over its head shard, plus the shadow checks."""

    def __init__(self, ctrl: Any, rank: int, tp_size: int, mla: bool = False) -> None:
        self.ctrl = ctrl
        self.rank = rank
        self.tp_size = tp_size
        self.layers = ctrl.num_layers
        self.io = ArrayIO(ctrl.backend.name)
        self.heads = ctrl.config.num_kv_heads
        self.mla = mla
        if not mla:
            assert self.heads * tp_size == FULL_HEADS, (self.heads, tp_size)
        # Copies chosen to fail on THIS rank (the payload: task id -> layer, -1: d2h).
        self.faults = ctrl.transfer_manager.wrap_backend(FaultInjectingBackend)

    # ------------------------------------------------------------------ patterns
    def shard(self, key: int, layer: int, kind: int, rank_shape: tuple[int, ...]) -> np.ndarray:
        if self.mla:
            return full_pattern(key, layer, kind, rank_shape)
        full = full_pattern(key, layer, kind, (FULL_HEADS, *rank_shape[1:]))
        return full[self.rank * self.heads:(self.rank + 1) * self.heads]

    def _write(self, block: int, key: int, layer: int) -> None:
        for kind, array in enumerate(self.ctrl.layer_caches(layer)):
            self.io.write(array, block, self.shard(key, layer, kind, tuple(array.shape[1:])))

    def _check(self, req: Any, layer: int, upto: int, where: str) -> None:
        hashes = req.block_hashes(BS, upto)
        for i in range(upto // BS):
            block = req.block_tables[i]
            for kind, array in enumerate(self.ctrl.layer_caches(layer)):
                got = self.io.read(array, block).astype(np.float32)
                want = self.shard(hashes[i], layer, kind, tuple(array.shape[1:]))
                assert np.array_equal(got, want), (
                    f"rank {self.rank} {where}: request {req.request_id} block {i} (device {block}) layer {layer} "
                    f"cache {kind} does not hold its prefix's KV shard"
                )

    # ------------------------------------------------------------------ hook API
    def prepare(self, batch: Any, payload: Optional[dict[int, int]]) -> None:
        for meta in (batch.cache_evict_metadata, batch.cache_swap_metadata):
            if payload and meta is not None and meta.task_id in payload:
                self.faults.fail_task(meta, payload[meta.task_id])

    def forward(self, batch: Any, counter: Any, payload: Any) -> bool:
        """One step on this rank; False if a load failed here (nothing is written after it)."""
        return compute_layers(batch, counter, self.layers, BS, self._check, self._write)

    def check_all(self, requests: list[Any]) -> int:
        for req in requests:
            for layer in range(self.layers):
                self._check(req, layer, req.num_computed_tokens, "after step")
        return len(requests)

    def shapes(self) -> list[tuple[int, ...]]:
        return [tuple(a.shape) for a in self.ctrl.layer_caches(0)]


def tp_config(policy: str, tp_size: int, quant: bool, mla: bool = False, **overrides: Any) -> CacheConfig:
    kwargs: dict[str, Any] = dict(
        block_size=BS, num_layers=2, num_extra_layers=1, num_kv_heads=FULL_HEADS, head_dim=4,
        num_gpu_blocks=14, num_host_blocks=10, write_policy=policy, write_through_threshold=1,
        tensor_parallel_size=tp_size,
    )
    if mla:
        # An MLA cache has one latent "head"; every rank holds it whole.
        kwargs.update(num_kv_heads=1, head_dim=16)
    kwargs.update(dtype="uint8", kv_cache_quant="int8") if quant else kwargs.update(dtype="float32")
    kwargs.update(overrides)
    return CacheConfig(**kwargs)


def run_tp_trace(
    policy: str,
    seed: int,
    steps: int,
    tp_size: int,
    fail_p: float,
    quant: bool = False,
    mla: bool = False,
    backend: str = "cpu",
    devices: Optional[list[int]] = None,
    async_launch: bool = False,
    timeout_s: float = 60.0,
    threaded: bool = True,
    coordinator_cls: Any = None,
) -> dict[str, int]:
    """Run one random trace over ``tp_size`` rank processes; returns what it exercised.

    ``threaded=False`` (cpu backend) runs every copy inline, so the trace, and what it
    exercises, is the same on every run; threaded copies finish when they finish, and the
    scheduler's decisions follow.
    """
    from fastdeploy_kvcache.core.cache_manager import CacheManager
    from fastdeploy_kvcache.core.request import BatchRequest
    from fastdeploy_kvcache.worker.tp import TPCoordinator

    rng = random.Random(seed)
    cfg = tp_config(policy, tp_size, quant, mla)
    counts = {"steps": 0, "swap_in_blocks": 0, "d2h_blocks": 0, "failed": 0, "redone": 0, "armed": 0,
              "failed_on_one_rank": 0}
    with (coordinator_cls or TPCoordinator)(cfg, devices=devices, backend=backend, mla=mla, hook=functools.partial(ShardModel, mla=mla),
                       async_launch=async_launch, timeout_s=timeout_s, threaded=threaded) as coord:
        mgr = CacheManager(coord.scheduler_config)
        families = [[rng.randrange(1000) for _ in range(20)] for _ in range(2)]
        running: list[Any] = []
        next_id = 0

        def complete(metas: list[CacheSwapMetadata]) -> None:
            for meta in metas:
                if not meta.success:
                    counts["failed"] += 1
                    failed_ranks = len(re.findall(r"(?:^|; )rank \d+: ", meta.error_message or ""))
                    counts["failed_on_one_rank"] += failed_ranks == 1
                mgr.complete_swap(meta)

        for _ in range(steps):
            next_id = scheduler_step(mgr, rng, families, running, next_id, BS)
            batch = BatchRequest(running)
            batch.append_evict_metadata(mgr.issue_pending_backup_to_batch_request())
            evict, swap = batch.cache_evict_metadata, batch.cache_swap_metadata
            # Faults go to ONE rank only: the merged verdict must still fail the copy for all.
            payloads: list[dict[int, int]] = [{} for _ in range(tp_size)]
            for meta, layers in ((evict, [-1]), (swap, list(range(cfg.total_layers)))):
                if meta is not None and not meta.is_empty and rng.random() < fail_p:
                    payloads[rng.randrange(tp_size)][meta.task_id] = rng.choice(layers)
                    counts["armed"] += 1
            counts["swap_in_blocks"] += len(swap) if swap else 0
            counts["d2h_blocks"] += len(evict) if evict else 0
            result = coord.step(batch, payloads, wait=rng.random() < 0.3)
            if not all(result.outcomes):
                # A load failed on some rank: the step is void on EVERY rank (in an engine the
                # ranks agree on that, since their forwards meet in collectives) and is redone.
                counts["redone"] += 1
                complete(result.finished)
                complete(coord.collect_finished(wait=True))
            else:
                for req in batch:
                    req.num_computed_tokens = req.num_total_tokens
                complete(result.finished)
            mgr.check_invariants()
            coord.call("check_all", running)
            counts["steps"] += 1
        complete(coord.collect_finished(wait=True))
        mgr.check_invariants()
        coord.call("check_all", running)
        assert coord.pending_tasks() == {}
        stats = coord.call("stats")
        per_rank_failed = sum(s["d2h"]["failed"] + s["h2d"]["failed"] for s in stats)
        assert all(s["in_flight"] == 0 for s in stats)
        # Each armed task failed on exactly one rank, and its merged verdict failed once.
        assert per_rank_failed == counts["armed"] == counts["failed"] == counts["failed_on_one_rank"], (
            per_rank_failed, counts)
    return counts


class ControlHook(ShardModel):
    """ShardModel plus the levers the process tests pull: pause a stream, die, hang."""

    def forward(self, batch: Any, counter: Any, payload: Any) -> bool:
        if payload == "no-forward":
            return True  # this step's forward does not read the load (nothing waits on it)
        return super().forward(batch, counter, payload)

    def prepare(self, batch: Any, payload: Any) -> None:
        if isinstance(payload, dict):
            super().prepare(batch, payload)

    def pause_input(self) -> None:
        self.ctrl.transfer_manager.input_stream.pause()

    def resume_input(self) -> None:
        self.ctrl.transfer_manager.input_stream.resume()

    def die(self, code: int) -> None:
        import os

        os._exit(code)

    def hang(self, seconds: float) -> None:
        import time

        time.sleep(seconds)

    def fail(self) -> None:
        raise ValueError("a hook error on purpose")


class OverlapProbe(ShardModel):
    """GPU rank hook: does a layer-wise load keep landing while this rank computes?

    Layer ``i``'s "attention" is a spin kernel of ``spin_ms`` on the compute stream, enqueued
    after ``wait_for_layer(i)``.  The probe watches (host side, no timing) whether the load's
    LAST layer has landed while layer 0's compute is still running: it can only have if the
    input stream ran next to the compute stream.
    """

    def forward(self, batch: Any, counter: Any, payload: Any) -> Any:
        if not (isinstance(payload, dict) and "spin_ms" in payload):
            return super().forward(batch, counter, payload)
        import time

        import cupy

        dev = cupy.cuda.Device(self.ctrl.device_id)
        with dev:
            spin = cupy.RawKernel(
                r'''extern "C" __global__ void spin(long long cycles) {
                    long long start = clock64(); while (clock64() - start < cycles) {}
                }''', "spin")
            cycles = int(payload["spin_ms"] * 1e-3 * dev.attributes["ClockRate"] * 1e3)
            ends = []
            for layer in range(self.layers):
                counter.wait_for_layer(layer)
                spin((1,), (1,), (cupy.int64(cycles),))
                ends.append(cupy.cuda.Event(disable_timing=True))
                ends[-1].record()
            overlapped = False
            last = self.layers - 1
            while not ends[0].done:
                if counter.is_layer_done(last):
                    overlapped = True
                    break
                time.sleep(1e-4)
            cupy.cuda.get_current_stream().synchronize()
            return {"overlapped": overlapped, "device": self.ctrl.device_id,
                    "compute_stream_device": getattr(cupy.cuda.get_current_stream(), "device_id", None)}
