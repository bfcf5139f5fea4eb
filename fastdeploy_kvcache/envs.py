"""Environment variables read by fastdeploy_kvcache, in one place.

Every variable is read lazily through :func:`get` so that tests can monkeypatch the
environment, and so that importing this module has no side effects.  These are the
user-facing switches only: the copy ops' tuning knobs are options set through
``CApi.set_option`` (and the benchmarks' ``--option`` flags), the worker's through its
constructor arguments (docs/ops.md, "Options"), and test-only switches live in the tests.
The ``FDKV_STORAGE_THROTTLE_*`` and ``FDKV_STORAGE_FORCE_*`` variables are the exception:
benchmark and test knobs that must reach servers started as subprocesses, where no Python
object can be passed in; they are named as such in their help.

One rule for every value:

* surrounding whitespace is ignored, and an empty value means the default;
* a number of seconds is finite and positive;
* a name (a boolean) is ASCII and case-insensitive;
* anything else is a ``ValueError`` naming the variable, never a silent fallback to the
  default.
"""

from __future__ import annotations

import math
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
    # A knob for benchmarks and tests that must reach a server started as a subprocess, not
    # a setting for users (its help says so).
    benchmark_only: bool = False


def _name(value: str) -> str:
    """A case-insensitive ASCII name (``str.lower`` alone would fold the Kelvin sign to
    ``k``)."""
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


def _positive_seconds(value: str) -> float:
    try:
        seconds = float(value.strip())
    except ValueError:
        raise ValueError(f"expected a number of seconds, got {value!r}") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"expected a finite number of seconds > 0, got {value!r}")
    return seconds


def _non_negative(value: str) -> float:
    try:
        number = float(value.strip())
    except ValueError:
        raise ValueError(f"expected a number >= 0, got {value!r}") from None
    if not math.isfinite(number) or number < 0:
        raise ValueError(f"expected a finite number >= 0, got {value!r}")
    return number


def _non_negative_or_unset(value: str) -> "float | None":
    """A finite number >= 0, or ``None`` for an empty value (the device's default)."""
    return None if not value.strip() else _non_negative(value)


def _non_negative_int_or_unset(value: str) -> "int | None":
    """An int >= 0, or ``None`` for an empty value (the knob is off)."""
    stripped = value.strip()
    if not stripped:
        return None
    try:
        number = int(stripped)
    except ValueError:
        raise ValueError(f"expected an int >= 0 (or empty: off), got {value!r}") from None
    if number < 0:
        raise ValueError(f"expected an int >= 0 (or empty: off), got {value!r}")
    return number


def _existing_file(value: str) -> str:
    """A library path that must exist: a wrong path is an error, not a silent fallback to
    whatever library the search would find instead."""
    path = value.strip()
    if path and not os.path.isfile(path):
        raise ValueError(f"no such file: {path!r}")
    return path


def _stripped(value: str) -> str:
    """A secret or free-form text: taken as it is, less surrounding whitespace."""
    return value.strip()


def _directory(value: str) -> str:
    """A directory path (created on first use); empty: the default location."""
    return os.path.expanduser(value.strip())


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
            "FDKV_API_KEY",
            "",
            "The API key the server and the router require (the --api-key default): every /v1 "
            "route then needs 'Authorization: Bearer <key>'. Empty: no key (unless "
            "--api-keys-file is given).",
            _stripped,
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
            "FDKV_LAYER_WAIT_TIMEOUT_S",
            "60",
            "Seconds a host-side wait on a layer's load may take before "
            "LayerSwapTimeoutError.",
            _positive_seconds,
        ),
        EnvVar(
            "FDKV_HOST_GROW_CHUNK_MIB",
            "",
            "How the engine's host tier (--swap-space) is pinned. 0 pins it before serving. N > 0 "
            "pins it in the background while the server already serves: with CPU copies N MiB of "
            "blocks at a time, lowest block ids first, each piece usable once pinned; with CUDA "
            "copies as one piece (a 2D copy across separately registered pieces fails), the "
            "tier empty until the whole of it lands. Empty (the default): in the background with "
            "CUDA copies, before serving with CPU copies.",
            _non_negative_or_unset,
        ),
        EnvVar(
            "FDKV_HOST_GROW_PACE_S",
            "0",
            "Seconds the background pinning of the host tier waits between pieces (0: none): "
            "leaves memory bandwidth to serving, and lets tests watch the tier grow.",
            _non_negative,
        ),
        EnvVar(
            "FDKV_MODEL_CACHE_DIR",
            "",
            "Directory of converted models (the --model-cache-dir default). Empty: "
            "~/.cache/fastdeploy_kvcache/models.",
            _directory,
        ),
        EnvVar(
            "FDKV_STORAGE_THROTTLE_BYTES_PER_S",
            "0",
            "Benchmarks and tests only: > 0 holds the storage tier's reads to this many bytes/s "
            "(storage/throttle.py's ThrottledBackend around the configured backend; writes are "
            "untouched), a slow store on a fast disk. 0: off.",
            _non_negative,
            benchmark_only=True,
        ),
        EnvVar(
            "FDKV_STORAGE_FORCE_FETCH_BLOCKS",
            "",
            "Benchmarks only (the offline sweep of the fetch-or-recompute split): with "
            "--kvcache-storage-fetch-plan on, every plan fetches N blocks of a stored prefix "
            "(all of it if shorter) and recomputes the rest, whatever the rates say. Empty: off.",
            _non_negative_int_or_unset,
            benchmark_only=True,
        ),
        EnvVar(
            "FD_PD_TRANSFER_VIA_STORAGE",
            "0",
            "1 lets a --splitwise-role prefill or decode server hand KV over through the "
            "storage tier (the only prefill/decode transfer this engine implements).",
            _bool,
        ),
    )
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


def api_key() -> "str | None":
    """``FDKV_API_KEY``: the key ``--api-key`` defaults to; None when unset or empty."""
    return get("FDKV_API_KEY") or None  # type: ignore[return-value]


def host_grow_chunk_bytes() -> "int | None":
    """``FDKV_HOST_GROW_CHUNK_MIB`` in bytes; None when unset (the controller's default:
    ``CacheController.initialize_host_cache``)."""
    mib = get("FDKV_HOST_GROW_CHUNK_MIB")
    return None if mib is None else int(float(mib) * (1 << 20))  # type: ignore[arg-type]


def storage_throttle_bytes_per_s() -> float:
    """``FDKV_STORAGE_THROTTLE_BYTES_PER_S``: the read rate a benchmark holds the store to (0: off)."""
    return float(get("FDKV_STORAGE_THROTTLE_BYTES_PER_S"))  # type: ignore[arg-type]


def storage_force_fetch_blocks() -> "int | None":
    """``FDKV_STORAGE_FORCE_FETCH_BLOCKS``: blocks every fetch plan fetches (None: the plan decides)."""
    return get("FDKV_STORAGE_FORCE_FETCH_BLOCKS")  # type: ignore[return-value]


def triton_interpreter() -> bool:
    """Whether Triton runs its kernels in its CPU interpreter: Triton's own ``TRITON_INTERPRET``
    (read by Triton at import; not one of ours, so not in :data:`ENV_VARS`).  The transformers
    runner's Triton attention runs on the CPU only there (tests)."""
    return os.environ.get("TRITON_INTERPRET") == "1"
