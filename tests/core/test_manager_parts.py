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
                   "invariants", "storage_tier", "tier_port")


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


# What only the manager's parts and the port may touch: the tree, its writes, the pools.
_TIER_FORBIDDEN = {"manager", "tree", "root", "host_pool", "device_pool", "evictor", "pool", "add_child",
                   "set_host", "clear_host", "set_device", "clear_device", "remove", "detach_subtree",
                   "free", "free_one", "allocate", "allocate_one", "pin", "unpin"}


def test_the_storage_tier_reaches_the_cache_only_through_its_port() -> None:
    """storage_tier.py names no tree, pool or manager attribute, nor any of their writes, on
    any object, and imports neither the manager nor its parts: everything it does to the cache
    goes through ``StoragePort`` (the tree's writers are the manager's parts and the port)."""
    path = CORE / "storage_tier.py"
    tree = ast.parse(path.read_text(), str(path))
    found = sorted(f"{n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and n.attr in _TIER_FORBIDDEN)
    assert found == [], f"storage_tier.py reaches past its port: {found}"
    imported = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    parts = {f"fastdeploy_kvcache.core.{m}" for m in ("cache_manager", "eviction", "allocation", "lifecycle",
                                                        "copies", "matching", "radix_tree")}
    assert not imported & parts, f"storage_tier.py imports the manager's parts: {imported & parts}"


def test_the_evictor_knows_no_storage_tier() -> None:
    """The evictor tells a listener of host evictions; it never names the storage tier, so calls
    run manager -> tier through the listener and tier -> manager through the port."""
    text = (CORE / "eviction.py").read_text()
    assert "StorageTier" not in text and "storage_tier" not in text


def test_a_bound_tier_holds_the_port_and_no_manager(tmp_path: Path) -> None:
    from fastdeploy_kvcache.core.storage_tier import StorageTier
    from fastdeploy_kvcache.core.tier_port import StoragePort
    from fastdeploy_kvcache.storage import KeyNamespace
    from fastdeploy_kvcache.storage.config import StorageConfig
    from fastdeploy_kvcache.storage.file_backend import FileBackend

    ns = KeyNamespace(model="m", weights_fingerprint="w", dtype="float32", block_size=4, layout="l")
    tier = StorageTier(FileBackend(path=str(tmp_path), min_free_bytes=0), ns,
                       StorageConfig(backend="file", path=str(tmp_path)))
    mgr = CacheManager(CacheConfig(num_gpu_blocks=8, block_size=4, num_host_blocks=8), storage=tier)
    assert isinstance(tier.port, StoragePort) and tier.port is mgr.storage_port
    held = [v for v in vars(tier).values() if v is mgr or v is mgr.tree or v is mgr.host_pool or v is mgr.evictor]
    assert held == [], "the tier holds the manager, its tree or a pool directly"
    with pytest.raises(ValueError, match="already serves"):
        tier.bind(mgr.storage_port)


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
