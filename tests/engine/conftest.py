"""Shared set-up of the engine tests: one tiny random Llama per session, engines per test."""

from __future__ import annotations

import gc
from typing import Any, Iterator, Optional

import pytest

pytest.importorskip("paddle", reason="the engine tests need paddlepaddle (bash build.sh)")
pytest.importorskip("paddleformers", reason="the engine tests need paddleformers (bash build.sh installs it)")

from fastdeploy_kvcache import ops  # noqa: E402

if not ops.paddle_ops_available():
    pytest.skip("the engine needs the compiled Paddle custom ops (bash build.sh)", allow_module_level=True)

from fastdeploy_kvcache.engine.llm_engine import LLMEngine  # noqa: E402
from fastdeploy_kvcache.engine.model_loader import LoadedModel, build_tiny_llama  # noqa: E402
from tests.engine_args import engine_args  # noqa: E402
from tests.reuse_workloads import Collector, greedy  # noqa: E402,F401 - the engine tests import them from here


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return build_tiny_llama(seed=0)


def make_engine(monkeypatch: pytest.MonkeyPatch, loaded: Optional[LoadedModel], v1: bool, **kwargs: Any) -> LLMEngine:
    """An started engine; ``loaded`` (the shared tiny model) unless ``model=`` names another."""
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1" if v1 else "0")
    defaults: dict[str, Any] = dict(model="tiny-llama-random", block_size=16, max_model_len=512,
                                    max_num_batched_tokens=64, max_num_seqs=4)
    defaults.update(kwargs)
    if defaults["model"] != "tiny-llama-random":
        loaded = None
    eng = LLMEngine(engine_args(**defaults), loaded_model=loaded)
    eng.start()
    return eng


@pytest.fixture
def engine_factory(monkeypatch: pytest.MonkeyPatch, tiny_model: LoadedModel) -> Iterator[Any]:
    made: list[LLMEngine] = []

    def factory(v1: bool = True, **kwargs: Any) -> LLMEngine:
        eng = make_engine(monkeypatch, tiny_model, v1, **kwargs)
        made.append(eng)
        return eng

    yield factory
    for eng in made:
        eng.shutdown()
    made.clear()
    # Free the engines' Paddle tensors now, not during interpreter shutdown (a tensor freed
    # after Paddle's own teardown has begun is what a late finaliser would trip over).
    gc.collect()
