"""``EngineArgs`` from flat keywords, for the engine factories the tests share.

A test names a cache setting and an engine setting the same way (``block_size=16,
max_num_seqs=2``); the engine keeps the cache's in one ``CacheConfig`` (``EngineArgs.cache``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.engine.args import EngineArgs

_CACHE_FIELDS = frozenset(f.name for f in dataclasses.fields(CacheConfig))


def engine_args(**kwargs: Any) -> EngineArgs:
    """CacheConfig's field names go into ``cache``; the rest are EngineArgs fields."""
    cache = {k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_FIELDS}
    return EngineArgs(cache=CacheConfig(**cache), **kwargs)
