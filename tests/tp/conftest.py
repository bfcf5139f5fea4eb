"""Fixtures of the tensor-parallel tests: rank processes on the cpu backend."""

from __future__ import annotations

import pytest


@pytest.fixture
def capi_cpu() -> None:
    """The ranks' cpu backend copies through the CPU build of the C ABI library."""
    from fastdeploy_kvcache import ops

    try:
        capi = ops.load_capi(variant="cpu")
    except ops.OpsNotBuiltError as exc:
        pytest.skip(f"needs the CPU C ABI library (run `bash build.sh`): {exc}")
    if capi.is_cuda:
        pytest.skip("the loaded libfdkv_capi is the CUDA build; the tp tests need `bash build.sh` (CPU)")
