"""Where the compiled libraries are: the installed package first, then a checkout's build/.

Two layouts exist, and both must work:

* **Installed** (``pip install``, a wheel): the wheel build compiles the C ABI library and,
  when Paddle is in the build environment, the Paddle custom ops, and ships them in
  ``fastdeploy_kvcache/_lib/`` next to a ``build_info.json`` that records what was built
  and against which Paddle.  A user of the plugin never has a ``build/`` folder.
* **Checkout** (``bash build.sh``, an editable install): ``build/libfdkv_capi*.so`` and
  ``build/paddle_ops/fdkv_paddle_ops.so`` under the repository root.

The package folder wins, so an installed copy never picks up a stale build of some other
checkout; ``build/`` is only looked at when this module really sits in a checkout (the
repository root has ``setup_ops.py``).  An explicit path (``FDKV_OPS_LIB``, a ``path``
argument) is handled by the caller, before these candidates.

Stdlib only, no Paddle import: the scheduler side imports ``ops`` lazily and fast.
"""

from __future__ import annotations

import json
import logging
from importlib import metadata
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

PACKAGE_DIR = Path(__file__).resolve().parent
LIB_DIR = PACKAGE_DIR / "_lib"
"""Where a wheel ships the compiled libraries (filled by ``setup.py``'s build step)."""
BUILD_INFO = "build_info.json"
"""``_lib/build_info.json``: what the wheel build compiled and what it skipped, and why."""

CAPI_NAMES: dict[str, str] = {"cuda": "libfdkv_capi.so", "cpu": "libfdkv_capi_cpu.so"}
"""File names of the C ABI library per variant (the CUDA build is preferred when both exist)."""
PADDLE_OPS_NAME = "fdkv_paddle_ops.so"

_REPO_ROOT = PACKAGE_DIR.parent
_CHECKOUT_HINT = {
    "capi_cpu": "run `bash build.sh` from the repository root",
    "paddle_ops": "run `bash build.sh` from the repository root (it builds them against the venv's Paddle)",
    "capi_cuda": "run `bash build.sh gpu` (needs nvcc) from the repository root",
}
_INSTALL_HINT = {
    "capi_cpu": "reinstall the package (`pip install --no-build-isolation <source>`)",
    "paddle_ops": "reinstall it from an environment that has Paddle: `pip install --no-build-isolation <source>`",
    "capi_cuda": "reinstall it where nvcc and a GPU are present, or with FDKV_BUILD_CUDA=1: "
                 "`pip install --no-build-isolation <source>`",
}


def checkout_build_dir() -> Optional[Path]:
    """``<repo>/build`` when this package is imported from a source checkout, else None."""
    if (_REPO_ROOT / "setup_ops.py").is_file():
        return _REPO_ROOT / "build"
    return None


def capi_candidates(variant: Optional[str] = None) -> list[Path]:
    """Default locations of the C ABI library, in search order.

    ``variant`` ``"cuda"`` or ``"cpu"`` picks one build; None lists the CUDA build before
    the CPU build.  The package folder comes first: a wheel's own libraries must not be
    shadowed by some checkout's ``build/``.
    """
    if variant not in (None, "cuda", "cpu"):
        raise ValueError(f"variant must be None, 'cuda' or 'cpu', got {variant!r}")
    names = [CAPI_NAMES[variant]] if variant else [CAPI_NAMES["cuda"], CAPI_NAMES["cpu"]]
    dirs = [LIB_DIR]
    build = checkout_build_dir()
    if build is not None:
        dirs.append(build)
    return [d / n for d in dirs for n in names]


def paddle_ops_candidates() -> list[Path]:
    """Default locations of the Paddle custom-op library, in search order."""
    out = [LIB_DIR / PADDLE_OPS_NAME]
    build = checkout_build_dir()
    if build is not None:
        out.append(build / "paddle_ops" / PADDLE_OPS_NAME)
    return out


def find_paddle_ops() -> Optional[Path]:
    """The first Paddle ops library that exists, or None."""
    return next((p for p in paddle_ops_candidates() if p.is_file()), None)


def build_info() -> dict[str, Any]:
    """The wheel build's record (``_lib/build_info.json``), or {} outside an installed wheel."""
    path = LIB_DIR / BUILD_INFO
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:  # a damaged install: say so, do not guess
        logger.warning("cannot read %s: %s", path, exc)
        return {}


def missing_hint(what: str) -> str:
    """Why ``what`` ("paddle_ops", "capi_cpu", "capi_cuda") is missing and how to get it.

    In a checkout: the ``build.sh`` command.  In an installed package: what its wheel build
    skipped and why (``build_info.json``, e.g. no Paddle in an isolated build), and the
    install command that includes it.
    """
    if what not in _CHECKOUT_HINT:
        raise ValueError(f"unknown library {what!r}; expected one of {sorted(_CHECKOUT_HINT)}")
    if checkout_build_dir() is not None:
        return _CHECKOUT_HINT[what]
    skipped = build_info().get("skipped", {}).get(what)
    why = f"this installation was built without it ({skipped}); " if skipped else ""
    return why + _INSTALL_HINT[what]


def paddle_build_mismatch(so_path: Path) -> Optional[str]:
    """A message if the shipped Paddle ops were built for another Paddle than the installed one.

    A custom op is compiled against one Paddle's headers and ABI; after ``pip install -U
    paddlepaddle`` it may fail to load or misbehave.  Only a wheel records its Paddle
    (``build_info.json``); a checkout's ``build/`` is rebuilt by ``build.sh`` instead.
    """
    if so_path.parent != LIB_DIR:
        return None
    built = build_info().get("paddle") or {}
    if not built.get("dist"):
        return None
    try:
        installed = metadata.version(built["dist"])
    except metadata.PackageNotFoundError:
        installed = None
    if installed == built.get("version"):
        return None
    now = f"{built['dist']} {installed}" if installed else f"no {built['dist']}"
    return (
        f"{so_path} was built for {built['dist']} {built.get('version')}, but {now} is installed; "
        f"reinstall fastdeploy_kvcache (`pip install --no-build-isolation <source>`) so its ops "
        f"match this Paddle"
    )
