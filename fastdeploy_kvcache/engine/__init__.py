"""A small continuous-batching engine that serves a Llama (paddleformers, or transformers on torch) on the tiered KV cache.

``ENABLE_V1_KVCACHE_MANAGER=1`` runs it on ``CacheManager`` + ``CacheController`` (prefix reuse
on device, a host tier with ``--swap-space``); ``0`` runs the same engine and attention on a
plain device block allocator with no reuse between requests (the baseline).  Paddle, torch and
their model libraries are imported lazily, by the modules that need them.
"""

from fastdeploy_kvcache.engine.args import EngineArgs, add_engine_cli_args
from fastdeploy_kvcache.engine.sampling import SamplingParams

__all__ = ["EngineArgs", "SamplingParams", "add_engine_cli_args", "LLMEngine", "RequestOutput"]


def __getattr__(name: str):  # lazy: LLMEngine pulls in Paddle
    if name in ("LLMEngine", "RequestOutput"):
        from fastdeploy_kvcache.engine import llm_engine

        return getattr(llm_engine, name)
    raise AttributeError(name)
