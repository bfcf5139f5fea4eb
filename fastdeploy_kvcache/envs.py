"""Environment variables read by fastdeploy_kvcache, in one place.

Every variable is read lazily through :func:`get` so that tests can monkeypatch the
environment, and so that importing this module has no side effects.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class EnvVar:
    """One documented environment variable."""

    name: str
    default: str
    help: str
    parse: Callable[[str], object] = str


def _bool(value: str) -> bool:
    lowered = value.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected a boolean (0/1/true/false), got {value!r}")


COPY_PATH_NAMES = ("process", "auto", "kernel", "dma")


def _copy_path(value: str) -> str:
    lowered = value.strip().lower()
    if lowered not in COPY_PATH_NAMES:
        raise ValueError(f"expected one of {', '.join(COPY_PATH_NAMES)}, got {value!r}")
    return lowered


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
            "Path of the C ABI library (libfdkv_capi.so); empty searches the package "
            "and build/ folders.",
        ),
        EnvVar(
            "FDKV_COPY_GRID",
            "8",
            "Number of CTAs the scattered-block copy kernel may use (keeps copies off "
            "most SMs while the forward pass runs).",
            int,
        ),
        EnvVar(
            "FDKV_COPY_PATH",
            "auto",
            "Process-wide copy path for scattered blocks: auto, kernel or dma "
            "(cudaMemcpyBatchAsync). Loads follow it; an op call's `path` argument and, for "
            "the worker's device->host copies, FDKV_D2H_COPY_PATH override it.",
        ),
        EnvVar(
            "FDKV_D2H_COPY_PATH",
            "dma",
            "Copy path of the worker's device->host copies (write_back evictions and "
            "write-through backups), per call: dma (default), auto, kernel, or process (the "
            "process-wide FDKV_COPY_PATH). Host->device loads always follow FDKV_COPY_PATH. "
            "dma because this traffic runs beside the forward pass: on an H100, 16 KiB-block "
            "evictions on the copy kernel slowed a cuBLAS forward pass by +218%, on the DMA "
            "batch (copy engines, no SMs) by +0.6% (docs/benchmarks.md).",
            _copy_path,
        ),
        EnvVar(
            "FDKV_DMA_MIN_BYTES",
            str(64 << 10),
            "auto copy path: use the cudaMemcpyBatchAsync DMA batch when the average copy "
            "(merged run of one tensor) is at least this many bytes, else the copy kernel "
            "(measured crossover on H100 PCIe: between 32 and 128 KiB).",
            int,
        ),
        EnvVar(
            "FDKV_MERGE_MIN_BYTES",
            str(1 << 20),
            "Kernel path: merged runs of consecutive ids at least this long go to one "
            "cudaMemcpyAsync each instead of the kernel.",
            int,
        ),
        EnvVar(
            "FDKV_DMA_SLICE_BYTES",
            str(16 << 20),
            "DMA path: bytes per cudaMemcpyBatchAsync call (slices let the copy engines start "
            "while the driver prepares the next slice).",
            int,
        ),
        EnvVar(
            "FDKV_COPY_KERNEL",
            "0",
            "Copy kernel variant: 0 warp copy with streaming cache hints, 1 warp copy with "
            "L2 256B prefetch loads, 2 warp copy with default caching, 3 bulk-copy (TMA) "
            "pipeline (sm_90, 16-byte multiples only).",
            int,
        ),
        EnvVar(
            "FDKV_KERNEL_TABLES",
            "1",
            "Copy kernel reads its id tables from pinned host memory (1, no extra memcpy "
            "per call) or from a device copy (0).",
            int,
        ),
        EnvVar(
            "FDKV_LAYER_WAIT_TIMEOUT_S",
            "60",
            "Seconds a host-side wait on a layer's load may take before "
            "LayerSwapTimeoutError.",
            float,
        ),
        EnvVar(
            "FDKV_UNSAFE_DISABLE_ORDERING",
            "",
            "Comma-separated worker ordering rules (1-5) whose fences are switched off. "
            "Only for the race tests that prove each fence is needed; never in serving.",
        ),
        EnvVar(
            "FDKV_SOAK",
            "0",
            "1 runs the long hypothesis soak (many more examples and steps).",
            _bool,
        ),
    )
}


def get(name: str) -> object:
    """Return the parsed value of a registered variable (raises KeyError if unknown)."""
    var = ENV_VARS[name]
    raw = os.environ.get(name, var.default)
    try:
        return var.parse(raw)
    except ValueError as exc:
        raise ValueError(f"bad value for environment variable {name}={raw!r}: {exc}") from exc


def enable_v1_kvcache_manager() -> bool:
    """True when an engine should route KV caching through this package."""
    return bool(get("ENABLE_V1_KVCACHE_MANAGER"))
