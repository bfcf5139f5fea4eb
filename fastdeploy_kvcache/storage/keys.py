"""Storage keys: a namespace that pins down what the bytes mean, plus the chained block hash.

Two processes may share an object only if its bytes would be identical for both: the same
model weights, cache dtype, block size, byte layout and tensor-parallel shard.  All of that
goes into the namespace, so a different model (or a re-quantized one, or another TP rank)
never reads another's KV; it simply misses.  The block hash itself
(:func:`fastdeploy_kvcache.core.hashing.storage_key`) already covers the token prefix,
multimodal items, LoRA id and cache salt.

Key grammar (ASCII, at most ~120 characters, safe as a file name and a Mooncake key)::

    <namespace>:<32 hex digits>                 a full block
    <namespace>:<32 hex digits>:partial:<n>     a partial last block of n tokens (PD hand-off)
    namespace = fdkv1-<model slug>-<16 hex digits>-tp<rank>of<size>

The 16 hex digits are an xxh3-64 over every field of :class:`KeyNamespace`; the slug and the
TP suffix are only there so a human can read a listing.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import xxhash

from fastdeploy_kvcache.core.hashing import partial_block_key, storage_key

logger = logging.getLogger(__name__)

__all__ = ["KeyNamespace", "weights_fingerprint", "bytes_fingerprint", "block_key", "block_keys", "KEY_RE"]

KEY_VERSION = 1
_SLUG_RE = re.compile(r"[^A-Za-z0-9._-]+")
KEY_RE = re.compile(r"^[A-Za-z0-9._-]+:[0-9a-f]{32}(:partial:[1-9][0-9]*)?$")
"""Every key :func:`block_key` forms matches this (backends may rely on the charset)."""

# Bytes of each weight file hashed from its head and from its tail (see weights_fingerprint).
_SAMPLE_BYTES = 1 << 20


def bytes_fingerprint(*parts: Union[bytes, str]) -> str:
    """xxh3-128 hex of length-prefixed parts (for engines that fingerprint weights in memory)."""
    h = xxhash.xxh3_128()
    for part in parts:
        data = part.encode("utf-8") if isinstance(part, str) else bytes(part)
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()


def weights_fingerprint(model_dir: Union[str, os.PathLike], full: bool = False) -> str:
    """Fingerprint of the model files under ``model_dir`` (xxh3-128 hex).

    Covers every regular file's relative path and size, the whole of small files (configs,
    tokenizer, < 4 MiB), and the first and last MiB of each large one; ``full=True`` hashes
    every byte.

    NOTE: sampling is a trade-off.  Hashing 140 GB of weights at start costs minutes; the
    sample costs milliseconds and changes with any re-quantization, re-shard or fine-tune
    that rewrites a file (sizes, headers, and the tail all move).  It would miss an edit
    confined to the middle of a file of the same size: pass ``full=True`` where that can
    happen, or put a checkpoint version into ``KeyNamespace.model``.
    """
    root = Path(model_dir)
    if root.is_file():
        files = [root]
        root = root.parent
    elif root.is_dir():
        files = sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))
    else:
        raise FileNotFoundError(f"weights_fingerprint: {model_dir!s} is neither a file nor a directory")
    h = xxhash.xxh3_128()
    for path in files:
        size = path.stat().st_size
        h.update(str(path.relative_to(root)).encode("utf-8") + b"\0" + size.to_bytes(8, "little"))
        with open(path, "rb") as f:
            if full or size <= 4 * _SAMPLE_BYTES:
                for chunk in iter(lambda: f.read(8 << 20), b""):
                    h.update(chunk)
            else:
                h.update(f.read(_SAMPLE_BYTES))
                f.seek(size - _SAMPLE_BYTES)
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


@dataclass(frozen=True)
class KeyNamespace:
    """Everything that decides the bytes of a stored block, apart from the tokens.

    Args:
        model: the model's name or path (readable part of the key, also hashed).
        weights_fingerprint: :func:`weights_fingerprint` of the checkpoint (or any string
            that changes whenever the weights do).
        dtype: cache dtype (``CacheConfig.dtype``), e.g. ``"bfloat16"``.
        block_size: tokens per block.
        layout: how the object's bytes are ordered, including the shape that decides its
            size, e.g. ``ObjectLayout.describe()``: ``"block-major/L32/kv/h8/d128"``.
        tp_rank, tp_size: the tensor-parallel shard this worker holds.
        kv_cache_quant: quantization scheme of a uint8 cache (None when unquantized).
    """

    model: str
    weights_fingerprint: str
    dtype: str
    block_size: int
    layout: str
    tp_rank: int = 0
    tp_size: int = 1
    kv_cache_quant: Optional[str] = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("KeyNamespace.model must be a non-empty string")
        if not self.weights_fingerprint:
            raise ValueError("KeyNamespace.weights_fingerprint must be non-empty (see weights_fingerprint())")
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"KeyNamespace.block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"KeyNamespace.tp_size must be an int >= 1, got {self.tp_size!r}")
        if not isinstance(self.tp_rank, int) or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"KeyNamespace.tp_rank must be in [0, {self.tp_size}), got {self.tp_rank!r}")

    @property
    def kv_format(self) -> str:
        """The KV format its objects hold, for messages: ``bfloat16``, ``uint8/block_wise_fp8``."""
        return self.dtype if self.kv_cache_quant is None else f"{self.dtype}/{self.kv_cache_quant}"

    @property
    def digest(self) -> str:
        """xxh3-64 hex over every field (and the key format version)."""
        fields = asdict(self)
        canonical = "\n".join(f"{k}={fields[k]!r}" for k in sorted(fields))
        return xxhash.xxh3_64_hexdigest(f"fdkv-key-v{KEY_VERSION}\n{canonical}".encode("utf-8"))

    @property
    def prefix(self) -> str:
        """The namespace part of every key, ``fdkv1-<slug>-<digest>-tp<r>of<n>``."""
        cached = self.__dict__.get("_prefix")
        if cached is None:
            slug = _SLUG_RE.sub("_", Path(self.model.rstrip("/")).name or self.model)[:40].strip("._-") or "model"
            cached = f"fdkv{KEY_VERSION}-{slug}-{self.digest}-tp{self.tp_rank}of{self.tp_size}"
            object.__setattr__(self, "_prefix", cached)  # frozen dataclass: cache by hand
        return cached

    def key(self, block_hash: int, num_tokens: Optional[int] = None) -> str:
        """The one function that forms keys; see :func:`block_key`."""
        return block_key(self, block_hash, num_tokens)

    def keys(self, block_hashes: Iterable[int]) -> list[str]:
        return block_keys(self, block_hashes)

    def block_hash_of(self, key: str) -> Optional[int]:
        """The block hash of a full-block key of this namespace; None for any other key."""
        prefix = self.prefix
        if len(key) != len(prefix) + 33 or not key.startswith(prefix) or key[len(prefix)] != ":":
            return None
        try:
            return int(key[len(prefix) + 1:], 16)
        except ValueError:
            return None


def block_key(ns: KeyNamespace, block_hash: int, num_tokens: Optional[int] = None) -> str:
    """Key of a full block (``num_tokens`` None or ``ns.block_size``) or of a partial last
    block of ``num_tokens`` tokens whose hash chains like a full block's
    (``BlockHasher.partial_key`` computes it)."""
    if num_tokens is None or num_tokens == ns.block_size:
        return f"{ns.prefix}:{storage_key(block_hash)}"
    if not 0 < num_tokens < ns.block_size:
        raise ValueError(f"block_key: num_tokens must be in [1, {ns.block_size}], got {num_tokens}")
    return f"{ns.prefix}:{partial_block_key(block_hash, num_tokens)}"


def block_keys(ns: KeyNamespace, block_hashes: Sequence[int] | Iterable[int]) -> list[str]:
    """Keys of consecutive full blocks (the chained hashes of one request)."""
    prefix = ns.prefix + ":"
    return [prefix + storage_key(h) for h in block_hashes]
