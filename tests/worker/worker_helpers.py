"""Helpers of the worker tests: skips, small configs, block fill/read through the caches."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import pytest

from fastdeploy_kvcache.config import CacheConfig
from skip_helpers import cpu_capi_or_skip


def capi_or_skip() -> None:
    """Skip unless the CPU build of the C ABI library is present."""
    cpu_capi_or_skip("the CPU worker tests")


def paddle_ops_or_skip() -> None:
    """Skip unless CPU Paddle and the compiled Paddle custom ops are present."""
    pytest.importorskip("paddle", reason="needs paddlepaddle (CPU) installed: `bash build.sh`")
    from fastdeploy_kvcache import ops

    if not ops.paddle_ops_available():
        pytest.skip("needs the Paddle custom ops (run `bash build.sh`, which runs setup_ops.py)")


def small_config(**overrides: Any) -> CacheConfig:
    kwargs: dict[str, Any] = dict(
        num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32",
        num_gpu_blocks=8, num_host_blocks=8,
    )
    kwargs.update(overrides)
    return CacheConfig(**kwargs)


def to_numpy(array: Any) -> np.ndarray:
    return array.numpy() if hasattr(array, "numpy") else np.asarray(array)


def block_value(seed: int, layer: int, kind: int) -> int:
    """A value distinct per (seed, layer, kind) that survives uint8 and float storage."""
    return (seed * 7 + layer * 3 + kind + 1) % 251


def fill_block(ctrl: Any, block: int, seed: int) -> None:
    """Compute-side write: every layer/kind of device block ``block`` := block_value(...)."""
    for layer in range(ctrl.num_layers):
        for kind, array in enumerate(ctrl.layer_caches(layer)):
            array[block] = block_value(seed, layer, kind)


def block_seed(ctrl: Any, block: int) -> Any:
    """The seed a device block was filled with, or None if its layers/kinds disagree."""
    seeds = set()
    for layer in range(ctrl.num_layers):
        for kind, array in enumerate(ctrl.layer_caches(layer)):
            data = to_numpy(array[block]).reshape(-1)
            values = set(np.unique(data).tolist())
            if len(values) != 1:
                return None
            seeds.add(_inverse(int(values.pop()), layer, kind))
    return seeds.pop() if len(seeds) == 1 else None


def _inverse(value: int, layer: int, kind: int) -> Any:
    for seed in range(0, 251):
        if block_value(seed, layer, kind) == value:
            return seed
    return None


def host_block_bytes(ctrl: Any, host_block: int) -> list[bytes]:
    """Raw bytes of host block ``host_block`` in every host buffer (layer-major, kind order)."""
    out = []
    for layer in range(ctrl.num_layers):
        names = ctrl.cache_names(layer)
        for kind in ("key", "value", "key_scale", "value_scale")[: len(ctrl.layer_caches(layer))]:
            ptr = ctrl.host_cache_kvs_map[names[kind]]
            nbytes = ctrl._block_bytes(kind)
            out.append(ctypes.string_at(ptr + host_block * nbytes, nbytes))
    return out


def device_block_bytes(ctrl: Any, block: int) -> list[bytes]:
    return [to_numpy(a[block]).tobytes() for layer in range(ctrl.num_layers) for a in ctrl.layer_caches(layer)]
