"""Reuse changes nothing on the paddleformers runner: greedy outputs with the tiered cache
equal recompute without it.

The workloads and checks are ``tests/reuse_workloads.py`` (shared with the transformers
runner's tests); each runs on the seeded tiny Llama under each write policy, in the situation
named (device hits, host hits, write_back evictions, failed loads, preemption).
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.reuse_workloads import (
    POLICIES,
    RecomputeBaseline,
    check_device_hits,
    check_failed_loads,
    check_host_hits,
    check_idle_backup,
    check_preemption,
    check_write_back_under_concurrency,
)
from tests.reuse_workloads import BS as BS  # noqa: F401 - re-exported for tests added here
from tests.reuse_workloads import assert_no_leak as assert_no_leak  # noqa: F401
from tests.reuse_workloads import doc as _doc  # noqa: F401
from tests.reuse_workloads import run_waves as run_waves  # noqa: F401

baseline = RecomputeBaseline()


@pytest.mark.parametrize("policy", POLICIES)
def test_device_hits_change_nothing(engine_factory: Any, policy: str) -> None:
    check_device_hits(engine_factory, baseline(engine_factory), policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_host_hits_change_nothing(engine_factory: Any, policy: str) -> None:
    check_host_hits(engine_factory, baseline(engine_factory), policy)


def test_write_back_evictions_under_concurrency(engine_factory: Any) -> None:
    check_write_back_under_concurrency(engine_factory, baseline(engine_factory, concurrent=True))


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_loads_recompute_and_change_nothing(engine_factory: Any, policy: str) -> None:
    check_failed_loads(engine_factory, baseline(engine_factory), policy)


@pytest.mark.parametrize("policy", POLICIES)
def test_preemption_changes_nothing(engine_factory: Any, policy: str) -> None:
    check_preemption(engine_factory, policy)


def test_last_request_is_backed_up_while_idle(engine_factory: Any) -> None:
    check_idle_backup(engine_factory)
