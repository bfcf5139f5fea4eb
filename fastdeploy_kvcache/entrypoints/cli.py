"""The ``fastdeploy-kvcache`` console script.

``fastdeploy-kvcache serve [flags]`` runs the OpenAI-compatible server with exactly the
flags of ``python -m fastdeploy_kvcache.entrypoints.openai.api_server``.

``fastdeploy-kvcache tokenizer --model M [--output DIR]`` writes model M's tokenizer as a
Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``) without
loading its weights, and prints the directory: what a client that loads a tokenizer by path
(SGLang's and vLLM's ``bench_serving --tokenizer``, ``AutoTokenizer.from_pretrained``) needs.
The server writes the same directory at start-up (docs/usage.md, "A tokenizer for clients").
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence


def make_parser() -> argparse.ArgumentParser:
    from fastdeploy_kvcache.entrypoints.openai.api_server import add_server_cli_args
    from fastdeploy_kvcache.entrypoints.openai.startup import OneLineErrorParser

    parser = OneLineErrorParser(prog="fastdeploy-kvcache",
                                description="fastdeploy_kvcache command-line tools.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    serve = sub.add_parser(
        "serve",
        help="Run the OpenAI-compatible server.",
        description="OpenAI-compatible server over fastdeploy_kvcache's reference engine. "
                    "ENABLE_V1_KVCACHE_MANAGER=1 turns on the tiered KV-cache manager "
                    "(device prefix cache, plus a host tier when --swap-space > 0).",
    )
    add_server_cli_args(serve)
    tok = sub.add_parser(
        "tokenizer",
        help="Write a model's tokenizer as a Hugging Face tokenizer directory and print its path.",
        description="Writes --model's tokenizer (the one the server uses) as tokenizer.json + "
                    "tokenizer_config.json, loadable with transformers.AutoTokenizer.from_pretrained(DIR) "
                    "or tokenizers.Tokenizer.from_file(DIR/tokenizer.json), without loading the model's weights.",
    )
    from fastdeploy_kvcache.engine.args import DEFAULT_MODEL, default_model_cache_dir

    tok.add_argument("--model", default=DEFAULT_MODEL,
                     help=f"A model as the server's --model names it (default: {DEFAULT_MODEL}).")
    tok.add_argument("--output", default=None, metavar="DIR",
                     help="Directory to write (default: <--model-cache-dir>/tokenizers/<model>, where the server "
                          "publishes it).")
    tok.add_argument("--model-cache-dir", default=None,
                     help=f"Used for the default --output (default: $FDKV_MODEL_CACHE_DIR or {default_model_cache_dir()}).")
    return parser


def write_tokenizer(model: str, output: Optional[str], model_cache_dir: Optional[str]) -> str:
    """Write ``model``'s tokenizer (``tokenizer`` subcommand); its directory.  ValueError names
    a model that is not loadable."""
    import logging
    import os

    # transformers' import advises installing PyTorch; a tokenizer needs none.
    logging.getLogger("transformers").addFilter(
        lambda record: not str(record.msg).startswith("PyTorch was not found."))
    from fastdeploy_kvcache.engine.args import default_model_cache_dir
    from fastdeploy_kvcache.engine.model_loader import load_tokenizer, model_positions, served_model_name
    from fastdeploy_kvcache.engine.tokenizer import export_tokenizer

    positions = model_positions(model)  # also: ValueError for a model that names nothing
    if output is None:
        output = os.path.join(model_cache_dir or default_model_cache_dir(), "tokenizers", served_model_name(model))
    return export_tokenizer(load_tokenizer(model), output, positions)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = make_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "tokenizer":
        try:
            print(write_tokenizer(args.model, args.output, args.model_cache_dir))
        except (ValueError, OSError) as exc:
            parser.exit(2, f"{parser.prog} tokenizer: error: {exc}\n")
        return
    if args.command == "serve":
        from fastdeploy_kvcache.entrypoints.openai.api_server import run_server

        run_server(args)


if __name__ == "__main__":
    main()
