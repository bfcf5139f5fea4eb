"""Measures a GPU's memory for ``--gpu-memory-utilization`` (``engine/kv_sizing.py`` does the arithmetic).

Runs on the transformers runner once the weights are loaded and before the KV pool exists:
one worst-case step (``--max-num-batched-tokens`` prompt tokens from no context, split over
up to ``--max-num-seqs`` sequences that each want logits) over a throw-away cache just large
enough for it, then reads torch's peak allocation and the driver's free memory.
"""

from __future__ import annotations

import logging
from typing import Any

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.engine.kv_sizing import DeviceMemory
from fastdeploy_kvcache.engine.runner import ScheduledSeq

logger = logging.getLogger(__name__)


def profile_split(num_tokens: int, num_seqs: int) -> list[int]:
    """``num_tokens`` split over ``min(num_seqs, num_tokens)`` sequences, as evenly as it goes."""
    n = max(1, min(num_seqs, num_tokens))
    return [num_tokens // n + (1 if i < num_tokens % n else 0) for i in range(n)]


def profile_device_memory(runner: Any, cache: CacheConfig, num_tokens: int, num_seqs: int,
                          graph_bytes: int) -> DeviceMemory:
    """Run the worst-case step on ``runner`` (a TorchModelRunner on CUDA) and measure."""
    torch = runner.torch
    bs = cache.block_size
    lens = profile_split(num_tokens, num_seqs)
    seqs, next_block = [], 0
    for n in lens:
        blocks = -(-n // bs)
        seqs.append(ScheduledSeq(token_ids=[0] * n, context_len=0, block_ids=list(range(next_block, next_block + blocks)),
                                 wants_logits=True))
        next_block += blocks
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import make_layer_caches
    from fastdeploy_kvcache.worker.backends.torch_backend import torch_dtype

    caches = make_layer_caches(cache.num_layers, next_block, *cache.block_shape, torch_dtype(cache.dtype),
                               runner.device, fp8=runner.fp8_kv)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    runner.forward(seqs, caches, None)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del caches
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    mem = DeviceMemory(total_bytes=int(total), free_bytes=int(free), step_peak_bytes=max(0, int(peak)),
                       graph_bytes=int(graph_bytes))
    logger.info("device memory: %.1f GiB in use of %.1f GiB after the weights and a %d-token step over %d "
                "sequences; the step peaks at %.2f GiB; %.2f GiB held back for CUDA graphs",
                (total - free) / (1 << 30), total / (1 << 30), num_tokens, len(lens), peak / (1 << 30),
                graph_bytes / (1 << 30))
    return mem
