"""A fetch-or-recompute split on the transformers runner on a CUDA device: the head of a
stored prefix recomputed while its tail is read from a file store, then loaded like host
hits, gives the greedy tokens of recompute (float32); a tail failing midway recomputes the
rest (tests/split_check.py; tests/engine_torch/test_split_torch.py runs it on the CPU).

Needs a CUDA GPU with torch and build/libfdkv_capi.so (`bash build.sh gpu-test`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.split_check import check_split_gives_the_tokens_of_recompute
from tests.torch_engines import cuda_torch_or_skip

torch = cuda_torch_or_skip()


def test_split_on_the_gpu_gives_the_tokens_of_recompute(capi: Any, monkeypatch: pytest.MonkeyPatch,
                                                         tmp_path: Path) -> None:
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model

    lm = load_torch_model("tiny-llama-random", seed=0, device=torch.device("cuda", 0), dtype="float32")
    check_split_gives_the_tokens_of_recompute(monkeypatch, lm, "gpu", tmp_path)
