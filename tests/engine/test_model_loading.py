"""--model PATH (a local checkpoint directory) and bad model names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fastdeploy_kvcache.engine.model_loader import LoadedModel, load_model
from tests.engine.conftest import Collector, greedy


def test_local_checkpoint_dir_serves_like_the_original(engine_factory: Any, tiny_model: LoadedModel,
                                                       tmp_path: Path) -> None:
    tiny_model.model.save_pretrained(str(tmp_path))
    tiny_model.tokenizer.save(str(tmp_path))
    loaded = load_model(str(tmp_path), str(tmp_path / "cache"))
    assert loaded.name == tmp_path.name
    assert (loaded.num_layers, loaded.num_kv_heads, loaded.head_dim) == (4, 2, 64)
    assert set(tiny_model.tokenizer.eos_token_ids) & set(loaded.tokenizer.eos_token_ids)
    prompt = [5 + (i * 7) % 400 for i in range(30)]
    results = []
    for eng in (engine_factory(v1=True), engine_factory(v1=True, model=str(tmp_path))):
        col = Collector()
        eng.add_request("r", prompt, greedy(6), col)
        assert eng.wait_idle(60)
        results.append(col.tokens("r"))
    assert results[0] == results[1]


@pytest.mark.parametrize("name", ["no-such-model", "/no/such/dir"])
def test_unknown_model_is_a_value_error(tmp_path: Path, name: str) -> None:
    with pytest.raises(ValueError, match="^model: "):
        load_model(name, str(tmp_path))


def test_non_llama_checkpoint_is_refused(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    with pytest.raises(ValueError, match="only Llama"):
        load_model(str(tmp_path), str(tmp_path / "cache"))
