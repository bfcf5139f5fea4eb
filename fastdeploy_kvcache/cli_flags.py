"""Adding flags to a parser that may already have some: the one helper for it.

The cache's, the storage tier's and the engine's flags are all added to a host server's
parser (FastDeploy's, or this package's own), which may define some of them already; a
flag the parser has keeps its own type, default and help there.
"""

from __future__ import annotations

import argparse
from typing import Any, Optional, Union

__all__ = ["existing_flag", "add_flag", "parser_actions"]

Container = Union[argparse.ArgumentParser, "argparse._ArgumentGroup"]


def existing_flag(parser: Container, flag: str) -> Optional[argparse.Action]:
    """The action that owns ``flag`` in ``parser`` (or in the parser a group belongs to), or None."""
    # NOTE: argparse has no public "does this parser have option X" query; the option table
    # its own conflict check reads (_option_string_actions, shared by a parser and its
    # groups) has kept its name since Python 2.7 and is what other frameworks' parsers read.
    return getattr(parser, "_option_string_actions", {}).get(flag)


def parser_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """A copy of every action ``parser`` holds, in the order they were added (groups' too)."""
    # NOTE: as for existing_flag, argparse lists its actions nowhere public; this is the
    # list its help formatter walks, and the one place this package reads it.
    return list(getattr(parser, "_actions", ()))


def add_flag(parser: Container, flag: str, **kwargs: Any) -> argparse.Action:
    """Add ``flag`` (``kwargs`` as for ``add_argument``) unless ``parser`` defines it already;
    either way return the action that owns it, whose ``dest`` is where its value lands."""
    have = existing_flag(parser, flag)
    if have is not None:
        return have
    return parser.add_argument(flag, **kwargs)
