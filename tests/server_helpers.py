"""Helpers shared by the tests that drive real servers (tests/entrypoints, tests/pd).

Starting and stopping the processes is the library's job
(``fastdeploy_kvcache.entrypoints.server_process``); what lives here is what only tests need.
"""

from __future__ import annotations

from typing import Any


def scrape(server: Any) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value} (labels sorted, as text)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(server.get_text("/metrics")):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples
