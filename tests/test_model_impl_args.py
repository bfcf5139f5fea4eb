"""``--model-impl`` and ``--model-dtype``: parsed, validated, and a clear error where the chosen
library is missing (no Paddle or torch needed to run these)."""

from __future__ import annotations

import argparse
import importlib.util

import pytest

from fastdeploy_kvcache.engine.args import EngineArgs, add_engine_cli_args


def _parse(argv: list[str]) -> EngineArgs:
    parser = add_engine_cli_args(argparse.ArgumentParser())
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_defaults_keep_the_paddleformers_path() -> None:
    args = _parse([])
    assert args.model_impl == "paddleformers" and args.model_dtype == "auto"


def test_transformers_flags_parse() -> None:
    args = _parse(["--model-impl", "transformers", "--model-dtype", "float32", "--model", "llama3-8b-random"])
    assert (args.model_impl, args.model_dtype, args.model) == ("transformers", "float32", "llama3-8b-random")


@pytest.mark.parametrize("fields,where", [
    ({"model_impl": "jax"}, "model_impl"),
    ({"model_dtype": "int4", "model_impl": "transformers"}, "model_dtype"),
    ({"model_dtype": "float32"}, "model_dtype: only --model-impl transformers"),
])
def test_bad_values_name_the_field(fields: dict, where: str) -> None:
    with pytest.raises(ValueError, match=where):
        EngineArgs(**fields).validate()


def test_use_cudagraph_flag_parses_and_defaults_off() -> None:
    assert _parse(["--model-impl", "transformers"]).use_cudagraph is False
    assert _parse(["--model-impl", "transformers", "--use-cudagraph"]).use_cudagraph is True


@pytest.mark.parametrize("fields,where", [
    ({"use_cudagraph": True}, "use_cudagraph: only --model-impl transformers"),
    ({"use_cudagraph": "yes", "model_impl": "transformers"}, "use_cudagraph: must be a bool"),
])
def test_use_cudagraph_needs_the_transformers_runner(fields: dict, where: str) -> None:
    with pytest.raises(ValueError, match=where):
        EngineArgs(**fields).validate()


def test_cli_rejects_use_cudagraph_with_paddleformers() -> None:
    with pytest.raises(ValueError, match="use_cudagraph: only --model-impl transformers"):
        _parse(["--use-cudagraph"])


def test_cli_rejects_an_unknown_impl() -> None:
    with pytest.raises(SystemExit):
        _parse(["--model-impl", "jax"])


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None,
                    reason="checks the error without torch; torch is installed here (tests/engine_torch runs instead)")
def test_transformers_without_torch_is_a_clear_error() -> None:
    from fastdeploy_kvcache.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="needs PyTorch and transformers"):
        LLMEngine(EngineArgs(model="tiny-llama-random", model_impl="transformers"))
