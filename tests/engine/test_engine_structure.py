"""The engine's seams: every model runner provides the ``ModelRunner`` protocol, and the engine
reaches the pool and the runner through what they declare, never by probing for attributes.

The runner classes are inspected, not built (no model, no torch needed for the paddleformers
runner's check); the engine's modules are parsed, not run.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
from pathlib import Path
from typing import Any

import pytest

from fastdeploy_kvcache.engine import runner as runner_mod
from fastdeploy_kvcache.engine.paddleformers_runner.paddle_runner import PaddleModelRunner
from fastdeploy_kvcache.engine.runner import RUNNER_ATTRIBUTES, RUNNER_METHODS, ModelRunner
from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

REPO = Path(__file__).resolve().parents[2]
ENGINE = REPO / "fastdeploy_kvcache" / "engine"


def _null_runner() -> type:
    spec = importlib.util.spec_from_file_location("bench_step_host", REPO / "benchmarks" / "bench_step_host.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.NullRunner


def test_runner_member_lists_match_the_protocol() -> None:
    """RUNNER_ATTRIBUTES / RUNNER_METHODS are the protocol's members, so the checks below cover it all."""
    annotated = set(ModelRunner.__annotations__)
    methods = {name for name, v in vars(ModelRunner).items() if inspect.isfunction(v) and not name.startswith("_")}
    assert set(RUNNER_ATTRIBUTES) == annotated
    assert set(RUNNER_METHODS) == methods


@pytest.mark.parametrize("cls", [PaddleModelRunner, TorchModelRunner, _null_runner()],
                         ids=["paddle", "torch", "null"])
def test_runner_class_satisfies_the_protocol(cls: type) -> None:
    for name in RUNNER_ATTRIBUTES:
        assert hasattr(cls, name), f"{cls.__name__} does not declare {name}"
        want = ModelRunner.__annotations__[name]
        assert type(getattr(cls, name)).__name__ == want, f"{cls.__name__}.{name}: {getattr(cls, name)!r} is not {want}"
    for name in RUNNER_METHODS:
        method = getattr(cls, name, None)
        assert callable(method), f"{cls.__name__} has no method {name}"
        want = list(inspect.signature(getattr(ModelRunner, name)).parameters)
        got = list(inspect.signature(method).parameters)
        assert got[: len(want)] == want, f"{cls.__name__}.{name}{got} does not take {want}"


def _probes(source: str) -> list[str]:
    """``getattr``/``hasattr`` calls whose object is a pool or a runner (``pool``, ``self.pool``,
    ``self.engine.pool``, ``self.runner``...), as ``line: call``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and node.args):
            target = ast.unparse(node.args[0]).rsplit(".", 1)[-1]
            if target in ("pool", "runner"):
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_probe_finder_finds_probes() -> None:
    src = "x = getattr(self.pool, 'tier', None)\ny = getattr(self.runner, 'a', 0)\nz = hasattr(engine.pool, 'b')\n"
    assert len(_probes(src)) == 3
    assert _probes("x = getattr(self.args, 'storage', None)\n") == []


@pytest.mark.parametrize("module", ["llm_engine.py", "scheduler.py", "kv_event_stream.py", "pd.py"])
def test_engine_has_no_probes_on_pool_or_runner(module: str) -> None:
    assert _probes((ENGINE / module).read_text()) == []


def test_engine_uses_no_private_scheduler_names() -> None:
    """The scheduler owns its queues: the engine calls its public methods only."""
    tree = ast.parse((ENGINE / "llm_engine.py").read_text())
    private = [f"{n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
               if isinstance(n, ast.Attribute) and n.attr.startswith("_")
               and ast.unparse(n.value) in ("self.scheduler", "scheduler")]
    assert private == []
    writes = [f"{n.lineno}: {ast.unparse(n)}" for n in ast.walk(tree)
              if isinstance(n, ast.Attribute) and n.attr in ("running", "waiting")
              and ast.unparse(n.value) in ("self.scheduler", "self")]
    assert writes == [], "the engine reads the queues through the scheduler's methods"


def test_runner_module_is_framework_free() -> None:
    """The protocol module imports no model library: both runners and the engine import it."""
    imported: set[Any] = set()
    for node in ast.walk(ast.parse(Path(runner_mod.__file__).read_text())):
        if isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            imported.add(node.module.split(".")[0])
    assert not imported & {"paddle", "torch", "paddleformers", "transformers"}
