"""Sampling on the device (engine/transformers_runner/torch_sampling.py) against the host reference.

* For a batch mixing greedy, temperature, top-k, top-p and top-k + top-p rows, over a small
  vocabulary and Llama-3's 128,256, the device picks the same ids as
  ``StepSampling.sample_host`` with the same draws.
* The runner's ``forward_sample`` returns int64 ids equal to sampling its own ``forward``'s
  logits on the host, eagerly and from a replayed decode graph.

Needs a CUDA GPU with torch (run `bash build.sh gpu-test` on a GPU machine).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from fastdeploy_kvcache.engine.sampling import RequestSampler, SamplingParams, StepSampling
from tests.torch_engines import cuda_torch_or_skip

torch = cuda_torch_or_skip(transformers=False)


def _params(rows: int) -> list[SamplingParams]:
    kinds = [dict(temperature=0.0), dict(temperature=0.8), dict(temperature=1.2, top_k=7),
             dict(temperature=1.0, top_p=0.7), dict(temperature=0.6, top_k=50, top_p=0.95),
             dict(temperature=1.0, top_k=1)]
    return [SamplingParams(seed=100 + i, **kinds[i % len(kinds)]) for i in range(rows)]


@pytest.mark.parametrize("rows,vocab", [(6, 97), (64, 128256), (3, 128256)])
def test_device_picks_what_the_host_picks(rows: int, vocab: int) -> None:
    from fastdeploy_kvcache.engine.transformers_runner.torch_sampling import sample_on_device

    samplers = [RequestSampler(p, 0) for p in _params(rows)]
    for step in range(8):
        logits = torch.randn(rows, vocab, device="cuda", generator=torch.Generator("cuda").manual_seed(step)) * 4
        sampling = StepSampling.for_samplers(samplers)
        packed = torch.from_numpy(sampling.packed()).cuda()
        got = sample_on_device(torch, logits, sampling, packed)
        assert got.dtype == torch.int64 and got.is_cuda
        want = sampling.sample_host(logits.cpu().numpy())
        np.testing.assert_array_equal(got.cpu().numpy(), want)
        for s in samplers:
            s.consume()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cudagraph"])
def test_runner_forward_sample_returns_the_ids_of_its_logits(capi: Any, graphs: bool) -> None:
    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    loaded = load_torch_model("tiny-llama-random", seed=0, device=torch.device("cuda", 0), dtype="float32")
    bs = 16
    runner = TorchModelRunner(loaded, bs, "gpu")
    shape = (64, loaded.num_kv_heads, bs, loaded.head_dim)
    caches = [[torch.randn(shape, device="cuda"), torch.randn(shape, device="cuda")]
              for _ in range(loaded.num_layers)]
    if graphs:
        if not runner.enable_decode_graphs(caches, 8, 4 * bs):
            pytest.fail("decode graph capture failed (see the warning logged)")
    seqs = [ScheduledSeq([3 + i], 5 + i, [2 * i, 2 * i + 1], True) for i in range(6)]
    for step in range(3):
        samplers = [RequestSampler(p, step) for p in _params(len(seqs))]
        sampling = StepSampling.for_samplers(samplers)
        want = sampling.sample_host(runner.forward(seqs, caches, None))
        got = runner.forward_sample(seqs, caches, None, sampling)
        assert runner.last_step_replayed == graphs
        assert isinstance(got, np.ndarray) and got.dtype == np.int64
        np.testing.assert_array_equal(got, want)
