"""Prefill/decode disaggregation through the storage tier (``--splitwise-role``).

A *prefill* server computes a prompt and, before it hands back the first token, writes all
of the prompt's KV to the shared store: every full block under its chained-hash key, and the
trailing partial block (``P % block_size`` tokens) under that chain's key plus
``:partial:<n>``.  A *decode* server is given the prompt and the prefill's first token (the
``kv_transfer_params`` extension of the request body, see :class:`KVTransferParams`); it
loads the prompt's KV from the store into its own device blocks, appends the first token
and decodes.  The router (:mod:`fastdeploy_kvcache.entrypoints.router`, in its prefill/decode mode) ties the two.

Who moves which bytes (one path each):

* **decode, full blocks**: the storage tier's own prefix match (``core/storage_tier.py``):
  one existence round trip, a prefetch into host blocks, then the usual layer-by-layer
  host-to-device load.  Nothing PD-specific.
* **decode, the partial block**: here (:meth:`PDCoordinator.after_admit`), straight from the
  store into the request's device block, once its full prefix is resident.
* **prefill, everything**: here (:meth:`PDCoordinator.on_finish`), straight from the
  request's device blocks to the store, before the blocks are released and before the
  output is emitted.

Both directions use :class:`~fastdeploy_kvcache.storage.transfer.StorageTransfer` over the
*device* caches (the C ABI's ``swap_layout`` takes device pointers: the CUDA build for GPU
tensors, the CPU build where the "device" caches live in host memory), so an object has the
same block-major bytes as the storage tier's.

Keys: :func:`handoff_keys` is the one function both sides call (a test checks they agree).
It hashes the *prompt* tokens only, so the decode side, whose request also holds the first
token, forms the same partial key as the prefill side.

Failures never fail a request: a full block that is missing or fails is recomputed (the
tier's rule: the leading run that arrived is used), a partial block that is missing, corrupt
or fails is recomputed, and every prompt token the decode server computes itself is counted
(``fastdeploy:pd_recomputed_token_num``) and logged.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from fastdeploy_kvcache import envs
from fastdeploy_kvcache.core.hashing import BlockHasher
from fastdeploy_kvcache.storage.keys import KeyNamespace, block_key

logger = logging.getLogger(__name__)

__all__ = [
    "ROLES",
    "HandoffKeys",
    "KVTransferParams",
    "PDCoordinator",
    "handoff_keys",
    "parse_kv_transfer_params",
    "make_pd_coordinator",
]

ROLES = ("mixed", "prefill", "decode")
MAX_PREFILL_TOKENS = 16
"""Most first tokens a ``kv_transfer_params.prefill_token_ids`` may carry (the router sends one)."""


# ---------------------------------------------------------------------- keys
@dataclass(frozen=True)
class HandoffKeys:
    """The store keys of one prompt: its full blocks, in order, and its partial last block."""

    full: tuple[str, ...]
    partial: Optional[str]
    partial_tokens: int
    block_size: int
    full_hashes: tuple[int, ...] = ()

    @property
    def num_full(self) -> int:
        return len(self.full)

    @property
    def num_prompt_tokens(self) -> int:
        return self.num_full * self.block_size + self.partial_tokens


def handoff_keys(ns: KeyNamespace, request: Any, num_prompt_tokens: Optional[int] = None) -> HandoffKeys:
    """Keys of ``request``'s prompt KV: THE function both the prefill and the decode side use.

    Hashes only the first ``num_prompt_tokens`` (default: the prompt) tokens, with the
    request's extra hash keys (multimodal items, LoRA id, cache salt), so a decode request
    that already holds the prefill's first token forms the same keys.  The full keys equal
    the storage tier's (``ns.keys(request.block_hashes(...))``), so the decode side's
    ordinary prefix match finds them; the partial key goes through
    :func:`~fastdeploy_kvcache.storage.keys.block_key` like every other key.
    """
    bs = ns.block_size
    prompt = request.prompt_token_ids
    n_tokens = len(prompt) if num_prompt_tokens is None else int(num_prompt_tokens)
    if not 0 < n_tokens <= len(prompt):
        raise ValueError(f"handoff_keys: num_prompt_tokens must be in [1, {len(prompt)}], got {n_tokens}")
    tokens = prompt[:n_tokens]
    hasher = BlockHasher(bs, getattr(request, "mm_items", ()), getattr(request, "lora_id", None),
                         getattr(request, "cache_salt", None))
    hashes = hasher.extend(tokens)
    num_full = n_tokens // bs
    partial_tokens = n_tokens - num_full * bs
    partial: Optional[str] = None
    if partial_tokens:
        # BlockHasher forms "<32 hex>:partial:<n>" over the chain; the namespace and the
        # grammar come from block_key, the one key function of the storage package.
        suffix = hasher.partial_key(tokens)
        assert suffix is not None
        hex_hash, _, n = suffix.split(":")
        if int(n) != partial_tokens:
            raise AssertionError(f"partial key {suffix!r} does not hold {partial_tokens} tokens")
        partial = block_key(ns, int(hex_hash, 16), partial_tokens)
    return HandoffKeys(tuple(ns.keys(hashes[:num_full])), partial, partial_tokens, bs, tuple(hashes[:num_full]))


# ---------------------------------------------------------------------- request extension
@dataclass(frozen=True)
class KVTransferParams:
    """``kv_transfer_params`` of a request body sent to a decode server (an extension).

    ``{"prefill_token_ids": [int, ...], "request_key": str | null, "num_prompt_tokens": int | null}``

    * ``prefill_token_ids``: the token(s) the prefill server generated (the router sends
      the one from ``max_tokens=1``); the decode server emits them first, then decodes.
    * ``request_key``: an opaque id for logs (the prefill response's id).
    * ``num_prompt_tokens``: the prompt length the prefill server saw; a decode server whose
      own tokenization differs logs it (the keys will not match: it recomputes).
    """

    prefill_token_ids: tuple[int, ...]
    request_key: Optional[str] = None
    num_prompt_tokens: Optional[int] = None

    def to_json(self) -> dict[str, Any]:
        return {"prefill_token_ids": list(self.prefill_token_ids), "request_key": self.request_key,
                "num_prompt_tokens": self.num_prompt_tokens}


def parse_kv_transfer_params(raw: Any) -> Optional[KVTransferParams]:
    """Validate a request's ``kv_transfer_params``; ValueError names the bad field."""
    if raw is None:
        return None
    if isinstance(raw, KVTransferParams):
        return raw
    if not isinstance(raw, Mapping):
        raise ValueError(f"kv_transfer_params: must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - {"prefill_token_ids", "request_key", "num_prompt_tokens"})
    if unknown:
        raise ValueError(f"kv_transfer_params: unknown field(s) {', '.join(unknown)}")
    ids = raw.get("prefill_token_ids")
    if not isinstance(ids, (list, tuple)) or not ids:
        raise ValueError("kv_transfer_params.prefill_token_ids: must be a non-empty list of token ids")
    if len(ids) > MAX_PREFILL_TOKENS:
        raise ValueError(f"kv_transfer_params.prefill_token_ids: at most {MAX_PREFILL_TOKENS} ids, got {len(ids)}")
    for i, t in enumerate(ids):
        if not isinstance(t, int) or isinstance(t, bool) or t < 0:
            raise ValueError(f"kv_transfer_params.prefill_token_ids[{i}]: must be a token id >= 0, got {t!r}")
    key = raw.get("request_key")
    if key is not None and (not isinstance(key, str) or len(key) > 256):
        raise ValueError("kv_transfer_params.request_key: must be a string of at most 256 characters")
    n = raw.get("num_prompt_tokens")
    if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n <= 0):
        raise ValueError(f"kv_transfer_params.num_prompt_tokens: must be a positive integer, got {n!r}")
    return KVTransferParams(tuple(int(t) for t in ids), key, n)


# ---------------------------------------------------------------------- engine side
@dataclass
class _DecodeState:
    """A decode request's hand-off bookkeeping (engine thread only)."""

    params: KVTransferParams
    num_prompt_tokens: int
    keys: Optional[HandoffKeys] = None
    partial_done: bool = False
    recomputed: int = 0
    logged: bool = False


@dataclass
class _Stats:
    prefill_requests: int = 0
    prefill_write_blocks_ok: int = 0
    prefill_write_blocks_failed: int = 0
    prefill_write_blocks_skipped: int = 0  # full blocks the store already held
    prefill_write_bytes: int = 0
    prefill_write_seconds: float = 0.0
    decode_requests: int = 0
    decode_partial_loaded: int = 0
    decode_partial_failed: int = 0
    decode_partial_read_seconds: float = 0.0
    recomputed_tokens: int = 0
    recomputed_requests: int = 0


def device_layout(controller: Any) -> Any:
    """The controller's *device* caches as a block layout for StorageTransfer (object order)."""
    from fastdeploy_kvcache.storage.transfer import HostTierLayout

    caches = controller.get_kv_caches()
    return HostTierLayout.of_caches(controller, lambda name: int(caches[name].data_ptr()),
                                    int(controller.num_gpu_blocks), memory="device")


class PDCoordinator:
    """The engine's prefill or decode role (see the module docstring).

    The engine calls it from its own thread only: :meth:`on_add` when a request arrives,
    :meth:`after_admit` after a request got its blocks, :meth:`count_recomputed` after each
    forward, :meth:`on_finish` before a request's blocks are released.
    """

    def __init__(self, engine: Any, role: str) -> None:
        from fastdeploy_kvcache.storage.transfer import StorageTransfer

        if role not in ("prefill", "decode"):
            raise ValueError(f"PDCoordinator: role must be 'prefill' or 'decode', got {role!r}")
        pool = engine.pool
        self.engine = engine
        self.role = role
        self.block_size = engine.cache_config.block_size
        self.ns: KeyNamespace = pool.namespace
        self.store = pool.store
        capi = _capi_for(engine.device)
        layout = device_layout(pool.controller)
        # NOTE: a decode server moves one object per request (the partial block); a prefill
        # server whole prompts, in calls of up to 16 MiB (at least 4 objects) so a long
        # prompt of small objects is one backend call.  Both lanes get this size.
        staging = 1 if role == "decode" else max(4, min(512, (16 << 20) // layout.object_bytes))
        self.transfer = StorageTransfer(layout, self.store, staging_blocks=staging, capi=capi)
        self.object_bytes = self.transfer.object_bytes
        self._decode: dict[str, _DecodeState] = {}
        self._stats = _Stats()
        logger.info("PD role %s: KV hand-off through the %s store, keys %s:*", role,
                    pool.storage_config.backend, self.ns.prefix)

    # ------------------------------------------------------------------ requests
    def check_request(self, kv_transfer: Any) -> Optional[KVTransferParams]:
        """Validate at ``add_request`` (caller's thread): ValueError for a misplaced or bad field."""
        params = parse_kv_transfer_params(kv_transfer)
        if params is not None and self.role != "decode":
            raise ValueError(f"kv_transfer_params: only a decode server takes them (this one is {self.role})")
        return params

    def on_add(self, er: Any) -> bool:
        """A request reached the engine thread; False when it is already finished.

        Decode requests emit the prefill's token(s) now, as if sampled here: the client's
        first token is the prefill's.  A seeded sampler skips the draw each of them used on
        the prefill side, so a seeded request continues the same random stream.
        """
        params = getattr(er, "kv_transfer", None)
        if self.role != "decode" or params is None:
            return True
        self._stats.decode_requests += 1
        r = er.req
        st = _DecodeState(params, r.num_prompt_tokens)
        if params.num_prompt_tokens is not None and params.num_prompt_tokens != r.num_prompt_tokens:
            logger.warning("PD decode %s (%s): the prefill saw %d prompt tokens, this server %d; its KV will not "
                           "match and is recomputed", er.request_id, params.request_key,
                           params.num_prompt_tokens, r.num_prompt_tokens)
        self._decode[er.request_id] = st
        for token in params.prefill_token_ids:
            if er.finished:
                break
            er.sampler.skip_draw()  # the draw the prefill side's sample() made
            self.engine.append_token(er, int(token))
        return not er.finished

    def after_admit(self, er: Any) -> None:
        """Decode: load the prompt's partial block into the request's own device block.

        Runs once the request holds its blocks.  Only when the whole full-block prefix is
        resident (the storage tier found every full block); otherwise the partial block is
        recomputed with the blocks before it.
        """
        st = self._decode.get(er.request_id)
        if st is None or st.partial_done:
            return
        r = er.req
        bs = self.block_size
        num_full, n = divmod(st.num_prompt_tokens, bs)
        if n == 0:
            st.partial_done = True
            return
        if r.num_computed_tokens != num_full * bs or len(r.block_tables) <= num_full:
            if r.num_computed_tokens < num_full * bs:
                st.partial_done = True  # the prefix is recomputed, and the partial block with it
            return
        st.partial_done = True
        if st.keys is None:
            st.keys = handoff_keys(self.ns, r, st.num_prompt_tokens)
        key = st.keys.partial
        assert key is not None
        t0 = time.perf_counter()
        try:
            if not self._store_available():
                raise RuntimeError("the store is unavailable (set-up pending or breaker open)")
            got = self.transfer.get_blocks([key], [r.block_tables[num_full]])[0]
        except Exception as exc:  # noqa: BLE001 - StorageError or anything: recompute it
            logger.warning("PD decode %s: partial block %s could not be read (%s); recomputing it",
                           er.request_id, key, exc)
            got = -1
        self._stats.decode_partial_read_seconds += time.perf_counter() - t0
        if got == self.object_bytes:
            r.num_computed_tokens += n
            er.cached_storage += n
            self._stats.decode_partial_loaded += 1
        else:
            self._stats.decode_partial_failed += 1
            logger.warning("PD decode %s: partial block %s not loaded (result %d); recomputing its %d tokens",
                           er.request_id, key, got, n)

    def count_recomputed(self, scheduled: Sequence[tuple[Any, int]]) -> None:
        """Decode: count the prompt tokens a forward computed (call before advancing them)."""
        if not self._decode:
            return
        for er, n in scheduled:
            st = self._decode.get(er.request_id)
            if st is None:
                continue
            c = er.req.num_computed_tokens
            k = max(0, min(c + n, st.num_prompt_tokens) - c)
            if k:
                st.recomputed += k
                self._stats.recomputed_tokens += k

    def on_finish(self, er: Any, reason: str) -> None:
        """Before ``er``'s blocks are released: prefill writes its KV; decode logs recompute."""
        st = self._decode.pop(er.request_id, None)
        if st is not None:
            if st.recomputed:
                self._stats.recomputed_requests += 1
                logger.warning("PD decode %s (%s): recomputed %d of %d prompt tokens (blocks missing from or "
                               "failed in the store)", er.request_id, st.params.request_key, st.recomputed,
                               st.num_prompt_tokens)
            return
        if self.role == "prefill" and reason in ("stop", "length"):
            self._write_prompt(er)

    def _write_prompt(self, er: Any) -> None:
        """Put every block of the prompt, full and partial, from the device to the store.

        NOTE: synchronous on the engine thread: the first token must not leave before its KV
        is stored, and the device blocks must not be reused while the gather reads them.
        Leading full blocks the store already holds (an earlier turn) are skipped after one
        existence round trip.  A failed put is logged and counted; the decode side will
        recompute those blocks.
        """
        r = er.req
        P = r.num_prompt_tokens
        if r.num_computed_tokens < P or not r.block_tables:
            return
        self._stats.prefill_requests += 1
        keys = handoff_keys(self.ns, r, P)
        nfull = keys.num_full
        blocks = list(r.block_tables)
        need = nfull + (1 if keys.partial else 0)
        if len(blocks) < need:
            logger.error("PD prefill %s: %d blocks for %d prompt tokens; not written", er.request_id, len(blocks), P)
            return
        t0 = time.perf_counter()
        if not self._store_available():
            # NOTE: no call at all: a dead store must not hold the engine thread for the
            # backend's timeout on every request; the decode side recomputes.
            self._stats.prefill_write_blocks_failed += need
            logger.warning("PD prefill %s: the store is unavailable; %d blocks not written", er.request_id, need)
            return
        skip = 0
        if nfull:
            try:
                skip = max(0, min(int(self.store.batch_exists(list(keys.full))), nfull))
            except Exception as exc:  # noqa: BLE001 - then write them all
                logger.debug("PD prefill %s: exists check failed (%s)", er.request_id, exc)
        todo_keys = list(keys.full[skip:]) + ([keys.partial] if keys.partial else [])
        todo_blocks = blocks[skip:nfull] + ([blocks[nfull]] if keys.partial else [])
        self._stats.prefill_write_blocks_skipped += skip
        if not todo_keys:
            return
        try:
            results = self.transfer.put_blocks(todo_keys, todo_blocks)
        except Exception as exc:  # noqa: BLE001 - the decode side recomputes
            logger.warning("PD prefill %s: writing %d blocks failed (%s)", er.request_id, len(todo_keys), exc)
            results = [-1] * len(todo_keys)
        ok = sum(1 for x in results if x == 0)
        # Full blocks now stored (or already there): the storage tier's own backups skip them.
        stored = list(keys.full_hashes[:skip]) + [h for h, x in zip(keys.full_hashes[skip:], results) if x == 0]
        tier = self.engine.pool.tier
        if stored and tier is not None:
            tier.mark_stored(stored)
        self._stats.prefill_write_blocks_ok += ok
        self._stats.prefill_write_blocks_failed += len(todo_keys) - ok
        self._stats.prefill_write_bytes += ok * self.object_bytes
        self._stats.prefill_write_seconds += time.perf_counter() - t0
        if ok < len(todo_keys):
            logger.warning("PD prefill %s: %d of %d blocks not stored (results %s)", er.request_id,
                           len(todo_keys) - ok, len(todo_keys), sorted(set(results)))

    def _store_available(self) -> bool:
        """The backend's cheap health flag (no I/O): False while set-up is pending or the
        breaker is open, so the engine thread never waits on a store known to be down."""
        try:
            return bool(self.store.health().available)
        except Exception:  # noqa: BLE001 - a broken health() means "off"
            return False

    # ------------------------------------------------------------------ stats / close
    def stats(self) -> dict[str, Any]:
        s = self._stats
        return {
            "role": self.role,
            "prefill_requests": s.prefill_requests,
            "prefill_write_blocks_ok": s.prefill_write_blocks_ok,
            "prefill_write_blocks_failed": s.prefill_write_blocks_failed,
            "prefill_write_blocks_skipped": s.prefill_write_blocks_skipped,
            "prefill_write_bytes": s.prefill_write_bytes,
            "prefill_write_seconds": s.prefill_write_seconds,
            "decode_requests": s.decode_requests,
            "decode_partial_loaded": s.decode_partial_loaded,
            "decode_partial_failed": s.decode_partial_failed,
            "decode_partial_read_seconds": s.decode_partial_read_seconds,
            "recomputed_tokens": s.recomputed_tokens,
            "recomputed_requests": s.recomputed_requests,
        }

    def close(self) -> None:
        self.transfer.close()


def _capi_for(device: str) -> Any:
    """The C ABI whose swap_layout reads this engine's device caches."""
    from fastdeploy_kvcache import ops

    return ops.load_capi(variant="cuda" if device == "gpu" else "cpu")


def check_role_config(role: str, storage: Any, use_v1: bool) -> None:
    """ValueError naming what a prefill or decode server lacks (at start, before any request)."""
    if role not in ROLES:
        raise ValueError(f"splitwise_role: must be one of {ROLES}, got {role!r}")
    if role == "mixed":
        return
    missing = []
    if not envs.get("FD_PD_TRANSFER_VIA_STORAGE"):
        missing.append("FD_PD_TRANSFER_VIA_STORAGE=1 (the store is the only hand-off this engine implements)")
    if not use_v1:
        missing.append("ENABLE_V1_KVCACHE_MANAGER=1")
    if storage is None or not getattr(storage, "enabled", False):
        missing.append("--kvcache-storage-backend file|mooncake (the store both roles share)")
    if missing:
        raise ValueError(f"--splitwise-role {role} needs " + "; ".join(missing))


def make_pd_coordinator(engine: Any) -> Optional[PDCoordinator]:
    """The engine's PD role, or None for ``mixed`` (checks the configuration first)."""
    role = getattr(engine.args, "splitwise_role", "mixed") or "mixed"
    check_role_config(role, getattr(engine.args, "storage", None), engine.use_v1)
    if role == "mixed":
        return None
    if role == "decode" and getattr(engine.pool.storage_config, "prefetch_policy", "") != "wait_complete":
        logger.warning("decode role with --kvcache-storage-prefetch-policy %s: a prefetch that takes longer "
                       "than its deadline is recomputed; wait_complete never is",
                       engine.pool.storage_config.prefetch_policy)
    return PDCoordinator(engine, role)
