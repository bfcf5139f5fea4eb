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


# What the tests that start a real server import in the server process or the test itself.
SERVER_MODULES = ("fastapi", "uvicorn", "httpx", "prometheus_client", "paddleformers")


def needs_modules(*modules: str) -> pytest.MarkDecorator:
    """Skip unless every module imports (they are what `bash build.sh` installs)."""
    import importlib.util

    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    return pytest.mark.skipif(bool(missing), reason=f"needs {missing} (installed by `bash build.sh`)")


def needs_server_modules() -> pytest.MarkDecorator:
    return needs_modules(*SERVER_MODULES)


def needs_mooncake() -> pytest.MarkDecorator:
    """Skip unless the Mooncake binaries and the ``mooncake.store`` module are installed."""
    from fastdeploy_kvcache.storage.mooncake_backend import mooncake_available
    from fastdeploy_kvcache.storage.mooncake_local import find_binary

    why = mooncake_available()
    return pytest.mark.skipif(
        why is not None or find_binary("mooncake_master") is None or find_binary("mooncake_client") is None,
        reason=f"mooncake_master / mooncake_client / mooncake.store not installed ({why}): run `bash build.sh`",
    )


def cuda_capi_missing(min_gpus: int = 1) -> "str | None":
    """Why the GPU tests through the C ABI cannot run here (None: they can): CuPy, at least
    ``min_gpus`` visible CUDA devices, and the CUDA build of the C ABI library."""
    try:
        import cupy
    except ImportError:
        return "cupy is not installed"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - no driver
        return f"no usable CUDA GPU ({exc})"
    if count < min_gpus:
        return f"{count} CUDA GPU(s) visible"
    from fastdeploy_kvcache import ops

    try:
        if not ops.load_capi(variant="cuda").is_cuda:
            return "the loaded libfdkv_capi is the CPU build"
    except ops.OpsNotBuiltError as exc:
        return f"CUDA C ABI library missing: {exc}"
    return None


def needs_cpu_capi() -> pytest.MarkDecorator:
    """Skip unless the CPU build of the C ABI library loads (a marker, for ``pytestmark``)."""
    from fastdeploy_kvcache import ops

    try:
        ops.load_capi(variant="cpu")
        missing = None
    except Exception as exc:  # noqa: BLE001 - OpsNotBuiltError, or an old library
        missing = str(exc)
    return pytest.mark.skipif(missing is not None, reason=f"CPU C ABI library missing ({missing}): run `bash build.sh`")
