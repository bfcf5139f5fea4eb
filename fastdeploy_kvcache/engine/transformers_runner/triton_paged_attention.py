"""Paged attention in Triton: queries over K/V blocks read in place through a block table.

The transformers runner's attention (``engine/transformers_runner/torch_attention.py``) on CUDA, two kernels
over the cache tensors ``[num_blocks, kv_heads, block_size, head_dim]``: nothing is
gathered or copied, and a block costs the same whichever tier it was loaded from.  Scores
and the softmax run in float32 with a running maximum (online softmax); the result is
written in the query's dtype straight into the caller's output rows.

* :func:`paged_decode_attention`, the decode batch: each program takes one sequence, one
  KV head and the query heads that share it (GQA), and walks the sequence's block table,
  masking positions past its length.  It also writes the new token's K and V into their
  slot first.  A batch of B sequences gives ``B * kv_heads`` programs, too few to keep the
  GPU busy for one or two sequences: the context can then be split over ``num_splits``
  programs per (sequence, KV head) (flash-decoding), each writing its partial output and
  log-sum-exp in float32 for a second small kernel to combine.  With one split (the usual
  case: :func:`choose_num_splits`) the first kernel writes the output itself.
* :func:`paged_prefill_attention`, a short chunk after cached context (a prefix hit's new
  tokens): each program takes 16 or 64 of the chunk's tokens and one query head, with a
  lower-right causal mask.

8-bit caches (``block_wise_fp8`` / ``block_wise_int8``, ``engine/transformers_runner/fp8_kv.py``):
uint8 K/V blocks with a float32 scale per (block, head, token).  Both kernels read the bytes
in place, reinterpret them as E4M3 (``fp8e4nv``) or int8 (``QUANT`` 1 or 2, a compile-time
constant: the int8 kernel is the same instruction count, one conversion per element) and
convert them to the query's dtype (exact); each
key's scale multiplies its scores and each value's scale its probabilities, so the dot
products run over unscaled values at the query's precision (tensor cores for bf16).  The
decode kernel's write of the new token stores bytes and a scale quantized by the caller.

Triton compiles these for GPUs only.  With ``TRITON_INTERPRET=1`` in the environment
before Triton is first imported, the same kernels run on CPU tensors in Triton's
interpreter (slow): that is how the tests check their logic on a machine without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, Callable, Optional

import triton
import triton.language as tl

logger = logging.getLogger(__name__)


@triton.jit
def _dot(a, b, DOT: tl.constexpr):
    """``a @ b`` accumulated in float32.  DOT 0: native (tensor cores for bf16/fp16); 1: exact
    float32 (no TF32 rounding for float32 caches); 2: both upcast to float32 first (Triton's
    CPU interpreter computes bfloat16 dots wrongly: tests on the CPU)."""
    if DOT == 2:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif DOT == 1:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _attend_rows(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, k_row, v_row, ks_row, vs_row, kv_head, d,
                 load_ok, see, scale, stride_kh, stride_kd, stride_vh, stride_vd, stride_ksh, stride_vsh,
                 HEAD_DIM: tl.constexpr, DOT: tl.constexpr, QUANT: tl.constexpr, PV_BOOST: tl.constexpr):
    """One step of the online softmax: rows ``q`` against a tile of cache positions, each
    given by its offsets into the caches (``k_row`` ... ``vs_row``: block and slot already
    applied, so a tile may span several cache blocks), loaded where ``load_ok``, scores kept
    where ``see``.  QUANT: 0 float blocks; 1 E4M3 bytes, 2 int8 bytes, with per-position
    scales at ``ks_ptr`` / ``vs_ptr``, converted (exactly) to ``q``'s dtype: bfloat16, or
    float16, to which E4M3 converts in one instruction.  ``PV_BOOST``: a power of two the
    scaled probabilities are multiplied by before they round to ``q``'s dtype (float16's
    range starts at 6e-5: a probability times a small value scale would lose its digits),
    which the caller divides out of the accumulator at the end."""
    kv_mask = load_ok[:, None] & (d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + kv_head * stride_kh + k_row[:, None] + d[None, :] * stride_kd, mask=kv_mask, other=0)
    v = tl.load(v_ptr + kv_head * stride_vh + v_row[:, None] + d[None, :] * stride_vd, mask=kv_mask, other=0)
    if QUANT:
        if QUANT == 2:
            # Through float32 (exact): Triton's CPU interpreter turns int8 -> bfloat16 into NaN.
            k = k.to(tl.int8, bitcast=True).to(tl.float32).to(q.dtype)
            v = v.to(tl.int8, bitcast=True).to(tl.float32).to(q.dtype)
        else:
            k = k.to(tl.float8e4nv, bitcast=True).to(q.dtype)
            v = v.to(tl.float8e4nv, bitcast=True).to(q.dtype)
        k_sc = tl.load(ks_ptr + kv_head * stride_ksh + ks_row, mask=load_ok, other=0.0)
        v_sc = tl.load(vs_ptr + kv_head * stride_vsh + vs_row, mask=load_ok, other=0.0)
        s = tl.where(see, _dot(q, tl.trans(k), DOT) * (k_sc * scale)[None, :], float("-inf"))
    else:
        s = tl.where(see, _dot(q, tl.trans(k), DOT) * scale, float("-inf"))
    # The callers visit only tiles where every row sees a position, or has seen one in an
    # earlier tile: m_new is finite.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if QUANT:
        acc = acc * alpha[:, None] + _dot((p * (v_sc * PV_BOOST)[None, :]).to(v.dtype), v, DOT)
    else:
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT)
    return m_new, l_i, acc


@triton.jit
def _attend_block(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, block, kv_head, n, d, load_ok, see, scale,
                  stride_kn, stride_kh, stride_kt, stride_kd, stride_vn, stride_vh, stride_vt, stride_vd,
                  stride_ksn, stride_ksh, stride_kst, stride_vsn, stride_vsh, stride_vst,
                  HEAD_DIM: tl.constexpr, DOT: tl.constexpr, QUANT: tl.constexpr, PV_BOOST: tl.constexpr):
    """:func:`_attend_rows` over positions ``n`` of one cache block ``block``."""
    return _attend_rows(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr,
                        block * stride_kn + n * stride_kt, block * stride_vn + n * stride_vt,
                        block * stride_ksn + n * stride_kst, block * stride_vsn + n * stride_vst,
                        kv_head, d, load_ok, see, scale, stride_kh, stride_kd, stride_vh, stride_vd,
                        stride_ksh, stride_vsh, HEAD_DIM, DOT, QUANT, PV_BOOST)


@triton.jit
def _decode_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, out_ptr, part_out_ptr, part_lse_ptr, k_new_ptr, v_new_ptr,
    ks_ptr, vs_ptr, ks_new_ptr, vs_new_ptr,
    scale, blocks_per_split,
    stride_qb, stride_qh, stride_qd,
    stride_knb, stride_knh, stride_knd, stride_vnb, stride_vnh, stride_vnd,
    stride_kn, stride_kh, stride_kt, stride_kd,
    stride_vn, stride_vh, stride_vt, stride_vd,
    stride_ksn, stride_ksh, stride_kst, stride_vsn, stride_vsh, stride_vst,
    stride_ksnb, stride_ksnh, stride_vsnb, stride_vsnh,
    stride_tb, stride_tw,
    stride_ob, stride_oh, stride_od,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, DOT: tl.constexpr, WRITE_NEW: tl.constexpr, QUANT: tl.constexpr,
    PER_TILE: tl.constexpr, F16: tl.constexpr, PV_BOOST: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + seq).to(tl.int32)
    seq_blocks = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, seq_blocks)

    g = tl.arange(0, BLOCK_G)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUPS + g
    g_ok = g < GROUPS
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + d[None, :] * stride_qd,
                mask=g_ok[:, None] & d_ok[None, :], other=0.0)
    if not QUANT:
        q = q.to(k_ptr.dtype.element_ty)
    elif F16:
        q = q.to(tl.float16)

    if WRITE_NEW:
        # The new token's K and V go to their slot (position seq_len - 1) first, written by the
        # one program that reads that block (its split), then a barrier so that all of this
        # program's threads see them: the step needs no separate cache write for its decodes.
        # A row of length 0 (a CUDA graph's padding) writes nothing: its position -1 would
        # truncate to slot 0 of its block 0 (Triton's // and % round toward zero).
        pos = seq_len - 1
        new_block = pos // BLOCK_SIZE
        if (seq_len > 0) & (new_block >= first) & (new_block < last):
            slot = tl.load(table_ptr + seq * stride_tb + new_block * stride_tw)
            at = pos % BLOCK_SIZE
            k_new = tl.load(k_new_ptr + seq * stride_knb + kv_head * stride_knh + d * stride_knd, mask=d_ok)
            v_new = tl.load(v_new_ptr + seq * stride_vnb + kv_head * stride_vnh + d * stride_vnd, mask=d_ok)
            tl.store(k_ptr + slot * stride_kn + kv_head * stride_kh + at * stride_kt + d * stride_kd,
                     k_new.to(k_ptr.dtype.element_ty), mask=d_ok)
            tl.store(v_ptr + slot * stride_vn + kv_head * stride_vh + at * stride_vt + d * stride_vd,
                     v_new.to(v_ptr.dtype.element_ty), mask=d_ok)
            if QUANT:
                tl.store(ks_ptr + slot * stride_ksn + kv_head * stride_ksh + at * stride_kst,
                         tl.load(ks_new_ptr + seq * stride_ksnb + kv_head * stride_ksnh))
                tl.store(vs_ptr + slot * stride_vsn + kv_head * stride_vsh + at * stride_vst,
                         tl.load(vs_new_ptr + seq * stride_vsnb + kv_head * stride_vsnh))
        tl.debug_barrier()

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    if PER_TILE == 1:
        for j in range(first, last):
            block = tl.load(table_ptr + seq * stride_tb + j * stride_tw)
            # Every block visited holds at least one valid position.
            tok_ok = (n < BLOCK_SIZE) & (j * BLOCK_SIZE + n < seq_len)
            m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, block, kv_head, n, d, tok_ok,
                                          tok_ok[None, :], scale, stride_kn, stride_kh, stride_kt, stride_kd,
                                          stride_vn, stride_vh, stride_vt, stride_vd,
                                          stride_ksn, stride_ksh, stride_kst, stride_vsn, stride_vsh, stride_vst,
                                          HEAD_DIM, DOT, QUANT, PV_BOOST)
    else:
        # PER_TILE cache blocks a tile (BLOCK_N = PER_TILE * BLOCK_SIZE positions): each row's
        # block comes from its own table entry.  Fewer, larger tiles keep more bytes in flight
        # per iteration, which the small FP8 blocks need to reach the device's bandwidth.
        sub = n // BLOCK_SIZE
        off = n % BLOCK_SIZE
        for j0 in range(first, last, PER_TILE):
            j = j0 + sub
            row_ok = j < last
            block = tl.load(table_ptr + seq * stride_tb + j * stride_tw, mask=row_ok, other=0).to(tl.int64)
            # The tile's first block is valid (j0 < last), so every tile holds a valid position.
            tok_ok = row_ok & (j * BLOCK_SIZE + off < seq_len)
            m_i, l_i, acc = _attend_rows(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr,
                                         block * stride_kn + off * stride_kt, block * stride_vn + off * stride_vt,
                                         block * stride_ksn + off * stride_kst, block * stride_vsn + off * stride_vst,
                                         kv_head, d, tok_ok, tok_ok[None, :], scale, stride_kh, stride_kd,
                                         stride_vh, stride_vd, stride_ksh, stride_vsh, HEAD_DIM, DOT, QUANT,
                                         PV_BOOST)
    if PV_BOOST != 1.0:
        acc = acc * (1.0 / PV_BOOST)

    o_mask = g_ok[:, None] & d_ok[None, :]
    if NUM_SPLITS == 1:
        # A row of length 0 saw nothing (l_i = 0, acc = 0): zeros, not 0 / 0.
        o = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + seq * stride_ob + heads[:, None] * stride_oh + d[None, :] * stride_od,
                 o.to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        # Partials [B, H, NUM_SPLITS, BLOCK_D] and [B, H, NUM_SPLITS], contiguous.  A split past
        # the sequence's end saw nothing: l_i = 0, stored as o = 0 and lse = -inf (weight 0).
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
        row = (seq * (tl.num_programs(1) * GROUPS) + heads) * NUM_SPLITS + split
        tl.store(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], o, mask=o_mask)
        tl.store(part_lse_ptr + row, lse, mask=g_ok)


@triton.jit
def _combine_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ob, stride_oh, stride_od,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < NUM_SPLITS
    row = (seq * NUM_HEADS + head) * NUM_SPLITS + s
    lse = tl.load(part_lse_ptr + row, mask=s_ok, other=float("-inf"))
    m = tl.max(lse, 0)  # finite unless the sequence has length 0: split 0 holds its first block
    m = tl.where(m == float("-inf"), 0.0, m)  # length 0: every weight 0, the output 0
    w = tl.exp(lse - m)
    o = tl.load(part_out_ptr + row[:, None] * BLOCK_D + d[None, :], mask=s_ok[:, None], other=0.0)
    w_sum = tl.sum(w, 0)
    o = tl.sum(o * w[:, None], 0) / tl.where(w_sum == 0.0, 1.0, w_sum)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d * stride_od, o.to(out_ptr.dtype.element_ty),
             mask=d < HEAD_DIM)


@triton.jit
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, out_ptr,
    context_len, num_new, scale,
    stride_qt, stride_qh, stride_qd,
    stride_kn, stride_kh, stride_kt, stride_kd,
    stride_vn, stride_vh, stride_vt, stride_vd,
    stride_ksn, stride_ksh, stride_kst, stride_vsn, stride_vsh, stride_vst,
    stride_tw,
    stride_ot, stride_oh, stride_od,
    GROUPS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, DOT: tl.constexpr, QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUPS
    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    m_ok = m < num_new
    d_ok = d < HEAD_DIM
    q = tl.load(q_ptr + m[:, None] * stride_qt + head * stride_qh + d[None, :] * stride_qd,
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    if not QUANT:
        q = q.to(k_ptr.dtype.element_ty)
    # The tile's last query sits at context_len + its last row: no key past it is read (slots
    # past the chunk's end may hold anything, NaN included).
    last_pos = context_len + tl.minimum(tile * BLOCK_M + BLOCK_M, num_new) - 1
    num_blocks = last_pos // BLOCK_SIZE + 1

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for j in range(0, num_blocks):
        block = tl.load(table_ptr + j * stride_tw)
        pos = j * BLOCK_SIZE + n
        load_ok = (n < BLOCK_SIZE) & (pos <= last_pos)
        # Lower-right causal: row i (position context_len + i) sees keys up to its own
        # position.  Block 0 holds position 0, seen by every row.
        see = load_ok[None, :] & (pos[None, :] <= context_len + m[:, None])
        m_i, l_i, acc = _attend_block(q, m_i, l_i, acc, k_ptr, v_ptr, ks_ptr, vs_ptr, block, kv_head, n, d, load_ok,
                                      see, scale, stride_kn, stride_kh, stride_kt, stride_kd,
                                      stride_vn, stride_vh, stride_vt, stride_vd,
                                      stride_ksn, stride_ksh, stride_kst, stride_vsn, stride_vsh, stride_vst,
                                      HEAD_DIM, DOT, QUANT, 1.0)
    o = acc / l_i[:, None]
    tl.store(out_ptr + m[:, None] * stride_ot + head * stride_oh + d[None, :] * stride_od,
             o.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


@functools.lru_cache(maxsize=None)
def _num_sms(device_index: int) -> int:
    import torch

    return int(torch.cuda.get_device_properties(device_index).multi_processor_count)


def choose_num_splits(batch: int, kv_heads: int, max_blocks: int, device: Any) -> int:
    """Context splits per sequence: only for a grid far smaller than the GPU (fewer than one
    program per 8 SMs), and never below 16 blocks a split.

    NOTE: a split run is a second kernel launch, and the transformers runner's decode step is
    bound by the host's launch time.  Measured on an H200 (bf16, Llama-3-8B heads, blocks of
    64): at 4 to 32 seqs x 2k context one split was the fastest (the GPU read the K/V of 32 x
    2k at about 3.7 TB/s in one split); 2 splits saved 6 to 15% of the kernel's GPU time at
    32 x 8k and 64 x 2k, less than the host time of the second launch.
    """
    if device.type != "cuda":
        return 1
    sms = _num_sms(device.index if device.index is not None else 0)
    programs = batch * kv_heads
    if programs * 8 >= sms:
        return 1
    return max(1, min(-(-sms // programs), max_blocks // 16))


@dataclasses.dataclass(frozen=True)
class DecodeTuning:
    """How :func:`paged_decode_attention` walks a sequence's blocks.

    * ``blocks_per_tile``: cache blocks per loop iteration (power-of-two block sizes only;
      others take one).  A tile of few bytes leaves the loop bound by each iteration's
      latency rather than by bandwidth: FP8 halves a block's bytes, so it needs twice the
      positions per tile to keep as many bytes in flight.
    * ``num_warps``: warps per program.
    * ``float16_dots``: with 8-bit caches, convert their bytes to float16 (E4M3: one instruction per pair)
      and run the dots in float16 instead of bfloat16 (the query and the scaled
      probabilities are rounded to float16 for them).
    * ``num_stages``: Triton's software-pipelining depth of the loop (None: Triton's default).
    """

    blocks_per_tile: int = 1
    num_warps: int = 4
    float16_dots: bool = False
    num_stages: Optional[int] = None

    def __post_init__(self) -> None:
        if self.blocks_per_tile < 1 or self.blocks_per_tile & (self.blocks_per_tile - 1):
            raise ValueError(f"DecodeTuning: blocks_per_tile must be a power of two >= 1, got {self.blocks_per_tile}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"DecodeTuning: num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages is not None and not 1 <= self.num_stages <= 8:
            raise ValueError(f"DecodeTuning: num_stages must be 1 to 8 or None, got {self.num_stages}")


# The default tile of each cache kind (False: bf16/fp16/fp32, True: FP8): positions per tile,
# warps, float16 dots, pipelining stages (None: Triton's).  Measured on an H200
# (bench_fp8_decode's sweep, Llama-3-8B heads, 32 x 2k, blocks of 64): bf16 one block a tile
# with Triton's stages read 2,881 GB/s, 128 positions with 2 stages 3,716 GB/s; FP8 one block
# a tile 1,200 GB/s, 128 positions with float16 dots and 2 stages 2,046 GB/s (bytes of K/V
# and scales: 0.93x bf16's time).  Wider tiles, 8 warps and deeper pipelines were slower.
DEFAULT_TILES: dict[bool, tuple[int, int, bool, Optional[int]]] = {False: (128, 4, False, 2),
                                                                   True: (128, 4, True, 2)}


def decode_tuning(quant: bool, block_size: int) -> DecodeTuning:
    """The default :class:`DecodeTuning` for a cache kind (``quant``: FP8) and block size:
    :data:`DEFAULT_TILES` with its positions rounded down to whole blocks (a power of two)."""
    positions, warps, f16, stages = DEFAULT_TILES[quant]
    # At most 4 blocks a tile by default: the H200 measured 2 (blocks of 64); wider default
    # tiles of small blocks were never measured on a GPU.  (In Triton's CPU interpreter under
    # numpy 2.x, 8-block tiles of 16 moved the int8 reuse check's logits by 1.7e-4 against the
    # torch path.  Not a kernel error: the tiling's float order, 1e-6 apart with a float32
    # cache, rounded 9 of 393,216 int8 codes to the neighbouring code, and one code step then
    # carried through the later layers.  tests/engine_torch/test_fp8_kv.py keeps 1e-4.)
    per_tile = min(4, max(1, positions // max(1, block_size)))
    return DecodeTuning(blocks_per_tile=1 << (per_tile.bit_length() - 1), num_warps=warps, float16_dots=f16,
                        num_stages=stages)


def _scale_args(who: str, k_cache: Any, v_cache: Any, k_scale: Any, v_scale: Any) -> tuple[bool, Any, Any, tuple]:
    """(quantized, key scales, value scales, their six strides) for a kernel call; ValueError
    when the caches and scales do not make one layout (uint8 caches need both scale caches,
    ``[num_blocks, kv_heads, block_size]`` float32; float caches take none)."""
    import torch

    quant = k_cache.dtype == torch.uint8
    if not quant:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"{who}: scales given for {k_cache.dtype} caches (only uint8 FP8 caches take them)")
        return False, k_cache, v_cache, (0,) * 6
    want = tuple(k_cache.shape[:3])
    for name, sc in (("k_scale", k_scale), ("v_scale", v_scale)):
        if sc is None or sc.dtype != torch.float32 or tuple(sc.shape) != want:
            raise ValueError(f"{who}: uint8 (FP8) caches need {name} float32 {list(want)}, got "
                             f"{None if sc is None else (sc.dtype, tuple(sc.shape))}")
    if v_cache.dtype != torch.uint8:
        raise ValueError(f"{who}: key cache uint8 but value cache {v_cache.dtype}")
    return True, k_scale, v_scale, (*k_scale.stride(), *v_scale.stride())


def _dot_mode(query: Any, cache_dtype: Any) -> int:
    """``_dot``'s DOT for a call: 2 in the CPU interpreter, 1 for float32 operands, else 0."""
    import torch

    return 2 if query.device.type != "cuda" else 1 if cache_dtype == torch.float32 else 0


def paged_decode_attention(
    query: Any,
    k_cache: Any,
    v_cache: Any,
    block_table: Any,
    seq_lens: Any,
    out: Any,
    scale: float,
    num_splits: Optional[int] = None,
    workspace: Optional[dict] = None,
    k_new: Any = None,
    v_new: Any = None,
    k_scale: Any = None,
    v_scale: Any = None,
    k_new_scale: Any = None,
    v_new_scale: Any = None,
    tuning: Optional["DecodeTuning"] = None,
    int8: bool = False,
) -> Any:
    """Attention of one query token per sequence over its paged K/V; writes and returns ``out``.

    * ``query``: ``[B, H, D]`` (any strides), H a multiple of the cache's KV heads (GQA:
      query head ``h`` reads KV head ``h // (H // kv_heads)``, as transformers' ``repeat_kv``);
    * ``k_cache``, ``v_cache``: ``[num_blocks, kv_heads, block_size, D]``, float32, float16
      or bfloat16; or uint8 bytes (E4M3, or int8 with ``int8``) with ``k_scale``, ``v_scale``
      float32 ``[num_blocks, kv_heads, block_size]`` (``fp8_kv.py``);
    * ``block_table``: int ``[B, W]``, each row covering its sequence's ``seq_lens[b]``
      positions (entries past them are never read: pad with any block id);
    * ``seq_lens``: int ``[B]``, the new token's K/V included; a row of length 0 (a CUDA
      graph's padding) reads and writes no cache slot and gets zeros;
    * ``out``: ``[B, H, D]`` in the query's dtype (any strides);
    * ``num_splits``: context splits per sequence (None: :func:`choose_num_splits`);
    * ``workspace``: a dict reused across calls of one step (every layer has the same
      shapes), holding the float32 partials of a split run instead of allocating per call;
    * ``k_new``, ``v_new``: ``[B, kv_heads, D]`` (any strides), the new token's K and V: the
      kernel writes them to position ``seq_lens[b] - 1`` of each sequence's blocks before it
      reads them (None: they are in the cache already); with FP8 caches, their uint8 bytes,
      and ``k_new_scale``, ``v_new_scale`` float32 ``[B, kv_heads]`` their scales
      (``fp8_kv.quantize_kv``);
    * ``tuning``: the kernel's tile and warps (None: :func:`decode_tuning`).
    """
    paged_decode_launcher(query, k_cache, v_cache, block_table, seq_lens, out, num_splits=num_splits,
                          workspace=workspace, k_new=k_new, v_new=v_new, k_new_scale=k_new_scale,
                          v_new_scale=v_new_scale, tuning=tuning, int8=int8)(k_cache, v_cache, scale, k_scale,
                                                                             v_scale)
    return out


def paged_decode_launcher(
    query: Any,
    k_cache: Any,
    v_cache: Any,
    block_table: Any,
    seq_lens: Any,
    out: Any,
    num_splits: Optional[int] = None,
    workspace: Optional[dict] = None,
    k_new: Any = None,
    v_new: Any = None,
    k_new_scale: Any = None,
    v_new_scale: Any = None,
    tuning: Optional["DecodeTuning"] = None,
    int8: bool = False,
) -> Callable[..., None]:
    """:func:`paged_decode_attention` prepared once for every layer of a step:
    ``launch(k_cache, v_cache, scale)`` launches it over one layer's caches (the shape, dtype
    and strides of ``k_cache``/``v_cache`` here) with everything else as given here; 8-bit
    caches (uint8: E4M3 bytes, or int8 with ``int8``) take ``launch(k_cache, v_cache, scale,
    k_scale, v_scale)``, checked per call.

    Why: the checks, the grid, the split choice and the strides cost the host tens of
    microseconds per call, the same for every layer of a step; a launch then costs only
    Triton's own launch.
    """
    import torch

    batch, num_heads, head_dim = query.shape
    _, kv_heads, block_size, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_decode_attention: query {tuple(query.shape)} does not fit caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if block_table.shape[0] != batch or seq_lens.shape[0] != batch or tuple(out.shape) != tuple(query.shape):
        raise ValueError(f"paged_decode_attention: batch {batch} but table {tuple(block_table.shape)}, "
                         f"lens {tuple(seq_lens.shape)}, out {tuple(out.shape)}")
    write_new = k_new is not None
    if write_new and (v_new is None or tuple(k_new.shape) != (batch, kv_heads, head_dim)
                      or tuple(v_new.shape) != (batch, kv_heads, head_dim)):
        raise ValueError(f"paged_decode_attention: k_new / v_new must both be [{batch}, {kv_heads}, {head_dim}]")
    if batch == 0:
        return _no_launch
    groups = num_heads // kv_heads
    width = int(block_table.shape[1])
    splits = num_splits if num_splits is not None else choose_num_splits(batch, kv_heads, width, query.device)
    splits = max(1, min(int(splits), width))
    blocks_per_split = -(-width // splits)
    splits = -(-width // blocks_per_split)  # no split left with nothing to do for the longest row
    block_d = max(16, triton.next_power_of_2(head_dim))
    if splits > 1:
        key = (batch, num_heads, splits, block_d, query.device)
        ws = workspace if workspace is not None else {}
        if ws.get("key") != key:
            ws["key"] = key
            ws["out"] = torch.empty((batch * num_heads * splits, block_d), dtype=torch.float32, device=query.device)
            ws["lse"] = torch.empty((batch * num_heads * splits,), dtype=torch.float32, device=query.device)
        part_out, part_lse = ws["out"], ws["lse"]
    else:
        part_out = part_lse = out  # unused
    quant = k_cache.dtype == torch.uint8
    if write_new and quant and (k_new.dtype != torch.uint8 or v_new.dtype != torch.uint8
                                or k_new_scale is None or v_new_scale is None
                                or tuple(k_new_scale.shape) != (batch, kv_heads)
                                or tuple(v_new_scale.shape) != (batch, kv_heads)):
        raise ValueError("paged_decode_attention: with FP8 caches, k_new / v_new must be uint8 with "
                         f"k_new_scale / v_new_scale [{batch}, {kv_heads}] (fp8_kv.quantize_kv)")
    if not write_new:
        k_new = v_new = query  # unused
    if write_new and quant:
        new_scales = (k_new_scale, v_new_scale)
        new_scale_strides: tuple = (*k_new_scale.stride(), *v_new_scale.stride())
    else:
        new_scales, new_scale_strides = (query, query), (0,) * 4  # unused
    tune = tuning if tuning is not None else decode_tuning(quant, block_size)
    per_tile = tune.blocks_per_tile if block_size & (block_size - 1) == 0 else 1
    dot_mode = _dot_mode(query, query.dtype if quant else k_cache.dtype)
    f16 = quant and tune.float16_dots and query.dtype != torch.float32
    # A tile's K and V operands stay within 64 KiB per pipelining stage (the H200's fastest
    # tiles are 128 positions of 128 bf16 values): 512 positions of float32 dots would need
    # 656 KiB of shared memory, past any GPU's.
    dot_bytes = 2 if f16 or (dot_mode == 0 and (quant or k_cache.element_size() == 2)) else 4
    max_positions = max(16, (64 << 10) // (2 * block_d * dot_bytes))
    while per_tile > 1 and per_tile * block_size > max_positions:
        per_tile //= 2
    if per_tile > 1:
        per_tile = max(per_tile, -(-16 // block_size))  # a tile holds at least Triton's 16 rows
    kernel = _decode_kernel[(batch, kv_heads, splits)]
    lead = (query,)
    mid = (block_table, seq_lens, out, part_out, part_lse, k_new, v_new)
    new_strides = (*query.stride(), *k_new.stride(), *v_new.stride())
    tail_strides = (*new_scale_strides, *block_table.stride(), *out.stride())
    consts = dict(
        GROUPS=groups, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(groups)), BLOCK_D=block_d,
        BLOCK_N=max(16, per_tile * triton.next_power_of_2(block_size)), NUM_SPLITS=splits,
        DOT=dot_mode, WRITE_NEW=write_new, QUANT=(2 if int8 else 1) if quant else 0, PER_TILE=per_tile, F16=f16,
        PV_BOOST=256.0 if f16 else 1.0,
        num_warps=tune.num_warps, **({} if tune.num_stages is None else {"num_stages": tune.num_stages}),
    )
    no_scales = (query, query, (0,) * 6)  # float caches: unused
    combine = None
    if splits > 1:
        combine = _combine_kernel[(batch, num_heads)]
        combine_args = (part_out, part_lse, out, *out.stride())
        combine_consts = dict(NUM_HEADS=num_heads, HEAD_DIM=head_dim, NUM_SPLITS=splits,
                              BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d, num_warps=4)

    def launch(k_cache: Any, v_cache: Any, scale: float, k_scale: Any = None, v_scale: Any = None) -> None:
        ks, vs, scale_strides = no_scales
        if quant or k_scale is not None or v_scale is not None:
            _, ks, vs, scale_strides = _scale_args("paged_decode_attention", k_cache, v_cache, k_scale, v_scale)
        kernel(*lead, k_cache, v_cache, *mid, ks, vs, *new_scales, float(scale), blocks_per_split, *new_strides,
               *k_cache.stride(), *v_cache.stride(), *scale_strides, *tail_strides, **consts)
        if combine is not None:
            combine(*combine_args, **combine_consts)

    return launch


def _no_launch(k_cache: Any, v_cache: Any, scale: float, k_scale: Any = None, v_scale: Any = None) -> None:
    """An empty batch's launch: nothing."""


# A chunk up to this many tokens after cached context goes through :func:`paged_prefill_attention`;
# a longer one is compute-bound, and the runner leaves it to SDPA's flash kernel over gathered blocks.
PAGED_PREFILL_MAX_TOKENS = 128


def paged_prefill_attention(query: Any, k_cache: Any, v_cache: Any, table: Any, context_len: int, out: Any,
                            scale: float, k_scale: Any = None, v_scale: Any = None, int8: bool = False) -> Any:
    """Causal attention of a chunk of ``n`` new tokens after ``context_len`` cached ones, over
    its blocks read in place; writes and returns ``out``.

    * ``query``: ``[n, H, D]`` (any strides); query row ``i`` is position ``context_len + i``
      and sees positions ``0 .. context_len + i`` (a lower-right causal mask);
    * ``k_cache``, ``v_cache``: ``[num_blocks, kv_heads, block_size, D]``, the chunk's own K/V
      already in their slots (uint8 caches with ``k_scale``, ``v_scale`` and ``int8`` as for
      :func:`paged_decode_attention`);
    * ``table``: int ``[nb]``, the sequence's blocks covering ``context_len + n`` positions;
    * ``out``: ``[n, H, D]`` in the query's dtype (any strides).
    """
    num_new, num_heads, head_dim = query.shape
    _, kv_heads, block_size, cache_dim = k_cache.shape
    if cache_dim != head_dim or num_heads % kv_heads or v_cache.shape != k_cache.shape:
        raise ValueError(f"paged_prefill_attention: query {tuple(query.shape)} does not fit caches "
                         f"{tuple(k_cache.shape)} / {tuple(v_cache.shape)}")
    if tuple(out.shape) != tuple(query.shape) or table.shape[0] * block_size < context_len + num_new:
        raise ValueError(f"paged_prefill_attention: out {tuple(out.shape)} or table of {table.shape[0]} blocks "
                         f"does not fit {num_new} tokens after {context_len}")
    quant, ks, vs, scale_strides = _scale_args("paged_prefill_attention", k_cache, v_cache, k_scale, v_scale)
    if num_new == 0:
        return out
    block_m = 16 if num_new <= 16 else 64
    _prefill_kernel[(triton.cdiv(num_new, block_m), num_heads)](
        query, k_cache, v_cache, ks, vs, table, out, int(context_len), num_new, float(scale),
        *query.stride(), *k_cache.stride(), *v_cache.stride(), *scale_strides, table.stride(0), *out.stride(),
        GROUPS=num_heads // kv_heads, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_M=block_m,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=max(16, triton.next_power_of_2(block_size)),
        DOT=_dot_mode(query, query.dtype if quant else k_cache.dtype), QUANT=(2 if int8 else 1) if quant else 0,
        num_warps=4,
    )
    return out
