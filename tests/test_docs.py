"""The docs stay references: short, free of lab-journal residue, and every pointer resolves.

Why: docs/benchmarks.md once grew to 1,873 lines of numbered measurement passes, code
comments cited those passes and files that were never in the repository, and renamed
sections left citations dangling.  These checks read the tracked files as they are; each
failure names the file, the line and what is wrong.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS_MD_MAX_LINES = 400

# Files people read as documentation, and the code whose comments cite it.
DOC_FILES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
CODE_SUFFIXES = {".py", ".cc", ".cu", ".h", ".sh"}
CODE_DIRS = ("fastdeploy_kvcache", "custom_ops", "benchmarks", "tests", "build.sh", "setup_ops.py")

ORDINALS = "first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth"
# An ordinal before "pass", "pass" before a number (a numbered measurement pass), or
# "machine" before a single capital letter or digit (a lent machine's nickname).
PASS_RE = re.compile(rf"\b(?:{ORDINALS}) pass(?:es)?\b|(?<!forward )\bpass(?:es)? [0-9]+\b(?![-%.0-9])",
                     re.IGNORECASE)
MACHINE_RE = re.compile(r"\bmachines? [A-Z0-9](?![\w-])")
COMMIT_RE = re.compile(r"`(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}`")
MD_NAME_RE = re.compile(r"(?<![\w/.<{-])((?:\.\./|\./)?[\w./-]*\w\.md)\b")
LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# `docs/ops.md`, "Spans" / docs/ops.md, "Measured costs" / (ops.md, "auto") ...
CITATION_RE = re.compile(r"(?:docs/)?(\w+)\.md`?,?\s+\"([^\"]{2,80})\"")
RESULT_RE = re.compile(r"(?:\.\./)?(benchmarks/results/[\w.{},-]+)")


def tracked(*paths: str) -> list[Path]:
    """Tracked files under ``paths`` (git ls-files), so build outputs and the venv never count."""
    out = subprocess.run(["git", "ls-files", "--", *paths], cwd=ROOT, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        pytest.skip(f"needs a git checkout to list tracked files: {out.stderr.strip()}")
    return [ROOT / line for line in out.stdout.splitlines() if (ROOT / line).is_file()]


def code_files() -> list[Path]:
    return [p for p in tracked(*CODE_DIRS) if p.suffix in CODE_SUFFIXES or p.name == "build.sh"]


def comments(path: Path) -> list[tuple[int, str]]:
    """(line number, text) of the comments and docstring lines of a source file.

    A line counts when it is a comment (``#``, ``//``, ``*``) or sits inside a triple-quoted
    string (Python docstrings); code such as ``f"before pass {r}"`` does not.
    """
    out: list[tuple[int, str]] = []
    in_doc = False
    for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
        quotes = line.count('"""') + line.count("'''")
        stripped = line.strip()
        if in_doc or quotes:
            out.append((n, line))
        elif stripped.startswith(("#", "//", "*", "/*")):
            out.append((n, line))
        elif "#" in line and path.suffix in (".py", ".sh"):
            out.append((n, line[line.index("#"):]))
        elif "//" in line and path.suffix in (".cc", ".cu", ".h"):
            out.append((n, line[line.index("//"):]))
        if quotes % 2 == 1:
            in_doc = not in_doc
    return out


def headings(doc: Path) -> list[str]:
    return [re.sub(r"[`*]", "", line.lstrip("#").strip()).lower()
            for line in doc.read_text().splitlines() if line.startswith("#")]


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def md_exists(name: str, where: Path) -> bool:
    """Whether a mentioned ``*.md`` file is in the repository (as a path, or by its name)."""
    if any((base / name).resolve().is_file() for base in (ROOT, ROOT / "docs", where.parent)):
        return True
    if "/" not in name:
        return any(p.name == name for p in tracked("."))
    return False


def test_benchmarks_md_is_a_reference_of_at_most_400_lines() -> None:
    lines = (ROOT / "docs" / "benchmarks.md").read_text().splitlines()
    assert len(lines) <= BENCHMARKS_MD_MAX_LINES, (
        f"docs/benchmarks.md has {len(lines)} lines (at most {BENCHMARKS_MD_MAX_LINES}): keep the latest "
        f"table per benchmark and put the history in the commit message")


def test_docs_name_no_passes_machine_letters_or_commit_hashes() -> None:
    bad = []
    for doc in DOC_FILES:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for rx, what in ((PASS_RE, "a measurement pass"), (MACHINE_RE, "a machine letter"),
                             (COMMIT_RE, "a commit hash")):
                m = rx.search(line)
                if m:
                    bad.append(f"{doc.relative_to(ROOT)}:{n}: {what} {m.group(0)!r}")
    assert not bad, "docs are references, not journals:\n" + "\n".join(bad)


def test_code_comments_name_no_passes_or_machine_letters() -> None:
    bad = []
    for path in code_files():
        for n, text in comments(path):
            for rx in (PASS_RE, MACHINE_RE):
                m = rx.search(text)
                if m:
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r} (state the fact, cite a doc section)")
    assert not bad, "\n".join(bad)


def test_every_md_file_that_docs_and_code_mention_exists() -> None:
    """MOONCAKE.md, DESIGN.md and the like were cited but never in the repository."""
    bad = []
    for path in DOC_FILES + tracked("fastdeploy_kvcache", "custom_ops"):
        if path.suffix not in CODE_SUFFIXES | {".md"}:
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            for name in MD_NAME_RE.findall(line):
                if not md_exists(name, path):
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {name} is not in the repository")
    assert not bad, "\n".join(bad)


def test_every_results_file_the_docs_name_exists() -> None:
    bad = []
    for doc in DOC_FILES:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for rel in RESULT_RE.findall(line):
                rel = rel.rstrip(".,")
                if rel.endswith("_") or "{" in rel or rel.endswith("/"):
                    continue  # a pattern such as bench_pd_<backend>_<date>.json, or the folder
                if not (ROOT / rel).is_file():
                    bad.append(f"{doc.relative_to(ROOT)}:{n}: {rel} does not exist")
    assert not bad, "\n".join(bad)


def test_every_relative_link_in_readme_and_docs_resolves() -> None:
    bad = []
    for doc in DOC_FILES:
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            for target in LINK_RE.findall(line):
                if re.match(r"[a-z]+:", target):
                    continue  # http:, https:, mailto:
                path_part, _, anchor = target.partition("#")
                dest = (doc.parent / path_part).resolve() if path_part else doc
                if not dest.exists():
                    bad.append(f"{doc.relative_to(ROOT)}:{n}: link {target} -> no such file")
                elif anchor and dest.suffix == ".md" and anchor not in {slug(h) for h in headings(dest)}:
                    bad.append(f"{doc.relative_to(ROOT)}:{n}: link {target} -> no heading #{anchor}")
    assert not bad, "\n".join(bad)


# "Work in flight is shared" in docs/architecture.md: a citation with the section first.
CITATION_AFTER_RE = re.compile(r"\"([^\"]{2,80})\"\s+in\s+`?(?:docs/)?(\w+)\.md")


def test_every_cited_doc_section_is_a_heading_of_that_doc() -> None:
    """``docs/ops.md, "Spans"`` and ``"Spans" in docs/ops.md``, in a doc or a comment, must
    name a heading that docs/ops.md has."""
    docs = {p.stem: p for p in (ROOT / "docs").glob("*.md")}
    bad = []
    for path in DOC_FILES + code_files():
        # Join wrapped comment lines, so a citation split over two lines is still one.
        text = re.sub(r"\n\s*(?:#|//|\*)?\s*", " ", path.read_text(errors="replace"))
        cited = CITATION_RE.findall(text) + [(stem, section) for section, stem in CITATION_AFTER_RE.findall(text)]
        for stem, section in cited:
            doc = docs.get(stem)
            if doc is None:
                continue  # a file name test above already reports a missing doc
            wanted = re.sub(r"[`*]", "", section).lower()
            if not any(wanted in h for h in headings(doc)):
                bad.append(f"{path.relative_to(ROOT)}: cites {stem}.md, {section!r}: no such heading")
    assert not bad, "\n".join(sorted(set(bad)))


ISSUE_RE = re.compile(r"\bissues? #?[0-9]+\b", re.IGNORECASE)
def test_docs_and_code_cite_no_issue_numbers() -> None:
    """History lives in commit messages: no issue number in a doc, a comment or a printed label."""
    bad = []
    for path in DOC_FILES + code_files():
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            m = ISSUE_RE.search(line)
            if m:
                bad.append(f"{path.relative_to(ROOT)}:{n}: {m.group(0)!r}")
    assert not bad, "state what a thing is, not which issue asked for it:\n" + "\n".join(bad)


def _storage_flags() -> list[str]:
    import argparse

    from fastdeploy_kvcache.storage.config import add_storage_cli_args

    parser = add_storage_cli_args(argparse.ArgumentParser())
    return [o for a in parser._actions for o in a.option_strings if o.startswith("--kvcache-storage-")]


def _table_rows(text: str, header: str) -> list[list[str]]:
    """The rows of the markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _section(text: str, heading: str) -> str:
    body = text.split(f"\n{heading}\n", 1)[1]
    return re.split(r"\n## ", body, maxsplit=1)[0]


def test_every_storage_flag_is_in_usage_md_and_in_storage_md_flag_table_with_a_meaning() -> None:
    flags = _storage_flags()
    assert len(flags) >= 9, flags
    usage = (ROOT / "docs" / "usage.md").read_text()
    storage = (ROOT / "docs" / "storage.md").read_text()
    table = _table_rows(_section(storage, "## Flags (`storage/config.py`)"), "| flag | default | meaning |")
    documented = {}
    for cells in table:
        for flag in re.findall(r"--kvcache-storage-[\w-]+", cells[0]):
            documented[flag] = cells
    missing_usage = [f for f in flags if f"`{f}" not in usage]
    assert not missing_usage, f"docs/usage.md's flag tables lack {missing_usage}"
    assert "storage.md" in _section(usage, "## Flags"), "docs/usage.md's flags must point to docs/storage.md"
    missing = [f for f in flags if f not in documented]
    assert not missing, f"docs/storage.md's flag table lacks {missing}"
    empty = [cells[0] for cells in table if len(cells) < 3 or len(cells[2]) < 10]
    assert not empty, f"docs/storage.md's flag table has rows without a meaning: {empty}"


def test_storage_md_starts_with_a_quick_start_and_its_flags_before_the_internals() -> None:
    heads = [line for line in (ROOT / "docs" / "storage.md").read_text().splitlines() if line.startswith("## ")]
    assert heads[:2] == ["## Quick start", "## Flags (`storage/config.py`)"], heads[:4]
    quick = _section((ROOT / "docs" / "storage.md").read_text(), "## Quick start")
    assert "bash build.sh serve --kvcache-storage-backend file" in quick
    assert "/metrics" in quick and "When a new block reaches the store" in quick


def test_runnable_recipes_use_the_venvs_python() -> None:
    """A fresh checkout has `.venv/bin/python` after `bash build.sh`, not a `python` on PATH."""
    bad = []
    for doc in DOC_FILES:
        for block in re.findall(r"```bash\n(.*?)```", doc.read_text(), flags=re.S):
            for line in block.splitlines():
                if re.match(r"\s*python -m ", line):
                    bad.append(f"{doc.relative_to(ROOT)}: {line.strip()[:80]}")
    assert not bad, "use .venv/bin/python (or a build.sh subcommand) in recipes:\n" + "\n".join(bad)


def test_build_sh_serve_installs_what_the_recipes_after_it_need() -> None:
    """docs/fleet.md's and docs/storage.md's recipes start from `bash build.sh serve`: it must
    install Mooncake (best effort) like a plain `bash build.sh`."""
    text = (ROOT / "build.sh").read_text()
    serve = text[text.index("\n  serve)"):]
    serve = serve[:serve.index(";;")]
    build = text[text.index("\n  build)"):]
    build = build[:build.index(";;")]
    for step in ("install_mooncake", "install_engine_packages", "setup_venv"):
        assert step in build and step in serve, f"`bash build.sh serve` lacks {step}"
