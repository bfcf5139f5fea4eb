"""Every validation error is raised, names op / argument / index, and writes nothing.
Checked on both faces: the C ABI (numpy memory) and the Paddle ops (CPU tensors)."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest

from fastdeploy_kvcache import ops

NUM_DEV, NUM_HOST, BB = 6, 8, 32

# (dev_ids, host_ids, mode, bad id list ("dev"/"host"/None), index, message fragment)
CASES = {
    "dev_id_too_large": ([0, 6], [0, 1], 0, "dev", 1, "out of range"),
    "dev_id_negative": ([-1, 2], [0, 1], 1, "dev", 0, "out of range"),
    "host_id_too_large": ([0, 1, 2], [0, 1, 8], 0, "host", 2, "out of range"),
    "host_id_negative": ([0], [-3], 1, "host", 0, "out of range"),
    "host_longer": ([0, 1], [0, 1, 2], 0, "host", 2, "lengths must be equal"),
    "dev_longer": ([0, 1, 2], [0], 1, "dev", 1, "lengths must be equal"),
    "duplicate_host_destination": ([0, 1, 2], [5, 4, 5], 0, "host", 2, "unique"),
    "duplicate_dev_destination": ([3, 3], [0, 1], 1, "dev", 1, "unique"),
    "bad_mode": ([0], [0], 2, None, None, "mode"),
}

CAPI_NAMES = {"dev": "dev_ids", "host": "host_ids", None: "mode"}
PADDLE_NAMES = {"dev": "swap_block_ids_gpu", "host": "swap_block_ids_cpu", None: "mode"}


def _check(err: ops.SwapOpError, op: str, argument: str, index: Optional[int], fragment: str) -> None:
    assert err.op == op
    assert err.argument == argument
    assert err.index == index
    assert fragment in str(err)
    assert isinstance(err, ValueError)


@pytest.mark.parametrize("case", sorted(CASES))
def test_capi_rejects_and_writes_nothing(capi_cpu: ops.CApi, case: str) -> None:
    dev_ids, host_ids, mode, which, index, fragment = CASES[case]
    rng = np.random.default_rng(0)
    dev = rng.integers(0, 256, (NUM_DEV, BB), dtype=np.uint8)
    host = rng.integers(0, 256, (NUM_HOST, BB), dtype=np.uint8)
    dev0, host0 = dev.copy(), host.copy()
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu.swap_per_layer(dev.ctypes.data, NUM_DEV, BB, host.ctypes.data, NUM_HOST, dev_ids, host_ids, mode)
    _check(info.value, "swap_per_layer", CAPI_NAMES[which], index, fragment)
    np.testing.assert_array_equal(dev, dev0)
    np.testing.assert_array_equal(host, host0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_capi_all_layers_and_layout_reject_and_write_nothing(capi_cpu: ops.CApi, case: str) -> None:
    dev_ids, host_ids, mode, which, index, fragment = CASES[case]
    devs = [np.full((NUM_DEV, BB), i, np.uint8) for i in range(3)]
    hosts = [np.full((NUM_HOST, BB), 9, np.uint8) for _ in range(3)]
    layout = np.full((NUM_HOST, 3 * BB), 7, np.uint8)
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu.swap_all_layers([d.ctypes.data for d in devs], [h.ctypes.data for h in hosts], NUM_DEV, BB,
                                 NUM_HOST, dev_ids, host_ids, mode)
    _check(info.value, "swap_all_layers", CAPI_NAMES[which], index, fragment)
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu.swap_layout([d.ctypes.data for d in devs], NUM_DEV, BB, layout.ctypes.data, NUM_HOST,
                             dev_ids, host_ids, mode)
    _check(info.value, "swap_layout", CAPI_NAMES[which], index, fragment)
    assert all((d == i).all() for i, d in enumerate(devs))
    assert all((h == 9).all() for h in hosts)
    assert (layout == 7).all()


def test_duplicate_sources_are_allowed(capi_cpu: ops.CApi) -> None:
    """Reading one block twice is harmless: only destinations must be unique."""
    dev = np.arange(NUM_DEV * BB, dtype=np.uint8).reshape(NUM_DEV, BB)
    host = np.zeros((NUM_HOST, BB), np.uint8)
    capi_cpu.swap_per_layer(dev.ctypes.data, NUM_DEV, BB, host.ctypes.data, NUM_HOST, [2, 2], [0, 1], 0)
    np.testing.assert_array_equal(host[[0, 1]], dev[[2, 2]])


def test_capi_rejects_null_and_zero_sized_inputs(capi_cpu: ops.CApi) -> None:
    host = np.zeros((NUM_HOST, BB), np.uint8)
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu.swap_per_layer(0, NUM_DEV, BB, host.ctypes.data, NUM_HOST, [0], [0], 0)
    assert "null" in str(info.value)
    dev = np.zeros((NUM_DEV, BB), np.uint8)
    with pytest.raises(ops.SwapOpError, match="block size"):
        capi_cpu.swap_per_layer(dev.ctypes.data, NUM_DEV, 0, host.ctypes.data, NUM_HOST, [0], [0], 0)
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu.swap_all_layers([dev.ctypes.data], [host.ctypes.data], NUM_DEV, [BB, BB], NUM_HOST, [0], [0], 0)
    assert info.value.argument == "block_bytes"


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("op_name", ["swap_cache_per_layer", "swap_cache_per_layer_async", "swap_cache_all_layers"])
def test_paddle_ops_reject_and_write_nothing(paddle_ops, host_buffer, case: str, op_name: str) -> None:
    dev_ids, host_ids, mode, which, index, fragment = CASES[case]
    paddle = paddle_ops
    cache = paddle.to_tensor(np.random.default_rng(1).integers(0, 256, (NUM_DEV, BB), dtype=np.uint8))
    host = host_buffer(NUM_HOST * BB).reshape(NUM_HOST, BB)
    dev0, host0 = cache.numpy().copy(), host.copy()
    with pytest.raises(ops.SwapOpError) as info:
        if op_name == "swap_cache_per_layer":
            ops.swap_cache_per_layer(cache, host.ctypes.data, NUM_HOST, dev_ids, host_ids, 0, mode)
        elif op_name == "swap_cache_per_layer_async":
            ops.swap_cache_per_layer_async(cache, host.ctypes.data, NUM_HOST, dev_ids, host_ids, 0, mode, 0)
        else:
            ops.swap_cache_all_layers([cache], [host.ctypes.data], NUM_HOST, dev_ids, host_ids, 0, mode, 0)
    _check(info.value, op_name, PADDLE_NAMES[which], index, fragment)
    np.testing.assert_array_equal(cache.numpy(), dev0)
    np.testing.assert_array_equal(host, host0)


@pytest.mark.parametrize("case", sorted(CASES))
def test_paddle_layout_rejects_and_writes_nothing(paddle_ops, host_buffer, case: str) -> None:
    dev_ids, host_ids, mode, which, index, fragment = CASES[case]
    names = {"dev": "gpu_block_ids", "host": "cpu_block_ids", None: "mode"}
    caches = [paddle_ops.full([NUM_DEV, BB], i, dtype="uint8") for i in range(2)]
    host = host_buffer(NUM_HOST * 2 * BB)
    host0 = host.copy()
    with pytest.raises(ops.SwapOpError) as info:
        ops.swap_cache_layout(caches, host.ctypes.data, [NUM_DEV, BB], dev_ids, host_ids, 0, mode,
                              max_block_num_cpu=NUM_HOST)
    _check(info.value, "swap_cache_layout", names[which], index, fragment)
    np.testing.assert_array_equal(host, host0)
    assert all((c.numpy() == i).all() for i, c in enumerate(caches))


def test_paddle_all_layers_pointer_count_mismatch(paddle_ops, host_buffer) -> None:
    caches = [paddle_ops.zeros([NUM_DEV, BB], dtype="uint8") for _ in range(2)]
    host = host_buffer(NUM_HOST * BB)
    with pytest.raises(ops.SwapOpError) as info:
        ops.swap_cache_all_layers(caches, [host.ctypes.data], NUM_HOST, [0], [0], 0, 0)
    assert info.value.argument == "cache_cpu_ptrs"
