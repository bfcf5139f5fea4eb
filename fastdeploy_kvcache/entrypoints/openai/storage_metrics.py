"""``/metrics`` families of the storage tier, read from ``engine.get_stats()["storage"]``.

Counters are cumulative since the server started (prometheus_client adds ``_total``):

* ``fastdeploy:prefix_storage_cache_token_num`` -- prompt tokens whose KV came from storage;
* ``fastdeploy:storage_write_block_num`` -- blocks whose put returned OK (stored);
* ``fastdeploy:storage_read_bytes`` / ``_read_seconds`` / ``_write_bytes`` / ``_write_seconds``;
* ``fastdeploy:storage_errors{kind}`` -- per-key failures by kind (unreachable, full, missing,
  corrupt, timeout, io, invalid, busy);
* ``fastdeploy:storage_aborted_prefetches`` -- prefetches a request stopped waiting for;
* ``fastdeploy:storage_evicted_objects``, ``fastdeploy:storage_forgotten_blocks``,
  ``fastdeploy:storage_generation_changes`` -- how the store heals (docs/storage.md);

* ``fastdeploy:storage_plan_requests{choice}`` -- stored prefixes planned, by choice
  (fetch_all, recompute_all, partial, unknown: rates not measured yet, so fetched whole);
* ``fastdeploy:storage_plan_blocks{action}`` -- their blocks fetched or recomputed by choice,
  and the fetched tail blocks of concurrent splits that were loaded (``attached``);
* ``fastdeploy:storage_plan_seconds{kind}`` -- predicted finish (``predicted``), predicted and
  actual fetch time (``fetch_predicted``, ``fetch_actual``), predicted recompute time, and the
  measured finish (``actual``: plan to stored prefix ready) of the requests it was measured for;
* ``fastdeploy:storage_plan_actual_requests`` -- those requests (``actual``'s denominator);
* ``fastdeploy:storage_plan_tails{outcome}`` -- concurrent splits' tails: ``attached``, ``late``
  (recomputed instead), ``failed`` (nothing arrived, or the head did not reach the tree);

and gauges: ``fastdeploy:storage_plan_rate{rate}`` (the planner's estimates: read and link
bytes/s, prefill tokens/s; absent while unknown), ``fastdeploy:storage_breaker_state`` (0 closed, 1 half open, 2 open),
``fastdeploy:storage_available`` (1 when the tier is on).  Nothing is emitted when the tier is
off, so a server without storage exports no storage series.
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fastdeploy_kvcache.entrypoints.openai.section_collector import SectionCollector

from fastdeploy_kvcache.storage.base import ERROR_KINDS

logger = logging.getLogger(__name__)

__all__ = ["StorageStatsCollector"]

_BREAKER = {"closed": 0.0, "half_open": 1.0, "open": 2.0}


class StorageStatsCollector(SectionCollector):
    """Turns the engine's storage stats into metric families at every scrape."""

    section = "storage"

    def families(self, storage: dict[str, Any]) -> list[Any]:
        tier = storage.get("tier", {})
        out: list[Any] = []

        def counter(name: str, doc: str, value: Any) -> None:
            out.append(CounterMetricFamily(name, doc, value=float(value or 0)))

        counter("fastdeploy:prefix_storage_cache_token_num",
                "Prompt tokens whose KV was loaded from the storage tier.", tier.get("storage_hit_tokens"))
        counter("fastdeploy:storage_write_block_num", "KV blocks stored (put returned OK).", tier.get("put_blocks_ok"))
        counter("fastdeploy:storage_read_bytes", "Bytes read from the storage tier into host blocks.",
                tier.get("read_bytes"))
        counter("fastdeploy:storage_read_seconds", "Seconds of storage reads (per job, start to finish).",
                tier.get("read_seconds"))
        counter("fastdeploy:storage_write_bytes", "Bytes written to the storage tier.", tier.get("write_bytes"))
        counter("fastdeploy:storage_write_seconds", "Seconds of storage writes (per job, start to finish).",
                tier.get("write_seconds"))
        counter("fastdeploy:storage_aborted_prefetches",
                "Prefetches a request stopped waiting for (timeout policy, or it was aborted).",
                tier.get("aborted_prefetches"))
        counter("fastdeploy:storage_evicted_objects",
                "Objects the backend evicted on its own (byte cap, free-space floor, full disk).",
                (storage.get("store") or {}).get("evicted"))
        counter("fastdeploy:storage_forgotten_blocks",
                "Blocks the scheduler stopped counting as stored (evicted, missing, corrupt, store restarted); "
                "each is stored again when next computed.", tier.get("stored_forgotten"))
        counter("fastdeploy:storage_generation_changes",
                "Times the store may have lost everything (a restarted Mooncake master).",
                tier.get("store_generation_changes"))
        choices = CounterMetricFamily("fastdeploy:storage_plan_requests",
                                      "Stored prefixes planned (fetch or recompute), by choice.", labels=["choice"])
        for choice in ("fetch_all", "recompute_all", "partial", "unknown"):
            choices.add_metric([choice], float(tier.get(f"plan_{choice}", 0) or 0))
        out.append(choices)
        blocks = CounterMetricFamily("fastdeploy:storage_plan_blocks",
                                     "Blocks of stored prefixes fetched or recomputed, by the plan's choice.",
                                     labels=["action"])
        blocks.add_metric(["fetched"], float(tier.get("plan_blocks_fetched", 0) or 0))
        blocks.add_metric(["recomputed"], float(tier.get("plan_blocks_recomputed", 0) or 0))
        blocks.add_metric(["attached"], float(tier.get("plan_tail_blocks_attached", 0) or 0))
        out.append(blocks)
        counter("fastdeploy:storage_plan_actual_requests",
                "Planned requests whose actual finish was measured (storage_plan_seconds{kind=\"actual\"}).",
                tier.get("plan_actual_requests"))
        tails = CounterMetricFamily("fastdeploy:storage_plan_tails",
                                    "Tails of concurrent splits (head recomputed while the tail is read), by outcome.",
                                    labels=["outcome"])
        for outcome in ("attached", "late", "failed"):
            tails.add_metric([outcome], float(tier.get(f"plan_tails_{outcome}", 0) or 0))
        out.append(tails)
        seconds = CounterMetricFamily("fastdeploy:storage_plan_seconds",
                                      "Seconds of the plans: predicted finish, fetch predicted against actual, "
                                      "recompute predicted.", labels=["kind"])
        for kind, key in (("predicted", "plan_predicted_s"), ("fetch_predicted", "plan_fetch_predicted_s"),
                          ("fetch_actual", "plan_fetch_actual_s"), ("recompute_predicted", "plan_recompute_predicted_s"),
                          ("actual", "plan_actual_s")):
            seconds.add_metric([kind], float(tier.get(key, 0) or 0))
        out.append(seconds)
        rates = GaugeMetricFamily("fastdeploy:storage_plan_rate",
                                  "The fetch planner's estimates: read_bytes_per_s, link_bytes_per_s, "
                                  "prefill_tokens_per_s (absent while unknown).", labels=["rate"])
        for name, value in (tier.get("plan_rates") or {}).items():
            if name != "block_bytes" and value is not None:
                rates.add_metric([name], float(value))
        out.append(rates)
        errors = CounterMetricFamily("fastdeploy:storage_errors", "Storage failures per key, by kind.",
                                     labels=["kind"])
        by_kind = tier.get("errors", {}) or {}
        for kind in ERROR_KINDS:
            errors.add_metric([kind], float(by_kind.get(kind, 0)))
        out.append(errors)
        breaker = str(storage.get("breaker", "closed"))
        out.append(GaugeMetricFamily("fastdeploy:storage_breaker_state",
                                     "Storage circuit breaker: 0 closed, 1 half open, 2 open.",
                                     value=_BREAKER.get(breaker, 2.0)))
        out.append(GaugeMetricFamily("fastdeploy:storage_available", "1 when the storage tier is on.",
                                     value=1.0 if storage.get("available") else 0.0))
        return out
