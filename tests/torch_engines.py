"""Engines on the transformers runner for tests (``--model-impl transformers``): shared by
tests/engine_torch (torch on the CPU) and tests/gpu/test_torch_engine_gpu.py (SmolLM2 on a GPU).

Imports nothing of torch at module level: the importing test module skips first when torch
is missing.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest

TORCH_REASON = ("needs PyTorch and transformers (the transformers model runner; CI does not install torch: "
                "`pip install torch transformers`, or run `bash build.sh gpu-test` on a GPU machine)")


def engine_factory_for(monkeypatch: pytest.MonkeyPatch, loaded: Any, **defaults: Any) -> Iterator[Callable[..., Any]]:
    """:func:`tests.engine_args.started_engines` on the transformers runner."""
    from tests.engine_args import started_engines

    yield from started_engines(monkeypatch, loaded, model_impl="transformers", **defaults)
