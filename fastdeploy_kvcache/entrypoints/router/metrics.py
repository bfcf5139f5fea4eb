"""The router's Prometheus metrics (its own registry), with the fleet's state read at scrape time."""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from fastdeploy_kvcache.entrypoints.router.view import DEVICE, HOST, STORAGE, TIER_NAMES

logger = logging.getLogger(__name__)

OVERHEAD_BUCKETS = (0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.5)


class FleetCollector(Collector):
    """Per worker: healthy, requests in flight, blocks in the view per tier, event counters."""

    def __init__(self, workers: Callable[[], Iterable[Any]]) -> None:
        self._workers = workers

    def collect(self) -> Iterable[Any]:
        healthy = GaugeMetricFamily("fdkv_router:worker_healthy", "1 when the worker passes health checks.",
                                    labels=["worker"])
        in_flight = GaugeMetricFamily("fdkv_router:worker_requests_in_flight",
                                      "Requests the router has in flight on the worker.", labels=["worker"])
        blocks = GaugeMetricFamily("fdkv_router:view_blocks",
                                   "Blocks the router believes the worker holds, per tier (from its events).",
                                   labels=["worker", "tier"])
        ev = {name: CounterMetricFamily(f"fdkv_router:event_{name}", doc, labels=["worker"]) for name, doc in (
            ("batches", "Event batches applied."),
            ("gaps", "Sequence gaps seen on the live stream (each asks the replay socket)."),
            ("replays", "Replay requests sent."),
            ("missed", "Event batches lost for good (neither received nor replayable)."),
            ("restarts", "Times the worker's publisher was seen restarting (view rebuilt)."),
            ("bad_batches", "Event batches that could not be decoded."),
        )}
        for w in self._workers():
            healthy.add_metric([w.url], 1.0 if w.healthy else 0.0)
            in_flight.add_metric([w.url], w.in_flight)
            for bit in (DEVICE, HOST, STORAGE):
                blocks.add_metric([w.url, TIER_NAMES[bit]], w.view.count(bit))
            if w.subscriber is not None:
                for name, family in ev.items():
                    family.add_metric([w.url], getattr(w.subscriber.stats, name))
        return [healthy, in_flight, blocks, *ev.values()]


class RouterMetrics:
    def __init__(self, workers: Callable[[], Iterable[Any]]) -> None:
        r = self.registry = CollectorRegistry()
        self.routed = Counter("fdkv_router:requests_routed",
                              "Requests sent to a worker, by worker and reason (cache, balance, no_match, round_robin, "
                              "least_requests; refused: the worker refused the connection, the request went on).",
                              ["worker", "reason"], registry=r)
        self.predicted = Counter("fdkv_router:predicted_cached_tokens",
                                 "Prompt tokens the router expected the worker to reuse.", ["worker"], registry=r)
        self.reported = Counter("fdkv_router:reported_cached_tokens",
                                "Prompt tokens the worker reported reused (usage.prompt_tokens_details.cached_tokens).",
                                ["worker"], registry=r)
        self.prompt_tokens = Counter("fdkv_router:prompt_tokens", "Prompt tokens the workers reported.",
                                     ["worker"], registry=r)
        self.failed = Counter("fdkv_router:upstream_failures",
                              "Requests that failed because the worker was unreachable or broke mid-request.",
                              ["worker"], registry=r)
        self.no_worker = Counter("fdkv_router:no_healthy_worker", "Requests answered 503: no healthy worker.",
                                 registry=r)
        self.overhead = Histogram("fdkv_router:overhead_seconds",
                                  "Seconds from a request's arrival to its forwarding (parse, tokenize, hash, choose).",
                                  buckets=OVERHEAD_BUCKETS, registry=r)
        r.register(FleetCollector(workers))

    def render(self) -> bytes:
        return generate_latest(self.registry)
