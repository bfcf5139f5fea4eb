"""block_wise_fp8 (and block_wise_int8) KV on the paddleformers runner: the quantization's
bounds, and reuse of cached 8-bit KV giving the greedy tokens of recomputing with it.

The reuse checks are the shared ones (``tests/reuse_workloads.py``) on an engine whose cache
is ``--quantization '{"kv_cache_quant_type": "block_wise_fp8"}'``: recompute is the switch off
(ENABLE_V1_KVCACHE_MANAGER=0) with the same fp8 cache, reuse is the switch on with device
hits, host hits, write_back evictions, failed loads and preemption.  The storage tier's
fp8 reuse is ``tests/storage_tier/test_fp8_store.py``.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from fastdeploy_kvcache.config import BLOCK_WISE_FP8, BLOCK_WISE_INT8, FP8_E4M3_MAX, INT8_MAX
from fastdeploy_kvcache.engine.model_loader import LoadedModel
from tests.engine_args import started_engines
from tests.reuse_workloads import ReuseChecks

FP8 = dict(dtype="uint8", kv_cache_quant=BLOCK_WISE_FP8)


@pytest.fixture
def engine_factory(monkeypatch: pytest.MonkeyPatch, tiny_model: LoadedModel) -> Iterator[Any]:
    """Engines over the tiny model with a block_wise_fp8 cache (a test may still name another)."""
    yield from started_engines(monkeypatch, tiny_model, model="tiny-llama-random", **FP8)


class TestFp8Reuse(ReuseChecks):
    """The shared reuse checks with fp8 KV; one write policy each where the policy does not
    change what is quantized (the policies' own logic is tested on the unquantized cache)."""

    policies = {"test_device_hits_change_nothing": ("write_through_selective",),
                "test_host_hits_change_nothing": ("write_through", "write_back"),
                "test_failed_loads_recompute_and_change_nothing": ("write_through",),
                "test_preemption_changes_nothing": ("write_back",)}


def test_int8_device_and_host_hits_change_nothing(engine_factory: Any) -> None:
    """block_wise_int8 (the same write and read paths as fp8, another encoding of the bytes):
    recompute (prefix caching off) against device hits and host hits."""
    from tests.reuse_workloads import check_device_hits, check_host_hits, recompute_tokens

    def int8(**kwargs: Any) -> Any:
        return engine_factory(**{"kv_cache_quant": BLOCK_WISE_INT8, **kwargs})

    ref = recompute_tokens(int8)
    check_device_hits(int8, ref, "write_through")
    check_host_hits(int8, ref, "write_through")


def test_int8_round_trip_bounds_and_bytes() -> None:
    """block_wise_int8: each value reads back within half a step (scale / 2, scale = amax /
    127) of itself, the amax is exact, zeros stay zero; the bytes are numpy's round-half-even
    of x / scale as int8 (torch.round's rule too: either runner's objects read on the other)."""
    import paddle

    from fastdeploy_kvcache.engine.paddleformers_runner import fp8_kv

    rng = np.random.default_rng(2)
    x = rng.standard_normal((4, 33, 64)).astype(np.float32) * np.logspace(-6, 4, 33, dtype=np.float32)[None, :, None]
    x[1, 5] = 0.0
    x[0, 0, :4] = [2.0, -1.0, 0.5, -2.0]  # with the rest zero below: ties at -63.5 go to -64
    x[0, 0, 4:] = 0.0
    q, scale = fp8_kv.quantize(paddle.to_tensor(x), BLOCK_WISE_INT8)
    s = scale.numpy()
    np.testing.assert_allclose(s, np.abs(x).max(-1) / INT8_MAX, rtol=1e-6)
    want = np.clip(np.rint(x / np.where(s > 0, s, 1)[..., None]), -127, 127).astype(np.int8).view(np.uint8)
    np.testing.assert_array_equal(q.numpy(), want)
    assert list(q.numpy()[0, 0, :4]) == [0x7F, 0xC0, 0x20, 0x81]
    back = fp8_kv.dequantize(q, scale, BLOCK_WISE_INT8).numpy()
    err = np.abs(back - x)
    assert (err <= s[..., None] * 0.5 * (1 + 1e-5) + 1e-30).all()
    assert (back[1, 5] == 0).all() and s[1, 5] == 0
    amax_at = np.abs(x).argmax(-1)
    np.testing.assert_allclose(np.take_along_axis(np.abs(back), amax_at[..., None], -1)[..., 0],
                               np.abs(x).max(-1), rtol=1e-6)
    # Read through the engine's gather (an int32 view of the bytes) it is the same.
    cache = paddle.to_tensor(q.numpy()[None].reshape(4, 1, 33, 64))
    got = fp8_kv.gather_blocks(cache, paddle.to_tensor(s.reshape(4, 1, 33)), paddle.to_tensor([2, 0]),
                               BLOCK_WISE_INT8).numpy()
    np.testing.assert_array_equal(got[:, 0], back[[2, 0]])


def test_round_trip_bounds() -> None:
    """Each value reads back within e4m3's rounding of it: relative 2**-4 for normal values,
    half a subnormal step (2**-10 of the scale) below them; zeros stay zero, the amax is exact."""
    import paddle

    from fastdeploy_kvcache.engine.paddleformers_runner import fp8_kv

    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 33, 64)).astype(np.float32) * np.logspace(-6, 4, 33, dtype=np.float32)[None, :, None]
    x[1, 5] = 0.0  # an all-zero token vector
    x[2, 7, 3] = 1e6  # one outlier: the rest of its vector loses precision, not other tokens'
    q, scale = fp8_kv.quantize(paddle.to_tensor(x))
    assert q.dtype == paddle.uint8 and list(q.shape) == [4, 33, 64] and list(scale.shape) == [4, 33]
    s = scale.numpy()
    np.testing.assert_allclose(s, np.abs(x).max(-1) / FP8_E4M3_MAX, rtol=1e-6)
    back = fp8_kv.dequantize(q, scale).numpy()
    err = np.abs(back - x)
    bound = np.maximum(np.abs(x) * 2.0 ** -4, s[..., None] * 2.0 ** -10) * (1 + 1e-6)
    assert (err <= bound).all(), float((err / bound).max())
    assert (back[1, 5] == 0).all() and (q.numpy()[1, 5] == 0).all() and s[1, 5] == 0
    amax_at = np.abs(x).argmax(-1)
    np.testing.assert_allclose(np.take_along_axis(np.abs(back), amax_at[..., None], -1)[..., 0],
                               np.abs(x).max(-1), rtol=1e-6)
    # Other tokens of the outlier's head keep their own scale.
    assert err[2, 8].max() <= np.abs(x[2, 8]).max() * 2.0 ** -4


def _forward(eng: Any, tokens: list[int], context_len: int, blocks: list[int]) -> np.ndarray:
    from fastdeploy_kvcache.engine.runner import ScheduledSeq

    seq = ScheduledSeq(tokens[context_len:], context_len, blocks, True)
    return eng.runner.forward([seq], eng.pool.layer_caches, None)[0]


def test_fp8_cache_holds_each_tokens_kv_within_e4m3_rounding(engine_factory: Any) -> None:
    """The engine's cache is uint8 with fp32 scale lanes; what it holds for a prompt reads back
    within e4m3's rounding of the float32 cache's (layer 0's K depends on the tokens only; the
    last layer's went through every fp8 attention before it), and the logits stay close."""
    import paddle

    from fastdeploy_kvcache.engine.paddleformers_runner import fp8_kv

    fp8 = engine_factory(v1=True)
    ref = engine_factory(v1=True, dtype="auto", kv_cache_quant=None)
    lanes = fp8.pool.layer_caches[0]
    assert [str(t.dtype).split(".")[-1] for t in lanes] == ["uint8", "uint8", "float32", "float32"]
    cfg, ref_cfg = fp8.cache_config, ref.cache_config
    assert cfg.kv_cache_quant == BLOCK_WISE_FP8 and ref_cfg.dtype == "float32"
    # float32 KV of head_dim d: 4d bytes per (head, token); fp8: d + 4.
    assert cfg.bytes_per_block * 4 * cfg.head_dim == ref_cfg.bytes_per_block * (cfg.head_dim + 4)
    tokens = [3 + (j * 11) % 500 for j in range(40)]
    blocks = [20, 21, 22]
    got, want = _forward(fp8, tokens, 0, blocks), _forward(ref, tokens, 0, blocks)
    for layer, tol in ((0, 2.0 ** -4), (cfg.num_layers - 1, 0.25)):
        idx = paddle.to_tensor(blocks, dtype="int64")
        lanes = fp8.pool.layer_caches[layer]
        k = fp8_kv.gather_blocks(lanes[0], lanes[2], idx).numpy()
        k_ref = ref.pool.layer_caches[layer][0].numpy()[blocks]
        amax = np.abs(k_ref).max(-1, keepdims=True)
        flat = lambda a: a.transpose(1, 0, 2, 3).reshape(a.shape[1], -1, a.shape[-1])[:, :40]  # noqa: E731
        err = (np.abs(flat(k) - flat(k_ref)) / flat(amax)).max()
        assert err <= tol, (layer, err)
    cos = float(got @ want / np.linalg.norm(got) / np.linalg.norm(want))
    assert cos >= 0.98, cos
    # Chunking changes nothing: the last token decoded over the cached 39 gives the logits of
    # prefilling all 40 at once (every token is attended from the quantized cache either way).
    again = _forward(fp8, tokens, 39, blocks)
    np.testing.assert_allclose(again, got, rtol=1e-5, atol=1e-5)


def test_pools_follow_the_smaller_blocks() -> None:
    """Llama-3-8B's shape (32 layers, 8 KV heads of 128, 64-token blocks): an fp8 block with
    its scales is 132/256 of a bfloat16 one, so the same --swap-space and the same device
    budget hold 1.94x the blocks."""
    from fastdeploy_kvcache.config import CacheConfig
    from fastdeploy_kvcache.engine import kv_sizing

    shape = dict(num_layers=32, num_kv_heads=8, head_dim=128, block_size=64, swap_space=4.0)
    bf16 = CacheConfig(dtype="bfloat16", **shape)
    fp8 = CacheConfig(dtype="block_wise_fp8", **shape)
    assert (fp8.dtype, fp8.kv_cache_quant) == ("uint8", BLOCK_WISE_FP8)
    assert fp8.bytes_per_block == 2 * 32 * (8 * 64 * 128 + 8 * 64 * 4)
    assert fp8.host_block_count / bf16.host_block_count >= 1.9
    sizes = dict(block_size=64, max_model_len=8192, max_num_seqs=64)
    budget = 40 << 30
    blocks = {c.dtype: kv_sizing.device_pool_blocks(bytes_per_block=c.bytes_per_block, kv_budget=budget, **sizes)
              for c in (bf16, fp8)}
    assert blocks["uint8"] / blocks["bfloat16"] >= 1.9


def test_the_same_swap_space_holds_more_fp8_blocks(engine_factory: Any) -> None:
    """The engine's host tier: the same GiB, blocks in the ratio of the block bytes (on the CPU,
    float32 KV of head_dim d is 4d bytes per (head, token), fp8 d + 4)."""
    fp8 = engine_factory(v1=True, swap_space=0.01, num_host_blocks=None)
    ref = engine_factory(v1=True, swap_space=0.01, num_host_blocks=None, dtype="auto", kv_cache_quant=None)
    a, b = fp8.pool.controller, ref.pool.controller
    assert a.num_host_blocks == int(0.01 * (1 << 30)) // fp8.cache_config.bytes_per_block
    d = fp8.cache_config.head_dim
    assert a.num_host_blocks / b.num_host_blocks == pytest.approx(4 * d / (d + 4), rel=0.01)
    # A host block is its K and V bytes and their scales, every layer: what storage stores.
    from fastdeploy_kvcache.storage.transfer import HostTierLayout

    layout = HostTierLayout.from_controller(a)
    assert layout.object_bytes == fp8.cache_config.bytes_per_block
    assert layout.describe() == HostTierLayout.describe_config(fp8.cache_config)


def test_an_odd_head_dim_is_refused_naming_the_flag() -> None:
    """Paddle's CPU build gathers no uint8: the blocks go through an int32 (or bfloat16) view,
    which an odd head_dim cannot have."""
    from fastdeploy_kvcache.engine.paddleformers_runner import fp8_kv

    assert fp8_kv.gather_view_dtype(128) == "int32" and fp8_kv.gather_view_dtype(66) == "bfloat16"
    with pytest.raises(ValueError, match=r"^kv_cache_quant: .*even head_dim.*65"):
        fp8_kv.gather_view_dtype(65)


def _e4m3_values() -> np.ndarray:
    """Every e4m3fn byte's value (NaN for 0x7f and 0xff), from the format's definition."""
    vals = np.zeros(256)
    for b in range(256):
        sign, e, m = (-1.0 if b & 0x80 else 1.0), (b >> 3) & 0xF, b & 7
        vals[b] = np.nan if (e, m) == (15, 7) else sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return vals


def _e4m3_round_to_nearest_even(x: np.ndarray) -> np.ndarray:
    """The reference encoding: nearest value, ties to the even code, saturating at 448."""
    table = _e4m3_values()
    codes = np.array([b for b in range(127)])  # 0x00..0x7e: the finite non-negative values, increasing
    values = table[codes]
    out = np.empty(x.shape, np.uint8)
    for i, v in np.ndenumerate(x):
        a = min(abs(float(v)), 448.0)
        j = int(np.searchsorted(values, a))
        if values[min(j, 126)] == a:
            code = codes[j]
        else:
            lo, hi = codes[j - 1], codes[j]
            below, above = a - values[lo], values[hi] - a
            code = lo if below < above else hi if above < below else (lo if lo % 2 == 0 else hi)
        out[i] = code | (0x80 if np.signbit(v) else 0)
    return out


def test_bytes_are_e4m3_round_to_nearest_even() -> None:
    """The bytes are the format's own rounding of x / scale (nearest, ties to even), which is
    what torch's float8_e4m3fn cast writes too: an object written by either runner reads back
    the same on the other.  A vector whose amax is 448 has scale 1, so the ties are exact."""
    import paddle

    from fastdeploy_kvcache.engine.paddleformers_runner import fp8_kv

    ties = np.array([448.0, 1.0625, 1.1875, -1.3125, 0.001953125 * 1.5, 2.0 ** -10, 300.0, -0.0] + [0.0] * 8,
                    dtype=np.float32)
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((4, 40, 16)) * np.logspace(-4, 3, 40)[None, :, None]).astype(np.float32)
    for data in (ties.reshape(1, 1, 16), x):
        q, s = fp8_kv.quantize(paddle.to_tensor(data))
        s = s.numpy()
        scaled = data / np.where(s > 0, s, 1)[..., None]
        np.testing.assert_array_equal(q.numpy(), _e4m3_round_to_nearest_even(scaled))
    q, _ = fp8_kv.quantize(paddle.to_tensor(ties.reshape(1, 1, 16)))
    # 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): the even code; 1.1875: 1.25 (0x3a).
    assert list(q.numpy()[0, 0, 1:3]) == [0x38, 0x3A]
