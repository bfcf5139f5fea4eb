"""Paged attention for transformers models, over the CacheController's torch block caches.

The same hook design as the paddleformers path (``engine/paddleformers_runner/attention.py``;
both share ``engine/attention.py``): the function is registered with transformers'
``AttentionInterface`` and selected through ``config._attn_implementation``, so
``LlamaForCausalLM`` itself runs unmodified.  Every
attention layer calls it with q, k and v after rotary embedding.  A third-party name makes
transformers build no causal mask: the masks here come from the :class:`TorchStep`, which
the runner builds once per forward pass with every index already on the device (one
host-to-device copy per step, none per layer), made visible to the function with
``attention.step_context`` as on the paddleformers path.

Per layer:

1. the compute stream waits on the GPU for this layer's host->device load
   (``LayerDoneCounter.wait_for_layer``: ``cudaStreamWaitEvent``, no host sync);
2. the step's new K and V go into their cache slots with one ``index_put_`` each (slots
   computed once per step), except the decode rows' when the Triton decode kernel runs: it
   writes those itself;
3. attention:
   * the leading one-token seqs (decodes) as one batch.  On CUDA with Triton: the paged
     decode kernel of ``engine/transformers_runner/triton_paged_attention.py``, which reads each seq's blocks in
     place through its block table (online float32 softmax, GQA, the context split over
     several programs at small batches).  Elsewhere (the CPU, or no Triton) the torch
     fallback :func:`decode_attention_torch`: the blocks gathered (padded to the longest,
     masked past each seq's end) in the cache's own layout, two batched matmuls per block
     with a float32 softmax over all blocks;
   * a prompt chunk with nothing cached before it attends over its own fresh K and V with
     SDPA (``is_causal``: the flash kernel), without reading the cache at all;
   * a chunk after cached tokens (a prefix hit, or the next chunk of a long prompt): a short
     one (up to ``PAGED_PREFILL_MAX_TOKENS``) on CUDA with Triton through the paged prefill
     kernel, reading its blocks in place; otherwise (:func:`prefill_attention_torch`) its
     blocks gathered and SDPA with a lower-right causal bias (flash or memory-efficient).

The views of the step's rows that these read (the rows to write, the decode batch's, each
chunk's) are a :class:`StepRows` (:func:`step_rows`); the eager hook builds one per layer
call, the piecewise graphs once per step (every layer's q, k, v and output are the same
static buffers there), so a layer between two pieces dispatches only the work above.

The cost of a read is the same whichever tier the blocks came from: by the time a layer
attends, a host hit's blocks are device blocks like any other.

With an 8-bit cache (``TorchStep.kv_quant``: ``block_wise_fp8`` or ``block_wise_int8``;
each layer's caches ``[key, value, key_scale,
value_scale]``, ``engine/transformers_runner/fp8_kv.py``) the
step's K and V are quantized once per layer (one scale per token and KV head) before they
are written; every read dequantizes in place: the per-token key scale multiplies the scores,
the value scale the probabilities, and the products run over the E4M3 (or int8) values
converted (exactly) to the query's dtype.  A chunk with nothing cached before it attends over its own
K/V as the cache holds them (quantized and back), so a recomputed prefix and a reused one
feed the attention the same values.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

# The step travels to the attention function the same way on both paths (thread-local).
from fastdeploy_kvcache.engine.attention import current_context, select_attention, step_context  # noqa: F401
from fastdeploy_kvcache.config import BLOCK_WISE_FP8, BLOCK_WISE_INT8
from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import dequantize_8bit, quantize_kv, values_8bit

logger = logging.getLogger(__name__)

ATTN_IMPL_NAME = "fdkv_paged_torch"

@dataclass
class PrefillChunk:
    """A multi-token (or lone) seq of the step: rows [start, start + num_new) of the batch."""

    start: int
    num_new: int
    context_len: int  # tokens already in the cache before this chunk
    table: Any = None  # int64 device tensor of its blocks covering context_len + num_new (context_len > 0)
    # With context before it: triton_paged_attention.paged_prefill_attention, reading the
    # blocks in place (a short chunk on CUDA with Triton); None: gather + SDPA.
    kernel: Optional[Callable[..., Any]] = None


@dataclass
class TorchStep:
    """Everything the attention function needs for one forward pass (built by the runner)."""

    # per layer: [key_cache, value_cache], [blocks, kv_heads, bs, d]; with fp8, uint8 caches
    # followed by their float32 scales [key_scale, value_scale], [blocks, kv_heads, bs]
    kv_caches: Sequence[Sequence[Any]]
    block_size: int
    slot_blocks: Any  # int64 [T]: the block each token's K/V goes to
    slot_offsets: Any  # int64 [T]: its position inside the block
    num_decodes: int  # leading one-token seqs, attended as one batch
    decode_table: Any = None  # int64 [B, W]: their block tables, padded with their first block
    # The decode batch's attention: a kernel (triton_paged_attention.paged_decode_attention)
    # reading decode_lens (int64 [B]: each seq's length with its new token), or, with no
    # kernel, the torch fallback reading decode_mask (float32 [B, W, 1, 1, bs]: 0 inside each
    # seq, -inf past its end).
    decode_kernel: Optional[Callable[..., Any]] = None
    # The same kernel prepared once for every layer of the step (its checks, grid and strides):
    # triton_paged_attention.paged_decode_launcher, or None (each layer calls decode_kernel).
    decode_launcher: Optional[Callable[..., Any]] = None
    decode_lens: Any = None
    decode_mask: Any = None
    decode_workspace: dict = field(default_factory=dict)  # the kernel's partials, shared by all layers
    prefills: list[PrefillChunk] = field(default_factory=list)
    layer_done: Optional[Any] = None  # the step's LayerDoneCounter, if it loads blocks
    layers_waited: int = 0
    # CUDA timing events around each load wait that was not already satisfied (None: not
    # timed, e.g. on the CPU); the runner reads them once the step has finished.
    wait_events: Optional[list[tuple[Any, Any]]] = None
    # 8-bit caches (uint8 bytes + float32 scales, fp8_kv.py): what the bytes are
    # (block_wise_fp8: E4M3, block_wise_int8); None: caches in a float dtype.
    kv_quant: Optional[str] = None

    @property
    def fp8(self) -> bool:
        """The caches are 8-bit (either encoding)."""
        return self.kv_quant is not None


def gather_blocks(cache: Any, table: Any) -> Any:
    """A seq's blocks as one sequence: ``[..., kv_heads, len(table) * bs, d]`` (a copy).

    ``table`` is ``[nb]`` or ``[B, nb]``; the result has the same leading dims.
    """
    blocks = cache[table]  # [..., nb, kvh, bs, d]
    nb, kvh, bs, d = blocks.shape[-4:]
    return blocks.transpose(-4, -3).reshape(*blocks.shape[:-4], kvh, nb * bs, d)


def gather_scales(scales: Any, table: Any) -> Any:
    """A seq's per-token FP8 scales as one sequence: ``[nb]`` table -> ``[kv_heads, nb * bs]``."""
    blocks = scales[table]  # [nb, kvh, bs]
    nb, kvh, bs = blocks.shape
    return blocks.transpose(0, 1).reshape(kvh, nb * bs)


_bmm_out_dtype: Optional[bool] = None  # whether torch.bmm takes out_dtype here (CUDA, torch >= 2.8)


def bmm_f32(a: Any, b: Any) -> Any:
    """``a @ b`` (batched) with a float32 result: bf16/fp16 inputs accumulate and come out in
    float32 without an upcast copy of the inputs where torch can (``bmm(..., out_dtype)``)."""
    import torch

    global _bmm_out_dtype
    if a.dtype == torch.float32:
        return torch.bmm(a, b)
    if a.is_cuda and _bmm_out_dtype is not False:
        try:
            out = torch.bmm(a, b, torch.float32)
            _bmm_out_dtype = True
            return out
        except (TypeError, RuntimeError):
            _bmm_out_dtype = False
            logger.info("torch.bmm has no out_dtype here: the decode attention upcasts its inputs")
    return torch.bmm(a.float(), b.float())


def decode_mask(lens: Any, width: int, block_size: int, positions: Any) -> Any:
    """float32 ``[B, W, 1, 1, bs]``: 0 at each decode seq's positions below ``lens[b]``, -inf
    past them (``positions``: ``arange(>= W * bs)`` on the device)."""
    import torch

    keep = positions[: width * block_size][None, :] < lens[:, None]
    zero = torch.zeros((), dtype=torch.float32, device=lens.device)
    return torch.where(keep, zero, float("-inf")).view(lens.shape[0], width, 1, 1, block_size)


def decode_attention_torch(q: Any, k_cache: Any, v_cache: Any, table: Any, mask: Any, scale: float,
                           k_scale: Any = None, v_scale: Any = None, kv_quant: str = BLOCK_WISE_FP8) -> Any:
    """One query token per seq over its blocks, in torch ops: q ``[B, H, D]`` -> float32 ``[B, H, D]``.

    The fallback of the Triton kernel (CPU, or no Triton): ``table`` ``[B, W]`` padded with
    any block, ``mask`` from :func:`decode_mask`.  ``k_scale``, ``v_scale``: the 8-bit caches'
    scales (uint8 ``k_cache`` / ``v_cache`` of ``kv_quant``); None for caches in a float dtype.
    """
    # NOTE: the gathered blocks stay in the cache layout ([B, W, kvh, bs, d], one copy) and
    # are never upcast: scores are per block (one small matmul per block and KV head,
    # batched), the softmax runs over (block, position) together.  Transposing them into one
    # sequence axis or upcasting them costs extra passes over all of the batch's K/V per
    # layer.  Scores and the output still come out in float32 (bmm_f32), as in a flash kernel.
    b, num_heads, head_dim = q.shape
    width = table.shape[1]
    num_kv, bs = k_cache.shape[1], k_cache.shape[2]
    groups = num_heads // num_kv
    rows = b * width * num_kv
    kb = k_cache[table].view(rows, bs, head_dim)
    vb = v_cache[table].view(rows, bs, head_dim)
    if k_scale is not None:
        # Per-token scales factor out of each score and each probability: the products run
        # over the unscaled E4M3 / int8 values (exact in the query's dtype).
        kb, vb = values_8bit(kb, q.dtype, kv_quant), values_8bit(vb, q.dtype, kv_quant)
    q = (q * scale).reshape(b, 1, num_kv, groups, head_dim).to(kb.dtype)
    q = q.expand(b, width, num_kv, groups, head_dim).reshape(rows, groups, head_dim)
    scores = bmm_f32(q, kb.transpose(1, 2)).view(b, width, num_kv, groups, bs)
    if k_scale is not None:
        scores = scores * k_scale[table].view(b, width, num_kv, 1, bs)
    scores = scores + mask
    scores = scores - scores.amax(dim=(1, 4), keepdim=True)
    probs = scores.exp_()
    probs = probs / probs.sum(dim=(1, 4), keepdim=True)
    if v_scale is not None:
        probs = probs * v_scale[table].view(b, width, num_kv, 1, bs)
    o = bmm_f32(probs.to(vb.dtype).view(rows, groups, bs), vb).view(b, width, num_kv, groups, head_dim).sum(dim=1)
    return o.reshape(b, num_heads, head_dim)


def prefill_attention_torch(q: Any, k_cache: Any, v_cache: Any, table: Any, context_len: int, scale: float,
                            k_scale: Any = None, v_scale: Any = None, kv_quant: str = BLOCK_WISE_FP8) -> Any:
    """A chunk of ``n`` tokens after ``context_len`` cached ones: q ``[1, H, n, D]`` -> ``[1, H, n, D]``.

    Its blocks gathered (a copy; 8-bit blocks of ``kv_quant`` dequantized with ``k_scale`` / ``v_scale`` into
    the query's dtype), then SDPA with a lower-right causal mask (flash or
    memory-efficient); the fallback of the Triton kernel, and the path of long chunks.
    """
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    n = q.shape[2]
    total = context_len + n
    groups = q.shape[1] // k_cache.shape[1]
    k, v = gather_blocks(k_cache, table)[:, :total], gather_blocks(v_cache, table)[:, :total]
    if k_scale is not None:
        k = dequantize_8bit(k, gather_scales(k_scale, table)[:, :total], kv_quant)
        v = dequantize_8bit(v, gather_scales(v_scale, table)[:, :total], kv_quant)
    k, v = k[None].to(q.dtype), v[None].to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, total), scale=scale,
                                          enable_gqa=groups > 1)


@dataclass
class ChunkRows:
    """One prompt chunk's views of the step's q/k/v/output rows (see :class:`StepRows`)."""

    chunk: PrefillChunk
    q: Any  # [1, H, n, D]: SDPA's layout
    k: Any  # [1, KVH, n, D] (its own fresh K/V: context_len == 0)
    v: Any
    q_rows: Any  # [n, H, D]: the kernel's layout
    out_rows: Any  # [n, H, D]
    out4: Any  # [1, H, n, D]: out_rows in SDPA's layout (a view), where its result is copied


@dataclass
class StepRows:
    """The views of one step's q, k, v and output rows that every layer's attention reads.

    Why: each view is an op the host dispatches (Python, the dispatcher: microseconds on a
    GPU), and a layer needs about thirty of them (the rows its cache write takes, the decode
    batch's, each chunk's, in two layouts).  Through the piecewise graphs every layer's q, k,
    v and output live in the same static buffers, so the views are built once per step
    (:func:`step_rows`) and each layer dispatches only its real work (:func:`attend_layer`):
    the cache writes, the kernels, a chunk's SDPA and the copy of its result.
    """

    q: Any  # [T, H, D]
    k: Any  # [T, KVH, D]
    v: Any
    out: Any  # [T, H, D]
    # Rows from write_from on go into the caches with index_put_ (the decode kernel writes the
    # rows before them): their slots, and the rows (None when they need a cast: per layer).
    write_from: int
    write_blocks: Any = None
    write_offsets: Any = None
    k_write: Any = None
    v_write: Any = None
    cast: Any = None  # the caches' dtype where it differs from the rows' (None: the same)
    kv_quant: Optional[str] = None  # 8-bit caches: the rows are quantized per layer (no k_write / dec_k / dec_launch)
    groups: int = 1  # query heads per KV head
    dec_q: Any = None  # [B, H, D]
    dec_k: Any = None  # [B, KVH, D] (None when cast: taken per layer)
    dec_v: Any = None
    dec_out: Any = None  # [B, H, D]
    dec_launch: Optional[Callable[[Any, Any, float], None]] = None  # from step.decode_launcher
    chunks: list[ChunkRows] = field(default_factory=list)


def step_rows(step: TorchStep, q: Any, k: Any, v: Any, out: Any) -> StepRows:
    """The views of ``q`` ``[T, H, D]``, ``k``/``v`` ``[T, KVH, D]`` and ``out`` ``[T, H, D]``
    that :func:`attend_layer` reads for ``step`` (any layer: built once per step)."""
    num_tokens = int(q.shape[0])
    cache_dtype = step.kv_caches[0][0].dtype
    cast = cache_dtype if k.dtype != cache_dtype and not step.fp8 else None
    direct = cast is None and not step.fp8  # the rows go into the caches as they are
    b = step.num_decodes
    # The decode kernel writes the decode rows' K and V itself (one launch fewer per cache);
    # the other rows go to their slots with one index_put_ each per layer.
    w = b if step.decode_kernel is not None else 0
    rows = StepRows(q, k, v, out, w)
    if w < num_tokens:
        rows.write_blocks = step.slot_blocks[w:] if w else step.slot_blocks
        rows.write_offsets = step.slot_offsets[w:] if w else step.slot_offsets
        if direct:
            rows.k_write = k[w:] if w else k
            rows.v_write = v[w:] if w else v
    rows.cast = cast
    rows.kv_quant = step.kv_quant
    rows.groups = int(q.shape[1]) // int(k.shape[1])
    if b:
        rows.dec_q = q[:b]
        rows.dec_out = out[:b]
        if direct:
            rows.dec_k, rows.dec_v = k[:b], v[:b]
            if step.decode_launcher is not None:
                first = step.kv_caches[0]  # every layer's caches have its shape and dtype
                rows.dec_launch = step.decode_launcher(rows.dec_q, first[0], first[1], step.decode_table, step.decode_lens,
                                                       rows.dec_out, workspace=step.decode_workspace,
                                                       k_new=rows.dec_k, v_new=rows.dec_v)
    for p in step.prefills:
        a, n = p.start, p.num_new
        q_rows, out_rows = q[a:a + n], out[a:a + n]
        kv = (k[a:a + n].transpose(0, 1)[None], v[a:a + n].transpose(0, 1)[None]) if p.context_len == 0 else (None, None)
        rows.chunks.append(ChunkRows(p, q_rows.transpose(0, 1)[None], kv[0], kv[1], q_rows, out_rows,
                                     out_rows.transpose(0, 1)[None]))
    return rows


def _wait_for_layer(step: TorchStep, layer: int) -> None:
    """Before ``layer``'s cache is read or written (a load may target the same blocks)."""
    import torch

    if step.wait_events is not None and not step.layer_done.is_layer_done(layer):
        before = torch.cuda.Event(enable_timing=True)
        before.record()
        step.layer_done.wait_for_layer(layer)
        after = torch.cuda.Event(enable_timing=True)
        after.record()
        step.wait_events.append((before, after))
    else:
        step.layer_done.wait_for_layer(layer)
    step.layers_waited += 1


def attend_layer(step: TorchStep, rows: StepRows, layer: int, scale: float) -> None:
    """Layer ``layer``'s paged attention of the step into ``rows.out``: its load wait, its new
    K/V into the cache, the decode batch and every chunk (see the module docstring)."""
    import torch.nn.functional as F

    if step.layer_done is not None:
        _wait_for_layer(step, layer)
    caches = step.kv_caches[layer]
    k_cache, v_cache = caches[0], caches[1]
    k_write, v_write, dec_k, dec_v = rows.k_write, rows.v_write, rows.dec_k, rows.dec_v
    k_scale = v_scale = None
    scales: dict[str, Any] = {}  # the decode kernel's FP8 keywords
    fresh: Optional[tuple[Any, Any]] = None  # FP8: the rows' K/V as the cache holds them, [T, KVH, D]
    if rows.kv_quant is not None:
        k_scale, v_scale = caches[2], caches[3]
        k_new, ks_new, v_new, vs_new = quantize_kv(rows.k, rows.v, rows.kv_quant)
        w, b = rows.write_from, step.num_decodes
        k_write, v_write = k_new[w:], v_new[w:]
        dec_k, dec_v = k_new[:b], v_new[:b]
        scales = dict(k_scale=k_scale, v_scale=v_scale, k_new_scale=ks_new[:b], v_new_scale=vs_new[:b],
                      int8=rows.kv_quant == BLOCK_WISE_INT8)
        if rows.write_blocks is not None:
            k_scale[rows.write_blocks, :, rows.write_offsets] = ks_new[w:]
            v_scale[rows.write_blocks, :, rows.write_offsets] = vs_new[w:]
        if any(c.chunk.context_len == 0 for c in rows.chunks):
            fresh = (dequantize_8bit(k_new, ks_new, rows.kv_quant, rows.k.dtype),
                     dequantize_8bit(v_new, vs_new, rows.kv_quant, rows.v.dtype))
    elif rows.cast is not None:
        k_new, v_new = rows.k.to(rows.cast), rows.v.to(rows.cast)
        w, b = rows.write_from, step.num_decodes
        k_write, v_write = k_new[w:], v_new[w:]
        dec_k, dec_v = k_new[:b], v_new[:b]
    if rows.write_blocks is not None:
        # k_cache[block[t], :, offset[t], :] = k_new[t], in place, one kernel each.
        k_cache[rows.write_blocks, :, rows.write_offsets] = k_write
        v_cache[rows.write_blocks, :, rows.write_offsets] = v_write
    if rows.dec_q is not None:
        if rows.dec_launch is not None:
            rows.dec_launch(k_cache, v_cache, scale)
        elif step.decode_kernel is not None:
            step.decode_kernel(rows.dec_q, k_cache, v_cache, step.decode_table, step.decode_lens, rows.dec_out, scale,
                               workspace=step.decode_workspace, k_new=dec_k, v_new=dec_v, **scales)
        else:
            rows.dec_out.copy_(decode_attention_torch(rows.dec_q, k_cache, v_cache, step.decode_table,
                                                      step.decode_mask, scale, k_scale, v_scale, rows.kv_quant))
    groups = rows.groups
    for c in rows.chunks:
        p = c.chunk
        if p.context_len == 0:
            k, v = c.k, c.v
            if fresh is not None:
                a, n = p.start, p.num_new
                k, v = fresh[0][a:a + n].transpose(0, 1)[None], fresh[1][a:a + n].transpose(0, 1)[None]
            o = F.scaled_dot_product_attention(c.q, k, v, is_causal=p.num_new > 1, scale=scale,
                                               enable_gqa=groups > 1)
        elif p.kernel is not None:
            p.kernel(c.q_rows, k_cache, v_cache, p.table, p.context_len, c.out_rows, scale,
                     k_scale=k_scale, v_scale=v_scale, int8=rows.kv_quant == BLOCK_WISE_INT8)
            continue
        else:
            o = prefill_attention_torch(c.q, k_cache, v_cache, p.table, p.context_len, scale, k_scale, v_scale,
                                        rows.kv_quant)
        c.out4.copy_(o)


def paged_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any = None,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    out: Any = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers attention interface: q [1, H, T, D], k/v [1, KVH, T, D] -> ([1, T, H, D], None).

    ``out``: where to write the result, ``[T, H, D]``; None allocates it."""
    step = current_context()
    _, num_heads, num_tokens, head_dim = query.shape
    scale = scaling if scaling is not None else head_dim ** -0.5
    if out is None:
        out = query.new_empty((num_tokens, num_heads, head_dim))
    rows = step_rows(step, query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), out)
    attend_layer(step, rows, int(module.layer_idx), scale)
    return out.unsqueeze(0), None


def _transformers_attention_interface() -> Any:
    from transformers import AttentionInterface

    return AttentionInterface


def register_paged_attention(config: Any) -> None:
    """Register the function with transformers (once) and select it in ``config``."""
    select_attention(config, ATTN_IMPL_NAME, _transformers_attention_interface, paged_attention_forward)
