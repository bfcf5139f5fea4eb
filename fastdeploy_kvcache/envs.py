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
            "Copy path for scattered blocks: auto, kernel or dma (cudaMemcpyBatchAsync).",
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
