"""CUDA graphs of the transformers runner's decode-only steps (``--use-cudagraph``).

Why: on a GPU the eager decode step of transformers' Llama is bound by the host enqueueing
its kernels (about 2,000 a step for an 8B model, tens of microseconds of host time each),
not by the GPU.  A CUDA graph replays the whole forward pass with one launch.

What is captured: for each batch size of :func:`graph_batch_sizes`, one forward pass of that
many one-token sequences (the model, the paged decode attention with its fused K/V write,
``lm_head`` and the float32 cast) over *static* buffers: token ids, positions, sequence
lengths and block tables ``[B, W_max]`` with ``W_max`` the blocks of ``max_model_len``.  A
decode-only step of ``n`` sequences copies its inputs into the smallest batch size
``B >= n`` (rows ``n..B`` get length 0: the decode kernel neither reads nor writes anything
for them and outputs zeros), replays, and reads back its ``n`` rows of the static logits.

Capture happens once, when the engine starts and the KV pool exists (the graphs bake in the
cache tensors' addresses), largest batch first, all graphs sharing one memory pool (they are
replayed one at a time, on one stream, and each step's logits are copied out before the
next replay).  Each batch size is first run eagerly on a side stream (Triton compiles its
kernels there; CUDA forbids that inside a capture), with every length 0, so that nothing in
the cache changes.

With an FP8 cache the step's K/V quantization (torch ops) is captured with the rest, and the
per-layer scale caches' addresses are baked in beside the K/V caches'.

Everything about the step is fixed at capture: the decode kernel's context-split count
(``choose_num_splits`` of the batch size and ``W_max``), its partials workspace (kept alive
with the bucket's :class:`TorchStep`), and the step object the attention function reads from
the thread-local (the bucket's own, set while capturing).  Nothing host-side runs at replay.

Without capture (``capture=False``: the CPU tests) the same static buffers and the same
padded forward run eagerly instead of a replay: the padding, the copies into the buffers and
the read-back are checked on a machine without a GPU.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from fastdeploy_kvcache.engine.attention import step_context
from fastdeploy_kvcache.engine.transformers_runner.torch_attention import TorchStep

logger = logging.getLogger(__name__)

# Batch sizes captured below 32; above it, every 16th up to max_num_seqs (which is always one).
SMALL_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32)
LARGE_BATCH_STEP = 16


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes captured for ``max_num_seqs``, ascending: 1, 2, 4, 8, 16, 24, 32, then
    every 16 (48, 64, ...), all below ``max_num_seqs``, then ``max_num_seqs`` itself, so that
    every decode step the scheduler can form has a graph.  A step pads to the next size up:
    at most 2x the rows below 32 sequences, at most 15 extra rows above."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs: must be >= 1, got {max_num_seqs}")
    sizes = [b for b in SMALL_BATCH_SIZES if b < max_num_seqs]
    b = SMALL_BATCH_SIZES[-1] + LARGE_BATCH_STEP
    while b < max_num_seqs:
        sizes.append(b)
        b += LARGE_BATCH_STEP
    sizes.append(max_num_seqs)
    return sizes


@dataclass
class GraphBucket:
    """One captured batch size: its views of the static buffers, its step and its graph."""

    size: int
    input_ids: Any  # int64 [B]
    positions: Any  # int64 [B]
    step: TorchStep  # decode_table [B, W_max], decode_lens [B] (0 on padded rows)
    graph: Any = None  # torch.cuda.CUDAGraph; None without capture
    logits: Any = None  # float32 [B, vocab], written by each replay (with capture)


class DecodeGraphs:
    """Static buffers and (on CUDA) one captured graph per batch size; see the module docstring."""

    def __init__(self, model: Any, kv_caches: Any, block_size: int, max_num_seqs: int, max_model_len: int,
                 decode_kernel: Callable[..., Any], device: Any, capture: bool,
                 kv_quant: Optional[str] = None) -> None:
        import torch

        self.torch = torch
        self.model = model
        self.capture = capture
        self.width = -(-max_model_len // block_size)  # W_max: blocks of the longest sequence
        self.sizes = graph_batch_sizes(max_num_seqs)
        self.cache_ptr = int(kv_caches[0][0].data_ptr())  # the graphs hold these caches' addresses
        top = self.sizes[-1]
        # NOTE: allocated before any capture, outside the graph pool: the copies into them
        # happen on the compute stream before each replay.
        self._ints = torch.zeros((3, top), dtype=torch.int64, device=device)  # ids, positions, lens
        self._table = torch.zeros((top, self.width), dtype=torch.int64, device=device)
        # The decode kernel writes the decode rows' K/V itself: the slot indices are never read.
        self._slots = torch.zeros(top, dtype=torch.int64, device=device)
        self.buckets: dict[int, GraphBucket] = {}
        for b in self.sizes:
            step = TorchStep(kv_caches, block_size, self._slots[:b], self._slots[:b], b, kv_quant=kv_quant)
            step.decode_table = self._table[:b]
            step.decode_lens = self._ints[2, :b]
            step.decode_kernel = decode_kernel
            self.buckets[b] = GraphBucket(b, self._ints[0, :b], self._ints[1, :b], step)
        self.pool_bytes = 0
        self.capture_s = 0.0

    # ------------------------------------------------------------------ capture
    def forward(self, bucket: GraphBucket) -> Any:
        """The padded forward pass over the bucket's static buffers: float32 logits ``[B, vocab]``."""
        with step_context(bucket.step):
            out = self.model.model(input_ids=bucket.input_ids[None], position_ids=bucket.positions[None],
                                   use_cache=False)
        return self.model.lm_head(out.last_hidden_state[0]).float()

    def capture_all(self) -> None:
        """Warm up and capture every batch size, largest first, into one shared pool.

        Raises whatever the capture raises (a host sync inside the forward pass, an op CUDA
        cannot capture): the caller logs it and runs every step eagerly.
        """
        torch = self.torch
        t0 = time.perf_counter()
        self._ints.zero_()  # every length 0: the warm-up runs read and write no cache slot
        torch.cuda.synchronize()
        # Device memory the warm-ups and captures take (the graphs' pool, Triton's and cuBLAS's
        # workspaces), as the driver sees it: torch's own reserved figure can fall during a
        # capture, which frees cached blocks first.
        free_before = torch.cuda.mem_get_info()[0]
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        with torch.inference_mode():
            for b in reversed(self.sizes):
                bucket = self.buckets[b]
                # Warm-up off the capture: Triton compiles and caches its kernels, transformers
                # and the allocator settle (torch's CUDA graph docs: warm up on a side stream).
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    for _ in range(2):
                        self.forward(bucket)
                torch.cuda.current_stream().wait_stream(side)
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                # The warm-up's stream, for every capture: per-stream library state (BLAS
                # handles and workspaces) already exists there, and one stream for all
                # captures lets them share the pool (torch.cuda.graph's notes).
                # thread_local: the worker's copy threads may call CUDA meanwhile; only this
                # thread's unsafe calls (a host sync in the forward pass) end the capture.
                with torch.cuda.graph(graph, pool=pool, stream=side, capture_error_mode="thread_local"):
                    bucket.logits = self.forward(bucket)
                bucket.graph = graph
        torch.cuda.synchronize()
        self.pool_bytes = max(0, free_before - torch.cuda.mem_get_info()[0])
        self.capture_s = time.perf_counter() - t0

    def release(self) -> None:
        """Drop every graph (after a failed capture; the buffers stay for nothing)."""
        for bucket in self.buckets.values():
            bucket.graph = None
            bucket.logits = None
        self.buckets.clear()

    # ------------------------------------------------------------------ a step
    def bucket_for(self, n: int) -> Optional[GraphBucket]:
        """The smallest batch size ``>= n`` (None: larger than any)."""
        for b in self.sizes:
            if b >= n and b in self.buckets:
                return self.buckets[b]
        return None

    def load(self, bucket: GraphBucket, head: Any, table: Any) -> None:
        """Copy a step's inputs (device tensors) into the static buffers, on the compute stream:
        ``head`` int64 ``[3, B]`` (ids, positions, lengths; 0 on padded rows), ``table`` int64
        ``[n, width]`` (``width <= W_max``; columns past it and padded rows keep stale ids,
        never read: each row reads only the blocks of its own length)."""
        b = bucket.size
        self._ints[:, :b].copy_(head)
        n, width = table.shape
        self._table[:n, :width].copy_(table)

    def run(self, bucket: GraphBucket) -> Any:
        """Replay the bucket's graph (or, without capture, run its padded forward pass):
        float32 logits ``[B, vocab]``, valid until the next run of the same bucket."""
        if bucket.graph is None:
            with self.torch.inference_mode():
                return self.forward(bucket)
        bucket.graph.replay()
        return bucket.logits
