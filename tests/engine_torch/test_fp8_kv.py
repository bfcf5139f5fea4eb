"""The 8-bit KV caches (``kv_cache_quant`` ``"block_wise_fp8"``, ``"block_wise_int8"``) of the
transformers runner on the CPU.

* the E4M3 and int8 round trips stay within their bounds, per element;
* the runner refuses caches that are not of its format, and formats it does not serve;
* the Triton kernels (in Triton's interpreter) over FP8 caches against float64 over the
  dequantized values and against the torch fallbacks, the decode kernel's own write of the
  new token's bytes and scale, length-0 rows (tests/fp8_kv_check.py);
* greedy tokens after reusing FP8 blocks (written by a prefill and by decode steps) equal
  recomputing them, in one chunk or in chunks, on the Triton kernels and on the torch
  fallbacks, and the two paths' logits agree;
* the CUDA-graph decode path's static buffers over FP8 caches, eagerly;
* the engine with an FP8 cache: device and host hits change no token (tests/reuse_workloads.py).
"""

from __future__ import annotations

import importlib.util
from typing import Any, Iterator

import pytest

from tests.triton_decode_cases import FP8_DTYPES, PREFILL_CASES, CASES, assert_case_ok, assert_prefill_ok
from tests.triton_decode_cases import assert_zero_length_ok
from tests.triton_interpreter import TRITON_REASON, run_in_interpreter

E4M3_HALF_ULP = 2.0 ** -4  # relative rounding error of a normal E4M3 value (3 mantissa bits)
E4M3_SUBNORMAL_HALF_STEP = 2.0 ** -10  # absolute, in units of the scale (subnormal step 2^-9)


def _vectors(torch: Any, top: float) -> Any:
    """Vectors of 64 values over many magnitudes (1e-6 to 10^top): some with an outlier, a
    zero vector, a ramp."""
    gen = torch.Generator().manual_seed(11)
    x = torch.randn((512, 64), generator=gen) * torch.logspace(-6, top, 512)[:, None]
    x[::7, 3] *= 300.0  # an outlier channel: the rest of those vectors goes subnormal
    x[5] = 0.0
    x[6] = torch.linspace(-1, 1, 64)
    return x


def test_round_trip_within_the_e4m3_bound() -> None:
    """Every element comes back within 2^-4 of itself (normal range) plus 2^-10 of its token's
    scale (subnormals), hence within 2^-4 of its vector's largest magnitude; the largest is
    exact; a zero vector stays zero with scale 0 (no NaN)."""
    import torch

    from fastdeploy_kvcache.config import FP8_E4M3_MAX
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import dequantize_fp8, quantize_fp8

    # float16 tops out at 65504: its vectors stay below 10^2 (x 300 for the outliers).
    for dtype, top in ((torch.float32, 6), (torch.bfloat16, 6), (torch.float16, 2)):
        x = _vectors(torch, top).to(dtype).float()
        q, scale = quantize_fp8(x.to(dtype))
        assert q.dtype == torch.uint8 and scale.dtype == torch.float32
        assert q.shape == x.shape and scale.shape == x.shape[:1]
        back = dequantize_fp8(q, scale)
        assert torch.isfinite(back).all()
        err = (back - x).abs()
        bound = E4M3_HALF_ULP * x.abs() + E4M3_SUBNORMAL_HALF_STEP * scale[:, None]
        assert bool((err <= bound * (1 + 1e-6) + 1e-30).all()), float((err - bound).max())
        amax = x.abs().amax(-1)
        assert bool((err.amax(-1) <= E4M3_HALF_ULP * amax * (1 + 1e-6)).all())
        # The bound is not slack: rounding does reach near it somewhere.
        assert float((err / bound.clamp_min(1e-30)).max()) > 0.5
        top = x.abs().argmax(-1)
        rows = torch.arange(x.shape[0])
        assert torch.allclose(back[rows, top].abs(), amax, rtol=1e-6)
        assert torch.allclose(scale, amax / FP8_E4M3_MAX)
        assert int(q[5].sum()) == 0 and float(scale[5]) == 0.0 and float(back[5].abs().sum()) == 0.0


INT8_HALF_STEP = 0.5  # absolute, in units of the scale (amax / 127): round to nearest


def test_round_trip_within_the_int8_bound() -> None:
    """Every element comes back within half a step (scale / 2 = amax / 254) of itself, the
    vector's largest is exact, -128 is never written, and a zero vector stays zero with scale
    0; int8's error on Gaussian-like vectors is well under E4M3's."""
    import torch

    from fastdeploy_kvcache.config import BLOCK_WISE_INT8, INT8_MAX
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import (dequantize_8bit, dequantize_fp8, quantize_8bit,
                                                                      quantize_fp8)

    for dtype, top in ((torch.float32, 6), (torch.bfloat16, 6), (torch.float16, 2)):
        x = _vectors(torch, top).to(dtype).float()
        q, scale = quantize_8bit(x.to(dtype), BLOCK_WISE_INT8)
        assert q.dtype == torch.uint8 and scale.dtype == torch.float32 and q.shape == x.shape
        assert int((q == 0x80).sum()) == 0  # -128
        back = dequantize_8bit(q, scale, BLOCK_WISE_INT8)
        err = (back - x).abs()
        bound = INT8_HALF_STEP * scale[:, None]
        assert bool((err <= bound * (1 + 1e-5) + 1e-30).all()), float((err - bound).max())
        assert float((err / bound.clamp_min(1e-30)).max()) > 0.9  # not slack
        amax = x.abs().amax(-1)
        rows = torch.arange(x.shape[0])
        assert torch.allclose(back[rows, x.abs().argmax(-1)].abs(), amax, rtol=1e-6)
        assert torch.allclose(scale, amax / INT8_MAX)
        assert int(q[5].sum()) == 0 and float(scale[5]) == 0.0 and float(back[5].abs().sum()) == 0.0
    g = torch.randn((256, 64), generator=torch.Generator().manual_seed(3))
    rel = {}
    for name, (qq, ss) in (("int8", quantize_8bit(g, BLOCK_WISE_INT8)), ("fp8", quantize_fp8(g))):
        back = dequantize_8bit(qq, ss, BLOCK_WISE_INT8) if name == "int8" else dequantize_fp8(qq, ss)
        rel[name] = float((back - g).norm() / g.norm())
    assert rel["int8"] < rel["fp8"] / 2, rel


def test_bytes_are_int8() -> None:
    """block_wise_int8's bytes are two's complement int8: a vector's largest is 127 (0x7f)."""
    import torch

    from fastdeploy_kvcache.config import BLOCK_WISE_INT8
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import quantize_8bit

    q, scale = quantize_8bit(torch.tensor([[2.0, -1.0, 0.5, 0.0, -2.0]]), BLOCK_WISE_INT8)
    assert q.tolist() == [[0x7F, 0xC0, 0x20, 0x00, 0x81]]  # 127, -64 (-63.5 to even), 32 (31.75), 0, -127
    assert float(scale[0]) == pytest.approx(2.0 / 127)


def test_bytes_are_e4m3() -> None:
    """The stored bytes are torch.float8_e4m3fn's encoding: 448 (0x7e) is a vector's largest."""
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import quantize_fp8

    q, scale = quantize_fp8(torch.tensor([[2.0, -1.0, 0.5, 0.0]]))
    assert q.tolist() == [[0x7E, 0xF6, 0x6E, 0x00]]  # 448, -224, 112, 0
    assert float(scale[0]) == pytest.approx(2.0 / 448)


def test_runner_refuses_other_formats_and_mismatched_caches(tiny_torch_model: Any) -> None:
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import make_layer_caches
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    with pytest.raises(ValueError, match="'int8'.*block_wise_fp8"):
        TorchModelRunner(tiny_torch_model, 16, "cpu", kv_cache_quant="int8")
    m = tiny_torch_model
    shape = (m.num_layers, 4, m.num_kv_heads, 16, m.head_dim)
    plain = make_layer_caches(*shape, torch.float32, "cpu", fp8=False)
    fp8 = make_layer_caches(*shape, torch.float32, "cpu", fp8=True)
    seq = [ScheduledSeq([5, 6, 7], 0, [1], True)]
    with pytest.raises(ValueError, match="key, value, key_scale, value_scale"):
        TorchModelRunner(m, 16, "cpu", kv_cache_quant="block_wise_fp8").forward(seq, plain, None)
    with pytest.raises(ValueError, match="uint8 caches without kv_cache_quant"):
        TorchModelRunner(m, 16, "cpu").forward(seq, [layer[:2] for layer in fp8], None)
    bad = [[layer[0], layer[1], layer[2][:, :1], layer[3]] for layer in fp8]
    with pytest.raises(ValueError, match="scale caches"):
        TorchModelRunner(m, 16, "cpu", kv_cache_quant="block_wise_fp8").forward(seq, bad, None)
    # Nothing was written by a refused step.
    assert all(int(t.count_nonzero()) == 0 for layer in fp8 for t in layer)


@pytest.mark.parametrize("kv_quant", ["block_wise_fp8", "block_wise_int8"])
def test_reuse_equals_recompute_on_the_torch_path(tiny_torch_model: Any, kv_quant: str) -> None:
    """The torch fallbacks (the CPU's default): reusing 8-bit blocks written by a prefill and by
    decode steps gives the recomputed tokens, and those of the first request's own decode."""
    from tests.fp8_kv_check import reuse_tokens

    r = reuse_tokens(tiny_torch_model, "torch", kv_quant=kv_quant)
    assert r["reused"] == r["recomputed"] == r["chunked"] == r["expected"], r


@pytest.fixture(scope="module")
def interpreted() -> dict[str, Any]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip(TRITON_REASON)
    return run_in_interpreter("tests.fp8_kv_check")


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_kernel_over_fp8_blocks(interpreted: dict[str, Any], case: str, dtype: str) -> None:
    assert_case_ok(interpreted[f"{case}/{dtype}"], dtype)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_kernel_over_fp8_blocks(interpreted: dict[str, Any], case: str, dtype: str) -> None:
    """E4M3 NaN bytes and NaN scales past the chunk's end are never read."""
    assert_prefill_ok(interpreted[f"prefill/{case}/{dtype}"], dtype)


@pytest.mark.parametrize("dtype", FP8_DTYPES)
def test_fp8_length_zero_rows_read_and_write_nothing(interpreted: dict[str, Any], dtype: str) -> None:
    assert_zero_length_ok(interpreted[f"zero_length/{dtype}"], dtype)


def test_reuse_equals_recompute_on_the_triton_kernels(interpreted: dict[str, Any]) -> None:
    """The decode kernel writing the new tokens' bytes and scales, the prefill kernel reading
    a chunk's cached context: the same tokens as recompute, and as the torch fallbacks."""
    r = interpreted["reuse"]["triton"]
    assert r["reused"] == r["recomputed"] == r["chunked"] == r["expected"], r
    assert r == interpreted["reuse"]["torch"]
    assert interpreted["reuse_paths_logits_err"] < 1e-4, interpreted["reuse_paths_logits_err"]


def test_reuse_equals_recompute_on_the_triton_kernels_over_int8(interpreted: dict[str, Any]) -> None:
    """The same with block_wise_int8 caches (the kernels' int8 reads and the decode kernel's writes)."""
    r = interpreted["reuse_int8"]["triton"]
    assert r["reused"] == r["recomputed"] == r["chunked"] == r["expected"], r
    assert r == interpreted["reuse_int8"]["torch"]
    assert interpreted["reuse_int8_paths_logits_err"] < 1e-4, interpreted["reuse_int8_paths_logits_err"]


def test_padded_static_decode_over_fp8_caches(interpreted: dict[str, Any]) -> None:
    """The CUDA-graph decode path's static buffers (run eagerly) over FP8 caches: the eager
    path's tokens and logits; no block (nor scale) outside the seqs' changed."""
    g = interpreted["graphs"]
    assert g["tokens_equal"] and g["logits_err"] < 1e-4, g
    assert g["replays"] == g["expected_replays"], g
    assert g["untouched_changed"] == 0.0, g


# ---------------------------------------------------------------------- the engine
@pytest.fixture(params=["block_wise_fp8", "block_wise_int8"])
def fp8_engine_factory(engine_factory: Any, request: Any) -> Iterator[Any]:
    def make(**kwargs: Any) -> Any:
        return engine_factory(**{"dtype": "uint8", "kv_cache_quant": request.param, **kwargs})

    yield make


def test_engine_caches_are_fp8(fp8_engine_factory: Any) -> None:
    import torch

    eng = fp8_engine_factory()
    layer = eng.pool.layer_caches[0]
    assert [t.dtype for t in layer] == [torch.uint8, torch.uint8, torch.float32, torch.float32]
    assert eng.runner.fp8_kv


@pytest.mark.parametrize("policy", ["write_through"])
def test_engine_device_and_host_hits_change_nothing(fp8_engine_factory: Any, policy: str) -> None:
    """Recompute (prefix caching off) against device hits and host hits, all with FP8 KV."""
    from tests.reuse_workloads import check_device_hits, check_host_hits, recompute_tokens

    ref = recompute_tokens(fp8_engine_factory)
    check_device_hits(fp8_engine_factory, ref, policy)
    check_host_hits(fp8_engine_factory, ref, policy)


def test_fused_layers_and_piecewise_path_over_fp8_caches(tiny_torch_model: Any) -> None:
    """A step mixing decodes, a fresh chunk and chunks after cached context, over FP8 caches:
    fused layers eagerly and through the piecewise graphs' pieces (run as plain calls on the
    CPU) give the unfused runner's logits and write the same bytes and scales."""
    import numpy as np
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.config import BLOCK_WISE_FP8
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import quantize_fp8
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    gen = torch.Generator().manual_seed(4)
    m = tiny_torch_model
    shape = (48, m.num_kv_heads, 16, m.head_dim)
    base = []
    for _ in range(m.num_layers):
        (k, ks), (v, vs) = quantize_fp8(torch.randn(shape, generator=gen)), quantize_fp8(torch.randn(shape, generator=gen))
        base.append([k, v, ks, vs])
    seqs = [ScheduledSeq([7 + i], 20 + i, [2 * i, 2 * i + 1], True) for i in range(3)]
    seqs.append(ScheduledSeq(list(range(30, 67)), 0, [20, 21, 22], True))  # nothing cached before it
    seqs.append(ScheduledSeq(list(range(90, 99)), 40, [30, 31, 32, 33], True))  # after cached context
    copies = [[[t.clone() for t in layer] for layer in base] for _ in range(3)]
    want = TorchModelRunner(m, 16, "cpu", kv_cache_quant=BLOCK_WISE_FP8).forward(seqs, copies[0], None)
    fused_model = load_torch_model("tiny-llama-random", seed=0, device=torch.device("cpu"), dtype="float32")
    eager = TorchModelRunner(fused_model, 16, "cpu", fused_layers=True, kv_cache_quant=BLOCK_WISE_FP8)
    got = eager.forward(seqs, copies[1], None)
    pieces = TorchModelRunner(fused_model, 16, "cpu", fused_layers=True, kv_cache_quant=BLOCK_WISE_FP8)
    assert pieces.enable_piecewise_graphs(64, capture=False)
    through = pieces.forward(seqs, copies[2], None)
    assert pieces.piecewise_steps == 1
    for out in (got, through):
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
        assert (out.argmax(-1) == want.argmax(-1)).all()
    for i in (1, 2):
        for a, b in zip(copies[0], copies[i]):
            for x, y in zip(a, b):
                # The same bytes but where float32 rounding moved a value across an E4M3
                # rounding edge (one step, rare).
                if x.dtype == torch.uint8:
                    steps = (x.to(torch.int16) - y.to(torch.int16)).abs()
                    assert int(steps.max()) <= 1 and float((steps > 0).float().mean()) < 1e-3
                else:
                    torch.testing.assert_close(x, y, rtol=1e-5, atol=0)
