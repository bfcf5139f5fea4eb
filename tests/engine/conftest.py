"""Shared set-up of the engine tests: one tiny random Llama per session, engines per test."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

pytest.importorskip("paddle", reason="the engine tests need paddlepaddle (bash build.sh)")
pytest.importorskip("paddleformers", reason="the engine tests need paddleformers (bash build.sh installs it)")

from fastdeploy_kvcache import ops  # noqa: E402

if not ops.paddle_ops_available():
    pytest.skip("the engine needs the compiled Paddle custom ops (bash build.sh)", allow_module_level=True)

from fastdeploy_kvcache.engine.model_loader import LoadedModel, build_tiny_llama  # noqa: E402
from tests.engine_args import started_engines  # noqa: E402
from tests.reuse_workloads import Collector, greedy  # noqa: E402,F401 - the engine tests import them from here


@pytest.fixture(scope="session")
def tiny_model() -> LoadedModel:
    return build_tiny_llama(seed=0)


@pytest.fixture
def engine_factory(monkeypatch: pytest.MonkeyPatch, tiny_model: LoadedModel) -> Iterator[Any]:
    yield from started_engines(monkeypatch, tiny_model, model="tiny-llama-random")
