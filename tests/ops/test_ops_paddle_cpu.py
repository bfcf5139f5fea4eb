"""Round trips of every Paddle op on CPU tensors (the CPU implementation of the core),
for every dtype, direction and id pattern; in-place semantics."""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_kvcache import ops

from swap_reference import PATTERNS, expected_after_swap, id_patterns

NUM_DEV, NUM_HOST = 10, 14
SHAPE = (NUM_DEV, 2, 4, 8)  # [blocks, kv_heads, block_size, head_dim]
DTYPES = ["bfloat16", "float16", "float32", "uint8"]


def make_cache(paddle, dtype: str, shape=SHAPE, seed: int = 0):
    rng = np.random.default_rng(seed)
    if dtype == "uint8":
        return paddle.to_tensor(rng.integers(0, 256, shape, dtype=np.uint8))
    t = paddle.to_tensor(rng.standard_normal(shape).astype(np.float32))
    return t if dtype == "float32" else t.astype(dtype)


def raw(t) -> np.ndarray:
    """The tensor's bytes, one row per block."""
    arr = np.ascontiguousarray(t.numpy())
    return arr.view(np.uint8).reshape(arr.shape[0], -1)


def block_bytes(t) -> int:
    return raw(t).shape[1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
@pytest.mark.parametrize("variant", ["sync", "async"])
def test_per_layer(paddle_ops, host_buffer, dtype: str, pattern: str, mode: int, variant: str) -> None:
    # A fixed seed per case (hash() of a string changes with every process).
    cache = make_cache(paddle_ops, dtype, seed=DTYPES.index(dtype) * 100 + PATTERNS.index(pattern))
    bb = block_bytes(cache)
    host = host_buffer(NUM_HOST * bb).reshape(NUM_HOST, bb)
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, np.random.default_rng(mode))[pattern]
    want_dev, want_host = expected_after_swap(raw(cache), host, dev_ids, host_ids, mode)
    if variant == "sync":
        out = ops.swap_cache_per_layer(cache, host.ctypes.data, NUM_HOST, dev_ids, host_ids, 0, mode)
    else:
        out = ops.swap_cache_per_layer_async(cache, host.ctypes.data, NUM_HOST, np.asarray(dev_ids),
                                             host_ids, 0, mode, stream=0)
    assert out.data_ptr() == cache.data_ptr(), "in place: the output shares the input's storage"
    np.testing.assert_array_equal(raw(cache), want_dev)
    np.testing.assert_array_equal(host, want_host)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_all_layers_with_scale_tensors_round_trip(paddle_ops, host_buffer, dtype: str, pattern: str) -> None:
    """Two layers of K/V plus fp32 scale caches ([blocks, heads, block_size]): evict all,
    clobber the device, load all back."""
    layers = [make_cache(paddle_ops, dtype, seed=i) for i in range(4)]
    scales = [make_cache(paddle_ops, "float32", shape=SHAPE[:3], seed=10 + i) for i in range(4)]
    tensors = layers + scales
    hosts = [host_buffer(NUM_HOST * block_bytes(t)).reshape(NUM_HOST, -1) for t in tensors]
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, np.random.default_rng(3))[pattern]
    original = [raw(t).copy() for t in tensors]

    outs = ops.swap_cache_all_layers(tensors, [h.ctypes.data for h in hosts], NUM_HOST, dev_ids, host_ids, 0,
                                     ops.CopyDirection.DEVICE_TO_HOST, stream=0)
    assert [o.data_ptr() for o in outs] == [t.data_ptr() for t in tensors]
    for h, o in zip(hosts, original):
        np.testing.assert_array_equal(h[host_ids], o[dev_ids])

    fresh = [paddle_ops.zeros_like(t) for t in tensors]
    ops.swap_cache_all_layers(fresh, [h.ctypes.data for h in hosts], NUM_HOST, dev_ids, host_ids, 0, ops.CopyDirection.HOST_TO_DEVICE)
    for f, o in zip(fresh, original):
        got = raw(f)
        np.testing.assert_array_equal(got[dev_ids], o[dev_ids])
        untouched = np.setdiff1d(np.arange(NUM_DEV), dev_ids)
        assert not got[untouched].any(), "blocks not named by the ids must stay untouched"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_layout_round_trip(paddle_ops, host_buffer, dtype: str, pattern: str) -> None:
    """[k0, v0, k1, v1] gathered into [block][layer][k|v][...], then scattered back."""
    tensors = [make_cache(paddle_ops, dtype, seed=20 + i) for i in range(4)]
    bb = block_bytes(tensors[0])
    host = host_buffer(NUM_HOST * 4 * bb).reshape(NUM_HOST, 4, bb)
    dev_ids, host_ids = id_patterns(NUM_DEV, NUM_HOST, np.random.default_rng(4))[pattern]
    want = host.copy()
    for t_idx, t in enumerate(tensors):
        want[host_ids, t_idx] = raw(t)[dev_ids]
    outs = ops.swap_cache_layout(tensors, host.ctypes.data, list(SHAPE), dev_ids, host_ids, 0, ops.CopyDirection.DEVICE_TO_HOST,
                                 max_block_num_cpu=NUM_HOST)
    assert [o.data_ptr() for o in outs] == [t.data_ptr() for t in tensors]
    np.testing.assert_array_equal(host, want)

    fresh = [paddle_ops.zeros_like(t) for t in tensors]
    ops.swap_cache_layout(fresh, host.ctypes.data, list(SHAPE), dev_ids, host_ids, 0, ops.CopyDirection.HOST_TO_DEVICE,
                          max_block_num_cpu=NUM_HOST)
    for f, t in zip(fresh, tensors):
        np.testing.assert_array_equal(raw(f)[dev_ids], raw(t)[dev_ids])


def test_layout_without_cache_shape_mixes_scale_tensors(paddle_ops, host_buffer) -> None:
    k, v = make_cache(paddle_ops, "uint8", seed=1), make_cache(paddle_ops, "uint8", seed=2)
    ks, vs = (make_cache(paddle_ops, "float32", shape=SHAPE[:3], seed=s) for s in (3, 4))
    tensors = [k, v, ks, vs]
    sizes = [block_bytes(t) for t in tensors]
    host = host_buffer(NUM_HOST * sum(sizes)).reshape(NUM_HOST, -1)
    ops.swap_cache_layout(tensors, host.ctypes.data, [], [4, 2], [0, 7], 0, ops.CopyDirection.DEVICE_TO_HOST)
    offsets = np.cumsum([0] + sizes[:-1])
    for t, off, size in zip(tensors, offsets, sizes):
        np.testing.assert_array_equal(host[[0, 7], off:off + size], raw(t)[[4, 2]])


def test_layout_rejects_tensor_not_matching_cache_shape(paddle_ops, host_buffer) -> None:
    tensors = [make_cache(paddle_ops, "float16", seed=1), make_cache(paddle_ops, "float16", shape=(NUM_DEV, 2, 4, 4))]
    host = host_buffer(NUM_HOST * 1024)
    before = host.copy()
    with pytest.raises(ops.SwapOpError) as info:
        ops.swap_cache_layout(tensors, host.ctypes.data, list(SHAPE), [0], [0], 0, ops.CopyDirection.DEVICE_TO_HOST)
    assert (info.value.op, info.value.argument, info.value.index) == ("swap_cache_layout", "cache_gpu_tensors", 1)
    np.testing.assert_array_equal(host, before)


def test_unsupported_dtype_is_rejected(paddle_ops, host_buffer) -> None:
    cache = paddle_ops.zeros([4, 8], dtype="int64")
    host = host_buffer(4 * 64)
    with pytest.raises(ops.SwapOpError, match="dtype"):
        ops.swap_cache_per_layer(cache, host.ctypes.data, 4, [0], [0], 0, ops.CopyDirection.DEVICE_TO_HOST)
