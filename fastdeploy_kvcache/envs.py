"""Environment variables read by fastdeploy_kvcache, in one place.

Every variable is read lazily through :func:`get` so that tests can monkeypatch the
environment, and so that importing this module has no side effects.

One rule for every value, the same one the C++ core applies to the ``FDKV_*`` variables
it reads itself (``custom_ops/csrc/swap_core.cc``; ``tests/ops/test_ops_env.py`` parses
a table of raw values through both and compares):

* surrounding whitespace is ignored, and an empty value means the default;
* an integer is an optional sign followed by ASCII decimal digits (no ``0x``, no ``_``,
  no ``1e3``), inside the variable's documented range;
* a name (a copy path, a boolean) is ASCII and case-insensitive;
* anything else is an error naming the variable (``ValueError`` here; a
  :class:`~fastdeploy_kvcache.ops.SwapOpError` whose ``argument`` is the variable when
  the C++ core finds it), never a silent fallback to the default.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class EnvVar:
    """One documented environment variable."""

    name: str
    default: str
    help: str
    parse: Callable[[str], object] = str


def _name(value: str) -> str:
    """A case-insensitive ASCII name (``str.lower`` alone would fold the Kelvin sign to
    ``k``, which the C++ reader would not)."""
    stripped = value.strip()
    if not stripped.isascii():
        raise ValueError(f"expected an ASCII name, got {value!r}")
    return stripped.lower()


def _bool(value: str) -> bool:
    lowered = _name(value)
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (0/1/true/false/yes/no/on/off), got {value!r}")


_INT_RE = re.compile(r"[+-]?[0-9]+")
INT64_MAX = (1 << 63) - 1


def int_in(lo: int, hi: int = INT64_MAX) -> Callable[[str], int]:
    """Parser of an integer in ``[lo, hi]`` (``int()`` alone would take ``1_000`` and
    Unicode digits, which the C++ reader does not)."""

    def parse(value: str) -> int:
        stripped = value.strip()
        if not _INT_RE.fullmatch(stripped):
            raise ValueError(f"expected an integer (optional sign, then decimal digits), got {value!r}")
        number = int(stripped)
        if not lo <= number <= hi:
            raise ValueError(f"{number} is out of range [{lo}, {hi}]")
        return number

    parse.__name__ = f"int_in_{lo}_{hi}"
    return parse


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value.strip())
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"expected a finite number of seconds > 0, got {value!r}")
    return seconds


COPY_PATH_NAMES = ("process", "auto", "kernel", "dma", "staged")
PROCESS_COPY_PATH_NAMES = ("auto", "kernel", "dma", "staged")


def _copy_path(value: str) -> str:
    lowered = _name(value)
    if lowered not in COPY_PATH_NAMES:
        raise ValueError(f"expected one of {', '.join(COPY_PATH_NAMES)}, got {value!r}")
    return lowered


def _process_copy_path(value: str) -> str:
    """FDKV_COPY_PATH is the process-wide option itself, so "process" means nothing there."""
    lowered = _name(value)
    if lowered not in PROCESS_COPY_PATH_NAMES:
        raise ValueError(f"expected one of {', '.join(PROCESS_COPY_PATH_NAMES)}, got {value!r}")
    return lowered


def _existing_file(value: str) -> str:
    """A library path that must exist: a wrong path is an error, not a silent fallback to
    whatever library the search would find instead."""
    path = value.strip()
    if path and not os.path.isfile(path):
        raise ValueError(f"no such file: {path!r}")
    return path


ENV_VARS: dict[str, EnvVar] = {
    v.name: v
    for v in (
        EnvVar(
            "ENABLE_V1_KVCACHE_MANAGER",
            "0",
            "1 turns on the tiered KV-cache manager in an engine.",
            _bool,
        ),
        EnvVar(
            "FDKV_OPS_LIB",
            "",
            "Path of the C ABI library (libfdkv_capi.so) that load_capi() and the cpu and "
            "cupy worker backends use; a path that is not a file is an error. Empty "
            "searches the package and build/ folders.",
            _existing_file,
        ),
        EnvVar(
            "FDKV_COPY_GRID",
            "8",
            "Number of CTAs the scattered-block copy kernel may use (keeps copies off "
            "most SMs while the forward pass runs); 1 to 65535.",
            int_in(1, 65535),
        ),
        EnvVar(
            "FDKV_COPY_PATH",
            "auto",
            "Process-wide copy path for scattered blocks: auto, kernel, dma "
            "(cudaMemcpyBatchAsync) or staged (device gather/scatter + one DMA per host run). Loads follow it; an op call's `path` argument and, for "
            "the worker's device->host copies, FDKV_D2H_COPY_PATH override it.",
            _process_copy_path,
        ),
        EnvVar(
            "FDKV_D2H_COPY_PATH",
            "dma",
            "Copy path of the worker's device->host copies (write_back evictions and "
            "write-through backups), per call: dma (default), auto, kernel, staged, or process "
            "(the process-wide FDKV_COPY_PATH). Host->device loads always follow FDKV_COPY_PATH. "
            "dma because this traffic runs beside the forward pass and the copy engines hold no "
            "SMs: on an H100, all-layer evictions of 128 KiB blocks as DMA rows (the worker's "
            "caches sit at one pitch; 16 or more tensors) cost a forward pass under 1% at ~0.91 "
            "of the link, staged 3-4.6%, the copy kernel up to +218%. At 16 KiB blocks DMA moves "
            "~0.58 of the link; auto (staged) ~0.95 for 1.5-4.6% of compute (docs/benchmarks.md).",
            _copy_path,
        ),
        EnvVar(
            "FDKV_BACKUPS_AFTER_LOADS",
            "1",
            "A write-through backup submitted in the same step as a load starts once that load "
            "has landed, so the load has the host link to itself (the forward pass waits for the "
            "load; nothing waits for the backup). Applies when the two share no block; evictions "
            "that free device blocks never wait. 0: both directions run at once.",
            _bool,
        ),
        EnvVar(
            "FDKV_DMA_MIN_BYTES",
            str(64 << 10),
            "auto copy path: use the cudaMemcpyBatchAsync DMA batch when the average copy "
            "(merged run of one tensor) is at least this many bytes, else the copy kernel "
            "(measured crossover on H100 PCIe: between 32 and 128 KiB).",
            int_in(0),
        ),
        EnvVar(
            "FDKV_MERGE_MIN_BYTES",
            str(1 << 20),
            "Kernel path: merged runs of consecutive ids at least this long go to one "
            "cudaMemcpyAsync each instead of the kernel.",
            int_in(0),
        ),
        EnvVar(
            "FDKV_DMA_SLICE_BYTES",
            str(16 << 20),
            "DMA path: bytes per cudaMemcpyBatchAsync call (slices let the copy engines start "
            "while the driver prepares the next slice).",
            int_in(1),
        ),
        EnvVar(
            "FDKV_COPY_KERNEL",
            "0",
            "Copy kernel variant: 0 warp copy with streaming cache hints, 1 warp copy with "
            "L2 256B prefetch loads, 2 warp copy with default caching, 3 bulk-copy (TMA) "
            "pipeline (sm_90, 16-byte multiples only).",
            int_in(0, 3),
        ),
        EnvVar(
            "FDKV_KERNEL_TABLES",
            "1",
            "Copy kernel reads its id tables from pinned host memory (1, no extra memcpy "
            "per call) or from a device copy (0).",
            int_in(0, 1),
        ),
        EnvVar(
            "FDKV_STAGING_BYTES",
            str(256 << 20),
            "Staged copy path: bytes of the device staging ring, per device and direction "
            "(allocated once, at the first staged copy; cut into chunks of up to 64 MiB).",
            int_in(1 << 20),
        ),
        EnvVar(
            "FDKV_LAYER_WAIT_TIMEOUT_S",
            "60",
            "Seconds a host-side wait on a layer's load may take before "
            "LayerSwapTimeoutError.",
            _positive_seconds,
        ),
        EnvVar(
            "FDKV_UNSAFE_DISABLE_ORDERING",
            "",
            "Comma-separated worker ordering rules (1-5) whose fences are switched off. "
            "Only for the race tests that prove each fence is needed; never in serving.",
        ),
        EnvVar(
            "FDKV_REQUIRE_OPS",
            "0",
            "1 makes a test that needs the compiled ops fail, instead of skip, when they are "
            "not built (CI sets it).",
            _bool,
        ),
        EnvVar(
            "FD_PD_TRANSFER_VIA_STORAGE",
            "0",
            "1 lets a --splitwise-role prefill or decode server hand KV over through the "
            "storage tier (the only prefill/decode transfer this engine implements).",
            _bool,
        ),
        EnvVar(
            "FDKV_SOAK",
            "0",
            "1 runs the long hypothesis soak (many more examples and steps).",
            _bool,
        ),
    )
}


# The variables the C++ core reads itself (swap_core.cc's option table), by option name.
CORE_VARS: dict[str, str] = {
    "copy_grid": "FDKV_COPY_GRID",
    "copy_path": "FDKV_COPY_PATH",
    "dma_min_bytes": "FDKV_DMA_MIN_BYTES",
    "merge_min_bytes": "FDKV_MERGE_MIN_BYTES",
    "copy_kernel": "FDKV_COPY_KERNEL",
    "dma_slice_bytes": "FDKV_DMA_SLICE_BYTES",
    "kernel_tables": "FDKV_KERNEL_TABLES",
    "staging_bytes": "FDKV_STAGING_BYTES",
}


def parse(name: str, raw: str) -> object:
    """Parse ``raw`` as a value of the registered variable ``name`` (empty: its default)."""
    var = ENV_VARS[name]
    if not raw.strip():
        raw = var.default
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"bad value for environment variable {name}={raw!r}: {exc}") from exc


def get(name: str) -> object:
    """Return the parsed value of a registered variable (raises KeyError if unknown, and
    ValueError naming the variable if its value is bad)."""
    return parse(name, os.environ.get(name, ENV_VARS[name].default))


def enable_v1_kvcache_manager() -> bool:
    """True when an engine should route KV caching through this package."""
    return bool(get("ENABLE_V1_KVCACHE_MANAGER"))
