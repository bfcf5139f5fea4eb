"""Paged attention for transformers models, over the CacheController's torch block caches.

The same hook design as the paddleformers path (``engine/attention.py``): the function is
registered with transformers' ``AttentionInterface`` and selected through
``config._attn_implementation``, so ``LlamaForCausalLM`` itself runs unmodified.  Every
attention layer calls it with q, k and v after rotary embedding.  A third-party name makes
transformers build no causal mask: the masks here come from the :class:`TorchStep`, which
the runner builds once per forward pass with every index already on the device (one
host-to-device copy per step, none per layer), made visible to the function with
``attention.step_context`` as on the paddleformers path.

Per layer:

1. the compute stream waits on the GPU for this layer's host->device load
   (``LayerDoneCounter.wait_for_layer``: ``cudaStreamWaitEvent``, no host sync);
2. the step's new K and V go into their cache slots with one ``index_put_`` each (slots
   computed once per step);
3. attention:
   * the leading one-token seqs (decodes) as one batch: their blocks gathered (padded to the
     longest, masked past each seq's end) in the cache's own layout, two batched matmuls
     per block with a float32 softmax over all blocks;
   * a prompt chunk with nothing cached before it attends over its own fresh K and V with
     SDPA (``is_causal``: the flash kernel), without reading the cache at all;
   * a chunk after cached tokens (a prefix hit, or the next chunk of a long prompt) gathers
     its blocks and uses SDPA with a lower-right causal bias (flash or memory-efficient).

The cost of a read is the same whichever tier the blocks came from: by the time a layer
attends, a host hit's blocks are device blocks like any other.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

# The step travels to the attention function the same way on both paths (thread-local).
from fastdeploy_kvcache.engine.attention import current_context, select_attention, step_context  # noqa: F401

logger = logging.getLogger(__name__)

ATTN_IMPL_NAME = "fdkv_paged_torch"

@dataclass
class PrefillChunk:
    """A multi-token (or lone) seq of the step: rows [start, start + num_new) of the batch."""

    start: int
    num_new: int
    context_len: int  # tokens already in the cache before this chunk
    table: Any = None  # int64 device tensor of its blocks covering context_len + num_new (context_len > 0)


@dataclass
class TorchStep:
    """Everything the attention function needs for one forward pass (built by the runner)."""

    kv_caches: Sequence[Sequence[Any]]  # per layer: [key_cache, value_cache], [blocks, kv_heads, bs, d]
    block_size: int
    slot_blocks: Any  # int64 [T]: the block each token's K/V goes to
    slot_offsets: Any  # int64 [T]: its position inside the block
    num_decodes: int  # leading one-token seqs, attended as one batch
    decode_table: Any = None  # int64 [B, W]: their block tables, padded with their first block
    decode_mask: Any = None  # float32 [B, W, 1, 1, bs]: 0 inside each seq, -inf past its end
    prefills: list[PrefillChunk] = field(default_factory=list)
    layer_done: Optional[Any] = None  # the step's LayerDoneCounter, if it loads blocks
    layers_waited: int = 0
    # CUDA timing events around each load wait that was not already satisfied (None: not
    # timed, e.g. on the CPU); the runner reads them once the step has finished.
    wait_events: Optional[list[tuple[Any, Any]]] = None


def gather_blocks(cache: Any, table: Any) -> Any:
    """A seq's blocks as one sequence: ``[..., kv_heads, len(table) * bs, d]`` (a copy).

    ``table`` is ``[nb]`` or ``[B, nb]``; the result has the same leading dims.
    """
    blocks = cache[table]  # [..., nb, kvh, bs, d]
    nb, kvh, bs, d = blocks.shape[-4:]
    return blocks.transpose(-4, -3).reshape(*blocks.shape[:-4], kvh, nb * bs, d)


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


def paged_attention_forward(
    module: Any,
    query: Any,
    key: Any,
    value: Any,
    attention_mask: Any = None,
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    **kwargs: Any,
) -> tuple[Any, None]:
    """transformers attention interface: q [1, H, T, D], k/v [1, KVH, T, D] -> ([1, T, H, D], None)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention.bias import causal_lower_right

    step = current_context()
    layer = int(module.layer_idx)
    if step.layer_done is not None:
        # Before this layer's cache is read or written (a load may target the same blocks).
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
    k_cache, v_cache = step.kv_caches[layer][0], step.kv_caches[layer][1]
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv = int(key.shape[1])
    groups = num_heads // num_kv
    scale = scaling if scaling is not None else head_dim ** -0.5
    k_new = key[0].transpose(0, 1)  # [T, kvh, d]
    v_new = value[0].transpose(0, 1)
    if k_new.dtype != k_cache.dtype:
        k_new, v_new = k_new.to(k_cache.dtype), v_new.to(v_cache.dtype)
    # In place, one kernel each: k_cache[block[t], :, offset[t], :] = k_new[t].
    k_cache[step.slot_blocks, :, step.slot_offsets] = k_new
    v_cache[step.slot_blocks, :, step.slot_offsets] = v_new
    out = query.new_empty((num_tokens, num_heads, head_dim))
    b = step.num_decodes
    if b:
        # NOTE: the gathered blocks stay in the cache layout ([B, W, kvh, bs, d], one copy)
        # and are never upcast: scores are per block (one small matmul per block and KV head,
        # batched), the softmax runs over (block, position) together.  Transposing them into
        # one sequence axis or upcasting them costs extra passes over all of the batch's K/V
        # per layer, which measured slower than transformers' own decode.  Scores and the
        # output still come out in float32 (bmm_f32), as in a flash kernel.
        width = step.decode_table.shape[1]
        bs = k_cache.shape[2]
        rows = b * width * num_kv
        kb = k_cache[step.decode_table].view(rows, bs, head_dim)
        vb = v_cache[step.decode_table].view(rows, bs, head_dim)
        q = (query[0, :, :b, :].transpose(0, 1) * scale).reshape(b, 1, num_kv, groups, head_dim).to(kb.dtype)
        q = q.expand(b, width, num_kv, groups, head_dim).reshape(rows, groups, head_dim)
        scores = bmm_f32(q, kb.transpose(1, 2)).view(b, width, num_kv, groups, bs) + step.decode_mask
        scores = scores - scores.amax(dim=(1, 4), keepdim=True)
        probs = scores.exp_()
        probs = probs / probs.sum(dim=(1, 4), keepdim=True)
        o = bmm_f32(probs.to(vb.dtype).view(rows, groups, bs), vb).view(b, width, num_kv, groups, head_dim).sum(dim=1)
        out[:b] = o.reshape(b, num_heads, head_dim).to(out.dtype)
    for p in step.prefills:
        a, n = p.start, p.num_new
        q = query[:, :, a:a + n, :]
        if p.context_len == 0:
            k, v = key[:, :, a:a + n, :], value[:, :, a:a + n, :]
            o = F.scaled_dot_product_attention(q, k, v, is_causal=n > 1, scale=scale, enable_gqa=groups > 1)
        else:
            total = p.context_len + n
            k = gather_blocks(k_cache, p.table)[None, :, :total, :].to(q.dtype)
            v = gather_blocks(v_cache, p.table)[None, :, :total, :].to(q.dtype)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(n, total), scale=scale,
                                               enable_gqa=groups > 1)
        out[a:a + n] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _transformers_attention_interface() -> Any:
    from transformers import AttentionInterface

    return AttentionInterface


def register_paged_attention(config: Any) -> None:
    """Register the function with transformers (once) and select it in ``config``."""
    select_attention(config, ATTN_IMPL_NAME, _transformers_attention_interface, paged_attention_forward)
