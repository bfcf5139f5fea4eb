"""Piecewise CUDA graphs for the steps the decode graphs cannot take (``--use-cudagraph`` with
fused layers).

Why: a step that holds a prompt chunk has a shape the decode graphs do not (any mix of
decodes and chunks, each chunk with its own context), so it used to run eagerly: about
2,000 kernel launches for an 8B model, tens of microseconds of host time each, for 60-70%
of such a step's time on an H200.  Everything in a layer except the attention depends only
on the step's token count, not on how the tokens split into sequences; only the attention
reads the block tables and the chunks' contexts.

What is captured: for each token count of :func:`graph_token_sizes`, the model cut at every
attention into ``num_layers + 1`` pieces over *static* buffers (token ids, positions, the
residual stream, q/k/v, the attention's output, the rotary cos/sin):

* piece 0: the embedding, the rotary cos/sin and layer 0's work before attention
  (``torch_fused.pre_attention``: RMSNorm, the merged q/k/v GEMM, rope);
* piece ``i`` (1 .. L-1): layer ``i-1``'s work after attention (``torch_fused.post_attention``)
  and layer ``i``'s before it;
* piece L: the last layer's work after attention and the final RMSNorm.

A step of ``T`` tokens copies its ids and positions into the buffers, replays the pieces of
the smallest size ``>= T`` and runs each layer's paged attention eagerly in between, over
the step's real ``T`` rows (the same attention, ``torch_attention.attend_layer``, and the
same :class:`TorchStep` as the eager path, so per-layer load waits, the K/V writes and every
chunk's context work as there).  Every layer's q, k, v and output are the same buffers, so
the views the attention reads are built once per step (the caller's ``bind``), and a layer
dispatches only its own work between two replays: on a GPU each op there is host time,
times the layers.  Rows past ``T`` carry stale values through the row-wise pieces; the attention
never writes or reads them, and the logits are taken from the real rows only
(``lm_head`` eagerly, on the sampled rows).

One step's launches fall from about 2,000 to ``L + 1`` graph replays plus the attention's
few kernels per layer.  The cost is padding: a step computes the pieces for up to
:data:`FINE_STEP` - 1 extra rows (below :data:`FINE_LIMIT` tokens), :data:`COARSE_STEP` - 1
above it.  Steps of more than :data:`MAX_CAPTURED_TOKENS` tokens run eagerly.

Capture, as for the decode graphs: once, when the KV pool exists (the attention is not in
the graphs, so the caches' addresses are not), largest size first, into one memory pool;
each size warmed up first on the side stream (inductor's kernels specialise there).
Without capture (``capture=False``: the CPU tests) the same pieces run as plain calls over
the same buffers, so the cutting, padding and read-back are checked without a GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fastdeploy_kvcache.engine.transformers_runner.torch_fused import post_attention, pre_attention

logger = logging.getLogger(__name__)

# Token counts captured: powers of two up to FINE_STEP, then every FINE_STEP up to FINE_LIMIT,
# then every COARSE_STEP, then the largest step itself.
FINE_STEP = 128
FINE_LIMIT = 4096
COARSE_STEP = 512
# The largest step captured, whatever --max-num-batched-tokens says: each size's warm-up is a
# forward pass of that many tokens, so capturing to 64k tokens would add minutes to the start,
# and a step that large is compute-bound (its launches are a few percent of it) anyway.
MAX_CAPTURED_TOKENS = 8192


def graph_token_sizes(max_tokens: int) -> list[int]:
    """The token counts captured for steps of up to ``max_tokens`` tokens, ascending: 16, 32,
    64, then every :data:`FINE_STEP` to :data:`FINE_LIMIT`, then every :data:`COARSE_STEP`,
    all below ``max_tokens``, then ``max_tokens`` itself; ``max_tokens`` is first capped at
    :data:`MAX_CAPTURED_TOKENS` (larger steps run eagerly)."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens: must be >= 1, got {max_tokens}")
    max_tokens = min(max_tokens, MAX_CAPTURED_TOKENS)
    sizes = [t for t in (16, 32, 64) if t < max_tokens]
    t = FINE_STEP
    while t < max_tokens:
        sizes.append(t)
        t += FINE_STEP if t < FINE_LIMIT else COARSE_STEP
    sizes.append(max_tokens)
    return sizes


def piecewise_reserve_bytes(max_tokens: int, config: Any, dtype_bytes: int = 2) -> int:
    """Device memory of the static buffers and the pool's largest piece, estimated before
    capture: per token, the residual stream twice, q, k, v and the attention's output, the
    merged q/k/v, and the MLP's gate/up and product (its widest piece)."""
    max_tokens = min(int(max_tokens), MAX_CAPTURED_TOKENS)
    hidden = int(config.hidden_size)
    head_dim = int(getattr(config, "head_dim", None) or hidden // config.num_attention_heads)
    nq = int(config.num_attention_heads) * head_dim
    nkv = int(config.num_key_value_heads) * head_dim
    inter = int(config.intermediate_size)
    per_token = 2 * hidden + 2 * nq + 2 * nkv + (nq + 2 * nkv) + 3 * inter + 2 * head_dim
    return int(max_tokens) * per_token * dtype_bytes


@dataclass
class TokenBucket:
    """One captured token count: its graphs, one per piece (empty without capture)."""

    size: int
    graphs: list[Any] = field(default_factory=list)


class PiecewiseGraphs:
    """Static buffers and (on CUDA) the pieces' graphs per token count; see the module docstring."""

    def __init__(self, model: Any, max_tokens: int, device: Any, capture: bool) -> None:
        import torch

        layers = list(model.model.layers)
        for layer in layers:
            if getattr(layer, "fdkv_w_qkv", None) is None:
                raise ValueError("piecewise graphs need every decoder layer fused (--fused-layers)")
        self.torch = torch
        self.model = model
        self.layers = layers
        self.capture = capture
        self.sizes = graph_token_sizes(max_tokens)
        cfg = model.config
        attn = layers[0].self_attn
        d = int(attn.head_dim)
        nq = int(attn.q_proj.weight.shape[0]) // d
        nkv = int(attn.k_proj.weight.shape[0]) // d
        dtype = model.model.embed_tokens.weight.dtype
        top = self.sizes[-1]
        # NOTE: allocated before any capture, outside the graphs' pool: the step's copies into
        # them and the attention's reads and writes happen between replays.
        self._ids = torch.zeros(top, dtype=torch.int64, device=device)
        self._pos = torch.zeros(top, dtype=torch.int64, device=device)
        self._hidden = torch.zeros((1, top, int(cfg.hidden_size)), dtype=dtype, device=device)
        self._q = torch.zeros((1, top, nq, d), dtype=dtype, device=device)
        self._k = torch.zeros((1, top, nkv, d), dtype=dtype, device=device)
        self._v = torch.zeros((1, top, nkv, d), dtype=dtype, device=device)
        self._attn = torch.zeros((1, top, nq * d), dtype=dtype, device=device)
        self._cos = torch.zeros((1, top, d), dtype=dtype, device=device)
        self._sin = torch.zeros((1, top, d), dtype=dtype, device=device)
        self.buckets: dict[int, TokenBucket] = {t: TokenBucket(t) for t in self.sizes}
        self.pool_bytes = 0
        self.capture_s = 0.0
        # Each layer's (layer_idx, scale) for its attention between the pieces.
        self._attention_args = [(int(layer.self_attn.layer_idx), float(layer.self_attn.scaling)) for layer in layers]
        self._rows_for = -1
        self.last_pieces_s = 0.0  # the last run's host seconds in its pieces (replays, or calls)
        self._rows_views: tuple[Any, ...] = ()

    @property
    def num_pieces(self) -> int:
        return len(self.layers) + 1

    # ------------------------------------------------------------------ the pieces
    def piece(self, index: int, size: int) -> None:
        """Piece ``index`` over the first ``size`` rows of the static buffers."""
        mm = self.model.model
        t = size
        if index == 0:
            x = mm.embed_tokens(self._ids[:t])[None]
            cos, sin = mm.rotary_emb(x, position_ids=self._pos[:t][None])
            self._cos[:, :t].copy_(cos)
            self._sin[:, :t].copy_(sin)
        else:
            x = post_attention(self.layers[index - 1], self._attn[:, :t], self._hidden[:, :t])
        if index < len(self.layers):
            q, k, v = pre_attention(self.layers[index], x, self._cos[:, :t], self._sin[:, :t])
            self._q[:, :t].copy_(q)
            self._k[:, :t].copy_(k)
            self._v[:, :t].copy_(v)
        else:
            x = mm.norm(x)
        self._hidden[:, :t].copy_(x)

    def capture_all(self) -> None:
        """Warm up and capture every token count's pieces, largest first, into one pool.

        Raises whatever the capture raises; the caller logs it and runs such steps eagerly.
        """
        torch = self.torch
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        with torch.inference_mode():
            for size in reversed(self.sizes):
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    # Twice for the first (largest) size, where inductor and cuBLAS settle;
                    # once for each smaller one (the warm-ups are most of the capture's time).
                    for _ in range(2 if size == self.sizes[-1] else 1):
                        for i in range(self.num_pieces):
                            self.piece(i, size)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graphs = []
                for i in range(self.num_pieces):
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=side, capture_error_mode="thread_local"):
                        self.piece(i, size)
                    graphs.append(g)
                self.buckets[size].graphs = graphs
        torch.cuda.synchronize()
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        self.capture_s = time.perf_counter() - t0

    def release(self) -> None:
        """Drop every graph (after a failed capture)."""
        for bucket in self.buckets.values():
            bucket.graphs = []
        self.buckets.clear()

    # ------------------------------------------------------------------ a step
    def bucket_for(self, num_tokens: int) -> Optional[TokenBucket]:
        """The smallest token count ``>= num_tokens`` (None: larger than any)."""
        for t in self.sizes:
            if t >= num_tokens and t in self.buckets:
                return self.buckets[t]
        return None

    def _rows(self, t: int) -> tuple[Any, ...]:
        """The first ``t`` rows of the static buffers: ids, positions, q ``[t, H, D]``, k and v
        ``[t, KVH, D]``, the attention's output ``[t, H, D]`` and the final hidden states
        (views, kept for the last ``t``: a run of steps of one size dispatches none)."""
        if self._rows_for != t:
            heads = self._q.shape[2]
            self._rows_views = (self._ids[:t], self._pos[:t], self._q[0, :t], self._k[0, :t], self._v[0, :t],
                                self._attn[0, :t].view(t, heads, -1), self._hidden[0, :t])
            self._rows_for = t
        return self._rows_views

    def run(self, bucket: TokenBucket, input_ids: Any, positions: Any,
            bind: Callable[[Any, Any, Any, Any], Callable[[int, float], None]]) -> Any:
        """One step of ``T = len(input_ids)`` tokens: the pieces of ``bucket`` replayed (or
        called, without capture) around each layer's attention.

        ``bind(q, k, v, out)`` is called once per step with the step's rows of the static
        buffers (q ``[T, H, D]``, k/v ``[T, KVH, D]``, ``out`` ``[T, H, D]``, the buffer the
        next piece reads; the same for every layer) and returns ``attend(layer_idx, scale)``,
        called between the pieces for each layer: it writes the layer's attention into
        ``out``.  Returns the final hidden states ``[T, hidden]`` (a view of the static
        buffer, valid until the next step)."""
        t = int(input_ids.shape[0])
        ids, pos, q, k, v, out, hidden = self._rows(t)
        ids.copy_(input_ids)
        pos.copy_(positions)
        attend = bind(q, k, v, out)
        size = bucket.size
        graphs = bucket.graphs
        clock = time.perf_counter
        pieces_s = 0.0
        for i, (layer_idx, scale) in enumerate(self._attention_args):
            t0 = clock()
            if graphs:
                graphs[i].replay()
            else:
                self.piece(i, size)
            pieces_s += clock() - t0
            attend(layer_idx, scale)
        t0 = clock()
        if graphs:
            graphs[-1].replay()
        else:
            self.piece(len(self._attention_args), size)
        self.last_pieces_s = pieces_s + clock() - t0
        return hidden
