"""Fixtures of the tensor-parallel tests: rank processes on the cpu backend."""

from __future__ import annotations

import pytest

from skip_helpers import cpu_capi_or_skip


@pytest.fixture
def capi_cpu() -> None:
    """The ranks' cpu backend copies through the CPU build of the C ABI library."""
    cpu_capi_or_skip("the tp tests")
