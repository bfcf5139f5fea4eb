"""One rule for FDKV_* environment values in Python (envs.py) and C++ (swap_core.cc).

The C++ core reads its tunables itself; it used to fall back silently to the default on a
bad value (``FDKV_COPY_PATH=dmaa``, ``FDKV_COPY_GRID=abc``) and to compare names case-
sensitively, while envs.py raised and lower-cased.  Now both parse a value the same way
(checked here on a table of raw values through both parsers), and a bad value is an
error naming the variable, through the C ABI and the Paddle ops alike, never an abort.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Optional

import pytest

from fastdeploy_kvcache import envs, ops

RAW_VALUES = [
    "", "   ", "8", " 8 ", "\t8\n", "+8", "-1", "0", "1", "2", "3", "4", "65535", "65536", "1048576", "8_000",
    "0x10", "1e3", "8.0", "abc", "\u0663", "99999999999999999999", "9223372036854775807",
    "-9223372036854775808", "auto", "AUTO", " Dma ", "dmaa", "kernel", "KERNEL", "process", "staged",
    "\u212aernel", "dma kernel",
]


def _python(name: str, raw: str) -> Optional[int]:
    try:
        value = envs.parse(name, raw)
    except ValueError:
        return None
    return ops.COPY_PATHS[value] if isinstance(value, str) else int(value)  # type: ignore[arg-type]


def _core(capi: ops.CApi, name: str, raw: str) -> Optional[int]:
    try:
        return capi.parse_env(name, raw)
    except ops.SwapOpError as exc:
        assert exc.argument == name, str(exc)
        assert name in str(exc)
        return None


@pytest.mark.parametrize("name", sorted(envs.CORE_VARS.values()))
def test_python_and_core_parse_every_value_alike(capi_cpu: ops.CApi, name: str) -> None:
    results = {raw: (_python(name, raw), _core(capi_cpu, name, raw)) for raw in RAW_VALUES}
    differ = {raw: got for raw, got in results.items() if got[0] != got[1]}
    assert not differ, f"{name}: (python, core) disagree on {differ}"
    assert results[""][0] is not None, "empty means the default"


def test_core_variables_are_the_registered_ones(capi_cpu: ops.CApi) -> None:
    """Every variable the core reads is in envs.CORE_VARS (and so in ENV_VARS and the
    README), and every CORE_VARS entry is one the core reads."""
    core_reads = set()
    for name in envs.ENV_VARS:
        try:
            capi_cpu.parse_env(name, "")
        except ops.SwapOpError as exc:
            assert exc.argument == "name"
        else:
            core_reads.add(name)
    assert core_reads == set(envs.CORE_VARS.values())
    for option in envs.CORE_VARS:
        capi_cpu.get_option(option)


def _child(code: str, **env: str) -> list[str]:
    prelude = textwrap.dedent("""
        from fastdeploy_kvcache import envs, ops
        def report(fn):
            try:
                fn()
            except ops.SwapOpError as exc:
                print(f"SwapOpError|{exc.op}|{exc.argument}|{exc}", flush=True)
            except Exception as exc:
                print(f"{type(exc).__name__}|{exc}", flush=True)
            else:
                print("OK", flush=True)
    """)
    proc = subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], env=dict(os.environ, **env),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child died with status {proc.returncode}:\n{proc.stderr[-3000:]}"
    return proc.stdout.splitlines()


@pytest.mark.parametrize("name,raw", [("FDKV_COPY_PATH", "dmaa"), ("FDKV_COPY_GRID", "abc"),
                                      ("FDKV_KERNEL_TABLES", "2"), ("FDKV_DMA_MIN_BYTES", "64k")])
def test_bad_value_is_an_error_naming_the_variable_on_both_faces(capi_cpu: ops.CApi, paddle_ops, name: str,
                                                                  raw: str) -> None:
    lines = _child("""
        import numpy as np, paddle
        capi = ops.load_capi(variant="cpu")
        dev = np.zeros((4, 16), np.uint8)
        host = np.zeros((4, 16), np.uint8)
        report(lambda: capi.swap_per_layer(dev.ctypes.data, 4, 16, host.ctypes.data, 4, [0], [0], 0))
        report(lambda: capi.get_option("copy_grid"))
        report(lambda: capi.set_option("copy_grid", 4))
        cache = paddle.zeros([4, 16], dtype="uint8")
        report(lambda: ops.swap_cache_per_layer(cache, host.ctypes.data, 4, [0], [0], 0, 0))
        report(lambda: ops.swap_cache_layout([cache], host.ctypes.data, [], [0], [0], 0, 0, max_block_num_cpu=4))
        report(lambda: envs.get(NAME))
    """.replace("NAME", repr(name)), **{name: raw})
    for line, op in zip(lines[:5], ["swap_per_layer", "get_option", "set_option", "swap_cache_per_layer",
                                    "swap_cache_layout"]):
        kind, got_op, argument, message = line.split("|", 3)
        assert (kind, got_op, argument) == ("SwapOpError", op, name), line
        assert repr(raw) in message
    assert lines[5].startswith("ValueError|") and name in lines[5]


def test_copy_path_names_are_case_insensitive_in_the_core(capi_cpu: ops.CApi) -> None:
    lines = _child("""
        capi = ops.load_capi(variant="cpu")
        print(capi.get_option("copy_path"), envs.get("FDKV_COPY_PATH"))
    """, FDKV_COPY_PATH=" DMA ")
    assert lines == [f"{ops.COPY_PATH_DMA} dma"]


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

    monkeypatch.delenv("FDKV_REQUIRE_OPS", raising=False)
    with pytest.raises(pytest.skip.Exception):
        ops_missing("needs the ops built by `bash build.sh`")
    monkeypatch.setenv("FDKV_REQUIRE_OPS", "1")
    with pytest.raises(pytest.fail.Exception, match="FDKV_REQUIRE_OPS"):
        ops_missing("needs the ops built by `bash build.sh`")
