"""The ``fastdeploy-kvcache`` console script.

``fastdeploy-kvcache serve [flags]`` runs the OpenAI-compatible server with exactly the
flags of ``python -m fastdeploy_kvcache.entrypoints.openai.api_server``.
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
    return parser


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = make_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "serve":
        from fastdeploy_kvcache.entrypoints.openai.api_server import run_server

        run_server(args)


if __name__ == "__main__":
    main()
