"""What a CPU user gets from an engine built with no limits given: the model's positions, the
CPU's batch limits and a device pool capped at 1 GiB; --gpu-memory-utilization is noted and unused."""

from __future__ import annotations

import logging

import pytest

from fastdeploy_kvcache.config import AUTO_DTYPE, CacheConfig
from fastdeploy_kvcache.engine.args import EngineArgs
from fastdeploy_kvcache.engine.llm_engine import LLMEngine
from fastdeploy_kvcache.engine.model_loader import LoadedModel


@pytest.mark.parametrize("utilization", [None, 0.5])
def test_cpu_engine_without_limits(tiny_model: LoadedModel, utilization: object, monkeypatch: pytest.MonkeyPatch,
                                   caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1")
    args = EngineArgs(model="tiny-llama-random", device="cpu", cache=CacheConfig(dtype=AUTO_DTYPE),
                      gpu_memory_utilization=utilization)
    with caplog.at_level(logging.INFO, logger="fastdeploy_kvcache.engine.llm_engine"):
        eng = LLMEngine(args, loaded_model=tiny_model)
    try:
        assert eng.max_model_len == tiny_model.max_position_embeddings == 4096
        assert (eng.args.max_num_seqs, eng.args.max_num_batched_tokens) == (16, 512)
        # 16 sequences of 4096 tokens in 64-token blocks: 1024 blocks of 256 KiB, under the 1 GiB cap.
        assert eng.cache_config.num_gpu_blocks == 16 * 4096 // 64
        assert eng.cache_config.num_gpu_blocks * eng.cache_config.bytes_per_block == 256 << 20
        noted = "--gpu-memory-utilization 0.5: not used on the CPU" in caplog.text
        assert noted == (utilization is not None), caplog.text
    finally:
        eng.shutdown()


def test_engine_refuses_max_model_len_past_the_models_positions(tiny_model: LoadedModel) -> None:
    args = EngineArgs(model="tiny-llama-random", device="cpu", max_model_len=5000, cache=CacheConfig(dtype=AUTO_DTYPE))
    with pytest.raises(ValueError, match="max_model_len: 5000 is more than the 4096 positions"):
        LLMEngine(args, loaded_model=tiny_model)
