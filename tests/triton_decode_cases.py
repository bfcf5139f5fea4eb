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
# Each dtype's bound on the kernel's error (inputs are exact in it; the probabilities and the
# output round to it, as in a flash kernel).
TOLERANCE = {"float32": 2e-5, "float16": 3e-3, "bfloat16": 2e-2}
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
    dt = getattr(torch, dtype)
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
    k_cache = torch.randn((num_blocks, kv_heads, bs, dim), generator=gen).to(dt)
    v_cache = torch.randn((num_blocks, kv_heads, bs, dim), generator=gen).to(dt)
    # The runner's query is a [B, H, D] view of [H, T, D]; its output rows a slice of [T, H, D].
    q = torch.randn((heads, b + 2, dim), generator=gen).to(dt)[:, :b].transpose(0, 1)
    lens = torch.tensor(lens_t, dtype=torch.int64)
    scale = dim ** -0.5
    ref = _reference(q, k_cache, v_cache, table, lens, scale)
    norm = float(ref.abs().max())

    def on(x: Any) -> Any:
        return x.to(device)

    def run(tbl: Any, splits: Any) -> Any:
        full = torch.full((b + 2, heads, dim), 7.0, dtype=dt, device=device)
        paged_decode_attention(on(q), on(k_cache), on(v_cache), on(tbl), on(lens), full[:b], scale, num_splits=splits)
        return full.cpu()

    res: dict[str, float] = {}
    outside = 0.0
    for s in SPLITS:
        full = run(table, s)
        outside = max(outside, float((full[b:] != 7.0).any()))
        res[f"f64_splits_{s}"] = float((full[:b].double() - ref).abs().max()) / norm
    res["outside_changed"] = outside
    got = run(table, 3)
    garbage = table.clone()
    for i, n in enumerate(need):
        garbage[i, n:] = 1 << 40  # would fault or read garbage if it were dereferenced
    res["padding_changed"] = float(not torch.equal(run(garbage, 3), got))
    # The new token's K/V handed to the kernel (slots zeroed first): it must write them, then
    # attend over them, as if they had been in the cache.
    k_in, v_in = k_cache.clone(), v_cache.clone()
    rows = torch.arange(b)
    last_blocks = table[rows, (lens - 1) // bs]
    at = (lens - 1) % bs
    k_new = k_cache[last_blocks, :, at].clone()  # [B, kvh, D]
    v_new = v_cache[last_blocks, :, at].clone()
    k_in[last_blocks, :, at] = 0
    v_in[last_blocks, :, at] = 0
    k_dev, v_dev = on(k_in), on(v_in)
    full = torch.full((b + 2, heads, dim), 7.0, dtype=dt, device=device)
    paged_decode_attention(on(q), k_dev, v_dev, on(table), on(lens), full[:b], scale, num_splits=3,
                           k_new=on(k_new), v_new=on(v_new))
    res["write_new_f64"] = float((full[:b].cpu().double() - ref).abs().max()) / norm
    res["write_new_cache_wrong"] = float(not (torch.equal(k_dev.cpu(), k_cache) and torch.equal(v_dev.cpu(), v_cache)))
    mask = decode_mask(on(lens), width, bs, torch.arange(width * bs, device=device))
    fallback = decode_attention_torch(on(q), on(k_cache), on(v_cache), on(table), mask, scale).cpu()
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
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(7)
    b = len(lens_t)
    width = max(-(-n // bs) for n in lens_t)
    num_blocks = b * width + 2
    # Every row's table is real blocks (a padded row's stale table from an earlier step).
    table = torch.randperm(num_blocks, generator=gen)[: b * width].view(b, width).clone()
    k_cache = torch.randn((num_blocks, kv_heads, bs, dim), generator=gen).to(dt)
    v_cache = torch.randn((num_blocks, kv_heads, bs, dim), generator=gen).to(dt)
    q = torch.randn((b, heads, dim), generator=gen).to(dt)
    k_new = torch.randn((b, kv_heads, dim), generator=gen).to(dt)
    v_new = torch.randn((b, kv_heads, dim), generator=gen).to(dt)
    lens = torch.tensor(lens_t, dtype=torch.int64)
    real = [i for i, n in enumerate(lens_t) if n > 0]
    want_k, want_v = k_cache.clone(), v_cache.clone()
    for i in real:
        blk, at = int(table[i, (lens_t[i] - 1) // bs]), (lens_t[i] - 1) % bs
        want_k[blk, :, at] = k_new[i]
        want_v[blk, :, at] = v_new[i]
    scale = dim ** -0.5
    ref = _reference(q[real], want_k, want_v, table[real], lens[real], scale)
    norm = float(ref.abs().max())
    res: dict[str, float] = {}
    for splits in SPLITS:
        k_dev, v_dev = k_cache.to(device), v_cache.to(device)
        out = torch.full((b, heads, dim), 7.0, dtype=dt, device=device)
        paged_decode_attention(q.to(device), k_dev, v_dev, table.to(device), lens.to(device), out, scale,
                               num_splits=splits, k_new=k_new.to(device), v_new=v_new.to(device))
        out = out.cpu()
        res[f"f64_splits_{splits}"] = float((out[real].double() - ref).abs().max()) / norm
        zeros = [i for i in range(b) if i not in real]
        res[f"zero_rows_not_zero_splits_{splits}"] = float(not bool((out[zeros] == 0).all()))
        res[f"cache_wrong_splits_{splits}"] = float(not (torch.equal(k_dev.cpu(), want_k)
                                                         and torch.equal(v_dev.cpu(), want_v)))
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
    dt = getattr(torch, dtype)
    gen = torch.Generator().manual_seed(len(name))
    total = ctx + n
    nb = -(-total // bs)
    num_blocks = nb + 3
    table = torch.randperm(num_blocks, generator=gen)[:nb]
    k_cache = torch.randn((num_blocks, kv_heads, bs, dim), generator=gen).to(dt)
    v_cache = torch.randn((num_blocks, kv_heads, bs, dim), generator=gen).to(dt)
    last, at = int(table[-1]), (total - 1) % bs + 1
    k_cache[last, :, at:] = float("nan")
    v_cache[last, :, at:] = float("nan")
    q = torch.randn((heads, n + 2, dim), generator=gen).to(dt)[:, 1:n + 1].transpose(0, 1)  # [n, H, D], strided
    scale = dim ** -0.5
    seq_k = torch.cat([k_cache[int(x)] for x in table], dim=1)[:, :total].double()  # [kvh, total, D]
    seq_v = torch.cat([v_cache[int(x)] for x in table], dim=1)[:, :total].double()
    ref = torch.empty((n, heads, dim), dtype=torch.float64)
    for h in range(heads):
        kv = h // (heads // kv_heads)
        s = (q[:, h].double() @ seq_k[kv].T) * scale  # [n, total]
        s = s.masked_fill(torch.arange(total)[None, :] > ctx + torch.arange(n)[:, None], float("-inf"))
        ref[:, h] = torch.softmax(s, dim=1) @ seq_v[kv]
    norm = float(ref.abs().max())
    full = torch.full((n + 2, heads, dim), 7.0, dtype=dt, device=device)
    paged_prefill_attention(q.to(device), k_cache.to(device), v_cache.to(device), table.to(device), ctx,
                            full[1:n + 1], scale)
    full = full.cpu()
    fallback = prefill_attention_torch(q.transpose(0, 1)[None].to(device), k_cache.to(device), v_cache.to(device),
                                       table.to(device), ctx, scale)[0].transpose(0, 1).cpu()
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
