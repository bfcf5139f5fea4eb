"""The library's environment variables (envs.py), and the tuning knobs that are not ones.

A user sets a handful of variables (``envs.ENV_VARS``: the tier switch, the ops library,
the layer-wait timeout, the model cache, the PD transfer); the copy ops' tunables are
options of the C ABI (``CApi.set_option``, the benchmarks' ``--option``), and the C++ core
never reads the environment: an old ``FDKV_COPY_GRID`` in a user's shell changes nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from fastdeploy_kvcache import envs, ops

ROOT = Path(__file__).resolve().parents[2]
FASTDEPLOYS_OWN = {"ENABLE_V1_KVCACHE_MANAGER", "FD_PD_TRANSFER_VIA_STORAGE"}


def test_the_library_reads_a_few_user_facing_variables() -> None:
    knobs = {name for name, var in envs.ENV_VARS.items() if var.benchmark_only}
    ours = set(envs.ENV_VARS) - FASTDEPLOYS_OWN - knobs
    assert ours == {"FDKV_OPS_LIB", "FDKV_LAYER_WAIT_TIMEOUT_S", "FDKV_MODEL_CACHE_DIR",
                    "FDKV_HOST_GROW_CHUNK_MIB", "FDKV_HOST_GROW_PACE_S", "FDKV_API_KEY"}
    assert len(ours) <= 6
    # The benchmark knobs say what they are, and stay few.
    assert knobs == {"FDKV_STORAGE_THROTTLE_BYTES_PER_S", "FDKV_STORAGE_FORCE_FETCH_BLOCKS"}
    assert all(envs.ENV_VARS[k].help.startswith("Benchmarks") for k in knobs)


def test_no_library_module_reads_the_environment_outside_envs_py() -> None:
    """One place for environment variables: any other read would be a variable nobody lists.
    (The TP rank's child sets its spawn environment, and the Mooncake config reads
    FastDeploy's own MOONCAKE_* names.)"""
    allowed = {"envs.py", "worker/tp/rank.py", "storage/mooncake_backend.py", "entrypoints/server_process.py"}
    readers = []
    for path in sorted((ROOT / "fastdeploy_kvcache").rglob("*.py")):
        rel = path.relative_to(ROOT / "fastdeploy_kvcache").as_posix()
        text = path.read_text(encoding="utf-8")
        if rel not in allowed and ("os.environ" in text or "getenv" in text):
            readers.append(rel)
    assert readers == []


def test_the_core_sources_read_no_environment_variable() -> None:
    sources = [p for d in ("csrc", "capi", "paddle") for p in (ROOT / "custom_ops" / d).glob("*.*")]
    assert sources
    assert [p.name for p in sources if "getenv" in p.read_text(encoding="utf-8", errors="replace")] == []


def test_options_start_at_their_defaults_whatever_the_environment(capi_cpu: ops.CApi) -> None:
    """A fresh process with the old tuning variables set still starts from the defaults;
    set_option is the one way to change an option."""
    if hasattr(capi_cpu.lib, "fdkv_parse_env"):
        pytest.skip(f"{capi_cpu.path} was built from sources that still read FDKV_* variables: "
                    "rebuild it with `bash build.sh`")
    code = ("from fastdeploy_kvcache import ops; c = ops.load_capi(variant='cpu'); "
            "print(c.get_option('copy_grid'), c.get_option('copy_path'), c.get_option('dma_min_bytes')); "
            "c.set_option('copy_grid', 3); print(c.get_option('copy_grid'))")
    env = dict(os.environ, FDKV_COPY_GRID="3", FDKV_COPY_PATH="dma", FDKV_DMA_MIN_BYTES="4096")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["8", str(ops.COPY_PATH_AUTO), str(64 << 10), "3"]


def test_a_bad_value_is_an_error_naming_the_variable(monkeypatch) -> None:
    for name, raw in (("FDKV_LAYER_WAIT_TIMEOUT_S", "soon"), ("FDKV_LAYER_WAIT_TIMEOUT_S", "-1"),
                      ("ENABLE_V1_KVCACHE_MANAGER", "maybe"), ("FDKV_OPS_LIB", "/no/such/lib.so")):
        monkeypatch.setenv(name, raw)
        with pytest.raises(ValueError, match=name):
            envs.get(name)
        monkeypatch.delenv(name)
        envs.get(name)  # unset: the default


# ------------------------------------------------------------------ FDKV_OPS_LIB
@pytest.mark.parametrize("variant", [None, "cpu", "cuda"])
def test_missing_ops_lib_is_an_error_not_a_fallback(monkeypatch, tmp_path: Path, variant: Optional[str]) -> None:
    missing = tmp_path / "libnope.so"
    monkeypatch.setenv("FDKV_OPS_LIB", str(missing))
    with pytest.raises(ValueError, match="FDKV_OPS_LIB") as info:
        ops.load_capi(variant=variant)
    assert str(missing) in str(info.value)


def test_cpu_backend_honours_ops_lib(monkeypatch, tmp_path: Path, capi_cpu: ops.CApi) -> None:
    from fastdeploy_kvcache.worker.backends.cpu import CpuBackend

    copy = tmp_path / "libfdkv_custom_cpu.so"
    shutil.copy2(capi_cpu.path, copy)
    monkeypatch.setenv("FDKV_OPS_LIB", str(copy))
    backend = CpuBackend(threaded=False)
    assert backend._capi.path == str(copy.resolve())
    monkeypatch.setenv("FDKV_OPS_LIB", str(tmp_path / "gone.so"))
    with pytest.raises(ValueError, match="FDKV_OPS_LIB"):
        CpuBackend(threaded=False)


def test_ops_lib_of_the_wrong_build_is_refused(monkeypatch, capi_cpu: ops.CApi) -> None:
    monkeypatch.setenv("FDKV_OPS_LIB", capi_cpu.path)
    with pytest.raises(ops.OpsNotBuiltError, match="FDKV_OPS_LIB"):
        ops.load_capi(variant="cuda")
    assert ops.load_capi() is capi_cpu


# ------------------------------------------------------------------ FDKV_REQUIRE_OPS
def test_require_ops_turns_a_missing_build_skip_into_a_failure(monkeypatch) -> None:
    from ops_required import ops_missing
    from skip_helpers import env_switch

    monkeypatch.delenv("FDKV_REQUIRE_OPS", raising=False)
    with pytest.raises(pytest.skip.Exception):
        ops_missing("needs the ops built by `bash build.sh`")
    monkeypatch.setenv("FDKV_REQUIRE_OPS", "1")
    with pytest.raises(pytest.fail.Exception, match="FDKV_REQUIRE_OPS"):
        ops_missing("needs the ops built by `bash build.sh`")
    monkeypatch.setenv("FDKV_REQUIRE_OPS", "yes please")
    with pytest.raises(ValueError, match="FDKV_REQUIRE_OPS"):
        env_switch("FDKV_REQUIRE_OPS")


@pytest.mark.parametrize("value,want", [(None, None), ("", None), ("0", 0), ("8", 8 << 20), ("0.5", 1 << 19)])
def test_host_growth_unset_leaves_the_choice_to_the_controller(monkeypatch: pytest.MonkeyPatch,
                                                               value: Optional[str], want: Optional[int]) -> None:
    """Unset: None, the controller's default (background with CUDA copies, before serving with
    CPU copies: tests/worker/test_controller_host_growth.py); a value set is bytes."""
    if value is None:
        monkeypatch.delenv("FDKV_HOST_GROW_CHUNK_MIB", raising=False)
    else:
        monkeypatch.setenv("FDKV_HOST_GROW_CHUNK_MIB", value)
    assert envs.host_grow_chunk_bytes() == want


def test_a_bad_host_growth_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FDKV_HOST_GROW_CHUNK_MIB", "-1")
    with pytest.raises(ValueError, match="FDKV_HOST_GROW_CHUNK_MIB"):
        envs.host_grow_chunk_bytes()
