"""The Triton paged decode kernel against the torch fallback and a plain float64 reference.

Shared by the CPU test (tests/engine_torch/test_triton_decode.py, which runs this module in
a subprocess with ``TRITON_INTERPRET=1``: Triton's interpreter must be chosen before Triton
is first imported) and the GPU test (tests/gpu/test_torch_engine_gpu.py, compiled kernels).

Each case is a batch of one-token queries over a scattered paged cache; :func:`case_errors`
returns the kernel's largest errors, each relative to the reference's largest magnitude.

    TRITON_INTERPRET=1 python -m tests.triton_decode_cases   # every case on the CPU, as JSON

The CPU run also puts the kernel into the runner (tiny-llama-random) and compares its logits
with transformers' sdpa (``runner``).
"""

from __future__ import annotations

import json
import sys
from typing import Any

# name -> (query heads, KV heads, head dim, block size, seq lengths, table width or None)
CASES: dict[str, tuple[int, int, int, int, tuple[int, ...], Any]] = {
    # GQA group 4, ragged: one token, one short of a block, exact multiples, a long one.
    "gqa4_bs16_ragged": (8, 2, 64, 16, (1, 15, 16, 33, 64, 97), None),
    # No GQA (group 1), large blocks, lengths at and across block edges.
    "gqa1_bs64": (4, 4, 128, 64, (1, 64, 65, 128, 200), None),
    # Group 3 (SmolLM2's 9 over 3): the head tile is padded past the group.
    "gqa3_bs16": (9, 3, 64, 16, (5, 16, 40), None),
    # A block size below the kernel's 16-row tile, and one that is not a power of two.
    "gqa4_bs8": (8, 2, 64, 8, (1, 8, 9, 50), None),
    "gqa2_bs24": (4, 2, 32, 24, (3, 24, 48, 71), None),
    # Tables wider than the longest seq needs (padded columns are never read).
    "gqa4_bs16_padded_table": (8, 2, 64, 16, (2, 17, 31), 6),
    # Llama-3-8B's heads (32 over 8 of 128) with its block size, context split over programs.
    "llama3_bs64": (32, 8, 128, 64, (1, 300, 640, 1000), None),
}
# GPU only (too slow for the interpreter): a serving-sized batch, where the kernel picks its
# own number of context splits from the GPU's SM count.
GPU_CASES: dict[str, tuple[int, int, int, int, tuple[int, ...], Any]] = {
    "llama3_bs64_batch32_2k": (32, 8, 128, 64, tuple(1 + (i * 677) % 2100 for i in range(31)) + (2048,), None),
}
# Chunks after cached context: name -> (query heads, KV heads, head dim, block size, context, chunk).
PREFILL_CASES: dict[str, tuple[int, int, int, int, int, int]] = {
    "gqa4_bs16_ctx37_n11": (8, 2, 64, 16, 37, 11),
    "gqa1_bs64_ctx64_n1": (4, 4, 128, 64, 64, 1),  # one token, context a whole block
    "gqa3_bs16_ctx16_n33": (9, 3, 64, 16, 16, 33),  # two row tiles
    "gqa4_bs8_ctx50_n70": (8, 2, 64, 8, 50, 70),
    "gqa2_bs24_ctx48_n5": (4, 2, 32, 24, 48, 5),
    "llama3_bs64_ctx300_n64": (32, 8, 128, 64, 300, 64),
}
DTYPES = ("float32", "float16", "bfloat16")
# 8-bit caches (uint8 bytes with float32 per-token scales, fp8_kv.py: E4M3 for "fp8-", int8
# for "int8-") under queries of the named dtype: the reference is float64 over the
# dequantized values, so the bound is the query dtype's (the dequantization itself is exact
# up to the scale multiply).
FP8_DTYPES = ("fp8-float32", "fp8-bfloat16", "int8-float32", "int8-bfloat16")
# Each dtype's bound on the kernel's error (inputs are exact in it; the probabilities and the
# output round to it, as in a flash kernel).
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2, "fp8-float32": 2e-5, "fp8-bfloat16": 2e-2,
             "int8-float32": 2e-5, "int8-bfloat16": 2e-2}


def _query_dtype(dtype: str) -> Any:
    """The torch dtype of the queries (and of float caches) of case dtype ``dtype``."""
    import torch

    return getattr(torch, dtype.split("-")[-1])


class _Caches:
    """A case's K/V caches ``[num_blocks, kv_heads, bs, d]``: float ones in the case's dtype, or
    FP8 ones (uint8 bytes plus float32 scales); ``k_ref`` / ``v_ref`` the values a read sees."""

    def __init__(self, gen: Any, shape: tuple[int, ...], dtype: str) -> None:
        import torch

        from fastdeploy_kvcache.config import BLOCK_WISE_FP8, BLOCK_WISE_INT8
        from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import dequantize_8bit, quantize_8bit

        self.fp8 = dtype.startswith(("fp8-", "int8-"))  # 8-bit, either encoding
        self.kv_quant = BLOCK_WISE_INT8 if dtype.startswith("int8-") else BLOCK_WISE_FP8
        k = torch.randn(shape, generator=gen)
        v = torch.randn(shape, generator=gen)
        if self.fp8:
            # Uneven magnitudes per token (the scales must be per token, not per block).
            k = k * torch.rand(shape[:3], generator=gen)[..., None].mul(4).add(0.25)
            v = v * torch.rand(shape[:3], generator=gen)[..., None].mul(4).add(0.25)
            (self.k, self.ks), (self.v, self.vs) = quantize_8bit(k, self.kv_quant), quantize_8bit(v, self.kv_quant)
            self.k_ref = dequantize_8bit(self.k, self.ks, self.kv_quant)
            self.v_ref = dequantize_8bit(self.v, self.vs, self.kv_quant)
        else:
            dt = _query_dtype(dtype)
            self.k, self.v, self.ks, self.vs = k.to(dt), v.to(dt), None, None
            self.k_ref, self.v_ref = self.k, self.v

    def clone(self) -> "_Caches":
        c = object.__new__(_Caches)
        c.__dict__.update({name: (t.clone() if hasattr(t, "clone") else t) for name, t in self.__dict__.items()})
        return c

    def to(self, device: Any) -> dict[str, Any]:
        """The kernel's keywords for the caches on ``device``: k_cache, v_cache (and scales)."""
        out = {"k_cache": self.k.to(device), "v_cache": self.v.to(device)}
        if self.fp8:
            out.update(k_scale=self.ks.to(device), v_scale=self.vs.to(device))
        return out

    def scales(self) -> dict[str, Any]:
        return {"k_scale": self.ks, "v_scale": self.vs} if self.fp8 else {}

    def flags(self) -> dict[str, Any]:
        """The kernels' keyword for int8 bytes (E4M3 and float caches: none)."""
        from fastdeploy_kvcache.config import BLOCK_WISE_INT8

        return {"int8": True} if self.fp8 and self.kv_quant == BLOCK_WISE_INT8 else {}
SPLITS = (None, 1, 3)  # None: the kernel's own choice


def _reference(q: Any, k_cache: Any, v_cache: Any, table: Any, lens: Any, scale: float) -> Any:
    """float64 softmax attention, one seq and head at a time, from the blocks' contents."""
    import torch

    b, h, d = q.shape
    kvh, bs = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty((b, h, d), dtype=torch.float64)
    for i in range(b):
        n = int(lens[i])
        blocks = [int(x) for x in table[i, : -(-n // bs)]]
        k = torch.cat([k_cache[x] for x in blocks], dim=1)[:, :n].double()  # [kvh, n, d]
        v = torch.cat([v_cache[x] for x in blocks], dim=1)[:, :n].double()
        for j in range(h):
            kv = j // (h // kvh)
            p = torch.softmax((k[kv] @ q[i, j].double()) * scale, dim=0)
            out[i, j] = p @ v[kv]
    return out


def tuning_variants() -> list[tuple[str, Any]]:
    """Kernel tunings checked besides the default: one block a tile, several (a tile over
    2 to 8 cache blocks, each row's block from its own table entry), and float16 dots (FP8
    caches under 16-bit queries; ignored otherwise)."""
    from fastdeploy_kvcache.engine.transformers_runner.triton_paged_attention import DecodeTuning

    return [("one_block", DecodeTuning(1)), ("two_blocks", DecodeTuning(2, num_warps=8)),
            ("eight_blocks_f16", DecodeTuning(8, float16_dots=True))]


def case_errors(name: str, dtype: str, device: Any) -> dict[str, float]:
    """The kernel's errors on case ``name``: against float64 (``f64``, per split choice), against
    the torch fallback (``torch``), and against float64 when the kernel writes the new token's
    K/V itself (``write_new_f64``); ``padding_changed``, ``outside_changed`` and
    ``write_new_cache_wrong`` are 1.0 when garbage table padding changed the result, a row
    outside the output was written, or the caches after the write differ from the expected."""
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.torch_attention import decode_attention_torch, decode_mask
    from fastdeploy_kvcache.engine.transformers_runner.triton_paged_attention import paged_decode_attention

    heads, kv_heads, dim, bs, lens_t, width = CASES.get(name) or GPU_CASES[name]
    dt = _query_dtype(dtype)
    gen = torch.Generator().manual_seed(len(name))
    b = len(lens_t)
    need = [-(-n // bs) for n in lens_t]
    width = width or max(need)
    num_blocks = sum(need) + 3
    ids = torch.randperm(num_blocks, generator=gen)
    table = torch.empty((b, width), dtype=torch.int64)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[at:at + n]
        table[i, n:] = ids[at]  # padding: a valid block (the torch fallback reads it, masked)
        at += n
    caches = _Caches(gen, (num_blocks, kv_heads, bs, dim), dtype)
    # The runner's query is a [B, H, D] view of [H, T, D]; its output rows a slice of [T, H, D].
    q = torch.randn((heads, b + 2, dim), generator=gen).to(dt)[:, :b].transpose(0, 1)
    lens = torch.tensor(lens_t, dtype=torch.int64)
    scale = dim ** -0.5
    ref = _reference(q, caches.k_ref, caches.v_ref, table, lens, scale)
    norm = float(ref.abs().max())
    on_dev = caches.to(device)

    def on(x: Any) -> Any:
        return x.to(device)

    def run(tbl: Any, splits: Any, tuning: Any = None) -> Any:
        full = torch.full((b + 2, heads, dim), 7.0, dtype=dt, device=device)
        paged_decode_attention(on(q), block_table=on(tbl), seq_lens=on(lens), out=full[:b], scale=scale,
                               num_splits=splits, tuning=tuning, **on_dev, **caches.flags())
        return full.cpu()

    res: dict[str, float] = {}
    outside = 0.0
    for s in SPLITS:
        full = run(table, s)
        outside = max(outside, float((full[b:] != 7.0).any()))
        res[f"f64_splits_{s}"] = float((full[:b].double() - ref).abs().max()) / norm
    for tname, tuning in tuning_variants():
        for s in (1, 3):
            full = run(table, s, tuning)
            outside = max(outside, float((full[b:] != 7.0).any()))
            res[f"f64_tuning_{tname}_splits_{s}"] = float((full[:b].double() - ref).abs().max()) / norm
    res["outside_changed"] = outside
    got = run(table, 3)
    garbage = table.clone()
    for i, n in enumerate(need):
        garbage[i, n:] = 1 << 40  # would fault or read garbage if it were dereferenced
    res["padding_changed"] = float(not torch.equal(run(garbage, 3), got))
    # The new token's K/V handed to the kernel (slots zeroed first): it must write them, then
    # attend over them, as if they had been in the cache.
    blank = caches.clone()
    rows = torch.arange(b)
    last_blocks = table[rows, (lens - 1) // bs]
    at = (lens - 1) % bs
    new = {"k_new": caches.k[last_blocks, :, at].clone(), "v_new": caches.v[last_blocks, :, at].clone()}  # [B, kvh, D]
    blank.k[last_blocks, :, at] = 0
    blank.v[last_blocks, :, at] = 0
    if caches.fp8:
        new.update(k_new_scale=caches.ks[last_blocks, :, at].clone(), v_new_scale=caches.vs[last_blocks, :, at].clone())
        blank.ks[last_blocks, :, at] = 0
        blank.vs[last_blocks, :, at] = 0
    dev = blank.to(device)
    full = torch.full((b + 2, heads, dim), 7.0, dtype=dt, device=device)
    paged_decode_attention(on(q), block_table=on(table), seq_lens=on(lens), out=full[:b], scale=scale, num_splits=3,
                           **dev, **caches.flags(), **{k: on(t) for k, t in new.items()})
    res["write_new_f64"] = float((full[:b].cpu().double() - ref).abs().max()) / norm
    want = caches.to("cpu")
    res["write_new_cache_wrong"] = float(not all(torch.equal(dev[k].cpu(), want[k]) for k in want))
    mask = decode_mask(on(lens), width, bs, torch.arange(width * bs, device=device))
    fallback = decode_attention_torch(on(q), on_dev["k_cache"], on_dev["v_cache"], on(table), mask, scale,
                                      on_dev.get("k_scale"), on_dev.get("v_scale"), caches.kv_quant).cpu()
    res["torch"] = float((got[:b].double() - fallback.double()).abs().max()) / norm
    res["torch_vs_f64"] = float((fallback.double() - ref).abs().max()) / norm
    return res


# Rows of length 0 (a CUDA graph's padded rows) between real ones: (lengths, block size).
ZERO_LENGTH_LENS = (0, 17, 0, 33, 0)
ZERO_LENGTH_BLOCK = 16


def zero_length_errors(dtype: str, device: Any) -> dict[str, float]:
    """Rows of length 0 among real rows, the kernel writing the new tokens' K/V, at each split
    choice: ``f64`` the real rows' error against float64 (relative), ``zero_rows_not_zero``
    1.0 when a length-0 row's output is not all zeros (NaN included), ``cache_wrong`` 1.0
    when the caches after the call differ from the real rows' two slots written (a
    length-0 row wrote somewhere: its position -1 truncates to slot 0 of its table's block)."""
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.triton_paged_attention import paged_decode_attention

    heads, kv_heads, dim, bs = 8, 2, 64, ZERO_LENGTH_BLOCK
    lens_t = ZERO_LENGTH_LENS
    dt = _query_dtype(dtype)
    gen = torch.Generator().manual_seed(7)
    b = len(lens_t)
    width = max(-(-n // bs) for n in lens_t)
    num_blocks = b * width + 2
    # Every row's table is real blocks (a padded row's stale table from an earlier step).
    table = torch.randperm(num_blocks, generator=gen)[: b * width].view(b, width).clone()
    caches = _Caches(gen, (num_blocks, kv_heads, bs, dim), dtype)
    q = torch.randn((b, heads, dim), generator=gen).to(dt)
    fresh = _Caches(gen, (b, kv_heads, 1, dim), dtype)  # the new tokens' K/V, one "block" per row
    new = {"k_new": fresh.k[:, :, 0], "v_new": fresh.v[:, :, 0]}
    if fresh.fp8:
        new.update(k_new_scale=fresh.ks[:, :, 0], v_new_scale=fresh.vs[:, :, 0])
    lens = torch.tensor(lens_t, dtype=torch.int64)
    real = [i for i, n in enumerate(lens_t) if n > 0]
    want = caches.clone()
    for i in real:
        blk, at = int(table[i, (lens_t[i] - 1) // bs]), (lens_t[i] - 1) % bs
        want.k[blk, :, at] = fresh.k[i, :, 0]
        want.v[blk, :, at] = fresh.v[i, :, 0]
        want.k_ref[blk, :, at] = fresh.k_ref[i, :, 0]
        want.v_ref[blk, :, at] = fresh.v_ref[i, :, 0]
        if want.fp8:
            want.ks[blk, :, at] = fresh.ks[i, :, 0]
            want.vs[blk, :, at] = fresh.vs[i, :, 0]
    scale = dim ** -0.5
    ref = _reference(q[real], want.k_ref, want.v_ref, table[real], lens[real], scale)
    norm = float(ref.abs().max())
    want_t = want.to("cpu")
    res: dict[str, float] = {}
    for splits in SPLITS:
        dev = caches.to(device)
        out = torch.full((b, heads, dim), 7.0, dtype=dt, device=device)
        paged_decode_attention(q.to(device), block_table=table.to(device), seq_lens=lens.to(device), out=out,
                               scale=scale, num_splits=splits, **dev, **caches.flags(),
                               **{k: t.to(device) for k, t in new.items()})
        out = out.cpu()
        res[f"f64_splits_{splits}"] = float((out[real].double() - ref).abs().max()) / norm
        zeros = [i for i in range(b) if i not in real]
        res[f"zero_rows_not_zero_splits_{splits}"] = float(not bool((out[zeros] == 0).all()))
        res[f"cache_wrong_splits_{splits}"] = float(not all(torch.equal(dev[k].cpu(), want_t[k]) for k in want_t))
    return res


def assert_zero_length_ok(r: dict[str, float], dtype: str) -> None:
    """The assertions on one :func:`zero_length_errors` result."""
    for s in SPLITS:
        assert r[f"f64_splits_{s}"] < TOLERANCE[dtype], (s, r)
        assert r[f"zero_rows_not_zero_splits_{s}"] == 0.0, f"a length-0 row's output is not zeros ({s} splits)"
        assert r[f"cache_wrong_splits_{s}"] == 0.0, f"a length-0 row wrote into the cache ({s} splits)"


def prefill_case_errors(name: str, dtype: str, device: Any) -> dict[str, float]:
    """The prefill kernel's errors on ``name``: against float64 (``f64``) and against the
    gather + SDPA fallback (``torch``); ``outside_changed`` is 1.0 when it wrote outside its
    rows.  Slots past the chunk's end hold NaN: a kernel that read them would return NaN."""
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.torch_attention import prefill_attention_torch
    from fastdeploy_kvcache.engine.transformers_runner.triton_paged_attention import paged_prefill_attention

    heads, kv_heads, dim, bs, ctx, n = PREFILL_CASES[name]
    dt = _query_dtype(dtype)
    gen = torch.Generator().manual_seed(len(name))
    total = ctx + n
    nb = -(-total // bs)
    num_blocks = nb + 3
    table = torch.randperm(num_blocks, generator=gen)[:nb]
    caches = _Caches(gen, (num_blocks, kv_heads, bs, dim), dtype)
    last, at = int(table[-1]), (total - 1) % bs + 1
    if caches.fp8:
        caches.k[last, :, at:] = 0x7F  # E4M3 NaN (int8: 127, far off the real values' scale)
        caches.v[last, :, at:] = 0x7F
        caches.ks[last, :, at:] = float("nan")
        caches.vs[last, :, at:] = float("nan")
    else:
        caches.k[last, :, at:] = float("nan")
        caches.v[last, :, at:] = float("nan")
    q = torch.randn((heads, n + 2, dim), generator=gen).to(dt)[:, 1:n + 1].transpose(0, 1)  # [n, H, D], strided
    scale = dim ** -0.5
    seq_k = torch.cat([caches.k_ref[int(x)] for x in table], dim=1)[:, :total].double()  # [kvh, total, D]
    seq_v = torch.cat([caches.v_ref[int(x)] for x in table], dim=1)[:, :total].double()
    ref = torch.empty((n, heads, dim), dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        s = (q[:, h].double() @ seq_k[kv].T) * scale  # [n, total]
        s = s.masked_fill(torch.arange(total)[None, :] > ctx + torch.arange(n)[:, None], float("-inf"))
        ref[:, h] = torch.softmax(s, dim=1) @ seq_v[kv]
    norm = float(ref.abs().max())
    full = torch.full((n + 2, heads, dim), 7.0, dtype=dt, device=device)
    dev = caches.to(device)
    paged_prefill_attention(q.to(device), table=table.to(device), context_len=ctx, out=full[1:n + 1], scale=scale,
                            **dev, **caches.flags())
    full = full.cpu()
    fallback = prefill_attention_torch(q.transpose(0, 1)[None].to(device), dev["k_cache"], dev["v_cache"],
                                       table.to(device), ctx, scale, dev.get("k_scale"),
                                       dev.get("v_scale"), caches.kv_quant)[0].transpose(0, 1).cpu()
    return {"f64": float((full[1:n + 1].double() - ref).abs().max()) / norm,
            "torch": float((full[1:n + 1].double() - fallback.double()).abs().max()) / norm,
            "outside_changed": float(bool((full[0] != 7.0).any() or (full[n + 1] != 7.0).any()))}


def assert_prefill_ok(r: dict[str, float], dtype: str) -> None:
    """The assertions on one :func:`prefill_case_errors` result."""
    assert r["f64"] < TOLERANCE[dtype], r
    assert r["torch"] < TOLERANCE[dtype], r
    assert r["outside_changed"] == 0.0, "the kernel wrote outside its output rows"


def assert_case_ok(r: dict[str, float], dtype: str) -> None:
    """The assertions on one case's :func:`case_errors` (the CPU and the GPU test share them)."""
    tol = TOLERANCE[dtype]
    for s in SPLITS:
        assert r[f"f64_splits_{s}"] < tol, (s, r)
    tuned = [k for k in r if k.startswith("f64_tuning_")]
    assert len(tuned) == 6, r  # three tunings x two split choices
    for k in tuned:
        assert r[k] < tol, (k, r)
    assert r["torch"] < tol, r
    assert r["outside_changed"] == 0.0, "the kernel wrote outside its output rows"
    assert r["padding_changed"] == 0.0, "the kernel read table entries past a seq's length"
    assert r["write_new_f64"] < tol, r
    assert r["write_new_cache_wrong"] == 0.0, "the new token's K/V did not land in (only in) its slot"


def runner_error() -> float:
    """The runner with the kernel as its decode attention against transformers' sdpa
    (tiny-llama-random, float32, on the CPU): tests/torch_attention_check.py."""
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from tests.torch_attention_check import paged_vs_sdpa_error

    loaded = load_torch_model("tiny-llama-random", seed=0, device=torch.device("cpu"), dtype="float32")
    return paged_vs_sdpa_error(loaded, prefix=37, chunk=11, decodes=3, block_size=16, attention="triton")


def main() -> int:
    import torch

    out: dict[str, Any] = {f"{name}/{dtype}": case_errors(name, dtype, torch.device("cpu"))
                           for name in CASES for dtype in DTYPES}
    out.update({f"prefill/{name}/{dtype}": prefill_case_errors(name, dtype, torch.device("cpu"))
                for name in PREFILL_CASES for dtype in DTYPES})
    out.update({f"zero_length/{dtype}": zero_length_errors(dtype, torch.device("cpu")) for dtype in DTYPES})
    out["runner"] = runner_error()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
