"""Fused decoder layers (engine/transformers_runner/torch_fused.py, ``--fused-layers``) on the GPU.

* A fused model's logits equal the unfused model's (float32, the same seeded weights) for a
  step mixing a prompt chunk, a chunk after cached context and decodes; the kernels are the
  compiled ones, and the merged weights are views (no second copy of q/k/v or gate/up).
* Piecewise graphs (engine/transformers_runner/piecewise_graphs.py): a mixed step replayed
  through the captured pieces gives the eager fused step's logits and cache writes.
* The shared reuse checks with fused layers, decode graphs and piecewise graphs: greedy
  tokens with the cache on equal recompute (float32) through device hits, host hits, failed
  loads and preemption, with prompt steps replayed through the pieces.

Needs a CUDA GPU with torch, Triton and build/libfdkv_capi.so (`bash build.sh gpu-test`).
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from tests.reuse_workloads import ReuseChecks
from tests.torch_engines import cuda_torch_or_skip, engine_factory_for

torch = cuda_torch_or_skip(triton=True)


def _model() -> Any:
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model

    return load_torch_model("tiny-llama-random", seed=0, device=torch.device("cuda", 0), dtype="float32")


def test_fused_layers_compute_what_the_unfused_layers_compute(capi: Any) -> None:
    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    plain, fused_model = _model(), _model()
    bs = 16
    shape = (64, plain.num_kv_heads, bs, plain.head_dim)
    gen = torch.Generator("cuda").manual_seed(3)
    caches = [[torch.randn(shape, device="cuda", generator=gen), torch.randn(shape, device="cuda", generator=gen)]
              for _ in range(plain.num_layers)]
    seqs = [ScheduledSeq([7 + i], 20 + i, [2 * i, 2 * i + 1], True) for i in range(5)]
    seqs.append(ScheduledSeq(list(range(30, 67)), 0, [20, 21, 22], True))  # a prompt chunk, nothing cached
    seqs.append(ScheduledSeq(list(range(90, 99)), 40, [30, 31, 32, 33], True))  # after cached context
    want = TorchModelRunner(plain, bs, "gpu").forward(seqs, [[k.clone(), v.clone()] for k, v in caches], None)
    runner = TorchModelRunner(fused_model, bs, "gpu", fused_layers=True)
    assert runner.fused_layers == plain.num_layers
    layer = fused_model.model.model.layers[0]
    assert layer.self_attn.q_proj.weight.data_ptr() == layer.fdkv_w_qkv.data_ptr()
    assert layer.mlp.up_proj.weight.untyped_storage().data_ptr() == layer.fdkv_w_gate_up.untyped_storage().data_ptr()
    got = runner.forward(seqs, [[k.clone(), v.clone()] for k, v in caches], None)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_a_mixed_step_replayed_in_pieces_computes_the_eager_step(capi: Any) -> None:
    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    lm = _model()
    bs = 16
    shape = (64, lm.num_kv_heads, bs, lm.head_dim)
    gen = torch.Generator("cuda").manual_seed(5)
    caches = [[torch.randn(shape, device="cuda", generator=gen), torch.randn(shape, device="cuda", generator=gen)]
              for _ in range(lm.num_layers)]
    seqs = [ScheduledSeq([7 + i], 20 + i, [2 * i, 2 * i + 1], True) for i in range(5)]
    seqs.append(ScheduledSeq(list(range(30, 67)), 0, [20, 21, 22], True))
    seqs.append(ScheduledSeq(list(range(90, 99)), 40, [30, 31, 32, 33], False))
    eager = TorchModelRunner(lm, bs, "gpu", fused_layers=True)
    c1 = [[k.clone(), v.clone()] for k, v in caches]
    want = eager.forward(seqs, c1, None)
    runner = TorchModelRunner(lm, bs, "gpu", fused_layers=True)
    assert runner.enable_piecewise_graphs(128)
    assert all(len(b.graphs) == lm.num_layers + 1 for b in runner.piecewise_graphs.buckets.values())
    c2 = [[k.clone(), v.clone()] for k, v in caches]
    got = runner.forward(seqs, c2, None)
    assert runner.piecewise_steps == 1 and runner.last_step_replayed
    # The host's time split (bench_gpu_runner prints it): each part of a replayed step timed.
    times = runner.last_host_times
    assert min(times.build_s, times.pieces_s, times.between_s, times.head_s) > 0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for (k1, v1), (k2, v2) in zip(c1, c2):
        torch.testing.assert_close(k1, k2, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(v1, v2, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module")
def fused_fp32(capi: Any) -> Any:
    return _model()


class TestFusedReuseCudaGraphs(ReuseChecks):
    """Greedy tokens with the cache on equal recompute, fused layers and decode graphs on."""

    policies = {
        "test_device_hits_change_nothing": ("write_through",),
        "test_host_hits_change_nothing": ("write_back",),
        "test_failed_loads_recompute_and_change_nothing": ("write_through",),
        "test_preemption_changes_nothing": ("write_back",),
    }

    @pytest.fixture
    def engine_factory(self, monkeypatch: pytest.MonkeyPatch, fused_fp32: Any) -> Iterator[Any]:
        engines = engine_factory_for(monkeypatch, fused_fp32, model="tiny-llama-random", device="gpu",
                                     model_dtype="float32", use_cudagraph=True, fused_layers="on")
        factory = next(engines)

        def make(**kwargs: Any) -> Any:
            eng = factory(**kwargs)
            assert eng.runner.fused_layers == fused_fp32.num_layers
            assert eng.runner.piecewise_graphs is not None and eng.runner.piecewise_graphs.buckets
            return eng

        yield make
        for _ in engines:
            pass
