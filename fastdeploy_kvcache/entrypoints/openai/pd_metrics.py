"""``/metrics`` families of prefill/decode disaggregation, read from ``engine.get_stats()["pd"]``.

* ``fastdeploy:pd_recomputed_token_num`` -- prompt tokens a decode server computed itself
  because their blocks were missing from, or failed in, the store (0 when every block came
  from the prefill server's hand-off);
* ``fastdeploy:pd_write_block_num{result}`` -- blocks a prefill server put (``ok`` / ``failed``
  / ``skipped``: already stored);
* ``fastdeploy:pd_partial_block_num{result}`` -- partial last blocks a decode server loaded or
  had to recompute;
* ``fastdeploy:pd_write_seconds`` / ``fastdeploy:pd_partial_read_seconds``.

Nothing is emitted by a ``mixed`` server (``engine/pd.py`` is off there).
"""

from __future__ import annotations

import logging
from typing import Any

from prometheus_client.core import CounterMetricFamily

from fastdeploy_kvcache.entrypoints.openai.section_collector import SectionCollector

logger = logging.getLogger(__name__)

__all__ = ["PDStatsCollector"]


class PDStatsCollector(SectionCollector):
    """Turns the engine's PD stats into metric families at every scrape."""

    section = "pd"

    def families(self, pd: dict[str, Any]) -> list[Any]:
        out: list[Any] = [CounterMetricFamily(
            "fastdeploy:pd_recomputed_token_num",
            "Prompt tokens a decode server recomputed because the store lacked or failed their blocks.",
            value=float(pd.get("recomputed_tokens", 0)))]
        writes = CounterMetricFamily("fastdeploy:pd_write_block_num",
                                     "Blocks a prefill server wrote to the store, by result.", labels=["result"])
        for result in ("ok", "failed", "skipped"):
            writes.add_metric([result], float(pd.get(f"prefill_write_blocks_{result}", 0)))
        partial = CounterMetricFamily("fastdeploy:pd_partial_block_num",
                                      "Partial last blocks a decode server loaded from the store or recomputed.",
                                      labels=["result"])
        partial.add_metric(["loaded"], float(pd.get("decode_partial_loaded", 0)))
        partial.add_metric(["failed"], float(pd.get("decode_partial_failed", 0)))
        out += [writes, partial,
                CounterMetricFamily("fastdeploy:pd_write_seconds", "Seconds prefill servers spent writing KV.",
                                    value=float(pd.get("prefill_write_seconds", 0.0))),
                CounterMetricFamily("fastdeploy:pd_partial_read_seconds",
                                    "Seconds decode servers spent reading partial blocks.",
                                    value=float(pd.get("decode_partial_read_seconds", 0.0)))]
        return out
