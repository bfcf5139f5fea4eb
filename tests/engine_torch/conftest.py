"""The transformers runner on the CPU (torch CPU): one tiny random Llama per session."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from tests.torch_engines import TORCH_REASON, engine_factory_for



@pytest.fixture(scope="session", autouse=True)
def _needs_torch_and_capi() -> None:
    """Skip (with what would make them run) where torch or the CPU C ABI library is missing.

    NOTE: a fixture, not a module-level importorskip: a skip raised while pytest imports a
    conftest is a collection error for the whole run, not a skip.
    """
    pytest.importorskip("torch", reason=TORCH_REASON)
    pytest.importorskip("transformers", reason=TORCH_REASON)
    from tests.skip_helpers import cpu_capi_or_skip

    cpu_capi_or_skip("the transformers runner's CPU tests (the torch backend copies through it)")


@pytest.fixture(scope="session")
def tiny_torch_model() -> Any:
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model

    return load_torch_model("tiny-llama-random", seed=0, device=torch.device("cpu"), dtype="float32")


@pytest.fixture
def engine_factory(monkeypatch: pytest.MonkeyPatch, tiny_torch_model: Any) -> Iterator[Any]:
    yield from engine_factory_for(monkeypatch, tiny_torch_model, model="tiny-llama-random", device="cpu")
