"""The package works outside its checkout (the user's path), and the build script behaves.

Builds a wheel from a copy of the sources (``pip wheel --no-build-isolation``, the
documented install: the Paddle ops are compiled against this interpreter's Paddle), installs
it into a fresh venv in a temporary directory, and from a directory outside the repository
runs a swap through the C ABI library, a swap through the Paddle op, and a CacheController
device->host->device round trip on the cpu backend, checking bytes each time.  The script
also checks that every library was loaded from the installed package's ``_lib/``, so the
test fails if the wheel does not ship them.

Offline-tolerant: nothing is downloaded.  The wheel is installed with ``--no-deps`` and the
new venv sees its dependencies (Paddle, numpy, xxhash) through a ``.pth`` line naming this
interpreter's site-packages; that line adds a directory to ``sys.path`` without processing
its ``.pth`` files, so the checkout's editable install stays invisible.

About a minute (the Paddle op compiles from scratch); ``-m "not packaging"`` leaves it out.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.packaging

ROOT = Path(__file__).resolve().parents[1]
# What a wheel build reads (pyproject.toml, setup.py and what they name); a missing entry
# shows up as a failed build here, before it does for a user.
SOURCES = ["pyproject.toml", "setup.py", "setup_ops.py", "MANIFEST.in", "README.md", "custom_ops", "fastdeploy_kvcache"]
IGNORE = shutil.ignore_patterns("__pycache__", "*.pyc", "*.so", "*.o", "_lib", "*.egg-info")

# Runs inside the fresh venv, with the working directory outside the repository.
SCRIPT = r'''
import ctypes, json, sys
from pathlib import Path

import numpy as np

import fastdeploy_kvcache
from fastdeploy_kvcache import libpaths, ops

venv, repo = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
pkg = Path(fastdeploy_kvcache.__file__).resolve().parent
assert pkg.is_relative_to(venv), f"imported {pkg}, not the installed copy under {venv}"
assert not any(Path(p).resolve() == repo for p in sys.path if p), f"the checkout is on sys.path: {sys.path}"
assert libpaths.checkout_build_dir() is None, "an installed package must not look for build/"
lib_dir = pkg / "_lib"
info = json.loads((lib_dir / "build_info.json").read_text())
assert info["built"].get("capi_cpu") and info["built"].get("paddle_ops"), info

# 1. The C ABI library (CPU build: numpy memory plays the device).
capi = ops.load_capi(variant="cpu")
assert Path(capi.path).parent == lib_dir, capi.path
rng = np.random.default_rng(7)
dev = rng.integers(0, 256, (6, 64), dtype=np.uint8)
host = np.zeros((8, 64), np.uint8)
original = dev.copy()
capi.swap_per_layer(dev.ctypes.data, 6, 64, host.ctypes.data, 8, [1, 4], [7, 0], ops.CopyDirection.DEVICE_TO_HOST)
assert (host[7] == original[1]).all() and (host[0] == original[4]).all()
dev[:] = 0
capi.swap_per_layer(dev.ctypes.data, 6, 64, host.ctypes.data, 8, [1, 4], [7, 0], ops.CopyDirection.HOST_TO_DEVICE)
assert (dev[1] == original[1]).all() and (dev[4] == original[4]).all() and not dev[0].any()

# 2. The Paddle op, on a CPU tensor and host memory from ops.cuda_host_alloc.
import paddle

assert Path(ops.paddle_ops.paddle_ops_path()).parent == lib_dir, ops.paddle_ops.paddle_ops_path()
cache = paddle.to_tensor(rng.standard_normal((5, 2, 4, 8)).astype(np.float32))
before = cache.numpy().copy()
block_bytes = before[0].nbytes
ptr = ops.cuda_host_alloc(4 * block_bytes)
try:
    host_view = np.ctypeslib.as_array((ctypes.c_uint8 * (4 * block_bytes)).from_address(ptr)).reshape(4, block_bytes)
    out = ops.swap_cache_per_layer(cache, ptr, 4, [3], [2], 0, ops.CopyDirection.DEVICE_TO_HOST)
    assert out.data_ptr() == cache.data_ptr()
    assert host_view[2].tobytes() == before[3].tobytes()
    ops.swap_cache_per_layer(cache, ptr, 4, [0], [2], 0, ops.CopyDirection.HOST_TO_DEVICE)
    assert cache.numpy()[0].tobytes() == before[3].tobytes()
finally:
    ops.cuda_host_free(ptr)

# 3. CacheController round trip on the cpu backend: device->host, then host->device.
from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, TransferKind
from fastdeploy_kvcache.worker.cache_controller import CacheController

cfg = CacheConfig(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
                  num_gpu_blocks=8, num_host_blocks=8)
ctrl = CacheController(cfg, local_rank=0, device_id=0, backend="cpu")
try:
    ctrl.initialize_kv_cache(cfg.num_gpu_blocks)
    ctrl.initialize_host_cache(8)
    arrays = [a for layer in range(ctrl.num_layers) for a in ctrl.layer_caches(layer)]
    for i, a in enumerate(arrays):
        a[2] = 10 + i
    ctrl.submit_swap_tasks(CacheSwapMetadata([2], [5], CacheLevel.DEVICE, CacheLevel.HOST, kind=TransferKind.EVICT), None)
    done = ctrl.collect_finished(wait=True, timeout_s=60)
    assert [m.success for m in done] == [True], [(m.success, m.error_message) for m in done]
    i = 0
    for layer in range(ctrl.num_layers):
        names = ctrl.cache_names(layer)
        for kind, a in zip(("key", "value"), ctrl.layer_caches(layer)):
            nbytes = a[2].nbytes
            got = ctypes.string_at(ctrl.host_cache_kvs_map[names[kind]] + 5 * nbytes, nbytes)
            assert got == a[2].tobytes(), (layer, kind)
            i += 1
    assert i == len(arrays)
    counter = ctrl.submit_swap_tasks(None, CacheSwapMetadata([5], [6], CacheLevel.HOST, CacheLevel.DEVICE, kind=TransferKind.SWAP_IN))
    counter.wait_all()
    done = ctrl.collect_finished(wait=True, timeout_s=60)
    assert [m.success for m in done] == [True], [(m.success, m.error_message) for m in done]
    for i, a in enumerate(arrays):
        assert (a[6] == 10 + i).all() and a[6].tobytes() == a[2].tobytes()
finally:
    ctrl.close()
print("installed package OK:", pkg)
'''


def _require_ops() -> bool:
    """FDKV_REQUIRE_OPS (CI): fail instead of skipping when the build cannot include the ops."""
    from skip_helpers import env_switch

    return env_switch("FDKV_REQUIRE_OPS")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"{' '.join(cmd)} exited {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    return proc.stdout


def _clean_env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "FDKV_OPS_LIB", "PIP_REQUIRE_VIRTUALENV")}
    env.update(PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1", PYTHONNOUSERSITE="1", HOME=str(tmp / "home"))
    return env


def test_wheel_installs_and_works_outside_the_checkout(tmp_path: Path) -> None:
    if importlib.util.find_spec("paddle") is None:  # find_spec: importing Paddle here costs seconds
        if _require_ops():
            pytest.fail("FDKV_REQUIRE_OPS=1 but Paddle is not installed; run `bash build.sh`")
        pytest.skip("needs paddlepaddle in this interpreter to build the wheel's Paddle ops (`bash build.sh`)")
    env = _clean_env(tmp_path)
    (tmp_path / "home").mkdir()

    src = tmp_path / "src"
    src.mkdir()
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=IGNORE)
        else:
            shutil.copy2(path, src / name)

    dist = tmp_path / "dist"
    build_env = dict(env, FDKV_BUILD_PADDLE_OPS="1")
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps", "--no-index",
          "-w", str(dist), str(src)], tmp_path, build_env, timeout=900)
    wheels = list(dist.glob("fastdeploy_kvcache-*.whl"))
    assert len(wheels) == 1, wheels
    wheel = wheels[0]
    assert "-none-any" not in wheel.name, f"{wheel.name}: a wheel with compiled libraries must be platform-tagged"
    names = set(zipfile.ZipFile(wheel).namelist())
    for lib in ("libfdkv_capi_cpu.so", "fdkv_paddle_ops.so", "build_info.json"):
        assert f"fastdeploy_kvcache/_lib/{lib}" in names, f"{wheel.name} does not ship _lib/{lib}"

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, env, timeout=120)
    vpy = venv / "bin" / "python"
    _run([sys.executable, "-m", "pip", "--python", str(vpy), "install", "-q", "--no-deps", "--no-index", str(wheel)],
         tmp_path, env, timeout=300)
    purelib = _run([str(vpy), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], tmp_path, env, 60).strip()
    deps = [p for p in site.getsitepackages() if Path(p).is_dir()]
    (Path(purelib) / "fdkv_test_deps.pth").write_text("\n".join(deps) + "\n")

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    script = outside / "check_installed.py"
    script.write_text(SCRIPT)
    out = _run([str(vpy), str(script), str(venv), str(ROOT)], outside, env, timeout=300)
    assert "installed package OK" in out


def _load_libpaths_at(pkg_dir: Path):
    """Import a copy of libpaths.py that lives in ``pkg_dir`` (its location is its input)."""
    import importlib.util as iu

    spec = iu.spec_from_file_location("fdkv_libpaths_copy", pkg_dir / "libpaths.py")
    module = iu.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_lookup_order_and_hints_in_a_checkout_and_in_an_install(tmp_path: Path) -> None:
    """Fast companion of the wheel test: the search order, and which hint a missing
    library gets, in both layouts (real directories, no wheel build)."""
    from fastdeploy_kvcache import libpaths

    # This checkout: the package's _lib first (a wheel's own libraries win), then build/.
    assert libpaths.checkout_build_dir() == ROOT / "build"
    assert libpaths.capi_candidates("cpu") == [libpaths.LIB_DIR / "libfdkv_capi_cpu.so", ROOT / "build" / "libfdkv_capi_cpu.so"]
    assert libpaths.capi_candidates()[0].name == "libfdkv_capi.so"  # CUDA build before CPU build
    assert libpaths.paddle_ops_candidates()[-1] == ROOT / "build" / "paddle_ops" / "fdkv_paddle_ops.so"
    assert "bash build.sh" in libpaths.missing_hint("paddle_ops")
    with pytest.raises(ValueError, match="variant"):
        libpaths.capi_candidates("rocm")

    # An installed layout: site-packages/fastdeploy_kvcache with _lib/build_info.json, no setup_ops.py.
    pkg = tmp_path / "site-packages" / "fastdeploy_kvcache"
    (pkg / "_lib").mkdir(parents=True)
    shutil.copy2(Path(libpaths.__file__), pkg / "libpaths.py")
    reason = "Paddle did not import in the build environment"
    (pkg / "_lib" / "build_info.json").write_text(f'{{"built": {{"capi_cpu": "libfdkv_capi_cpu.so"}}, "skipped": {{"paddle_ops": "{reason}"}}}}')
    installed = _load_libpaths_at(pkg)
    assert installed.checkout_build_dir() is None
    assert installed.paddle_ops_candidates() == [pkg / "_lib" / "fdkv_paddle_ops.so"]
    assert installed.find_paddle_ops() is None
    hint = installed.missing_hint("paddle_ops")
    assert reason in hint and "--no-build-isolation" in hint and "build.sh" not in hint

    # Ops built for another Paddle than the installed one are named as such before loading.
    shipped = pkg / "_lib" / "fdkv_paddle_ops.so"
    (pkg / "_lib" / "build_info.json").write_text('{"paddle": {"dist": "paddlepaddle", "version": "0.0.1"}}')
    message = installed.paddle_build_mismatch(shipped)
    assert message and "paddlepaddle 0.0.1" in message and "reinstall" in message
    assert installed.paddle_build_mismatch(ROOT / "build" / "paddle_ops" / "fdkv_paddle_ops.so") is None
    try:
        current = importlib.metadata.version("paddlepaddle")
    except importlib.metadata.PackageNotFoundError:
        return
    (pkg / "_lib" / "build_info.json").write_text(f'{{"paddle": {{"dist": "paddlepaddle", "version": "{current}"}}}}')
    assert installed.paddle_build_mismatch(shipped) is None


def _have_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    return bool(smi) and subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def test_gpu_test_without_a_gpu_exits_nonzero_saying_why() -> None:
    """Without a GPU every tests/gpu test would skip and the run would look green."""
    if _have_gpu():
        pytest.skip("this machine has a GPU; the refusal is checked on machines without one (CI)")
    proc = subprocess.run(["bash", str(ROOT / "build.sh"), "gpu-test"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    assert "gpu-test needs an NVIDIA GPU" in proc.stderr, proc.stderr


def test_build_on_a_built_tree_is_silent() -> None:
    """`bash build.sh` on a built tree prints nothing: no pip, setuptools or compiler output.

    Under `bash build.sh test` (CI) the tree was built moments before, so this run is the
    second build.  Run by hand on a stale tree, it builds first and then checks a second run.
    """
    cmd = ["bash", str(ROOT / "build.sh"), "build"]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
    assert first.returncode == 0, first.stderr[-6000:]
    second = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert second.returncode == 0, second.stderr[-6000:]
    assert second.stdout == "" and second.stderr == "", f"a second build printed:\n{second.stdout}{second.stderr}"


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__, "-q"]))
