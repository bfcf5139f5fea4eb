"""Skips shared by several test directories (each says what would make the test run)."""

from __future__ import annotations

import os

import pytest

# The test suite's own switches (not the library's; envs.py holds those): FDKV_REQUIRE_OPS=1
# (CI sets it) fails a test that needs the compiled ops instead of skipping it; FDKV_SOAK=1
# runs the long hypothesis soak.
TEST_SWITCHES = ("FDKV_REQUIRE_OPS", "FDKV_SOAK")


def env_switch(name: str) -> bool:
    """A test switch's value: 1/true/yes/on or 0/false/no/off/unset; anything else raises
    naming the variable (a typo must not quietly turn a CI check off)."""
    if name not in TEST_SWITCHES:
        raise KeyError(f"{name} is not one of the test switches {TEST_SWITCHES}")
    raw = os.environ.get(name, "").strip().lower()
    if raw in ("1", "true", "yes", "on"):
        return True
    if raw in ("", "0", "false", "no", "off"):
        return False
    raise ValueError(f"bad value for test switch {name}={os.environ[name]!r}: expected 0/1/true/false/yes/no/on/off")


def cpu_capi_missing() -> "str | None":
    """Why the CPU build of the C ABI library does not load here (None: it does)."""
    from fastdeploy_kvcache import ops

    try:
        ops.load_capi(variant="cpu")
    except Exception as exc:  # noqa: BLE001 - OpsNotBuiltError, or an old library
        return str(exc)
    return None


_CPU_CAPI_FIX = ("run `bash build.sh` to build build/libfdkv_capi_cpu.so (and if FDKV_OPS_LIB is set, point it at "
                 "that file)")


def cpu_capi_or_skip(needed_by: str) -> None:
    """Skip unless the CPU build of the C ABI library loads; ``needed_by`` names the tests."""
    missing = cpu_capi_missing()
    if missing is not None:
        pytest.skip(f"{needed_by} need the CPU C ABI library ({missing}): {_CPU_CAPI_FIX}")


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
    missing = cpu_capi_missing()
    return pytest.mark.skipif(missing is not None, reason=f"CPU C ABI library missing ({missing}): {_CPU_CAPI_FIX}")
