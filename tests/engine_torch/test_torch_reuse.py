"""The transformers runner on the CPU: reuse changes nothing (the shared workloads of
tests/reuse_workloads.py), the paged attention matches transformers' own, and this path
never imports Paddle."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.reuse_workloads import ReuseChecks

ROOT = Path(__file__).resolve().parents[2]


class TestTorchReuse(ReuseChecks):
    """The shared reuse checks; on the CPU the slower checks run under fewer policies."""

    policies = {
        "test_host_hits_change_nothing": ("write_through", "write_back"),
        "test_failed_loads_recompute_and_change_nothing": ("write_through",),
        "test_preemption_changes_nothing": ("write_back",),
    }


def test_cache_is_the_workers_torch_memory(engine_factory: Any) -> None:
    """The runner attends over the controller's own tensors: no copy, no conversion."""
    import torch

    eng = engine_factory(v1=True)
    caches = eng.pool.layer_caches
    assert all(isinstance(t, torch.Tensor) for layer in caches for t in layer)
    ctrl = eng.pool.controller
    names = ctrl.cache_names(0)
    assert caches[0][0].data_ptr() == ctrl.get_kv_caches()[names["key"]].data_ptr()
    assert eng.pool.controller.backend.name == "torch"


def test_paged_attention_matches_transformers_sdpa(tiny_torch_model: Any) -> None:
    """Logits of a prompt split into a prefix and a chunk over the paged cache equal
    transformers' own sdpa forward of the whole prompt (float32 on the CPU)."""
    from tests.torch_attention_check import paged_vs_sdpa_error

    err = paged_vs_sdpa_error(tiny_torch_model, prefix=37, chunk=11, decodes=3, block_size=16)
    assert err < 1e-4, err


def test_transformers_path_imports_no_paddle() -> None:
    code = (
        "import os, sys, json\n"
        "os.environ['ENABLE_V1_KVCACHE_MANAGER'] = '1'\n"
        "from fastdeploy_kvcache.config import CacheConfig\n"
        "from fastdeploy_kvcache.engine.args import EngineArgs\n"
        "from fastdeploy_kvcache.engine.llm_engine import LLMEngine\n"
        "eng = LLMEngine(EngineArgs(model='tiny-llama-random', model_impl='transformers', device='cpu',\n"
        "                           max_model_len=256, cache=CacheConfig(num_host_blocks=8, dtype='auto')))\n"
        "eng.shutdown()\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('paddle', 'paddleformers'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
