"""Wheel build glue: compile the C ABI library and the Paddle custom ops into the package.

``pyproject.toml`` holds the metadata; this file only adds a build step, so that
``pip install .`` and a wheel built from the repository work outside the checkout:
the libraries land in ``fastdeploy_kvcache/_lib/`` (found there first by
``fastdeploy_kvcache.libpaths``), with ``build_info.json`` recording what was built.

* The **C ABI library** (``libfdkv_capi_cpu.so``, g++) is always built; the CUDA build
  (``libfdkv_capi.so``, nvcc) too when nvcc and a GPU are present.
* The **Paddle custom ops** are compiled against the Paddle *of the build environment*.
  A custom op must match the Paddle that loads it (version, CPU or CUDA), so Paddle is
  deliberately not a build requirement: an isolated build would download some other
  Paddle and build against that.  Build with the target Paddle visible, as Paddle's own
  custom-op packages do::

      pip install --no-build-isolation .

  Without Paddle in the build environment the wheel ships the C ABI only (enough for the
  cpu and cupy backends) and ``build_info.json`` says why; the ops loader repeats that.

Build-time switches (environment variables, read only here):

``FDKV_BUILD_PADDLE_OPS``  ``auto`` (default: build if Paddle imports), ``1`` (required:
                           fail without Paddle), ``0`` (skip).
``FDKV_BUILD_CUDA``        ``auto`` (default: nvcc and a GPU present), ``1``, ``0``.

An editable install (``pip install -e .``, the ``bash build.sh`` flow) builds nothing here:
the loader uses the checkout's ``build/`` folder.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parent
LIB_SUBDIR = Path("fastdeploy_kvcache") / "_lib"
logger = logging.getLogger("fdkv-setup")


def _switch(name: str) -> str:
    value = os.environ.get(name, "auto").strip().lower() or "auto"
    aliases = {"true": "1", "yes": "1", "on": "1", "false": "0", "no": "0", "off": "0"}
    value = aliases.get(value, value)
    if value not in ("auto", "1", "0"):
        raise SystemExit(f"{name}={os.environ[name]!r}: expected auto, 1 or 0")
    return value


def _nvcc() -> str | None:
    found = shutil.which(os.environ.get("NVCC", "nvcc"))
    if found:
        return found
    return "/usr/local/cuda/bin/nvcc" if os.access("/usr/local/cuda/bin/nvcc", os.X_OK) else None


def _have_gpu() -> bool:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return False
    return subprocess.run([smi, "-L"], capture_output=True).returncode == 0


def _build_capi(kind: str) -> Path:
    """Run custom_ops/capi/build_capi.sh (idempotent) and return the library it made."""
    subprocess.run(["bash", str(ROOT / "custom_ops" / "capi" / "build_capi.sh"), kind], check=True, cwd=ROOT)
    return ROOT / "build" / ("libfdkv_capi_cpu.so" if kind == "cpu" else "libfdkv_capi.so")


class BinaryDistribution(Distribution):
    """The wheel holds compiled libraries: tag it for this platform and Python."""

    def has_ext_modules(self) -> bool:  # noqa: D401 - setuptools API
        return True


class BuildPyWithLibs(build_py):
    """build_py, then compile the native libraries into build_lib/fastdeploy_kvcache/_lib."""

    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # the checkout flow: fastdeploy_kvcache/ops finds build/ (bash build.sh builds it)
        out = Path(self.build_lib) / LIB_SUBDIR
        out.mkdir(parents=True, exist_ok=True)
        info: dict = {"built": {}, "skipped": {}}

        info["built"]["capi_cpu"] = self._ship(_build_capi("cpu"), out)
        cuda = _switch("FDKV_BUILD_CUDA")
        nvcc = _nvcc()
        if cuda == "1" and not nvcc:
            raise SystemExit("FDKV_BUILD_CUDA=1 but there is no nvcc on PATH or in /usr/local/cuda/bin")
        if cuda == "1" or (cuda == "auto" and nvcc and _have_gpu()):
            info["built"]["capi_cuda"] = self._ship(_build_capi("gpu"), out)
        else:
            info["skipped"]["capi_cuda"] = (
                "FDKV_BUILD_CUDA=0" if cuda == "0" else "no nvcc" if not nvcc else "no GPU at build time (FDKV_BUILD_CUDA=1 forces it)"
            )

        want = _switch("FDKV_BUILD_PADDLE_OPS")
        if want == "0":
            info["skipped"]["paddle_ops"] = "FDKV_BUILD_PADDLE_OPS=0"
        else:
            sys.path.insert(0, str(ROOT))
            import setup_ops

            try:
                setup_ops.import_paddle()  # can the build see Paddle?
            except ImportError as exc:
                if want == "1":
                    raise SystemExit(
                        f"FDKV_BUILD_PADDLE_OPS=1 but Paddle does not import in the build environment ({exc}); "
                        "install paddlepaddle(-gpu) and build with `pip install --no-build-isolation .`"
                    ) from exc
                info["skipped"]["paddle_ops"] = (
                    f"Paddle did not import in the build environment ({exc}); pip's build isolation "
                    "hides an installed Paddle: build with --no-build-isolation"
                )
                logger.warning("fastdeploy_kvcache: building without the Paddle ops: %s", info["skipped"]["paddle_ops"])
            else:
                lib = setup_ops.build()
                info["built"]["paddle_ops"] = self._ship(lib, out)
                info["paddle"] = setup_ops.paddle_identity()
        (out / "build_info.json").write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")

    @staticmethod
    def _ship(lib: Path, out: Path) -> str:
        if not lib.is_file():
            raise SystemExit(f"expected {lib} after the build; it is missing")
        shutil.copy2(lib, out / lib.name)
        return lib.name


setup(distclass=BinaryDistribution, cmdclass={"build_py": BuildPyWithLibs})
