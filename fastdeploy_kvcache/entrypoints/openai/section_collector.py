"""The base of the collectors of one section of ``engine.get_stats()``.

Its own module so that the section collectors (storage, PD hand-off, KV events) and the
server's metrics (``metrics.py``, which registers them) both import it, and neither imports
the other back.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable

from prometheus_client.registry import Collector

logger = logging.getLogger(__name__)


class SectionCollector(Collector):
    """Base of the collectors of one section of ``engine.get_stats()`` (``stats[section]``).

    At every scrape: nothing when the section is absent or empty (the feature is off),
    else :meth:`families` of it.  A failing ``get_stats`` is logged, never raised.
    """

    section = ""

    def __init__(self, get_stats: Callable[[], dict[str, Any]]) -> None:
        self._get_stats = get_stats

    def collect(self) -> Iterable[Any]:
        try:
            stats = (self._get_stats() or {}).get(self.section)
        except Exception:  # noqa: BLE001 - a scrape must not take the server down
            logger.exception("engine.get_stats() failed during a /metrics scrape")
            return []
        if not isinstance(stats, dict) or not stats:
            return []
        return self.families(stats)

    def families(self, stats: dict[str, Any]) -> list[Any]:
        raise NotImplementedError
