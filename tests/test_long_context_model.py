"""``llama3.1-8b-random``: Llama-3.1-8B's shapes, 131,072 positions and llama3 rope scaling.

The config checks need transformers only; the rotary check builds a tiny-shaped model with the
same rope settings on torch's CPU (skipped without torch, which the GPU machine has).
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from fastdeploy_kvcache.engine.args import check_max_model_len
from fastdeploy_kvcache.engine.model_loader import model_positions
from fastdeploy_kvcache.engine.transformers_runner.torch_models import (
    LLAMA3_8B_SHAPE,
    LLAMA3_ROPE_SCALING,
    LLAMA31_8B_RANDOM,
    LLAMA31_8B_SHAPE,
    TINY_SHAPE,
    llama_config,
)


def _rope(cfg: object) -> dict:
    """The config's rope settings, under either transformers spelling (4.x rope_scaling +
    rope_theta; 5.x rope_parameters)."""
    params = getattr(cfg, "rope_parameters", None)
    if params:
        return dict(params)
    return dict(getattr(cfg, "rope_scaling") or {}, rope_theta=getattr(cfg, "rope_theta"))


def test_config_has_llama31_positions_and_rope_scaling() -> None:
    pytest.importorskip("transformers", reason="needs transformers (bash build.sh installs it)")
    cfg = llama_config(LLAMA31_8B_SHAPE)
    assert cfg.max_position_embeddings == 131072
    rope = _rope(cfg)
    assert rope["rope_type"] == "llama3" and rope["rope_theta"] == 500000.0
    assert (rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]) == (8.0, 1.0, 4.0)
    assert rope["original_max_position_embeddings"] == 8192
    # Llama-3-8B's layers otherwise.
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim"):
        assert getattr(cfg, key) == LLAMA3_8B_SHAPE[key], key
    assert "rope_scaling" not in LLAMA3_8B_SHAPE  # the 8k model stays unscaled


def test_positions_allow_long_prompts() -> None:
    assert model_positions(LLAMA31_8B_RANDOM) == 131072
    check_max_model_len(32768, model_positions(LLAMA31_8B_RANDOM), LLAMA31_8B_RANDOM)
    with pytest.raises(ValueError, match="max_model_len: 131073 is more than the 131072 positions"):
        check_max_model_len(131073, model_positions(LLAMA31_8B_RANDOM), LLAMA31_8B_RANDOM)


def _llama3_inv_freq(head_dim: int, theta: float, factor: float, low: float, high: float, old_ctx: int) -> np.ndarray:
    """Llama 3.1's published frequency scaling, written out independently of transformers."""
    inv = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    out = []
    for f in inv:
        wavelen = 2 * math.pi / f
        if wavelen < old_ctx / high:
            out.append(f)
        elif wavelen > old_ctx / low:
            out.append(f / factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append((1 - smooth) * f / factor + smooth * f)
    return np.array(out)


def test_transformers_rotary_uses_the_scaling() -> None:
    pytest.importorskip("torch", reason="needs PyTorch (the GPU machine's python has it)")
    import torch

    from fastdeploy_kvcache.engine.tokenizer import build_synthetic_tokenizer
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import _random_llama

    shape = dict(TINY_SHAPE, max_position_embeddings=131072, rope_theta=500000.0, rope_scaling=dict(LLAMA3_ROPE_SCALING))
    lm = _random_llama(shape, build_synthetic_tokenizer(TINY_SHAPE["vocab_size"]), "tiny-llama3.1", seed=0,
                       device=torch.device("cpu"), dtype="float32", std=0.02)
    assert lm.max_position_embeddings == 131072
    head_dim = TINY_SHAPE["hidden_size"] // TINY_SHAPE["num_attention_heads"]
    got = lm.model.model.rotary_emb.inv_freq.double().numpy()
    want = _llama3_inv_freq(head_dim, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    unscaled = 1.0 / 500000.0 ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    assert not np.allclose(got, unscaled, rtol=1e-3)  # the low frequencies are stretched 8x
