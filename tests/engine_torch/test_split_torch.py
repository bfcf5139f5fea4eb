"""A fetch-or-recompute split on the transformers runner, torch on the CPU (tests/split_check.py;
tests/gpu/test_split_gpu.py runs the same on a CUDA device)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.split_check import check_split_gives_the_tokens_of_recompute


def test_split_on_the_transformers_runner_gives_the_tokens_of_recompute(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model

    lm = load_torch_model("tiny-llama-random", seed=0, device=torch.device("cpu"), dtype="float32")
    check_split_gives_the_tokens_of_recompute(monkeypatch, lm, "cpu", tmp_path)
