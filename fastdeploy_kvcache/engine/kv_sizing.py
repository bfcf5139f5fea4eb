"""How many device KV blocks the engine allocates: pure arithmetic, no framework.

Three ways, in order of precedence:

1. ``--num-gpu-blocks-override N``: exactly N blocks.
2. ``--kv-cache-memory-gib G``: enough blocks for ``--max-num-seqs`` sequences of
   ``--max-model-len`` tokens, capped at G GiB (never below one such sequence).  On the CPU
   without the flag, G is :data:`CPU_KV_CACHE_MEMORY_GIB`.
3. ``--gpu-memory-utilization U`` (on a GPU, without the two above): the pool takes what is
   left of ``U`` x the device's memory once everything else is counted: what is in use on
   the device after the weights loaded and a worst-case step ran (this process's and any
   other's), that step's transient peak, and what the CUDA graphs captured after the pool
   will take.  All of it goes to the pool (a larger pool caches more prefixes); fewer blocks
   than one ``--max-model-len`` sequence is an error that names the flags.

The measurement (:class:`DeviceMemory`) is taken by the runner (``engine/transformers_runner/gpu_memory.py``);
everything here is a function of plain numbers, so it is tested without a device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

GiB = 1 << 30

# The CPU's device pool cap when no flag sizes it: 1 GiB of K+V.  With the default model
# (SmolLM2-135M, float32 KV: 2.9 MiB per 64-token block) that is 364 blocks, 23,296 tokens.
CPU_KV_CACHE_MEMORY_GIB = 1.0
# Share of a GPU's memory the engine may bring the device's use up to (FastDeploy's and
# vLLM's default).
DEFAULT_GPU_MEMORY_UTILIZATION = 0.9
# Held back beside the decode graphs' outputs for what their capture allocates that no
# profile sees (cuBLAS and Triton workspaces, the graphs' shared activations).
GRAPH_WORKSPACE_BYTES = 256 << 20


@dataclass(frozen=True)
class DeviceMemory:
    """The device's memory, measured after the weights loaded and one worst-case step ran.

    Attributes:
        total_bytes: the device's memory.
        free_bytes: free on the device after the step, with torch's cache of freed blocks
            emptied: weights, CUDA context, and any other process's use are outside it.
        step_peak_bytes: what the step allocated at its peak beyond what stayed allocated
            (activations, logits): free again now, needed again by every such step.
        graph_bytes: held back for the CUDA graphs captured after the pool (0 without).
    """

    total_bytes: int
    free_bytes: int
    step_peak_bytes: int
    graph_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("total_bytes", "free_bytes", "step_peak_bytes", "graph_bytes"):
            if getattr(self, name) < 0:
                raise ValueError(f"DeviceMemory.{name}: must be >= 0, got {getattr(self, name)}")
        if self.free_bytes > self.total_bytes:
            raise ValueError(f"DeviceMemory: free {self.free_bytes} B > total {self.total_bytes} B")


def kv_budget_bytes(mem: DeviceMemory, utilization: float) -> int:
    """Bytes the KV pool may take: ``utilization`` x total, less what is in use, the step's
    transient peak and the graphs' share; 0 when nothing is left."""
    if not 0.0 < utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {utilization!r}")
    in_use = mem.total_bytes - mem.free_bytes
    left = int(utilization * mem.total_bytes) - in_use - mem.step_peak_bytes - mem.graph_bytes
    return max(0, left)


def graph_reserve_bytes(batch_sizes: Sequence[int], vocab_size: int) -> int:
    """The decode graphs' device memory, estimated before they are captured: each captured
    batch size keeps its float32 logits ``[B, vocab]`` (and the bf16 ones they came from), plus
    :data:`GRAPH_WORKSPACE_BYTES`."""
    return sum(int(b) for b in batch_sizes) * int(vocab_size) * (4 + 2) + GRAPH_WORKSPACE_BYTES


def blocks_per_sequence(max_model_len: int, block_size: int) -> int:
    """Blocks one sequence of ``max_model_len`` tokens needs."""
    return -(-max_model_len // block_size)


def device_pool_blocks(*, bytes_per_block: int, block_size: int, max_model_len: int, max_num_seqs: int,
                       kv_cache_memory_gib: Optional[float] = None,
                       kv_budget: Optional[int] = None) -> int:
    """The device pool's block count when ``--num-gpu-blocks-override`` is not given.

    ``kv_cache_memory_gib`` (given, or the CPU's default) caps a pool sized for
    ``max_num_seqs`` full sequences; otherwise ``kv_budget`` (bytes, from
    :func:`kv_budget_bytes`) is all the pool's.  ValueError when the budget holds less than one
    ``max_model_len`` sequence.
    """
    per_seq = blocks_per_sequence(max_model_len, block_size)
    if kv_cache_memory_gib is not None:
        cap = max(per_seq, int(kv_cache_memory_gib * GiB) // bytes_per_block)
        return min(max_num_seqs * per_seq, cap)
    if kv_budget is None:
        raise ValueError("device_pool_blocks: give kv_cache_memory_gib or kv_budget")
    blocks = kv_budget // bytes_per_block
    if blocks < per_seq:
        raise ValueError(
            f"gpu_memory_utilization: leaves {kv_budget / GiB:.2f} GiB for the KV cache ({blocks} blocks), less "
            f"than one --max-model-len {max_model_len} sequence needs ({per_seq} blocks, "
            f"{per_seq * bytes_per_block / GiB:.2f} GiB); raise --gpu-memory-utilization, lower --max-model-len or "
            "--max-num-batched-tokens, or size the pool with --kv-cache-memory-gib")
    return blocks
