"""Paged attention for paddleformers models, over the CacheController's block caches.

paddleformers calls the function registered here (``AttentionInterface.register`` plus
``config._attn_implementation``) from every attention layer, with q, k and v after rotary
embedding, so the model itself stays unmodified.  The engine flattens all of a step's
scheduled tokens into one sequence ``[1, T]`` (explicit position ids per request) and, before
the forward pass, sets a :class:`StepContext` saying which slice of ``T`` belongs to which
request, its block table and how many of its tokens are already in the cache.

Per layer and request the function

1. waits for this layer's host->device load (``LayerDoneCounter.wait_for_layer``);
2. writes the step's new K and V in place into the request's blocks, one slice assignment
   per block touched (never a scatter over the whole cache: that copies it);
3. gathers the request's blocks (``index_select`` of its table only) and attends with a causal
   mask offset by the cached length.

NOTE: Paddle registers no paged or variable-length attention kernel for CPU, so the gather is
explicit.  Its cost is proportional to the request's own context, never to the cache size.

A block_wise_fp8 or block_wise_int8 cache (uint8 K/V with fp32 scales, ``[key, value,
key_scale, value_scale]`` per layer; ``StepContext.kv_quant`` says which) is written quantized
and read dequantized (``fp8_kv.py``); the new tokens are
attended from the cache like the cached ones, so a reused prefix reads exactly what
recomputing it would have written.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

from fastdeploy_kvcache.config import BLOCK_WISE_FP8
from fastdeploy_kvcache.engine.attention import current_context, select_attention
from fastdeploy_kvcache.engine.paddleformers_runner import fp8_kv

logger = logging.getLogger(__name__)

ATTN_IMPL_NAME = "fdkv_paged"

@dataclass
class SeqSlice:
    """One request's part of a step: tokens [start, start + num_new) of the flattened batch."""

    start: int
    num_new: int
    context_len: int  # tokens already in the cache (their KV is read, not written)
    block_ids: list[int]
    # Filled by the attention function on the first layer, reused by the others: the block
    # table as an index tensor, and (for a chunk of several tokens) the causal mask.
    index: Any = None
    mask: Any = None

    @property
    def total_len(self) -> int:
        return self.context_len + self.num_new


@dataclass
class StepContext:
    """What the attention function needs for one forward pass."""

    seqs: list[SeqSlice]
    kv_caches: Sequence[Sequence[Any]]  # per layer: [key_cache, value_cache, ...]
    block_size: int
    staging: Any  # int64_staging.Int64Staging: makes the step's index tensors
    layer_done: Optional[Any] = None  # LayerDoneCounter of this step's load, if any
    layers_waited: set[int] = field(default_factory=set)
    # Built on the first layer, reused by the others: the leading run of one-token (decode)
    # seqs, attended as one batch.
    decode_batch: Optional["_DecodeBatch"] = None
    # What a uint8 cache's bytes are (block_wise_fp8: e4m3; block_wise_int8: int8).
    kv_quant: str = BLOCK_WISE_FP8

    @property
    def num_leading_decodes(self) -> int:
        """How many seqs at the front are single tokens at consecutive positions 0, 1, ..."""
        k = 0
        for i, s in enumerate(self.seqs):
            if s.num_new != 1 or s.start != i:
                break
            k += 1
        return k


@dataclass
class _DecodeBatch:
    """Gather index and length mask of the leading decode seqs, padded to the longest."""

    count: int
    blocks_per_seq: int
    index: Any  # int64 [count * blocks_per_seq]: each seq's table, padded with its first block
    mask: Any  # float32 [count, blocks_per_seq, 1, 1, block_size]: 0 inside, -inf past the end


def write_kv(cache: Any, new: Any, block_ids: Sequence[int], start_pos: int, block_size: int) -> None:
    """Write ``new`` ([kv_heads, n, head_dim], or [kv_heads, n] into a scale cache) at positions
    ``start_pos..`` of a request's blocks."""
    n = int(new.shape[1])
    pos, i = start_pos, 0
    while i < n:
        blk = block_ids[pos // block_size]
        off = pos % block_size
        m = min(block_size - off, n - i)
        # In place (set_value on a slice of one block): the rest of the cache is untouched.
        cache[blk, :, off : off + m] = new[:, i : i + m]
        pos += m
        i += m


class _Lanes:
    """One layer's cache of K (or V): the cache, and its fp32 scales when it is 8-bit (``kv_quant``)."""

    def __init__(self, cache: Any, scales: Any = None, kv_quant: str = BLOCK_WISE_FP8) -> None:
        self.cache = cache
        self.scales = scales
        self.kv_quant = kv_quant

    def write(self, new: Any, block_ids: Sequence[int], start_pos: int, block_size: int) -> None:
        """``new`` is [kv_heads, n, head_dim] in the cache's dtype, or (quantized) the pair
        (bytes, scales) from :func:`fp8_kv.quantize`."""
        if self.scales is None:
            write_kv(self.cache, new, block_ids, start_pos, block_size)
            return
        q, scale = new
        write_kv(self.cache, q, block_ids, start_pos, block_size)
        write_kv(self.scales, scale, block_ids, start_pos, block_size)

    def blocks(self, index: Any) -> Any:
        """Blocks ``index`` as float32 [nb, kv_heads, block_size, head_dim]."""
        import paddle

        if self.scales is None:
            return _as_float32(paddle.index_select(self.cache, index, axis=0))
        return fp8_kv.gather_blocks(self.cache, self.scales, index, self.kv_quant)


def _slice_new(new: Any, a: int, n: int) -> Any:
    """Tokens ``[a, a + n)`` of a step's new K (or V): a tensor, or a quantized (bytes, scales) pair."""
    if isinstance(new, tuple):
        return new[0][:, a : a + n, :], new[1][:, a : a + n]
    return new[:, a : a + n, :]


def _gather(lanes: _Lanes, index: Any, total: int) -> Any:
    """The first ``total`` positions of a request's blocks: float32 [kv_heads, total, head_dim]."""
    blocks = lanes.blocks(index)  # [nb, kvh, bs, d]
    nb, kvh, bs, d = blocks.shape
    return blocks.transpose([1, 0, 2, 3]).reshape([kvh, nb * bs, d])[:, :total, :]


def _as_float32(x: Any) -> Any:
    import paddle

    return x if x.dtype == paddle.float32 else x.astype("float32")


def paged_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any = None,
    attn_mask_startend_row_indices: Any = None,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """paddleformers attention interface: q [1, H, T, D], k/v [1, KVH, T, D] -> ([1, T, H*D], None)."""
    import paddle
    import paddle.nn.functional as F

    ctx: StepContext = current_context()
    layer = int(module.layer_idx)
    if ctx.layer_done is not None:
        # Before this layer's cache is read (or written: a load may target the same blocks).
        ctx.layer_done.wait_for_layer(layer)
        ctx.layers_waited.add(layer)
    caches = ctx.kv_caches[layer]
    bs = ctx.block_size
    _, num_heads, _, head_dim = query.shape
    num_kv = int(key.shape[1])
    groups = num_heads // num_kv
    scale = scaling if scaling is not None else 1.0 / math.sqrt(head_dim)
    q_all, k_all, v_all = query[0], key[0], value[0]
    if caches[0].dtype == paddle.uint8:
        # 8-bit: [key, value, key_scale, value_scale]; the step's tokens are quantized once
        # per layer and written as (bytes, scales).
        quant = ctx.kv_quant
        k_cache, v_cache = _Lanes(caches[0], caches[2], quant), _Lanes(caches[1], caches[3], quant)
        k_all, v_all = fp8_kv.quantize(k_all, quant), fp8_kv.quantize(v_all, quant)
    else:
        k_cache, v_cache = _Lanes(caches[0]), _Lanes(caches[1])
        if k_all.dtype != caches[0].dtype:
            k_all = k_all.astype(caches[0].dtype)
            v_all = v_all.astype(caches[1].dtype)
    outs = []
    seqs = ctx.seqs
    if ctx.decode_batch is None and ctx.num_leading_decodes >= 2:
        ctx.decode_batch = _build_decode_batch(seqs[: ctx.num_leading_decodes], bs, ctx.staging)
    if ctx.decode_batch is not None:
        # NOTE: decodes are batched (one gather, two matmuls for all of them); per-seq work
        # is only the two one-token writes.  Prefill chunks keep the per-seq path below.
        dec = ctx.decode_batch
        for s in seqs[: dec.count]:
            k_cache.write(_slice_new(k_all, s.start, 1), s.block_ids, s.context_len, bs)
            v_cache.write(_slice_new(v_all, s.start, 1), s.block_ids, s.context_len, bs)
        outs.append(_decode_attention(q_all[:, : dec.count, :], k_cache, v_cache, dec, num_kv, groups, scale))
        seqs = seqs[dec.count :]
    for s in seqs:
        a, n = s.start, s.num_new
        k_cache.write(_slice_new(k_all, a, n), s.block_ids, s.context_len, bs)
        v_cache.write(_slice_new(v_all, a, n), s.block_ids, s.context_len, bs)
        total = s.total_len
        if s.index is None:
            nb = -(-total // bs)
            s.index = ctx.staging.tensor(s.block_ids[:nb])
            if n > 1:
                # Query i sits at position context_len + i and sees keys 0..context_len + i.
                kpos = paddle.arange(total, dtype="int64").unsqueeze(0)
                qpos = paddle.arange(s.context_len, total, dtype="int64").unsqueeze(1)
                # Additive mask, built once per step and shared by every layer.
                s.mask = paddle.where(kpos > qpos, paddle.full([], float("-inf"), "float32"),
                                       paddle.zeros([], "float32"))
        k = _gather(k_cache, s.index, total)  # float32 [kvh, total, d]
        v = _gather(v_cache, s.index, total)
        # GQA without repeating K/V: the `groups` query heads of one KV head are stacked
        # along the row axis, [kvh, groups * n, d], and share one matmul with that head.
        q = _as_float32(q_all[:, a : a + n, :]).reshape([num_kv, groups * n, head_dim])
        # float32 scores and softmax whatever the model dtype: cheap at these sizes, and the
        # result does not depend on how the step's tokens were batched.
        scores = paddle.matmul(q, k, transpose_y=True) * scale  # [kvh, groups * n, total]
        if s.mask is not None:
            scores = (scores.reshape([num_kv, groups, n, total]) + s.mask).reshape([num_kv, groups * n, total])
        probs = F.softmax(scores, axis=-1)
        o = paddle.matmul(probs, v).reshape([num_heads, n, head_dim])
        if o.dtype != q_all.dtype:
            o = o.astype(q_all.dtype)
        outs.append(o.transpose([1, 0, 2]).reshape([n, num_heads * head_dim]))
    out = outs[0] if len(outs) == 1 else paddle.concat(outs, axis=0)
    return out.unsqueeze(0), None


def _build_decode_batch(seqs: Sequence[SeqSlice], bs: int, staging: Any) -> _DecodeBatch:
    import paddle

    nbs = [-(-s.total_len // bs) for s in seqs]
    width = max(nbs)
    idx: list[int] = []
    for s, nb in zip(seqs, nbs):
        idx.extend(s.block_ids[:nb])
        idx.extend([s.block_ids[0]] * (width - nb))  # padding: read, then masked out
    lens = staging.tensor([s.total_len for s in seqs], [-1, 1, 1])
    pos = paddle.arange(width * bs, dtype="int64").reshape([1, width, bs])
    mask = paddle.where(pos < lens, paddle.zeros([], "float32"), paddle.full([], float("-inf"), "float32"))
    return _DecodeBatch(len(seqs), width, staging.tensor(idx), mask.reshape([len(seqs), width, 1, 1, bs]))


def _decode_attention(q: Any, k_cache: _Lanes, v_cache: _Lanes, dec: _DecodeBatch, num_kv: int, groups: int,
                      scale: float) -> Any:
    """q [H, B, D] of B one-token seqs -> [B, H*D], over each seq's gathered blocks.

    NOTE: the gathered blocks stay in the cache layout ([B, blocks, kvh, bs, d]); scores are
    computed per block and the softmax runs over (block, position) together.  Transposing
    the gathered K/V into one sequence axis instead costs a strided copy of all of it per
    layer, which measured slower than the whole rest of the attention on CPU.
    """
    import paddle

    num_heads, b, d = q.shape
    out_dtype = q.dtype
    nb = dec.blocks_per_seq

    def gather(cache: _Lanes) -> Any:
        blocks = cache.blocks(dec.index)  # float32 [B*nb, kvh, bs, d]
        _, kvh, bs, _ = blocks.shape
        return blocks.reshape([b, nb, kvh, bs, d])  # a view: no copy

    k, v = gather(k_cache), gather(v_cache)
    qb = (_as_float32(q).transpose([1, 0, 2]) * scale).reshape([b, 1, num_kv, groups, d])
    scores = paddle.matmul(qb, k, transpose_y=True) + dec.mask  # [B, nb, kvh, groups, bs]
    m = paddle.max(scores, axis=[1, 4], keepdim=True)
    e = paddle.exp(scores - m)
    probs = e / paddle.sum(e, axis=[1, 4], keepdim=True)
    o = paddle.sum(paddle.matmul(probs, v), axis=1)  # [B, kvh, groups, d]
    if o.dtype != out_dtype:
        o = o.astype(out_dtype)
    return o.reshape([b, num_heads * d])


def _paddleformers_attention_interface() -> Any:
    from fastdeploy_kvcache.engine.dependency_notices import import_paddleformers

    import_paddleformers()
    from paddleformers.nn.attention.interface import AttentionInterface

    return AttentionInterface


def register_paged_attention(config: Any) -> None:
    """Register the function with paddleformers (once) and select it in ``config``."""
    select_attention(config, ATTN_IMPL_NAME, _paddleformers_attention_interface, paged_attention_forward)
