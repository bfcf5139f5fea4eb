"""Build the Paddle custom swap ops into ``build/paddle_ops/fdkv_paddle_ops.so``.

A CUDA extension (nvcc, the copy kernel included) when the installed Paddle is compiled
with CUDA, a C++ extension otherwise; either way one translation unit, built through
``paddle.utils.cpp_extension``.  ``fastdeploy_kvcache/ops.py`` loads the result from
``build/`` in a checkout (``bash build.sh``); a wheel build (``setup.py``) calls
:func:`build` and ships the library inside the package.

Usage: ``python setup_ops.py [--force]``.  Skips the build when the library is newer than
every source and was built for the same Paddle distribution and version; that check reads
package metadata only, so a no-op run neither imports Paddle nor prints anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import warnings
from importlib import metadata
from pathlib import Path
from typing import Iterator, Optional

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
    ROOT / "custom_ops" / "csrc" / "file_io.cc",
    ROOT / "custom_ops" / "csrc" / "stack_launcher.cc",
    ROOT / "custom_ops" / "csrc" / "swap_cuda.cu",
    ROOT / "custom_ops" / "csrc" / "swap_staged.cu",
    Path(__file__).resolve(),
]


PADDLE_DISTS = ("paddlepaddle-gpu", "paddlepaddle")


def paddle_identity() -> dict[str, str]:
    """The installed Paddle's distribution name and version, from package metadata.

    Reading metadata instead of importing Paddle keeps the up-to-date check instant and
    silent.  Empty values when Paddle was installed some other way (a source build).
    """
    for dist in PADDLE_DISTS:
        try:
            return {"dist": dist, "version": metadata.version(dist)}
        except metadata.PackageNotFoundError:
            continue
    return {"dist": "", "version": ""}


def _stamp_text() -> Optional[str]:
    ident = paddle_identity()
    return f"{ident['dist']}=={ident['version']}" if ident["dist"] else None


def _up_to_date(lib: Path, stamp: Path) -> bool:
    expected = _stamp_text()
    if expected is None or not lib.is_file() or not stamp.is_file():
        return False
    if stamp.read_text().split()[0:1] != [expected]:
        return False
    built = lib.stat().st_mtime
    return all(src.stat().st_mtime <= built for src in SOURCES)


_CCACHE_FILTER = "ignore:No ccache found"


def import_paddle():
    """Import Paddle and its extension builder without the ccache notice."""
    # NOTE: paddle.utils.cpp_extension warns about a missing ccache on import; a build
    # without ccache is normal here (one translation unit), so that line is noise.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*ccache.*")
        import paddle
        from paddle.utils.cpp_extension import load
    return paddle, load


@contextlib.contextmanager
def _output_to(log: Path) -> Iterator[None]:
    """Send this process's stdout/stderr (file descriptors, so the compiler's child processes
    too) to ``log``; replay the log on stderr only if the body fails.

    NOTE: paddle's JIT builder prints every compiler command and setuptools' progress; a
    successful build needs none of it, a failed one needs all of it.
    """
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    ok = False
    try:
        with open(log, "wb") as sink:
            os.dup2(sink.fileno(), 1)
            os.dup2(sink.fileno(), 2)
            try:
                yield
                ok = True
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)
        if not ok:
            sys.stderr.write(log.read_text(errors="replace"))
            sys.stderr.flush()


def _load(load, src: str, flag: str, cuda_flags: Optional[list[str]], work: Path) -> None:
    """Compile through paddle.utils.cpp_extension.load (the JIT path: no install step)."""
    load(
        name=NAME,
        sources=[src],
        extra_cxx_cflags=[flag, "-O2", "-std=c++17"],
        extra_cuda_cflags=cuda_flags,
        # NOTE: -Bsymbolic keeps this library's calls inside itself even when the C ABI
        # library (same exported names, maybe built without CUDA) is loaded too.
        extra_ldflags=["-Wl,-Bsymbolic"],
        build_directory=str(work),
        verbose=False,
    )


def build(force: bool = False) -> Path:
    """Compile the extension (if stale) and return the path of the shared library."""
    lib = OUT_DIR / f"{NAME}.so"
    stamp = OUT_DIR / ".kind"
    if not force and _up_to_date(lib, stamp):
        logger.debug("%s is up to date (%s)", lib, stamp.read_text().strip())
        return lib
    paddle, load = import_paddle()
    cuda = bool(paddle.is_compiled_with_cuda())
    kind = f"{_stamp_text() or 'paddle==' + paddle.__version__} {'cuda' if cuda else 'cpu'}"

    work = OUT_DIR / "work"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    unity = "fdkv_paddle_ops.cu" if cuda else "fdkv_paddle_ops.cc"
    src = str(ROOT / "custom_ops" / "paddle" / unity)
    flag = f"-DFDKV_WITH_CUDA={1 if cuda else 0}"
    cuda_flags = [flag, "-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a",
                  "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=compute_90"]
    logger.info("building %s (%s) from %s", NAME, kind, unity)
    # load() compiles in a child Python that imports Paddle again: silence the notice there too.
    saved = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [saved, _CCACHE_FILTER]))
    try:
        with warnings.catch_warnings(), _output_to(work / "build.log"):
            warnings.filterwarnings("ignore", message=".*ccache.*")
            _load(load, src, flag, cuda_flags if cuda else None, work)
    finally:
        if saved is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = saved
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
