"""Engines on the transformers runner for tests (``--model-impl transformers``): shared by
tests/engine_torch (torch on the CPU) and tests/gpu/test_torch_engine_gpu.py (SmolLM2 on a GPU).

Imports nothing of torch at module level: the importing test module skips first when torch
is missing.
"""

from __future__ import annotations

import importlib.util
from typing import Any, Callable, Iterator

import pytest

TORCH_REASON = ("needs PyTorch and transformers (the transformers model runner; CI does not install torch: "
                "`pip install torch transformers`, or run `bash build.sh gpu-test` on a GPU machine)")
CUDA_TORCH_REASON = "needs a CUDA GPU visible to torch (run `bash build.sh gpu-test` on a GPU machine)"
TRITON_GPU_REASON = ("needs Triton: `pip install triton` (CUDA builds of torch bring it), then run "
                     "`bash build.sh gpu-test` on a GPU machine")


def cuda_torch_or_skip(*, transformers: bool = True, triton: bool = False) -> Any:
    """torch, where the transformers runner's GPU tests can run; otherwise the calling module
    is skipped with a reason that names what is missing (called at module level)."""
    torch = pytest.importorskip("torch", reason=TORCH_REASON)
    if transformers:
        pytest.importorskip("transformers", reason=TORCH_REASON)
    if not torch.cuda.is_available():
        pytest.skip(CUDA_TORCH_REASON, allow_module_level=True)
    if triton and importlib.util.find_spec("triton") is None:
        pytest.skip(TRITON_GPU_REASON, allow_module_level=True)
    return torch


def engine_factory_for(monkeypatch: pytest.MonkeyPatch, loaded: Any, **defaults: Any) -> Iterator[Callable[..., Any]]:
    """:func:`tests.engine_args.started_engines` on the transformers runner."""
    from tests.engine_args import started_engines

    yield from started_engines(monkeypatch, loaded, model_impl="transformers", **defaults)
