"""``EngineArgs`` from flat keywords, for the engine factories the tests share.

A test names a cache setting and an engine setting the same way (``block_size=16,
max_num_seqs=2``); the engine keeps the cache's in one ``CacheConfig`` (``EngineArgs.cache``).
"""

from __future__ import annotations

import dataclasses
import gc
from typing import Any, Callable, Iterator

import pytest

from fastdeploy_kvcache.config import AUTO_DTYPE, CacheConfig
from fastdeploy_kvcache.engine.args import EngineArgs

_CACHE_FIELDS = frozenset(f.name for f in dataclasses.fields(CacheConfig))


def engine_args(**kwargs: Any) -> EngineArgs:
    """CacheConfig's field names go into ``cache``; the rest are EngineArgs fields.  The cache
    dtype is the model's unless a test names one, as on the server."""
    cache = {"dtype": AUTO_DTYPE, **{k: kwargs.pop(k) for k in list(kwargs) if k in _CACHE_FIELDS}}
    return EngineArgs(cache=CacheConfig(**cache), **kwargs)


# What every engine test starts from; a factory's own defaults and a test's keywords win.  The
# 1 GiB pool cap (the CPU's default) also holds on a GPU: a test process runs several engines
# on one device, and --gpu-memory-utilization would give the first one the whole share.
ENGINE_DEFAULTS: dict[str, Any] = dict(block_size=16, max_model_len=512, max_num_batched_tokens=64, max_num_seqs=4,
                                       kv_cache_memory_gib=1.0)


def wait_for_the_host_tier(engine: Any, timeout_s: float = 60.0) -> None:
    """Until the engine's host tier is pinned whole: with CUDA copies it is pinned in the
    background by default, and a workload that counts host hits must not start before it."""
    import time

    ctrl = getattr(engine.pool, "controller", None)
    if ctrl is None or not ctrl.num_host_blocks:
        return
    deadline = time.monotonic() + timeout_s
    while ctrl.host_blocks_ready < ctrl.num_host_blocks:
        assert time.monotonic() < deadline, f"host tier stuck at {ctrl.host_blocks_ready} of {ctrl.num_host_blocks} blocks"
        time.sleep(0.005)


def started_engines(monkeypatch: pytest.MonkeyPatch, loaded: Any, **defaults: Any) -> Iterator[Callable[..., Any]]:
    """Yields ``factory(v1=True, **engine_args)``, which builds and starts an engine over the
    shared ``loaded`` model (a test naming another ``model=`` gets that one loaded), then
    shuts every engine down and frees its tensors (before interpreter teardown, where a late
    finaliser would trip over a framework already torn down)."""
    from fastdeploy_kvcache.engine.llm_engine import LLMEngine

    made: list[Any] = []

    def factory(v1: bool = True, **kwargs: Any) -> Any:
        monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1" if v1 else "0")
        args = {**ENGINE_DEFAULTS, **defaults, **kwargs}
        model = loaded if args.get("model") == defaults.get("model") else None
        eng = LLMEngine(engine_args(**args), loaded_model=model)
        eng.start()
        made.append(eng)
        wait_for_the_host_tier(eng)
        return eng

    yield factory
    for eng in made:
        eng.shutdown()
    made.clear()
    gc.collect()
