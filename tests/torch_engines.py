"""Engines on the transformers runner for tests (``--model-impl transformers``): shared by
tests/engine_torch (torch on the CPU) and tests/gpu/test_torch_engine_gpu.py (SmolLM2 on a GPU).

Imports nothing of torch at module level: the importing test module skips first when torch
is missing.
"""

from __future__ import annotations

import gc
from typing import Any, Callable, Iterator

import pytest

TORCH_REASON = ("needs PyTorch and transformers (the transformers model runner; CI does not install torch: "
                "`pip install torch transformers`, or run `bash build.sh gpu-test` on a GPU machine)")


def engine_factory_for(monkeypatch: pytest.MonkeyPatch, loaded: Any, **defaults: Any) -> Iterator[Callable[..., Any]]:
    """Yields ``factory(v1, **engine_args)`` building started engines over ``loaded``; shuts
    them down afterwards."""
    from fastdeploy_kvcache.engine.llm_engine import LLMEngine
    from tests.engine_args import engine_args

    made: list[Any] = []

    def factory(v1: bool = True, **kwargs: Any) -> Any:
        monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1" if v1 else "0")
        args = dict(model_impl="transformers", block_size=16, max_model_len=512, max_num_batched_tokens=64,
                    max_num_seqs=4)
        args.update(defaults)
        args.update(kwargs)
        eng = LLMEngine(engine_args(**args), loaded_model=loaded)
        eng.start()
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        eng.shutdown()
    made.clear()
    gc.collect()
