"""The cache manager's parts talk through public names, and what they show is read-only.

Why: the manager was once a set of mixins over one ``self``, and the invariant checker and
the storage tier read its private attributes; a rename inside one part then broke a
module nobody looked at.  Each part now owns its state and shows it through a public view.
The first test parses the manager's modules (``ast``, nothing runs) and names every read
of another object's ``_private`` attribute; the others check that the views cannot be used
to write the state they show.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.cache_manager import CacheManager
from fastdeploy_kvcache.core.request import Request

CORE = Path(__file__).resolve().parents[2] / "fastdeploy_kvcache" / "core"
# The facade, its parts, what they share, and the modules that read the manager.
MANAGER_MODULES = ("cache_manager", "matching", "allocation", "lifecycle", "copies", "eviction", "manager_state",
                   "invariants", "storage_tier")


def _private_reads(path: Path) -> list[str]:
    """``line: expression`` for each private attribute of an object other than self/cls, and
    each getattr/hasattr/setattr of a private name by string."""
    out: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            if not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                out.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) > 1
              and isinstance(node.args[1], ast.Constant) and str(node.args[1].value).startswith("_")):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
    return out


@pytest.mark.parametrize("module", MANAGER_MODULES)
def test_no_module_of_the_manager_reads_private_names_of_another_object(module: str) -> None:
    path = CORE / f"{module}.py"
    assert path.is_file(), f"{path} is gone: update MANAGER_MODULES"
    assert _private_reads(path) == [], f"{path.name} reads private names of other objects"


def _running_manager() -> tuple[CacheManager, Request]:
    mgr = CacheManager(CacheConfig(num_gpu_blocks=8, block_size=4, num_host_blocks=8))
    req = Request("r", list(range(10)))
    mgr.match_prefix(req)
    mgr.ensure_resident(req, 10)
    return mgr, req


def test_the_running_requests_view_cannot_change_the_table() -> None:
    mgr, req = _running_manager()
    view = mgr.allocator.requests
    assert list(view) == ["r"] and view["r"].request is req
    with pytest.raises(TypeError):
        view["x"] = view["r"]  # type: ignore[index]
    with pytest.raises(TypeError):
        del view["r"]  # type: ignore[attr-defined]
    assert mgr.is_running("r")
    mgr.request_finish(req)
    assert "r" not in view, "the view is live: a finished request leaves it"


def test_the_detached_nodes_view_is_a_snapshot() -> None:
    """A backup in flight across reset_cache leaves a detached node until it completes; the
    view shows it, cannot add to the set, and a later completion does not change it."""
    mgr = CacheManager(CacheConfig(num_gpu_blocks=8, block_size=4, num_host_blocks=8,
                                   write_policy="write_through"))
    req = Request("r", list(range(10)))
    mgr.match_prefix(req)
    mgr.ensure_resident(req, 10)
    req.num_computed_tokens = 10
    mgr.request_finish(req)
    backup = mgr.issue_pending_backup_to_batch_request()
    assert backup is not None and len(backup.dst_block_ids) == 2
    mgr.reset_cache()
    before = mgr.evictor.detached
    assert len(before) == 2 and all(node.detached for node in before)
    with pytest.raises(AttributeError):
        before.add(next(iter(before)))  # type: ignore[attr-defined]
    mgr.check_invariants()
    mgr.complete_swap(backup)
    assert mgr.evictor.detached == frozenset() and len(before) == 2
    assert mgr.check_invariants()["device_free"] == 8
