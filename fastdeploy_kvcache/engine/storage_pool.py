"""The engine's KV pool with the storage tier below host memory (``--kvcache-storage-backend``).

:class:`StorageKVPool` is the tiered :class:`~fastdeploy_kvcache.engine.kv_pool.ManagedKVPool`
plus the three storage pieces, wired the way a serving engine wires them:

* scheduler side: :class:`~fastdeploy_kvcache.core.storage_tier.StorageTier` (matching,
  prefetch policy, backups, which hashes are stored);
* worker side: :class:`~fastdeploy_kvcache.worker.storage_worker.StorageWorker` over a
  :class:`~fastdeploy_kvcache.storage.transfer.StorageTransfer` of the controller's host tier;
* the backend (``file`` or ``mooncake``) from :class:`~fastdeploy_kvcache.storage.config.StorageConfig`.

Per step the engine calls the same methods as on any pool; in addition it asks
:meth:`StorageKVPool.prefetch_ready` before admitting a waiting request (the prefetch
policy may hold it while its storage hits arrive in host memory).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from typing import Any, Optional

from fastdeploy_kvcache.config import BLOCK_WISE_FP8, BLOCK_WISE_INT8, CacheConfig
from fastdeploy_kvcache.core.metadata import CacheLevel, ResidencyPlan, TransferKind
from fastdeploy_kvcache.core.request import BatchRequest, Request
from fastdeploy_kvcache.core.storage_tier import PREFETCH_READY, StorageJob, StorageTier
from fastdeploy_kvcache.engine.kv_pool import ManagedKVPool
from fastdeploy_kvcache.storage.log_limit import ThrottledLog

logger = logging.getLogger(__name__)

# Seconds after start-up at which a storage tier still off is reported (with what it tried).
STORAGE_OFF_REPORT_S = 3.0
# The KV formats an engine serves, as (dtype, kv_cache_quant): a miss is looked up under the
# others' keys at most once per FOREIGN_PROBE_INTERVAL_S, to log why a store misses.
OTHER_KV_FORMATS = (("bfloat16", None), ("float16", None), ("float32", None), ("uint8", BLOCK_WISE_FP8),
                    ("uint8", BLOCK_WISE_INT8))
FOREIGN_PROBE_INTERVAL_S = 1.0

__all__ = ["StorageKVPool", "model_fingerprint"]


def model_fingerprint(model: str, seed: int) -> str:
    """What identifies the weights in storage keys: file contents where there are files,
    else the registered name and the seed of its random weights (tiny-llama-random)."""
    from fastdeploy_kvcache.storage.keys import bytes_fingerprint, weights_fingerprint

    path = os.path.expanduser(model)
    if os.path.exists(path):
        return weights_fingerprint(path)
    try:
        from fastdeploy_kvcache.engine.model_loader import DEFAULT_MODEL_NAME, find_smollm2_gguf

        if model == DEFAULT_MODEL_NAME:
            return weights_fingerprint(find_smollm2_gguf())
    except Exception:  # noqa: BLE001 - fall back to the name
        logger.debug("no weights file for %s; fingerprinting its name", model, exc_info=True)
    return bytes_fingerprint("registered-model", model, f"seed={seed}")


class StorageKVPool(ManagedKVPool):
    """ManagedKVPool + storage tier (see the module docstring)."""

    prefetches_on_arrival = True
    tier: StorageTier

    def __init__(self, config: CacheConfig, storage_config: Any, model_id: str, weights_fp: str,
                 backend: str = "paddle", *, arrival_prefetch_blocks: Optional[int] = None,
                 **backend_overrides: Any) -> None:
        if config.host_block_count <= 0:
            raise ValueError(
                "--kvcache-storage-backend needs a host tier to stage blocks through: give --swap-space "
                "(GiB, > 0)"
            )
        # Host blocks that prefetches started on arrival may hold (None: half the host tier).
        self.arrival_prefetch_blocks = (config.host_block_count // 2 if arrival_prefetch_blocks is None
                                        else arrival_prefetch_blocks)
        self.storage_config = storage_config
        self._issue_backups = False  # a split waits for its head's backups (compute_limit)
        self._model_id = model_id
        self._weights_fp = weights_fp
        self._backend_overrides = backend_overrides
        self._other_formats: list[Any] = []
        self._next_format_probe = 0.0
        self._format_log = ThrottledLog(logger)
        try:
            super().__init__(config, backend)  # builds the manager with _make_storage_tier()
        except BaseException:
            if getattr(self, "store", None) is not None and getattr(self, "tier", None) is not None:
                self.store.close()  # made, but the manager did not take the tier
            raise
        logger.info("storage tier: %s backend, keys %s:*, write %s, prefetch %s",
                    storage_config.backend, self.namespace.prefix, storage_config.put_policy,
                    storage_config.prefetch_policy)
        # A backend that sets itself up in the background (Mooncake) retries quietly; say so
        # soon if it is still off, with what it tried, instead of leaving the tier off unseen.
        self._off_report = threading.Timer(STORAGE_OFF_REPORT_S, self._report_if_off)
        self._off_report.daemon = True
        self._off_report.start()

    def _make_storage_tier(self) -> StorageTier:
        """The backend, key namespace, transfer threads and the tier over the controller's host
        tier (the backend is closed again if any of it fails)."""
        from fastdeploy_kvcache.storage.file_format import kv_format_code
        from fastdeploy_kvcache.storage.keys import KeyNamespace
        from fastdeploy_kvcache.storage.transfer import HostTierLayout, StorageTransfer
        from fastdeploy_kvcache.worker.storage_worker import StorageWorker

        config = self.config
        overrides = dict(self._backend_overrides)
        if self.storage_config.backend == "file":
            # Each object's header records the KV format, and an object of another is a miss.
            overrides.setdefault("kv_format", kv_format_code(config.dtype, config.kv_cache_quant))
        self.store = self.storage_config.make_backend(**overrides)
        try:
            layout = HostTierLayout.from_controller(self.controller)
            self.namespace = KeyNamespace(
                model=self._model_id, weights_fingerprint=self._weights_fp, dtype=str(config.dtype),
                block_size=config.block_size, layout=layout.describe(), kv_cache_quant=config.kv_cache_quant,
            )
            self._other_formats = self._other_format_namespaces()
            # NOTE: one backend call per staging buffer: small objects (tiny models) batch up
            # to 16 MiB per call instead of 32 objects, so a long prefix is one get, not many.
            staging = max(32, min(512, (16 << 20) // layout.object_bytes))
            self.transfer = StorageTransfer(layout, self.store, staging_blocks=staging)
            self.storage_worker = StorageWorker(self.transfer)
            self.tier = StorageTier(self.store, self.namespace, self.storage_config, on_miss=self._probe_other_formats)
        except BaseException:
            self.store.close()
            raise
        return self.tier

    # ------------------------------------------------------------------ KV formats
    def _other_format_namespaces(self) -> list[Any]:
        """The key namespaces this model's blocks would have under the other KV formats an
        engine serves: keys differ per format, so a store written in one is a miss in another."""
        from fastdeploy_kvcache.storage.keys import KeyNamespace
        from fastdeploy_kvcache.storage.transfer import HostTierLayout

        out = []
        for dtype, quant in OTHER_KV_FORMATS:
            if (dtype, quant) == (self.config.dtype, self.config.kv_cache_quant):
                continue
            other = dataclasses.replace(self.config, dtype=dtype, kv_cache_quant=quant)
            out.append(KeyNamespace(
                model=self.namespace.model, weights_fingerprint=self.namespace.weights_fingerprint, dtype=dtype,
                block_size=self.namespace.block_size, layout=HostTierLayout.describe_config(other),
                tp_rank=self.namespace.tp_rank, tp_size=self.namespace.tp_size, kv_cache_quant=quant))
        return out

    def _probe_other_formats(self, hashes: Any) -> None:
        """The tier's ``on_miss``: at most once per :data:`FOREIGN_PROBE_INTERVAL_S`, ask the
        store whether the request's first block is there in another KV format, and say so
        (one line per minute at most): such a store answers every request with a miss."""
        now = time.monotonic()
        if now < self._next_format_probe or not hashes:
            return
        self._next_format_probe = now + FOREIGN_PROBE_INTERVAL_S
        for ns in self._other_formats:
            if int(self.store.batch_exists([ns.key(hashes[0])])) > 0:
                self._format_log.warning(
                    "foreign-kv-format", "storage tier (%s): the store holds this prefix as %s KV (keys %s:*), this "
                    "server's KV is %s (keys %s:*): a miss; a store written with one KV dtype is never read as "
                    "another", self.storage_config.backend, ns.kv_format, ns.prefix, self.namespace.kv_format,
                    self.namespace.prefix)
                return

    def storage_health(self) -> dict[str, Any]:
        """The tier's state now (not the step snapshot): backend, available, breaker, detail."""
        try:
            h = self.store.health()
        except Exception as exc:  # noqa: BLE001 - a broken health() reads as "off"
            return {"backend": self.storage_config.backend, "available": False, "breaker": "unknown",
                    "detail": f"health() raised {type(exc).__name__}: {exc}"}
        return {"backend": self.storage_config.backend, "available": bool(h.available), "breaker": h.breaker,
                "detail": h.detail, **{k: v for k, v in (h.extra or {}).items() if k == "master"}}

    def _report_if_off(self) -> None:
        health = self.storage_health()
        if health["available"]:
            return
        tried = ""
        if self.storage_config.backend == "mooncake":
            tried = (f"; master {health.get('master', '?')} (MOONCAKE_MASTER_SERVER_ADDR; its /health is polled "
                     "at MOONCAKE_MASTER_METRICS_ADDR, the master's --metrics_host:--metrics_port)")
        logger.warning("storage tier (%s) still off %.0f s after start: %s%s. Requests are served without it; "
                       "it keeps retrying and logs when it is on", health["backend"], STORAGE_OFF_REPORT_S,
                       health["detail"], tried)

    # ------------------------------------------------------------------ admission
    def prefetch_ready(self, request: Request, engine_idle: bool = False) -> bool:
        """False while the prefetch policy holds ``request`` for its storage hits.

        ``engine_idle``: nothing runs and nothing else is admitted this step, so the engine
        would only wait for this request's fetch: it reads it on its own thread (see
        :meth:`_submit_storage_jobs`) and the request is admitted in this same step.
        """
        if self.manager.is_running(request.request_id):
            return True
        state = self.tier.prefetch_state(request)
        # A prefetch just planned starts now, not at the next step.
        if self._submit_storage_jobs(inline=engine_idle) and state != PREFETCH_READY:
            state = self.tier.prefetch_state(request)
        return state == PREFETCH_READY

    def prefetch_on_arrival(self, requests: list[Request], engine_idle: bool = False) -> None:
        """Requests were queued: their storage lookups and prefetches start now, within the
        arrival budget (each is still checked again at admission, as without this).

        ``engine_idle``: nothing runs and the next step admits these requests, so the engine
        would only wait for their fetches: they are read on the engine's thread at once, all
        in one batch (:meth:`StorageWorker.run_many`, see :meth:`_submit_storage_jobs`): one
        native read and one wait for the GIL after it, not one per request; on a server
        taking in a burst, the event loop holds the GIL most of the time between the
        engine's calls.  A lookup that fails leaves its request to admission.
        """
        if self.arrival_prefetch_blocks <= 0:
            return
        for request in requests:
            if self.manager.is_running(request.request_id):
                continue
            try:
                self.tier.prefetch_on_arrival(request, self.arrival_prefetch_blocks)
            except Exception:  # noqa: BLE001 - a prefetch never keeps a request out
                logger.warning("prefetch on arrival of %s failed", request.request_id, exc_info=True)
        self._submit_storage_jobs(inline=engine_idle, inline_all=engine_idle)

    def ensure_resident(self, request: Request, num_tokens: int) -> ResidencyPlan:
        first = not self.manager.is_running(request.request_id)
        plan = self.manager.ensure_resident(request, num_tokens)
        if first:
            plan.storage_fetch = self.tier.fetch_timing(request)
            s = self.tier.admitted(request)
            plan.num_storage_hit_tokens = s
            plan.num_host_hit_tokens -= s
        return plan

    def forget_request(self, request: Request) -> None:
        self.tier.forget_request(request.request_id)

    def preempt(self, request: Request) -> None:
        # A split's tail is dropped (its held blocks go back): the request is matched anew.
        self.tier.forget_request(request.request_id)
        super().preempt(request)

    def compute_limit(self, request: Request) -> Optional[int]:
        """Where a storage split stops the request (see ``KVPool.compute_limit``).

        Before the end of the head: that end.  At it, the head is committed to the tree
        and the tail, once it arrived, is hung below it and loaded like host hits
        (``CacheManager.extend_match``); while the tail is still read, and not late, the
        request waits (its position is the limit).  Under a policy that keeps the host tier
        prefix-closed the head's blocks are backed up to host first (the tail hangs only
        below a host copy).  A tail that failed or is late is dropped: the request
        recomputes the rest.
        """
        tier = self.tier
        rid = request.request_id
        head_end = tier.split_head_end(rid)
        if head_end is None:
            return None
        if not self.manager.is_running(rid) or request.num_computed_tokens < head_end:
            return head_end
        status = tier.split_tail_status(rid)
        if status == "waiting":
            return request.num_computed_tokens
        if status in ("late", "failed"):
            tier.drop_split(rid, status)
            return None
        if request.num_computed_tokens > head_end:
            tier.drop_split(rid, "gone")  # admitted past the head: the tree had more by then
            return None
        if self.manager.commit_computed_blocks(request) * self.block_size < head_end:
            if self.manager.loads_in_flight(request) and tier.wait_for_head(rid):
                return request.num_computed_tokens  # commits once the loads under it are confirmed
            tier.drop_split(rid, "failed")  # the head is not the tree's (computed elsewhere too)
            return None
        hung = tier.attach_split_tail(rid)
        if hung is None:
            # The head's last block needs a host copy first; its backup goes out now.
            if not tier.wait_for_head(rid):
                tier.drop_split(rid, "late")
                return None
            self.manager.back_up_committed(request)
            self._issue_backups = True
            return request.num_computed_tokens
        tier.end_split(rid, self.manager.extend_match(request) if hung else 0)
        return None

    def observe_forward(self, seqs: list[Any], seconds: float) -> None:
        """A step's forward pass (``ScheduledSeq`` per request) took ``seconds``: the storage
        tier's fetch-or-recompute planner learns the prefill rate from it."""
        self.tier.observe_prefill([(len(s.token_ids), s.context_len) for s in seqs], seconds)

    # ------------------------------------------------------------------ steps
    def begin_step(self, requests: list[Request]) -> tuple[BatchRequest, Optional[Any]]:
        batch, counter = super().begin_step(requests)
        self._submit_storage_jobs()
        return batch, counter

    def _submit_storage_jobs(self, inline: bool = False, inline_all: bool = False) -> bool:
        """Hand the tier's new jobs to the worker; True if a get ran here and is complete.

        ``inline`` (the engine would only wait for it): the first get runs on the calling
        thread when no other get is in flight, and its blocks are in the tree on return.  A
        hand-off to the transfer thread and back costs two thread wake-ups, several
        milliseconds each on a loaded machine, on the critical path of a lone storage hit.
        ``inline_all``: every get runs here, as one batch.
        """
        jobs = self.tier.take_jobs()
        here: list[StorageJob] = []
        for job in jobs:
            if (inline and (inline_all or not here) and job.kind is TransferKind.STORAGE_LOAD
                    and not self.storage_worker.loads_in_flight and not self.tier.is_split_job(job)):
                here.append(job)
            else:
                self.storage_worker.submit(job)
        if not here:
            return False
        for job in self.storage_worker.run_many(here):
            self.tier.complete(job)
        self.tier.stats["prefetch_jobs_inline"] += len(here)
        return True

    def complete_finished(self, wait: bool = False) -> set[str]:
        affected: set[str] = set()
        self._admit_landed_host_blocks()
        self._flush_idle_backups()
        if self._issue_backups:
            # A split waits for its head's host copies: issue them now (after the step's
            # forward pass, or with no step at all), not with a step that may never come.
            self._issue_backups = False
            meta = self.manager.issue_pending_backup_to_batch_request()
            if meta is not None:
                self.controller.submit_swap_tasks(meta, None)
        copies = self.controller.collect_finished(wait=wait)
        for meta in copies:
            if meta.src_type == CacheLevel.DEVICE and meta.dst_type == CacheLevel.HOST and meta.hash_values:
                self.tier.on_host_copies(meta.hash_values, meta.dst_block_ids, bool(meta.success))
            affected.update(self.manager.complete_swap(meta))
        # Storage: wait only when nothing else came back and a waiting request needs it.
        timeout = None
        if wait and not copies:
            deadline = self.tier.next_deadline()
            timeout = 0.05 if deadline is None or deadline == float("inf") else max(0.0, min(0.05, deadline - time.monotonic()))
        for job in self.storage_worker.collect_finished(wait=timeout is not None, timeout_s=timeout):
            self.tier.complete(job)
        # Backups the copies above queued go out now, not a step later.
        self._submit_storage_jobs()
        return affected

    @property
    def copies_in_flight(self) -> int:
        return super().copies_in_flight + self.tier.num_jobs_in_flight

    # ------------------------------------------------------------------ stats / checks / close
    def stats(self) -> dict[str, Any]:
        out = super().stats()
        try:
            health = self.store.health()
            backend_stats = self.store.stats()
        except Exception:  # noqa: BLE001 - stats never fail a scrape
            logger.debug("storage stats failed", exc_info=True)
            health, backend_stats = None, {}
        out["storage"] = {
            "backend": self.storage_config.backend,
            "available": bool(health.available) if health is not None else False,
            "breaker": health.breaker if health is not None else "unknown",
            "tier": self.tier.get_stats(),
            "store": backend_stats,
            "transfer": self.transfer.stats(),
            # Copies, storage jobs and idle backups still to run (0: everything settled).
            "pending_work": self.copies_in_flight,
        }
        return out

    def check_invariants(self) -> dict[str, int]:
        self.tier.check_invariants()
        return self.manager.check_invariants()

    def flush_to_storage(self, timeout_s: float) -> dict[str, Any]:
        """Write every cached block the store lacks, within ``timeout_s`` (a graceful stop).

        Host copies are put as they are; device-only blocks are first copied to host through
        the manager's backup path (``queue_backups`` + ``issue_pending_backup_to_batch_request``:
        ancestors first, host blocks from the host LRU) in batches of at most ``batch``
        blocks, then put.  Call with no request running.  Logs one line with what was
        written and what was left, and returns the same figures.
        """
        tier, m = self.tier, self.manager
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        ok0, bytes0 = tier.stats["put_blocks_ok"], tier.stats["write_bytes"]
        batch = max(1, min(tier.max_put_batch, m.host_pool.num_blocks // 2))
        outcome = "complete"
        if timeout_s <= 0:
            outcome = "off (--kvcache-storage-shutdown-flush 0)"
        elif not tier.available():
            outcome = "store unavailable"
        else:
            # The store keeps what the flush writes: a store smaller than the cache fills once
            # and the flush stops, instead of evicting its own puts and writing them again.
            self.store.keep_new_objects(True)
            tier.begin_flush()
            tried: set[Any] = set()  # device-only nodes whose backup was queued once
            last: tuple[Any, ...] = ()
            still = 0  # rounds in a row in which nothing moved
            while True:
                if time.monotonic() >= deadline:
                    outcome = f"stopped after {timeout_s:g} s (--kvcache-storage-shutdown-flush)"
                    break
                if tier.flush_store_full:
                    outcome = "store full (its byte cap, free-space floor or disk)"
                    self._drain_storage_jobs(deadline)
                    break
                host, device = tier.flush_candidates()
                device = [n for n in device if n not in tried]
                issued = tier.queue_flush_puts(host)
                if device and not m.num_copies_in_flight and not m.has_idle_backups:
                    chunk = device[:batch]
                    tried.update(chunk)
                    issued += m.queue_backups(chunk)  # issued by complete_finished (engine idle)
                if not issued and not self.copies_in_flight:
                    if device:
                        outcome = "no host block free to stage through"
                    break
                self._submit_storage_jobs()
                self.complete_finished(wait=True)
                now = (len(host), len(device), m.num_copies_in_flight, tier.num_jobs_in_flight,
                       tier.stats["put_blocks_ok"], tier.stats["put_blocks_failed"])
                still = still + 1 if now == last else 0
                last = now
                if still >= 200:  # about 2 s: queued backups find no host block to stage through
                    outcome = "no host block free to stage through"
                    break
                if still:
                    time.sleep(0.01)
            self.store.keep_new_objects(False)
        host, device = tier.flush_candidates()
        written = int(tier.stats["put_blocks_ok"] - ok0)
        lost = tier.flush_lost_blocks
        out = {"written_blocks": written, "written_bytes": int(tier.stats["write_bytes"] - bytes0),
               "left_device_only": len(device), "left_host": len(host),
               "failed_puts": tier.flush_failed_blocks, "lost_after_write": lost,
               "seconds": time.monotonic() - t0, "outcome": outcome}
        logger.info(
            "storage flush at stop: wrote %d blocks (%.1f MiB) in %.2f s; left %d unstored (%d device-only, "
            "%d on host, %d puts failed, %d evicted by the store after the write): %s", written,
            out["written_bytes"] / (1 << 20), out["seconds"], len(device) + len(host) + out["failed_puts"] + lost,
            len(device), len(host), out["failed_puts"], lost, outcome)
        return out

    def _drain_storage_jobs(self, deadline: float) -> None:
        """Collect the storage jobs in flight (the flush stops; their pins must come back)."""
        while self.copies_in_flight and time.monotonic() < deadline:
            self.complete_finished(wait=True)

    def close(self, timeout_s: float = 30.0) -> None:
        # Finish what the last requests left: backups to host, then their puts (all bounded).
        deadline = time.monotonic() + timeout_s
        while self.copies_in_flight and time.monotonic() < deadline:
            try:
                self.complete_finished(wait=True)
            except Exception:  # noqa: BLE001 - closing anyway
                logger.warning("draining storage work at close failed", exc_info=True)
                break
        try:
            # Within what is left of the stop's budget (the server's grace period).
            self.flush_to_storage(min(self.storage_config.shutdown_flush_s, max(0.0, deadline - time.monotonic())))
        except Exception:  # noqa: BLE001 - closing anyway
            logger.warning("storage flush at stop failed", exc_info=True)
        try:
            for job in self.storage_worker.close(timeout_s=max(0.0, deadline - time.monotonic())):
                try:
                    self.tier.complete(job)
                except ValueError:
                    pass
        finally:
            self._off_report.cancel()
            self.store.close()
            super().close()
