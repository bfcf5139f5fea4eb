"""8-bit KV cache of the transformers runner (``CacheConfig.kv_cache_quant``: ``block_wise_fp8``
or ``block_wise_int8``).

Layout (the cache controller's, ``worker/cache_controller.py``): per layer four tensors,

* ``key``, ``value``: ``uint8 [num_blocks, kv_heads, block_size, head_dim]``, each byte an
  FP8 E4M3 number (``block_wise_fp8``: ``torch.float8_e4m3fn``'s bits, read through ``.view``)
  or an int8 (``block_wise_int8``: two's complement, read through ``.view(torch.int8)``);
* ``key_scale``, ``value_scale``: ``float32 [num_blocks, kv_heads, block_size]``, one scale per
  (block, head, token): the token's vector of ``head_dim`` values is stored as
  ``round_e4m3(x / scale)`` with ``scale = max|x| / 448`` (fp8), or ``round(x / scale)`` with
  ``scale = max|x| / 127`` (int8), and read back as ``value(byte) * scale``.

Why two encodings: E4M3 keeps 3 mantissa bits whatever the value, a relative error up to
2^-4 on every element (1.8-2.5% of a K or V vector's norm on SmolLM2).  A token's K or V
vector spans a small range below its largest element (largest / RMS about 3 to 6 at
head_dim 64), so int8's 255 evenly spaced levels over [-max, max] round each element to
within max/254: 0.6-1.3% of the norm, a third to a half of E4M3's.  On SmolLM2
(benchmarks/bench_fp8_accuracy.py, 200 prompts) top-1 agreement with a bf16 cache is 0.961
with fp8 and 0.973 with int8, where a float32 cache's is 0.981 (the rest are bf16's own
near-ties).  K's error costs most (scores go through the softmax's exp).  A Hadamard
rotation of each head vector before quantizing (measured) lowers int8's KL by about a
quarter but flips no fewer tokens, and leaves E4M3's error as it was; it is not used.

Why E4M3 and not E5M2: the scale already maps every vector's largest value onto the top of
the format, so the extra exponent bit of E5M2 (a range to 57344) buys nothing, while E4M3's
third mantissa bit halves the rounding error: a value in the normal range comes back within
2^-4 of itself (E5M2: 2^-3).  Values more than 2^-6 below the vector's largest (subnormals)
keep an absolute error of at most 2^-10 of the scale.  The block-wise layout fixes the
scales' granularity only, not the 8-bit encoding; E4M3 is also the one of the two that
Hopper GPUs convert to and from in hardware.

Quantization always runs here (:func:`quantize_kv`: torch ops, compiled into one kernel on
CUDA) for every path that writes the cache (the index_put of a step's rows and the decode
kernel's own write of the new token, which gets its bytes and scale from it): one rounding
everywhere, so a block written by one kernel and read by another, or loaded from another
tier, holds the same bytes as if it had been recomputed.  (Not in the Triton kernels:
Triton's CPU interpreter, where the tests check them, rounds float32 to E4M3 wrongly near
exponent edges.)  A prompt chunk that attends over its own fresh K/V (no cached
context) attends over their dequantized values too, so a prefix computed now and the same
prefix reused from the cache give the same attention inputs.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Optional, Sequence

from fastdeploy_kvcache.config import BLOCK_WISE_FP8, BLOCK_WISE_INT8, FP8_E4M3_MAX, INT8_MAX

logger = logging.getLogger(__name__)

# The CacheConfig.kv_cache_quant values this runner serves.  Each encoding's largest value is
# the config's: FP8_E4M3_MAX (torch.float8_e4m3fn has no infinities, 0x7f/0xff are NaN) and
# INT8_MAX (symmetric: -128 is never written).
KV_QUANTS = (BLOCK_WISE_FP8, BLOCK_WISE_INT8)


def check_kv_cache_quant(kv_cache_quant: Optional[str]) -> bool:
    """True for ``block_wise_fp8`` and ``block_wise_int8`` (8-bit caches), False for None (an
    unquantized cache); ValueError for any other format, naming the ones this runner serves."""
    if kv_cache_quant is None:
        return False
    if kv_cache_quant in KV_QUANTS:
        return True
    raise ValueError(f"kv_cache_quant {kv_cache_quant!r}: the transformers runner serves None (the cache in "
                     f"the model's dtype), {BLOCK_WISE_FP8!r} or {BLOCK_WISE_INT8!r}")


def check_fp8_layer_caches(caches: Sequence[Any], layer: int = 0) -> None:
    """ValueError unless ``caches`` is one layer's ``[key, value, key_scale, value_scale]`` of
    the FP8 layout (uint8 K/V, float32 scales of their first three dims)."""
    import torch

    if len(caches) != 4:
        raise ValueError(f"layer {layer}: an FP8 KV cache needs [key, value, key_scale, value_scale], "
                         f"got {len(caches)} tensors")
    k, v, ks, vs = caches
    if k.dtype != torch.uint8 or v.dtype != torch.uint8:
        raise ValueError(f"layer {layer}: FP8 key/value caches must be uint8, got {k.dtype} / {v.dtype}")
    if ks.dtype != torch.float32 or vs.dtype != torch.float32:
        raise ValueError(f"layer {layer}: FP8 scale caches must be float32, got {ks.dtype} / {vs.dtype}")
    if k.shape != v.shape or tuple(ks.shape) != tuple(k.shape[:3]) or tuple(vs.shape) != tuple(k.shape[:3]):
        raise ValueError(f"layer {layer}: scale caches {tuple(ks.shape)} / {tuple(vs.shape)} do not fit "
                         f"key/value caches {tuple(k.shape)} / {tuple(v.shape)}")


def quantize_fp8(x: Any) -> tuple[Any, Any]:
    """``x`` ``[..., head_dim]`` (any float dtype) -> (uint8 bytes ``[..., head_dim]``, float32
    scales ``[...]``), one scale per vector: ``max|x| / 448``."""
    import torch

    xf = x.float()
    scale = xf.abs().amax(dim=-1) / FP8_E4M3_MAX
    # A zero vector (scale 0) divides by 1: zero bytes, not NaN (the Paddle runner's rule too).
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (xf / divisor.unsqueeze(-1)).clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return q.to(torch.float8_e4m3fn).view(torch.uint8), scale


def quantize_int8(x: Any) -> tuple[Any, Any]:
    """``x`` ``[..., head_dim]`` (any float dtype) -> (uint8 bytes of int8 values ``[..., head_dim]``,
    float32 scales ``[...]``), one scale per vector: ``max|x| / 127``, values rounded to nearest
    (half to even)."""
    import torch

    xf = x.float()
    scale = xf.abs().amax(dim=-1) / INT8_MAX
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(xf / divisor.unsqueeze(-1)).clamp_(-INT8_MAX, INT8_MAX)
    return q.to(torch.int8).view(torch.uint8), scale


def quantize_8bit(x: Any, kv_quant: str) -> tuple[Any, Any]:
    """:func:`quantize_fp8` or :func:`quantize_int8`, by the cache's ``kv_quant``."""
    return quantize_int8(x) if kv_quant == BLOCK_WISE_INT8 else quantize_fp8(x)


def _quantize_pair_fp8(k: Any, v: Any) -> tuple[Any, Any, Any, Any]:
    (kq, ks), (vq, vs) = quantize_fp8(k), quantize_fp8(v)
    return kq, ks, vq, vs


def _quantize_pair_int8(k: Any, v: Any) -> tuple[Any, Any, Any, Any]:
    (kq, ks), (vq, vs) = quantize_int8(k), quantize_int8(v)
    return kq, ks, vq, vs


_EAGER_PAIR: dict[str, Callable[..., Any]] = {BLOCK_WISE_FP8: _quantize_pair_fp8, BLOCK_WISE_INT8: _quantize_pair_int8}
_compiled_pair: dict[str, Callable[..., Any]] = {}


def quantize_kv(k: Any, v: Any, kv_quant: str = BLOCK_WISE_FP8) -> tuple[Any, Any, Any, Any]:
    """A step's K and V for the cache: ``(k bytes, k scales, v bytes, v scales)``
    (:func:`quantize_8bit` of each, ``kv_quant`` the cache's encoding).

    On CUDA, one kernel generated by ``torch.compile`` (``dynamic=True``: one compilation
    serves every token count) instead of about fifteen small ones per layer: the decode
    step's launches are what its time goes to.  Elsewhere, and where compiling fails
    (logged once), the eager ops.  Every write on one device goes through the same
    function, so a block's bytes do not depend on the path that wrote it.
    """
    eager = _EAGER_PAIR.get(kv_quant)
    if eager is None:
        check_kv_cache_quant(kv_quant)  # names the served ones
        raise ValueError(f"quantize_kv: kv_quant {kv_quant!r} is not an 8-bit cache format")
    if not k.is_cuda:
        return eager(k, v)
    compiled = _compiled_pair.get(kv_quant)
    if compiled is None:
        import torch

        compiled = _compiled_pair[kv_quant] = torch.compile(eager, dynamic=True, fullgraph=True)
    if compiled is not eager:
        try:
            return compiled(k, v)
        except Exception as exc:  # noqa: BLE001 - a compiler failure means eager ops, never a crash
            logger.warning("torch.compile of the %s KV quantizer failed (%s: %s); quantizing with eager ops",
                           kv_quant, type(exc).__name__, exc)
            _compiled_pair[kv_quant] = eager
    return eager(k, v)


def fp8_values(q: Any, dtype: Any) -> Any:
    """The E4M3 numbers of uint8 bytes ``q`` in ``dtype`` (exact in bfloat16, float16 and
    float32: every E4M3 value is one of theirs), unscaled."""
    import torch

    return q.view(torch.float8_e4m3fn).to(dtype)


def values_8bit(q: Any, dtype: Any, kv_quant: str) -> Any:
    """The numbers of uint8 bytes ``q`` in ``dtype``, unscaled: E4M3 (:func:`fp8_values`) or
    int8 (exact in bfloat16, float16 and float32: |value| <= 127 < 2^8)."""
    import torch

    return q.view(torch.int8).to(dtype) if kv_quant == BLOCK_WISE_INT8 else fp8_values(q, dtype)


def dequantize_fp8(q: Any, scale: Any, dtype: Any = None) -> Any:
    """uint8 E4M3 bytes ``[..., head_dim]`` and scales ``[...]`` -> values (float32, or ``dtype``)."""
    return dequantize_8bit(q, scale, BLOCK_WISE_FP8, dtype)


def dequantize_8bit(q: Any, scale: Any, kv_quant: str, dtype: Any = None) -> Any:
    """uint8 bytes ``[..., head_dim]`` of ``kv_quant`` and scales ``[...]`` -> values (float32, or ``dtype``)."""
    import torch

    out = values_8bit(q, torch.float32, kv_quant) * scale.unsqueeze(-1)
    return out if dtype is None else out.to(dtype)


def fake_quantize_fp8(x: Any, kv_quant: str = BLOCK_WISE_FP8) -> Any:
    """``x`` through the cache and back, in its own dtype: what any later read of it sees."""
    q, scale = quantize_8bit(x, kv_quant)
    return dequantize_8bit(q, scale, kv_quant, x.dtype)


def make_layer_caches(num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int,
                      dtype: Any, device: Any, fp8: bool) -> list[list[Any]]:
    """Zeroed per-layer caches outside the controller (tests, benchmarks, the memory profile):
    ``[key, value]`` in ``dtype``, or, with ``fp8``, uint8 ``[key, value]`` and their float32
    scales, in the controller's order."""
    import torch

    shape = (num_blocks, kv_heads, block_size, head_dim)
    if not fp8:
        return [[torch.zeros(shape, dtype=dtype, device=device) for _ in range(2)] for _ in range(num_layers)]
    return [[torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(2)]
            + [torch.zeros(shape[:3], dtype=torch.float32, device=device) for _ in range(2)]
            for _ in range(num_layers)]
