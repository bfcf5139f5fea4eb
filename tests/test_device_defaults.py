"""Device defaults and the device pool's size: ``EngineArgs.resolved`` and ``engine/kv_sizing.py``.

Pure arithmetic on injected numbers (a GPU's measurements included), so it runs anywhere; the
measurement itself (``engine/transformers_runner/gpu_memory.py``) runs in tests/gpu.
"""

from __future__ import annotations

import argparse

import pytest

from fastdeploy_kvcache.engine.args import DEVICE_DEFAULTS, EngineArgs, add_engine_cli_args
from fastdeploy_kvcache.engine.transformers_runner.gpu_memory import profile_split
from fastdeploy_kvcache.engine.kv_sizing import (
    CPU_KV_CACHE_MEMORY_GIB,
    DEFAULT_GPU_MEMORY_UTILIZATION,
    GRAPH_WORKSPACE_BYTES,
    DeviceMemory,
    GiB,
    device_pool_blocks,
    graph_reserve_bytes,
    kv_budget_bytes,
)

# llama3-8b-random's KV: 32 layers x 8 heads x 128 x bf16, K and V, 64-token blocks: 8 MiB a block.
LLAMA3_BLOCK = 2 * 32 * 8 * 64 * 128 * 2


def _parse(argv: list[str]) -> EngineArgs:
    return EngineArgs.from_cli_args(add_engine_cli_args(argparse.ArgumentParser()).parse_args(argv))


# ---------------------------------------------------------------------- resolved defaults
def test_unset_limits_take_the_devices_defaults_and_the_models_positions() -> None:
    args = _parse([])
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (None, None, None)
    cpu = args.resolved("cpu", 8192)
    assert (cpu.max_model_len, cpu.max_num_seqs, cpu.max_num_batched_tokens) == (8192, 16, 512)
    assert cpu.kv_cache_memory_gib == CPU_KV_CACHE_MEMORY_GIB
    gpu = args.resolved("gpu", 8192)
    assert (gpu.max_model_len, gpu.max_num_seqs, gpu.max_num_batched_tokens) == (8192, 64, 8192)
    assert gpu.kv_cache_memory_gib is None  # --gpu-memory-utilization sizes the pool
    assert gpu.gpu_memory_utilization == DEFAULT_GPU_MEMORY_UTILIZATION == 0.9
    assert DEVICE_DEFAULTS["gpu"].max_num_batched_tokens == 8192 and DEVICE_DEFAULTS["gpu"].max_num_seqs == 64


def test_given_limits_are_kept_on_every_device() -> None:
    args = _parse(["--max-model-len", "1024", "--max-num-seqs", "3", "--max-num-batched-tokens", "96",
                   "--kv-cache-memory-gib", "2", "--gpu-memory-utilization", "0.5"])
    for device in ("cpu", "gpu"):
        r = args.resolved(device, 4096)
        assert (r.max_model_len, r.max_num_seqs, r.max_num_batched_tokens) == (1024, 3, 96)
        assert (r.kv_cache_memory_gib, r.gpu_memory_utilization) == (2.0, 0.5)


def test_max_model_len_beyond_the_models_positions_is_an_error() -> None:
    args = _parse(["--max-model-len", "32768", "--model", "llama3-8b-random"])
    with pytest.raises(ValueError, match=r"^max_model_len: 32768 is more than the 8192 positions of the model "
                                         r"llama3-8b-random"):
        args.resolved("gpu", 8192)
    assert args.resolved("gpu", 131072).max_model_len == 32768


@pytest.mark.parametrize("flag, value", [("--gpu-memory-utilization", "0"), ("--gpu-memory-utilization", "1.01"),
                                         ("--kv-cache-memory-gib", "-1"), ("--max-model-len", "0")])
def test_bad_values_name_their_field(flag: str, value: str) -> None:
    with pytest.raises(ValueError, match="^" + flag[2:].replace("-", "_")):
        _parse([flag, value])


def test_help_states_each_devices_default() -> None:
    text = " ".join(add_engine_cli_args(argparse.ArgumentParser()).format_help().split())
    assert "(default: 16 on the CPU, 64 on a GPU)" in text
    assert "(default: 512 on the CPU, 8192 on a GPU)" in text
    assert "default: the model's positions" in text
    assert "default: 0.9 on a GPU" in text and "ignored, with a note in the log, on the CPU" in text


# ---------------------------------------------------------------------- the pool's size
def test_budget_is_the_share_left_after_use_the_steps_peak_and_the_graphs() -> None:
    # An H200 (140 GiB) holding 16 GiB of weights and 1 GiB of context, a 2 GiB step peak,
    # 0.5 GiB for graphs: 0.9 x 140 - 17 - 2 - 0.5 = 106.5 GiB.
    mem = DeviceMemory(total_bytes=140 * GiB, free_bytes=123 * GiB, step_peak_bytes=2 * GiB, graph_bytes=GiB // 2)
    assert kv_budget_bytes(mem, 0.9) == int(0.9 * 140 * GiB) - 17 * GiB - 2 * GiB - GiB // 2
    blocks = device_pool_blocks(bytes_per_block=LLAMA3_BLOCK, block_size=64, max_model_len=8192, max_num_seqs=64,
                                kv_budget=kv_budget_bytes(mem, 0.9))
    assert blocks == kv_budget_bytes(mem, 0.9) // LLAMA3_BLOCK  # all of it: more blocks cache more prefixes
    assert blocks > 64 * 128  # far beyond 64 full sequences
    # Another process holding 113 GiB beside ours leaves nothing: no negative budget.
    crowded = DeviceMemory(total_bytes=140 * GiB, free_bytes=10 * GiB, step_peak_bytes=2 * GiB)
    assert kv_budget_bytes(crowded, 0.9) == 0


def test_a_budget_below_one_sequence_is_an_error_naming_the_flags() -> None:
    with pytest.raises(ValueError, match=r"^gpu_memory_utilization: leaves .* less than one --max-model-len 131072 "
                                         r"sequence needs \(2048 blocks"):
        device_pool_blocks(bytes_per_block=LLAMA3_BLOCK, block_size=64, max_model_len=131072, max_num_seqs=64,
                           kv_budget=2047 * LLAMA3_BLOCK)
    assert device_pool_blocks(bytes_per_block=LLAMA3_BLOCK, block_size=64, max_model_len=131072, max_num_seqs=64,
                              kv_budget=2048 * LLAMA3_BLOCK) == 2048


def test_gib_cap_sizes_for_the_sequences_and_never_below_one() -> None:
    # SmolLM2-135M on the CPU: float32, 30 layers x 3 KV heads x 64: 2.8 MiB a block.
    smol = 2 * 30 * 3 * 64 * 64 * 4
    # The CPU default: 1 GiB holds 364 blocks, fewer than 16 sequences of 8192 tokens want.
    assert device_pool_blocks(bytes_per_block=smol, block_size=64, max_model_len=8192, max_num_seqs=16,
                              kv_cache_memory_gib=CPU_KV_CACHE_MEMORY_GIB) == GiB // smol == 364
    # tiny-llama-random: 16 sequences of its 4096 positions (1024 blocks, 256 MiB) fit under 1 GiB.
    tiny = 2 * 4 * 2 * 64 * 64 * 4
    assert device_pool_blocks(bytes_per_block=tiny, block_size=64, max_model_len=4096, max_num_seqs=16,
                              kv_cache_memory_gib=1.0) == 16 * 64
    # A cap below one sequence still gives one sequence.
    assert device_pool_blocks(bytes_per_block=LLAMA3_BLOCK, block_size=64, max_model_len=8192, max_num_seqs=64,
                              kv_cache_memory_gib=0.01) == 128


def test_graph_reserve_counts_each_captured_batchs_logits() -> None:
    assert graph_reserve_bytes([1, 2, 4], 1000) == 7 * 1000 * 6 + GRAPH_WORKSPACE_BYTES


def test_device_memory_refuses_impossible_measurements() -> None:
    with pytest.raises(ValueError, match="free"):
        DeviceMemory(total_bytes=GiB, free_bytes=2 * GiB, step_peak_bytes=0)
    with pytest.raises(ValueError, match="step_peak_bytes"):
        DeviceMemory(total_bytes=GiB, free_bytes=GiB, step_peak_bytes=-1)


@pytest.mark.parametrize("tokens, seqs, expected", [(8192, 64, [128] * 64), (10, 4, [3, 3, 2, 2]), (3, 64, [1, 1, 1])])
def test_profile_step_splits_the_token_budget_over_the_sequences(tokens: int, seqs: int, expected: list[int]) -> None:
    assert profile_split(tokens, seqs) == expected
