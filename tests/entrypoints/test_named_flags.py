"""Every ``--flag`` the docs or the package's messages name is one some program accepts.

A message or a page that tells an operator to pass a flag the parser rejects sends them
in a circle (``--num-host-blocks`` was such a flag). This walks every ``--flag`` in
``README.md``, ``docs/*.md`` and the string literals of the package's source (error
messages, docstrings, ``--help`` text) and checks it against the server's own argument
parser. Flags of this repository's other programs (the benchmarks, the PD router, the
local Mooncake launcher) are checked against those programs' definitions; flags of
third-party programs are listed below, each with its program.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from fastdeploy_kvcache.entrypoints.openai.api_server import make_arg_parser

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "fastdeploy_kvcache"

# A flag: two dashes, a letter, then letters, digits, '-' or '_', not ending in '-'.
# (?<![\w-]) keeps "a--b" and "---" out; "-->" arrows in ASCII diagrams end in '-' or '>'.
FLAG = re.compile(r"(?<![\w-])--[A-Za-z][\w-]*[A-Za-z0-9_]")

# Flags of programs that are not part of this repository, named where the docs or a
# message tell the operator how to run them.
THIRD_PARTY: dict[str, str] = {
    "--no-build-isolation": "pip (README's install, the rebuild hints of libpaths.py)",
    "--no-deps": "pip (README's install, model_loader.py's wheel hint)",
    "--rpc_address": "mooncake_master (docs/storage.md, storage/mooncake_local.py)",
    "--rpc_port": "mooncake_master",
    "--metrics_host": "mooncake_master",
    "--metrics_port": "mooncake_master",
    "--logtostderr": "mooncake_master (glog)",
    "--global_segment_size": "mooncake_client (docs/storage.md, storage/mooncake_local.py)",
    "--master_server_address": "mooncake_client",
    "--metadata_server": "mooncake_client",
    "--query-gpu": "nvidia-smi (worker/numa.py)",
    "--format": "nvidia-smi (worker/numa.py)",
    "--stop-timeout": "docker run (docs/operations.md)",
    "--only-binary": "pip download (docs/usage.md, wheels for an offline GPU machine)",
    "--python-version": "pip download",
    "--implementation": "pip download",
    "--platform": "pip download",
    "--no-index": "pip install (docs/usage.md, build.sh's offline wheels)",
    "--tokenizer": "SGLang's and vLLM's bench_serving (docs/usage.md, a tokenizer for clients)",
}

# Text that looks like a flag but is none: the arrows of docs/pd_disaggregation.md's
# diagram ("server --writes KV--> store", "<--reads KV-").
NOT_FLAGS = {"--writes", "--reads"}


def _server_flags() -> set[str]:
    return set(make_arg_parser()._option_string_actions)


def _flags_defined_in(path: Path) -> set[str]:
    """The ``--flags`` that ``add_argument`` calls in ``path`` define (``--no-x`` too, for
    ``BooleanOptionalAction``)."""
    flags: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "add_argument":
            names = [a.value for a in node.args
                     if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("--")]
            flags.update(names)
            if any("BooleanOptionalAction" in ast.unparse(k.value) for k in node.keywords if k.arg == "action"):
                flags.update("--no-" + n[2:] for n in names)
    return flags


def _other_programs_flags() -> set[str]:
    """Flags of the repository's other command-line programs (benchmarks, router, launcher)."""
    paths = sorted((ROOT / "benchmarks").glob("*.py")) + [
        PACKAGE / "entrypoints" / "router" / "cli.py", PACKAGE / "storage" / "mooncake_local.py",
        PACKAGE / "entrypoints" / "cli.py"]  # its tokenizer subcommand
    out: set[str] = set()
    for p in paths:
        out |= _flags_defined_in(p)
    return out


def _named_in_text(text: str) -> list[tuple[str, bool]]:
    """(flag, is_prefix) for each flag in ``text``; ``--kvcache-storage-*`` is a prefix."""
    out = []
    for m in FLAG.finditer(text):
        out.append((m.group(0), text[m.end():m.end() + 2] == "-*"))
    return out


def _doc_mentions() -> list[tuple[str, str, bool]]:
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            found += [(flag, f"{path.relative_to(ROOT)}:{lineno}", prefix) for flag, prefix in _named_in_text(line)]
    return found


def _source_mentions() -> list[tuple[str, str, bool]]:
    """Flags in every string literal of the package (f-string parts included)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                where = f"{path.relative_to(ROOT)}:{node.lineno}"
                found += [(flag, where, prefix) for flag, prefix in _named_in_text(node.value)]
    return found


def _unknown(mentions: list[tuple[str, str, bool]]) -> list[str]:
    accepted = _server_flags() | _other_programs_flags() | set(THIRD_PARTY) | NOT_FLAGS
    bad = []
    for flag, where, prefix in mentions:
        ok = any(a.startswith(flag + "-") for a in accepted) if prefix else flag in accepted
        if not ok:
            bad.append(f"{where}: {flag}")
    return bad


def test_the_walk_finds_flags_and_rejects_a_made_up_one() -> None:
    """The checker itself: it sees the flags the docs name, and a flag nobody defines fails."""
    docs = {flag for flag, _, _ in _doc_mentions()}
    assert {"--swap-space", "--kvcache-storage-backend", "--port"} <= docs
    assert _unknown([("--num-host-blocks", "example", False), ("--swap-space", "example", False)]) == [
        "example: --num-host-blocks"]
    assert _unknown([("--kvcache-storage", "example", True), ("--kvcache-nothing", "example", True)]) == [
        "example: --kvcache-nothing"]


def test_every_flag_the_docs_name_is_accepted() -> None:
    assert _unknown(_doc_mentions()) == []


def test_every_flag_the_package_source_names_is_accepted() -> None:
    assert _unknown(_source_mentions()) == []


def test_third_party_exceptions_are_not_our_flags() -> None:
    """An exception that a program of ours accepts belongs to that program, not this list."""
    ours = _server_flags() | _other_programs_flags()
    assert sorted(set(THIRD_PARTY) & ours) == []
