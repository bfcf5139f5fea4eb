"""``/metrics`` families of KV cache events, read from ``engine.get_stats()["kv_events"]``.

* ``fastdeploy_kvcache:kv_events_published_batches`` -- batches sent on the PUB socket;
* ``fastdeploy_kvcache:kv_events_dropped_batches`` -- batches dropped because the
  publisher's queue was full (``max_queue_size``; the engine step never waits for it);
* ``fastdeploy_kvcache:kv_events_replay_requests`` -- replay requests served;
* ``fastdeploy_kvcache:kv_events_queued_batches`` (gauge) -- batches waiting to be sent.

Nothing is emitted when events are off (``--kv-events-config``).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from fastdeploy_kvcache.entrypoints.openai.section_collector import SectionCollector

logger = logging.getLogger(__name__)

__all__ = ["KVEventsStatsCollector"]

_COUNTERS = (
    ("published_batches", "KV cache event batches sent on the PUB socket."),
    ("dropped_batches", "KV cache event batches dropped because the publisher's queue was full."),
    ("replay_requests", "KV cache event replay requests served."),
)


class KVEventsStatsCollector(SectionCollector):
    """Turns the engine's KV event stats into metric families at every scrape."""

    section = "kv_events"

    def families(self, ev: dict[str, Any]) -> list[Any]:
        out: list[Any] = [
            CounterMetricFamily(f"fastdeploy_kvcache:kv_events_{key}", doc, value=float(ev.get(key, 0)))
            for key, doc in _COUNTERS
        ]
        out.append(GaugeMetricFamily("fastdeploy_kvcache:kv_events_queued_batches",
                                     "KV cache event batches waiting to be sent.",
                                     value=float(ev.get("queued_batches", 0))))
        return out
