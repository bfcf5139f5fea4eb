"""8-bit KV cache of the transformers runner (``CacheConfig.kv_cache_quant == "block_wise_fp8"``).

Layout (the cache controller's, ``worker/cache_controller.py``): per layer four tensors,

* ``key``, ``value``: ``uint8 [num_blocks, kv_heads, block_size, head_dim]``, each byte an
  FP8 E4M3 number (``torch.float8_e4m3fn``'s bits, read through ``.view``);
* ``key_scale``, ``value_scale``: ``float32 [num_blocks, kv_heads, block_size]``, one scale per
  (block, head, token): the token's vector of ``head_dim`` values is stored as
  ``round_e4m3(x / scale)`` with ``scale = max|x| / 448``, and read back as ``byte * scale``.

Why E4M3 and not E5M2: the scale already maps every vector's largest value onto the top of
the format, so the extra exponent bit of E5M2 (a range to 57344) buys nothing, while E4M3's
third mantissa bit halves the rounding error: a value in the normal range comes back within
2^-4 of itself (E5M2: 2^-3).  Values more than 2^-6 below the vector's largest (subnormals)
keep an absolute error of at most 2^-10 of the scale.  The block-wise layout fixes the
scales' granularity only, not the 8-bit encoding; E4M3 is also the one of the two that
Hopper GPUs convert to and from in hardware.

Quantization always runs here, in torch ops, for every path that writes the cache (the
index_put of a step's rows and the decode kernel's own write of the new token, which gets
its bytes and scale from :func:`quantize_fp8`): one rounding everywhere, so a block written
by one kernel and read by another, or loaded from another tier, holds the same bytes as if
it had been recomputed.  A prompt chunk that attends over its own fresh K/V (no cached
context) attends over their dequantized values too, so a prefix computed now and the same
prefix reused from the cache give the same attention inputs.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

# The CacheConfig.kv_cache_quant value this runner serves.
FP8_KV_QUANT = "block_wise_fp8"
# Largest finite E4M3 (torch.float8_e4m3fn: no infinities, 0x7f/0xff are NaN).
FP8_MAX = 448.0
# A vector of zeros gets scale 0; dividing by this floor keeps its bytes 0 (not NaN).
_SCALE_FLOOR = 1e-30


def check_kv_cache_quant(kv_cache_quant: Optional[str]) -> bool:
    """True for ``block_wise_fp8``, False for None (an unquantized cache); ValueError for any
    other format, naming the ones this runner serves."""
    if kv_cache_quant is None:
        return False
    if kv_cache_quant == FP8_KV_QUANT:
        return True
    raise ValueError(f"kv_cache_quant {kv_cache_quant!r}: the transformers runner serves None (the cache in "
                     f"the model's dtype) or {FP8_KV_QUANT!r}")


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
    scale = xf.abs().amax(dim=-1) / FP8_MAX
    q = (xf / scale.clamp_min(_SCALE_FLOOR).unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX)
    return q.to(torch.float8_e4m3fn).view(torch.uint8), scale


def fp8_values(q: Any, dtype: Any) -> Any:
    """The E4M3 numbers of uint8 bytes ``q`` in ``dtype`` (exact in bfloat16, float16 and
    float32: every E4M3 value is one of theirs), unscaled."""
    import torch

    return q.view(torch.float8_e4m3fn).to(dtype)


def dequantize_fp8(q: Any, scale: Any, dtype: Any = None) -> Any:
    """uint8 bytes ``[..., head_dim]`` and scales ``[...]`` -> values (float32, or ``dtype``)."""
    import torch

    out = fp8_values(q, torch.float32) * scale.unsqueeze(-1)
    return out if dtype is None else out.to(dtype)


def fake_quantize_fp8(x: Any) -> Any:
    """``x`` through the cache and back, in its own dtype: what any later read of it sees."""
    q, scale = quantize_fp8(x)
    return dequantize_fp8(q, scale, x.dtype)


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
