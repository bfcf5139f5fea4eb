"""The FP8 KV cache (``block_wise_fp8``) of the transformers runner on a GPU.

* The compiled Triton decode and prefill kernels over FP8 blocks (uint8 E4M3 bytes, float32
  scales per block, head and token) against float64 over the dequantized values and the
  torch fallbacks, with bf16 and float32 queries, the decode kernel writing the new token's
  bytes and scale, length-0 rows, a batch of 32 up to 2k context (tests/triton_decode_cases.py).
* Reuse of FP8 blocks written by a prefill and by the decode kernel gives the recomputed
  greedy tokens (tests/fp8_kv_check.py).
* Decode steps replayed from CUDA graphs over FP8 caches: the eager runner's logits, the
  replays counted, no block or scale outside the seqs written (tests/decode_graph_check.py).
* Fused layers and piecewise graphs over FP8 caches: the unfused eager step's logits and
  cache bytes.

Needs a CUDA GPU with torch, Triton and build/libfdkv_capi.so (`bash build.sh gpu-test`).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tests.torch_engines import cuda_torch_or_skip
from tests.triton_decode_cases import CASES, FP8_DTYPES, GPU_CASES, PREFILL_CASES

torch = cuda_torch_or_skip(triton=True)

CUDA = torch.device("cuda", 0)


def _tiny(dtype: str = "float32") -> Any:
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model

    return load_torch_model("tiny-llama-random", seed=0, device=CUDA, dtype=dtype)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("case", sorted(CASES) + sorted(GPU_CASES))
def test_decode_kernel_over_fp8_blocks_compiled(capi: Any, case: str, dtype: str) -> None:
    from tests.triton_decode_cases import assert_case_ok, case_errors

    assert_case_ok(case_errors(case, dtype, CUDA), dtype)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_kernel_over_fp8_blocks_compiled(capi: Any, case: str, dtype: str) -> None:
    from tests.triton_decode_cases import assert_prefill_ok, prefill_case_errors

    assert_prefill_ok(prefill_case_errors(case, dtype, CUDA), dtype)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_fp8_length_zero_rows_compiled(capi: Any, dtype: str) -> None:
    from tests.triton_decode_cases import assert_zero_length_ok, zero_length_errors

    assert_zero_length_ok(zero_length_errors(dtype, CUDA), dtype)


@pytest.mark.parametrize("kv_quant", ["block_wise_fp8", "block_wise_int8"])
def test_reuse_equals_recompute_with_fp8_kv(capi: Any, kv_quant: str) -> None:
    """float32 tiny-llama-random: no greedy choice flips on float noise between paths."""
    from tests.fp8_kv_check import reuse_tokens

    r = reuse_tokens(_tiny(), "triton", device="gpu", kv_quant=kv_quant)
    assert r["reused"] == r["recomputed"] == r["chunked"] == r["expected"], r


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
def test_decode_graphs_over_fp8_caches(capi: Any, dtype: str, tol: float) -> None:
    """Steps of 1, 3 (padded to 4) and 32 seqs replayed over FP8 caches (the graphs hold the
    scale caches' addresses too)."""
    from tests.decode_graph_check import GPU_DECODE_STEPS, GPU_PROMPTS, padded_decode_results

    r = padded_decode_results("gpu", dtype, GPU_PROMPTS, GPU_DECODE_STEPS, max_num_seqs=32, fp8=True)
    assert r["logits_err"] < tol, r
    if dtype == "float32":
        assert r["tokens_equal"], r
    assert r["replays"] == r["expected_replays"], r
    assert r["untouched_changed"] == 0.0, r
    assert r["eager_steps_replayed"] == 0, r


def _fp8_caches(lm: Any, seed: int) -> list[list[Any]]:
    """Random FP8 caches (64 blocks of 16): valid E4M3 bytes with their scales."""
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import quantize_fp8

    gen = torch.Generator("cuda").manual_seed(seed)
    shape = (64, lm.num_kv_heads, 16, lm.head_dim)
    out = []
    for _ in range(lm.num_layers):
        (k, ks), (v, vs) = (quantize_fp8(torch.randn(shape, device="cuda", generator=gen)) for _ in range(2))
        out.append([k, v, ks, vs])
    return out


def _mixed_step() -> list[Any]:
    from fastdeploy_kvcache.engine.runner import ScheduledSeq

    seqs = [ScheduledSeq([7 + i], 20 + i, [2 * i, 2 * i + 1], True) for i in range(5)]
    seqs.append(ScheduledSeq(list(range(30, 67)), 0, [20, 21, 22], True))  # a prompt chunk, nothing cached
    seqs.append(ScheduledSeq(list(range(90, 99)), 40, [30, 31, 32, 33], True))  # after cached context
    return seqs


def test_fused_layers_and_piecewise_graphs_over_fp8_caches(capi: Any) -> None:
    """A step mixing decodes, a fresh chunk and a chunk after cached context: fused eager and
    fused through the piecewise graphs give the unfused runner's logits, and write the same
    bytes and scales."""
    from fastdeploy_kvcache.config import BLOCK_WISE_FP8
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import dequantize_fp8
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    plain, fused = _tiny(), _tiny()
    base = _fp8_caches(plain, 3)
    copies = [[[t.clone() for t in layer] for layer in base] for _ in range(3)]
    want = TorchModelRunner(plain, 16, "gpu", kv_cache_quant=BLOCK_WISE_FP8).forward(_mixed_step(), copies[0], None)
    eager = TorchModelRunner(fused, 16, "gpu", fused_layers=True, kv_cache_quant=BLOCK_WISE_FP8)
    got = eager.forward(_mixed_step(), copies[1], None)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    pieces = TorchModelRunner(fused, 16, "gpu", fused_layers=True, kv_cache_quant=BLOCK_WISE_FP8)
    assert pieces.enable_piecewise_graphs(128)
    replayed = pieces.forward(_mixed_step(), copies[2], None)
    assert pieces.piecewise_steps == 1 and pieces.last_step_replayed
    np.testing.assert_allclose(replayed, want, rtol=1e-4, atol=1e-4)
    for i in (1, 2):
        for a, b in zip(copies[0], copies[i]):
            # Bytes may differ by one E4M3 step where float32 rounding moved a value across a
            # rounding edge; their dequantized values stay within that step.
            for (q1, s1), (q2, s2) in (((a[0], a[2]), (b[0], b[2])), ((a[1], a[3]), (b[1], b[3]))):
                torch.testing.assert_close(dequantize_fp8(q2, s2), dequantize_fp8(q1, s1), rtol=2 ** -3, atol=1e-5)


@pytest.mark.parametrize("kv_quant", ["block_wise_fp8", "block_wise_int8"])
def test_compiled_quantizer_matches_the_eager_ops(capi: Any, kv_quant: str) -> None:
    """The CUDA quantizer (one torch.compile kernel for K and V) against the eager ops the CPU
    runs: scales to float32 rounding, bytes equal but for rare one-step differences where the
    compiled division rounds the other way at a rounding edge (E4M3's, or int8's halves)."""
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import quantize_8bit, quantize_kv

    gen = torch.Generator("cuda").manual_seed(9)
    for t in (1, 7, 300):  # a decode row, a few, a prompt chunk (T = 1 compiles apart)
        # [t, 8, 128], strided as the runner's views of [1, heads, T, D]
        k = torch.randn((8, t, 128), device="cuda", dtype=torch.bfloat16, generator=gen).transpose(0, 1)
        v = torch.randn((8, t, 128), device="cuda", dtype=torch.bfloat16, generator=gen).transpose(0, 1)
        kq, ks, vq, vs = quantize_kv(k, v, kv_quant)
        for (q, s), x in (((kq, ks), k), ((vq, vs), v)):
            eq, es = quantize_8bit(x, kv_quant)
            torch.testing.assert_close(s, es, rtol=1e-6, atol=0)
            # int8 steps are its values' (E4M3's byte codes are ordered within a sign).
            view = torch.int8 if kv_quant == "block_wise_int8" else torch.uint8
            steps = (q.view(view).to(torch.int16) - eq.view(view).to(torch.int16)).abs()
            assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 1e-3
