"""Fixtures of the worker tests: initialized CacheControllers on the CPU backends."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from worker_helpers import capi_or_skip, paddle_ops_or_skip, small_config


@pytest.fixture
def make_controller() -> Iterator[Any]:
    """Factory of initialized CacheControllers; closes them after the test.

    ``disabled_rules`` switches fences off (the ordering-rule tests show the corruption
    each fence prevents).
    """
    from fastdeploy_kvcache.worker import CacheController

    made: list[Any] = []

    def factory(backend: str = "cpu", threaded: bool = True, disabled_rules: Any = frozenset(),
                async_launch: Any = None, backups_after_loads: Any = None, **cfg: Any) -> Any:
        if backend == "cpu":
            capi_or_skip()
        elif backend == "paddle":
            paddle_ops_or_skip()
        config = small_config(**cfg)
        ctrl = CacheController(config, local_rank=0, device_id=0, backend=backend, threaded=threaded,
                               async_launch=async_launch, disabled_rules=set(disabled_rules),
                               backups_after_loads=backups_after_loads)
        assert ctrl.transfer_manager.disabled_rules == frozenset(disabled_rules)
        ctrl.initialize_kv_cache()
        ctrl.initialize_host_cache()
        made.append(ctrl)
        return ctrl

    yield factory
    for ctrl in made:
        for stream in (ctrl.transfer_manager.input_stream, ctrl.transfer_manager.output_stream):
            if hasattr(stream, "resume"):
                stream.resume()
        ctrl.close()


