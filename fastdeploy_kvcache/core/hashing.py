"""Chained block hashes: the keys of the prefix tree and of the storage tier.

A block's hash covers its token ids, its parent block's hash and its "extra keys"
(multimodal items overlapping the block, a LoRA/adapter id, a cache salt), so equal
hashes mean equal prefixes and therefore equal KV.  Storage keys are built from these
hashes and are shared between processes and machines, so the function must be
deterministic everywhere: no ``hash()``, no pickle, no per-process seed.

Definition (tokens little-endian int64; 128-bit values as xxhash's canonical
big-endian 16-byte digests)::

    content_i = XXH3_128(tokens of block i || extra-key bytes of block i)
    hash_i    = XXH3_128(hash_{i-1} || content_i)
    hash_{-1} = ROOT_HASH

Two levels, because the first one can run over all blocks in one C-level loop
(``map`` over the rows of a packed ``[num_blocks, block_size]`` int64 array) and the
second hashes just 32 bytes per block; a per-block Python loop of pickle + sha256
over tuples spends ~20 ns per token, this spends ~3 once tokens are packed.

NOTE: turning a Python list of ints into int64 costs ~11 ns per token (unboxing
every int), more than the hashing.  Each token is packed once per request (the
hasher is incremental), and engines that keep token ids in numpy arrays skip it.

NOTE: xxh3 is not a cryptographic hash.  128 bits make accidental
collisions negligible (~2**-64 at 2**32 blocks); a deployment that shares a cache
between mutually untrusting tenants should give each tenant its own ``cache_salt``
(salted blocks can only collide with blocks of the same salt).
"""

from __future__ import annotations

import itertools
import logging
import sys
from array import array
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import numpy as np
import xxhash

logger = logging.getLogger(__name__)

_xxh128 = xxhash.xxh3_128_intdigest
_xxh128_digest = xxhash.xxh3_128_digest

# The parent hash of the first block.  A fixed constant (not random per process), so
# that two processes agree on every hash.
ROOT_HASH: int = _xxh128(b"fastdeploy_kvcache/root/v1")

_BIG_ENDIAN = sys.byteorder == "big"
_ROOT_DIGEST = ROOT_HASH.to_bytes(16, "big")  # xxhash's canonical digest byte order
_I64 = np.dtype("<i8")
_EXTRA_TAG = b"\x00\xffextra"


@dataclass(frozen=True)
class MMItem:
    """A multimodal item (image, audio clip) occupying ``length`` placeholder tokens.

    ``mm_hash`` identifies the item's content; it is folded into every block the item
    overlaps, because the placeholder token ids alone do not distinguish two images.
    """

    offset: int
    length: int
    mm_hash: Union[str, bytes, int]

    @property
    def end(self) -> int:
        return self.offset + self.length


def _as_bytes(value: Union[str, bytes, int]) -> bytes:
    if isinstance(value, bytes):
        return value
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, int):
        return value.to_bytes((value.bit_length() + 8) // 8 or 1, "little", signed=True)
    raise TypeError(f"extra hash key must be str, bytes or int, got {type(value).__name__}")


def _field(tag: bytes, value: Union[str, bytes, int]) -> bytes:
    data = _as_bytes(value)
    # Length-prefixed so that ("ab", "c") and ("a", "bc") encode differently.
    return tag + len(data).to_bytes(4, "little") + data


def pack_array(token_ids: Sequence[int]) -> np.ndarray:
    """Token ids as a little-endian int64 array (no copy if they already are one)."""
    if isinstance(token_ids, np.ndarray):
        return np.ascontiguousarray(token_ids, dtype=_I64)
    if _BIG_ENDIAN:  # pragma: no cover - no big-endian CI
        return np.asarray(token_ids, dtype=_I64)
    arr = array("q", token_ids)  # the fastest list -> int64 path (~11 ns per token)
    return np.frombuffer(arr, dtype=_I64) if len(arr) else np.zeros(0, dtype=_I64)


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Pack token ids as little-endian int64: the byte form every hash is taken over."""
    return pack_array(token_ids).tobytes()


def hash_block_bytes(parent_hash: int, token_bytes: Union[bytes, memoryview], extra: bytes = b"") -> int:
    """Hash one block given its packed tokens (see :func:`pack_tokens`)."""
    content = _xxh128_digest(bytes(token_bytes) + extra if extra else token_bytes)
    return _xxh128(parent_hash.to_bytes(16, "big") + content)


def encode_extra_keys(
    mm_hashes: Sequence[Union[str, bytes, int]] = (),
    lora_id: Optional[Union[str, int]] = None,
    cache_salt: Optional[str] = None,
) -> bytes:
    """Byte form of a block's extra keys; empty when there are none (the common case)."""
    if not mm_hashes and lora_id is None and cache_salt is None:
        return b""
    parts = [_EXTRA_TAG]
    for h in mm_hashes:
        parts.append(_field(b"M", h))
    if lora_id is not None:
        parts.append(_field(b"L", lora_id))
    if cache_salt is not None:
        parts.append(_field(b"S", cache_salt))
    return b"".join(parts)


def hash_block_tokens(
    parent_hash: int,
    token_ids: Sequence[int],
    mm_hashes: Sequence[Union[str, bytes, int]] = (),
    lora_id: Optional[Union[str, int]] = None,
    cache_salt: Optional[str] = None,
) -> int:
    """Hash of one block chained to ``parent_hash`` (convenience, one block at a time)."""
    return hash_block_bytes(parent_hash, pack_tokens(token_ids), encode_extra_keys(mm_hashes, lora_id, cache_salt))


class BlockHasher:
    """Computes a sequence's chained block hashes, incrementally.

    One hasher per request: it remembers how far it got, so a decoding request only
    hashes its new full blocks.  Only full blocks get a hash (a partial block's
    content still changes); :meth:`partial_key` gives the last partial block the
    separate key form used for prefill/decode hand-off.
    """

    __slots__ = ("block_size", "mm_items", "lora_id", "cache_salt", "hashes", "_mm_cursor")

    def __init__(
        self,
        block_size: int,
        mm_items: Sequence[MMItem] = (),
        lora_id: Optional[Union[str, int]] = None,
        cache_salt: Optional[str] = None,
    ) -> None:
        if not isinstance(block_size, int) or block_size <= 0:
            raise ValueError(f"block_size must be a positive int, got {block_size!r}")
        self.block_size = block_size
        self.mm_items = sorted(mm_items, key=lambda it: it.offset)
        for item in self.mm_items:
            if item.offset < 0 or item.length <= 0:
                raise ValueError(f"bad multimodal item {item!r}: offset must be >= 0 and length > 0")
        self.lora_id = lora_id
        self.cache_salt = cache_salt
        self.hashes: list[int] = []
        self._mm_cursor = 0  # first item that may still overlap a block not hashed yet

    def _extra_for_block(self, start: int, end: int) -> bytes:
        mm: list[Union[str, bytes, int]] = []
        items = self.mm_items
        if items:
            # Items are sorted by offset; skip those that end at or before this block.
            i = self._mm_cursor
            while i < len(items) and items[i].end <= start:
                i += 1
            self._mm_cursor = i
            while i < len(items) and items[i].offset < end:
                if items[i].end > start:
                    mm.append(items[i].mm_hash)
                i += 1
        salt = self.cache_salt if start == 0 else None  # chained: the first block carries it
        return encode_extra_keys(mm, self.lora_id, salt)

    def extend(self, token_ids: Sequence[int], num_tokens: Optional[int] = None) -> list[int]:
        """Hash every full block of ``token_ids[:num_tokens]`` not hashed yet; return all hashes.

        ``token_ids`` must extend the sequence hashed so far (append-only).  Only the
        new blocks' tokens are packed, so each token is converted once.
        """
        n = len(token_ids) if num_tokens is None else min(num_tokens, len(token_ids))
        bs = self.block_size
        num_full = n // bs
        done = len(self.hashes)
        if num_full <= done:
            return self.hashes
        start_tok = done * bs
        return self.extend_packed(pack_array(token_ids[start_tok : num_full * bs]), start_tok)

    def extend_packed(self, packed: np.ndarray, start_tok: int) -> list[int]:
        """Hash the full blocks of ``packed`` (int64 tokens starting at ``start_tok``)."""
        bs = self.block_size
        if start_tok != len(self.hashes) * bs:
            raise ValueError(f"tokens must continue at {len(self.hashes) * bs}, got {start_tok}")
        nblocks = len(packed) // bs
        if not nblocks:
            return self.hashes
        rows = packed[: nblocks * bs].reshape(nblocks, bs)
        if not self.mm_items and self.lora_id is None:
            contents = map(_xxh128_digest, rows)  # one C-level loop over the blocks
            if self.cache_salt is not None and start_tok == 0:
                # NOTE: only the first block carries the salt (the chain carries it on), so a
                # salted prompt costs one extra block of Python, not one per block.
                first = _xxh128_digest(rows[0].tobytes() + encode_extra_keys(cache_salt=self.cache_salt))
                contents = itertools.chain((first,), map(_xxh128_digest, rows[1:]))
        else:
            contents = (
                _xxh128_digest(rows[k].tobytes() + self._extra_for_block(start_tok + k * bs, start_tok + (k + 1) * bs))
                for k in range(nblocks)
            )
        parent = self.hashes[-1].to_bytes(16, "big") if self.hashes else _ROOT_DIGEST
        digests = []
        append = digests.append
        for content in contents:
            parent = _xxh128_digest(parent + content)
            append(parent)
        from_bytes = int.from_bytes
        self.hashes.extend([from_bytes(d, "big") for d in digests])
        return self.hashes

    def partial_key(self, token_ids: Sequence[int]) -> Optional[str]:
        """``<hash>:partial:<n>`` for the trailing partial block, None if there is none.

        The hash chains to the last full block like a full block would, over the
        ``n`` tokens present; the suffix keeps it from ever colliding with a full key.
        """
        self.extend(token_ids)
        bs = self.block_size
        num_full = len(token_ids) // bs
        n = len(token_ids) - num_full * bs
        if n == 0:
            return None
        parent = self.hashes[num_full - 1] if num_full else ROOT_HASH
        start = num_full * bs
        extra = self._extra_for_block_nocursor(start, start + bs)
        return partial_block_key(hash_block_bytes(parent, pack_tokens(token_ids[start:]), extra), n)

    def _extra_for_block_nocursor(self, start: int, end: int) -> bytes:
        saved = self._mm_cursor
        self._mm_cursor = 0
        try:
            return self._extra_for_block(start, end)
        finally:
            self._mm_cursor = saved


def compute_block_hashes(
    token_ids: Sequence[int],
    block_size: int,
    mm_items: Sequence[MMItem] = (),
    lora_id: Optional[Union[str, int]] = None,
    cache_salt: Optional[str] = None,
) -> list[int]:
    """All full-block hashes of a token sequence (one-shot form of :class:`BlockHasher`)."""
    return list(BlockHasher(block_size, mm_items, lora_id, cache_salt).extend(token_ids))


def storage_key(hash_value: int) -> str:
    """The storage-tier key of a full block: 32 lowercase hex digits."""
    return format(hash_value, "032x")


def partial_block_key(hash_value: int, num_tokens: int) -> str:
    """Key of a partial last block whose (chained) hash is ``hash_value``."""
    if num_tokens <= 0:
        raise ValueError(f"a partial block holds at least one token, got {num_tokens}")
    return f"{storage_key(hash_value)}:partial:{num_tokens}"
