"""Build the Paddle custom swap ops into ``build/paddle_ops/fdkv_paddle_ops.so``.

A CUDA extension (nvcc, the copy kernel included) when the installed Paddle is compiled
with CUDA, a C++ extension otherwise; either way one translation unit, built through
``paddle.utils.cpp_extension``.  ``fastdeploy_kvcache/ops.py`` loads the result, so
nothing is installed into site-packages and a clean clone works through ``bash build.sh``.

Usage: ``python setup_ops.py [--force]``.  Skips the build when the library is newer than
every source.
"""

from __future__ import annotations

import logging
import os
import shutil
import sys
from pathlib import Path

logger = logging.getLogger("setup_ops")

ROOT = Path(__file__).resolve().parent
OUT_DIR = ROOT / "build" / "paddle_ops"
NAME = "fdkv_paddle_ops"
SOURCES = [
    ROOT / "custom_ops" / "paddle" / "fdkv_paddle_ops.cc",
    ROOT / "custom_ops" / "paddle" / "fdkv_paddle_ops.cu",
    ROOT / "custom_ops" / "paddle" / "pd_static_op.h",
    ROOT / "custom_ops" / "capi" / "fdkv_capi.cc",
    ROOT / "custom_ops" / "capi" / "fdkv_capi.h",
    ROOT / "custom_ops" / "csrc" / "swap_core.h",
    ROOT / "custom_ops" / "csrc" / "swap_core.cc",
    ROOT / "custom_ops" / "csrc" / "swap_cuda.cu",
    Path(__file__).resolve(),
]


def _up_to_date(lib: Path, stamp: Path, kind: str) -> bool:
    if not lib.is_file() or not stamp.is_file() or stamp.read_text().strip() != kind:
        return False
    built = lib.stat().st_mtime
    return all(src.stat().st_mtime <= built for src in SOURCES)


def build(force: bool = False) -> Path:
    """Compile the extension (if stale) and return the path of the shared library."""
    import paddle
    from paddle.utils.cpp_extension import load

    cuda = bool(paddle.is_compiled_with_cuda())
    kind = f"{'cuda' if cuda else 'cpu'}-paddle{paddle.__version__}"
    lib = OUT_DIR / f"{NAME}.so"
    stamp = OUT_DIR / ".kind"
    if not force and _up_to_date(lib, stamp, kind):
        logger.info("%s is up to date (%s)", lib, kind)
        return lib

    work = OUT_DIR / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    unity = "fdkv_paddle_ops.cu" if cuda else "fdkv_paddle_ops.cc"
    src = str(ROOT / "custom_ops" / "paddle" / unity)
    flag = f"-DFDKV_WITH_CUDA={1 if cuda else 0}"
    cuda_flags = [flag, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                  "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=compute_90"]
    logger.info("building %s (%s) from %s", NAME, kind, unity)
    load(
        name=NAME,
        sources=[src],
        extra_cxx_cflags=[flag, "-O2", "-std=c++17"],
        extra_cuda_cflags=cuda_flags if cuda else None,
        # NOTE: -Bsymbolic keeps this library's calls inside itself even when the C ABI
        # library (same exported names, maybe built without CUDA) is loaded too.
        extra_ldflags=["-Wl,-Bsymbolic"],
        build_directory=str(work),
        verbose=False,
    )
    built = [p for p in work.rglob(f"{NAME}*.so")]
    if not built:
        raise RuntimeError(f"paddle build produced no {NAME}*.so under {work}")
    # The loader module paddle generates is not needed: ops.py registers the .so itself.
    best = max(built, key=lambda p: p.stat().st_mtime)
    shutil.copy2(best, lib)
    os.utime(lib, None)
    stamp.write_text(kind)
    logger.info("built %s", lib)
    return lib


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="[setup_ops] %(message)s")
    build(force="--force" in argv)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
