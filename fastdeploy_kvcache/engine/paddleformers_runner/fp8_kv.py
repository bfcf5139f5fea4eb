"""8-bit KV on Paddle (block_wise_fp8, block_wise_int8): quantize K/V as they are written,
dequantize the blocks read.

The formats (``CacheConfig.kv_cache_quant``): the key and value caches are uint8
``[blocks, kv_heads, block_size, head_dim]``, and each has an fp32 scale cache
``[blocks, kv_heads, block_size]``: one scale per (block, head, token).  ``block_wise_fp8``
holds float8 e4m3fn bytes,

    scale = amax(|x| over head_dim) / 448        (448: the largest finite e4m3fn value)
    byte  = e4m3fn(x / scale)                    (x / 448 * amax: |byte value| <= 448)
    x'    = float(byte) * scale

``block_wise_int8`` int8 bytes (two's complement), ``scale = amax / 127``,
``byte = round_half_even(x / scale)``, ``x' = int8(byte) * scale``: about a third of e4m3's
error (the transformers runner's ``fp8_kv.py`` says why and what it measured).

An all-zero vector has scale 0 and zero bytes (the division uses 1 there), so it reads back
as zeros.  The transformers runner writes the same bytes and scales, so host blocks, storage
objects and PD hand-offs written by either runner read back on the other.

NOTE: e4m3 rather than e5m2: K and V of a token vary by far less than e4m3's range once
divided by their own amax, and e4m3's extra mantissa bit halves the rounding error (relative
error <= 2**-4 for normal values, against 2**-3).  A per-token scale costs 4 bytes per
(head, token): 3% of a 128-wide head's bytes, 6% of a 64-wide one's.

NOTE: Paddle 3.3's CPU build casts float32 <-> float8_e4m3fn (round to nearest even,
saturating at 448) and views uint8 as float8_e4m3fn, but registers no ``index_select`` for
uint8: the gather runs over an int32 (or bfloat16) view of the same bytes, which needs a
head_dim that is a multiple of 4 (or 2).  Every Llama has one; the engine refuses an odd
head_dim when it starts (:func:`gather_view_dtype`).
"""

from __future__ import annotations

from typing import Any

from fastdeploy_kvcache.config import BLOCK_WISE_FP8, BLOCK_WISE_INT8, FP8_E4M3_MAX, INT8_MAX


def gather_view_dtype(head_dim: int) -> str:
    """The dtype a uint8 cache is viewed as for ``index_select`` (no uint8 kernel on CPU)."""
    if head_dim % 4 == 0:
        return "int32"
    if head_dim % 2 == 0:
        return "bfloat16"  # a bit copy: index_select does no arithmetic on the values
    raise ValueError(f"kv_cache_quant: block_wise_fp8 on the paddleformers runner needs an even head_dim "
                     f"(Paddle has no uint8 gather on the CPU), the model has {head_dim}")


def check_kv_quant(kv_quant: str) -> str:
    """``kv_quant`` when Paddle serves it (block_wise_fp8, block_wise_int8); ValueError otherwise."""
    if kv_quant not in (BLOCK_WISE_FP8, BLOCK_WISE_INT8):
        raise ValueError(f"kv_cache_quant {kv_quant!r}: the paddleformers runner serves None, "
                         f"{BLOCK_WISE_FP8!r} or {BLOCK_WISE_INT8!r}")
    return kv_quant


def quantize(x: Any, kv_quant: str = BLOCK_WISE_FP8) -> tuple[Any, Any]:
    """``x`` [..., head_dim] (any float dtype) -> (uint8 bytes [..., head_dim] of ``kv_quant``, fp32 scales [...])."""
    import paddle

    x = x if x.dtype == paddle.float32 else x.astype("float32")
    int8 = kv_quant == BLOCK_WISE_INT8
    scale = paddle.max(paddle.abs(x), axis=-1) / (INT8_MAX if int8 else FP8_E4M3_MAX)
    divisor = paddle.where(scale > 0, scale, paddle.ones_like(scale))
    if int8:
        # paddle.round rounds half to even, as torch.round: both runners write the same bytes.
        q = paddle.clip(paddle.round(x / divisor.unsqueeze(-1)), -INT8_MAX, INT8_MAX).astype(paddle.int8)
    else:
        q = (x / divisor.unsqueeze(-1)).astype(paddle.float8_e4m3fn)
    return q.view(paddle.uint8), scale


def dequantize(q: Any, scale: Any, kv_quant: str = BLOCK_WISE_FP8) -> Any:
    """uint8 bytes [..., head_dim] of ``kv_quant`` and fp32 scales [...] -> float32 [..., head_dim]."""
    import paddle

    values = q.view(paddle.int8 if kv_quant == BLOCK_WISE_INT8 else paddle.float8_e4m3fn)
    return values.astype("float32") * scale.unsqueeze(-1)


def gather_blocks(cache: Any, scales: Any, index: Any, kv_quant: str = BLOCK_WISE_FP8) -> Any:
    """Blocks ``index`` of a quantized cache, dequantized: float32 [len(index), kv_heads, block_size, head_dim]."""
    import paddle

    view = gather_view_dtype(int(cache.shape[-1]))
    raw = paddle.index_select(cache.view(view), index, axis=0).view(paddle.uint8)
    return dequantize(raw, paddle.index_select(scales, index, axis=0), kv_quant)
