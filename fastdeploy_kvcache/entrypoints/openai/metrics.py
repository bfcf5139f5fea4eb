"""Prometheus metrics of one server, with FastDeploy's metric names.

Each server owns its own ``CollectorRegistry`` (tests run several servers in one
process, and prometheus_client's global registry refuses duplicate names).

Two sources:

- **Per request**, recorded by the server as requests finish: the prefix-cache token
  counters, the hit rate and the time-to-first-token histogram.  These come from the
  ``RequestOutput`` fields, so they are exact per request and identical with the switch
  on or off.
- **Engine state**, read from ``engine.get_stats()`` at scrape time by a custom
  collector: running/waiting requests, block usage per tier, bytes and seconds copied
  per direction, failed loads.  Reading at scrape time means no background thread and
  no stale copy.

NOTE: prometheus_client appends ``_total`` to counters in the exposition, as it does in
FastDeploy (which uses the same library): ``fastdeploy:prefix_cache_token_num`` is
scraped as ``fastdeploy:prefix_cache_token_num_total``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Iterable, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fastdeploy_kvcache.entrypoints.openai.kv_events_metrics import KVEventsStatsCollector
from fastdeploy_kvcache.entrypoints.openai.pd_metrics import PDStatsCollector
from fastdeploy_kvcache.entrypoints.openai.storage_metrics import StorageStatsCollector

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "storage")
DIRECTIONS = ("d2h", "h2d")

# Buckets of FastDeploy's TTFT histogram (seconds), extended downwards for small models.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)


def flatten_stats(stats: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: one namespace to look engine stats up in."""
    flat: dict[str, Any] = {}
    for key, value in stats.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(flatten_stats(value, name + "."))
        else:
            flat[name] = value
    return flat


def lookup(flat: dict[str, Any], *names: str) -> Optional[float]:
    """First numeric value found under any of ``names`` (exact key, or a dotted suffix)."""
    for name in names:
        if name in flat and isinstance(flat[name], (int, float)) and not isinstance(flat[name], bool):
            return float(flat[name])
    for name in names:
        suffix = "." + name
        for key, value in flat.items():
            if key.endswith(suffix) and isinstance(value, (int, float)) and not isinstance(value, bool):
                return float(value)
    return None


class EngineStatsCollector(Collector):
    """Turns ``engine.get_stats()`` into gauges and counters at every scrape."""

    def __init__(self, get_stats: Callable[[], dict[str, Any]]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterable[Any]:
        try:
            flat = flatten_stats(self._get_stats())
        except Exception:  # noqa: BLE001 - a scrape must not take the server down
            logger.exception("engine.get_stats() failed during a /metrics scrape")
            return []
        out: list[Any] = []

        def gauge(name: str, doc: str, value: Optional[float]) -> None:
            if value is not None:
                out.append(GaugeMetricFamily(name, doc, value=value))

        gauge("fastdeploy:num_requests_running", "Requests the engine is running (prefill or decode).",
              lookup(flat, "num_requests_running"))
        gauge("fastdeploy:num_requests_waiting", "Requests waiting for admission.",
              lookup(flat, "num_requests_waiting"))
        usage = lookup(flat, "device_usage", "gpu_cache_usage_perc")
        if usage is None:
            total, free = lookup(flat, "device_blocks_total"), lookup(flat, "device_blocks_free")
            if total:
                usage = (total - (free or 0.0)) / total
        gauge("fastdeploy:gpu_cache_usage_perc",
              "Fraction of device KV blocks in use by running requests or cached (0..1).", usage)

        blocks_used = GaugeMetricFamily("fastdeploy_kvcache:blocks_used",
                                        "KV blocks in use (owned by a request or cached), per tier.",
                                        labels=["tier"])
        blocks_free = GaugeMetricFamily("fastdeploy_kvcache:blocks_free", "Free KV blocks, per tier.",
                                        labels=["tier"])
        blocks_cached = GaugeMetricFamily("fastdeploy_kvcache:blocks_cached",
                                          "Device KV blocks held only by the prefix cache (evictable).",
                                          labels=["tier"])
        blocks_owned = GaugeMetricFamily("fastdeploy_kvcache:blocks_owned",
                                         "Device KV blocks owned by running requests.", labels=["tier"])
        for tier in ("device", "host"):
            # A host tier still being pinned in the background has only its ready blocks.
            total = lookup(flat, f"{tier}_blocks_ready", f"{tier}_blocks_total")
            free = lookup(flat, f"{tier}_blocks_free")
            if total is not None and free is not None:
                blocks_used.add_metric([tier], total - free)
                blocks_free.add_metric([tier], free)
        cached = lookup(flat, "device_blocks_cached")
        owned = lookup(flat, "device_blocks_owned")
        if cached is not None:
            blocks_cached.add_metric(["device"], cached)
        if owned is not None:
            blocks_owned.add_metric(["device"], owned)
        out += [blocks_used, blocks_free, blocks_cached, blocks_owned]
        gauge("fastdeploy_kvcache:host_blocks_ready",
              "Host KV blocks whose memory is pinned (the tier is pinned in the background "
              "while the server serves; equal to host_blocks_total once complete).",
              lookup(flat, "host_blocks_pinned", "host_blocks_ready"))
        gauge("fastdeploy_kvcache:host_blocks_total", "Host KV blocks of the host tier, pinned or not yet.",
              lookup(flat, "host_blocks_total"))

        copied_bytes = CounterMetricFamily("fastdeploy_kvcache:swap_bytes",
                                           "Bytes copied between device and host, per direction.",
                                           labels=["direction"])
        copied_seconds = CounterMetricFamily("fastdeploy_kvcache:swap_seconds",
                                             "Seconds spent copying between device and host, per direction.",
                                             labels=["direction"])
        copied_blocks = CounterMetricFamily("fastdeploy_kvcache:swap_blocks",
                                            "Blocks copied between device and host, per direction.",
                                            labels=["direction"])
        for d in DIRECTIONS:
            for family, field in ((copied_bytes, "bytes"), (copied_seconds, "seconds"), (copied_blocks, "blocks")):
                value = lookup(flat, f"{d}.{field}")
                family.add_metric([d], value if value is not None else 0.0)
        out += [copied_bytes, copied_seconds, copied_blocks]

        # In-batch prefix sharing and copies in flight shared (docs/usage.md, "Work in flight is shared").
        held = lookup(flat, "prefix_sharing.held_requests")
        if held is not None:
            out.append(CounterMetricFamily("fastdeploy_kvcache:prefix_share_held_requests",
                                           "Requests held while another request computed their uncached prefix.",
                                           value=held))
            out.append(CounterMetricFamily("fastdeploy_kvcache:prefix_share_reused_tokens",
                                           "Cached tokens the held requests reused when they were admitted.",
                                           value=lookup(flat, "prefix_sharing.held_reused_tokens") or 0.0))
            gauge("fastdeploy_kvcache:prefix_share_held", "Requests held in the last scheduling pass.",
                  lookup(flat, "prefix_sharing.held_now"))
        shared = CounterMetricFamily("fastdeploy_kvcache:copy_shared_blocks",
                                     "Blocks a request took from a copy already in flight for another request "
                                     "instead of issuing its own: host-to-device loads, storage fetches.",
                                     labels=["kind"])
        for kind, key in (("load", "cache.shared_load_blocks"), ("fetch", "storage.tier.prefetch_blocks_shared")):
            value = lookup(flat, key)
            if value is not None:
                shared.add_metric([kind], value)
        out.append(shared)

        failed = lookup(flat, "failed_loads", "failed_blocks")
        out.append(CounterMetricFamily("fastdeploy_kvcache:failed_loads",
                                       "KV blocks whose host-to-device load failed (their tokens were recomputed).",
                                       value=failed if failed is not None else 0.0))
        return out


class ServerMetrics:
    """The metrics of one server instance, in its own registry."""

    def __init__(self, model_name: str, get_stats: Callable[[], dict[str, Any]]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prefix_cache_token_num = Counter(
            "fastdeploy:prefix_cache_token_num", "Prompt tokens whose KV was reused from any tier.", registry=r)
        self.prefix_gpu_cache_token_num = Counter(
            "fastdeploy:prefix_gpu_cache_token_num", "Prompt tokens whose KV was reused from the device tier.",
            registry=r)
        self.prefix_cpu_cache_token_num = Counter(
            "fastdeploy:prefix_cpu_cache_token_num", "Prompt tokens whose KV was loaded from the host tier.",
            registry=r)
        self.prefix_ssd_cache_token_num = Counter(
            "fastdeploy:prefix_ssd_cache_token_num", "Prompt tokens whose KV was loaded from the storage tier.",
            registry=r)
        self.hit_token_rate = Gauge(
            "fastdeploy:hit_token_rate", "Reused prompt tokens / prompt tokens, over all finished requests.",
            registry=r)
        self.hit_req_rate = Gauge(
            "fastdeploy:hit_req_rate", "Finished requests that reused any KV / finished requests.", registry=r)
        self.prompt_tokens = Counter(
            "fastdeploy:prompt_tokens", "Prompt tokens of finished requests.", registry=r)
        self.generation_tokens = Counter(
            "fastdeploy:generation_tokens", "Generated tokens of finished requests.", registry=r)
        self.request_success = Counter(
            "fastdeploy:request_success", "Finished requests, by finish reason.", ["finish_reason"], registry=r)
        self.ttft = Histogram(
            "fastdeploy:time_to_first_token_seconds", "Seconds from arrival to the first generated token.",
            buckets=TTFT_BUCKETS, registry=r)
        self.e2e = Histogram(
            "fastdeploy:e2e_request_latency_seconds", "Seconds from arrival to the last token.",
            buckets=TTFT_BUCKETS, registry=r)
        r.register(EngineStatsCollector(get_stats))
        r.register(StorageStatsCollector(get_stats))  # storage tier series (none when it is off)
        r.register(PDStatsCollector(get_stats))  # prefill/decode hand-off series (none when mixed)
        r.register(KVEventsStatsCollector(get_stats))  # KV cache event series (none when off)
        self._lock = threading.Lock()
        self._prompt_total = 0
        self._cached_total = 0
        self._requests = 0
        self._hit_requests = 0
        self.model_name = model_name

    def observe_first_token(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_finished(self, output: Any, e2e_seconds: Optional[float]) -> None:
        """Record one finished engine request (any finish reason)."""
        by_tier = getattr(output, "cached_tokens_by_tier", None) or {}
        cached = int(getattr(output, "num_cached_tokens", 0) or 0)
        prompt = int(getattr(output, "num_prompt_tokens", 0) or 0)
        self.prefix_cache_token_num.inc(cached)
        self.prefix_gpu_cache_token_num.inc(int(by_tier.get("device", 0)))
        self.prefix_cpu_cache_token_num.inc(int(by_tier.get("host", 0)))
        self.prefix_ssd_cache_token_num.inc(int(by_tier.get("storage", 0)))
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(int(getattr(output, "num_output_tokens", 0) or 0))
        self.request_success.labels(finish_reason=str(getattr(output, "finish_reason", None))).inc()
        if e2e_seconds is not None:
            self.e2e.observe(e2e_seconds)
        with self._lock:
            self._prompt_total += prompt
            self._cached_total += cached
            self._requests += 1
            self._hit_requests += 1 if cached > 0 else 0
            self.hit_token_rate.set(self._cached_total / self._prompt_total if self._prompt_total else 0.0)
            self.hit_req_rate.set(self._hit_requests / self._requests)

    def render(self) -> bytes:
        return generate_latest(self.registry)
