"""Skips shared by several test directories (each says what would make the test run)."""

from __future__ import annotations

import pytest


def cpu_capi_or_skip(needed_by: str) -> None:
    """Skip unless the CPU build of the C ABI library is loaded; ``needed_by`` names the tests."""
    from fastdeploy_kvcache import ops

    try:
        capi = ops.load_capi(variant="cpu")
    except ops.OpsNotBuiltError as exc:
        pytest.skip(f"needs the CPU C ABI library (run `bash build.sh`): {exc}")
    if capi.is_cuda:
        pytest.skip(f"the loaded libfdkv_capi is the CUDA build; {needed_by} need `bash build.sh` (CPU)")
