"""The transformers runner's decode step with an FP8 KV cache against a bf16 one, on one GPU.

``llama3-8b-random`` (Llama-3-8B shapes, random bf16 weights), ``--batch`` sequences at
``--context`` tokens of context each, blocks of ``--block-size`` with scattered ids, in one
process over two caches holding the same K/V: bf16, and FP8 (``block_wise_fp8``: uint8
E4M3 with a float32 scale per block, head and token, quantized from the bf16 one).

Figures (median of ``--repeat`` timed runs; logits or sampled ids read back as an engine
does), each as FP8 / bf16 (target for the served step: <= 1.0):

* the decode step replayed from a CUDA graph with greedy sampling on the GPU, as
  ``--use-cudagraph`` serves it; again with fused decoder layers (``--fused-layers``);
* the eager decode step;
* the paged decode attention alone on one layer's caches, with the K/V bytes it reads per
  second: first a sweep of the kernel's tile (positions per loop iteration, warps, and for
  FP8 float16 dots; ``--no-sweep`` skips it), whose fastest tile per cache kind then serves
  the steps below (each step's tile is printed);
* the logits' relative difference between the two caches (the quantization's effect).

    python benchmarks/bench_fp8_decode.py [--batch 32] [--context 2048] [--block-size 64]

Writes ``bench_fp8_decode.json`` under ``--out``.  Exits 0 with a message without a GPU or torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench_gpu_runner import timed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=8192, help="the CUDA graphs' table width, as the server's flag")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True,
                    help="Sweep the decode kernel's tile first and serve the steps with each kind's fastest "
                         "(default: on; off: the kernel's default tiles).")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_fp8_decode: needs torch; skipped")
        return 0
    if not torch.cuda.is_available():
        print("bench_fp8_decode: needs a CUDA GPU; skipped")
        return 0
    from fastdeploy_kvcache.config import BLOCK_WISE_FP8
    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.sampling import RequestSampler, SamplingParams, StepSampling
    from fastdeploy_kvcache.engine.transformers_runner import triton_paged_attention as tpa
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import quantize_fp8
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import LLAMA3_8B_RANDOM, load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    dev = torch.device("cuda", 0)
    lm = load_torch_model(LLAMA3_8B_RANDOM, seed=0, device=dev, dtype="bfloat16")
    bs = a.block_size
    gen = torch.Generator(device=dev).manual_seed(1)
    nb_seq = -(-(a.context + 1) // bs)
    num_blocks = a.batch * nb_seq + 8
    shape = (num_blocks, lm.num_kv_heads, bs, lm.head_dim)
    caches: dict[str, list[list[Any]]] = {"bf16": [], "fp8": []}
    for _ in range(lm.num_layers):
        k = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
        v = torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen)
        caches["bf16"].append([k, v])
        (kq, ks), (vq, vs) = quantize_fp8(k), quantize_fp8(v)
        caches["fp8"].append([kq, vq, ks, vs])
    perm = torch.randperm(num_blocks, device=dev, generator=gen).tolist()
    toks = torch.randint(0, 50000, (a.batch,), device=dev, generator=gen).tolist()
    dec = [ScheduledSeq([toks[i]], a.context, perm[i * nb_seq:(i + 1) * nb_seq], True) for i in range(a.batch)]
    greedy = StepSampling.for_samplers([RequestSampler(SamplingParams(temperature=0.0), 0)] * a.batch)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "model": LLAMA3_8B_RANDOM, "args": vars(a)}
    width = max(a.max_model_len, a.context + 1)

    def runner(name: str, fused: bool = False) -> Any:
        return TorchModelRunner(lm, bs, "gpu", fused_layers=fused,
                                kv_cache_quant=BLOCK_WISE_FP8 if name == "fp8" else None)

    q = torch.randn((a.batch, lm.num_heads, lm.head_dim), device=dev, dtype=torch.bfloat16, generator=gen)
    o = torch.empty_like(q)
    lens = torch.full((a.batch,), a.context + 1, dtype=torch.int64, device=dev)
    table = torch.tensor([perm[i * nb_seq:(i + 1) * nb_seq] for i in range(a.batch)], device=dev)
    calls = 20

    def kv_bytes(name: str) -> int:
        n = 2 * a.batch * (a.context + 1) * lm.num_kv_heads * lm.head_dim * caches[name][0][0].element_size()
        return n + (2 * a.batch * (a.context + 1) * lm.num_kv_heads * 4 if name == "fp8" else 0)  # the scales

    def attention_s(name: str, tuning: Any = None) -> float:
        layer = caches[name][0]
        scales = dict(k_scale=layer[2], v_scale=layer[3]) if name == "fp8" else {}

        def attend() -> None:
            for _ in range(calls):
                tpa.paged_decode_attention(q, layer[0], layer[1], table, lens, o, lm.head_dim ** -0.5,
                                           tuning=tuning, **scales)

        return timed(attend, a.repeat) / calls

    res["tiles"] = {}
    if a.sweep:
        grid = {"bf16": [(p, w, False) for p in (64, 128) for w in (4, 8)],
                "fp8": [(p, w, f) for p in (128, 256, 512) for w in (4, 8) for f in (False, True)]}
        for name, plans in grid.items():
            rows = []

            def measure(positions: int, warps: int, f16: bool, stages: Any) -> None:
                per_tile = max(1, positions // bs)
                tuning = tpa.DecodeTuning(1 << (per_tile.bit_length() - 1), warps, f16, stages)
                t = attention_s(name, tuning)
                rows.append({"positions": positions, "num_warps": warps, "float16_dots": f16, "num_stages": stages,
                             "s": t, "GBps": kv_bytes(name) / t / 1e9})
                print(f"tile sweep {name}: {positions} positions, {warps} warps, float16 dots {f16}, stages "
                      f"{stages or 'default'}: {t * 1e3:.4f} ms, {rows[-1]['GBps']:.0f} GB/s", flush=True)

            for positions, warps, f16 in plans:
                measure(positions, warps, f16, None)
            best = min(rows, key=lambda r: r["s"])
            for stages in (2, 3, 4):  # then the pipelining depth of the fastest
                measure(best["positions"], best["num_warps"], best["float16_dots"], stages)
            best = min(rows, key=lambda r: r["s"])
            res["tiles"][name] = {"sweep": rows, "best": best}
            tpa.DEFAULT_TILES[name == "fp8"] = (best["positions"], best["num_warps"], best["float16_dots"],
                                                best["num_stages"])
    res["tiles_used"] = {name: tpa.DEFAULT_TILES[name == "fp8"] for name in ("bf16", "fp8")}

    logits = {}
    for name in ("bf16", "fp8"):
        eager = runner(name)
        res[f"eager_{name}_s"] = timed(lambda: eager.forward(dec, caches[name], None), a.repeat)
        with torch.inference_mode():
            logits[name] = torch.from_numpy(eager.forward(dec, caches[name], None))
        graphed = runner(name)
        if graphed.enable_decode_graphs(caches[name], a.batch, width):
            res[f"graph_{name}_s"] = timed(lambda: graphed.forward_sample(dec, caches[name], None, greedy), a.repeat)
        if eager.decode_kernel is not None:
            res[f"attn_{name}_s"] = attention_s(name)
            res[f"attn_{name}_GBps"] = kv_bytes(name) / res[f"attn_{name}_s"] / 1e9
    res["logits_rel_diff"] = float((logits["fp8"] - logits["bf16"]).norm() / logits["bf16"].norm())
    res["top1_agree"] = float((logits["fp8"].argmax(-1) == logits["bf16"].argmax(-1)).float().mean())
    # Fused layers change the model in place: measured last, both caches.
    for name in ("bf16", "fp8"):
        fused = runner(name, fused=True)
        if fused.enable_decode_graphs(caches[name], a.batch, width):
            res[f"fused_graph_{name}_s"] = timed(lambda: fused.forward_sample(dec, caches[name], None, greedy), a.repeat)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_fp8_decode.json").write_text(json.dumps(res, indent=1))
    print(f"{res['device']}: {LLAMA3_8B_RANDOM}, decode of {a.batch} seqs at {a.context} tokens, blocks of {bs}")
    for name, (positions, warps, f16, stages) in res["tiles_used"].items():
        print(f"decode kernel tile, {name}: {positions} positions, {warps} warps, float16 dots {f16}, "
              f"stages {stages or 'default'}"
              + (" (fastest of the sweep)" if a.sweep else " (default)"))
    for label, key in (("graph-replayed step + sampling", "graph"), ("  with fused layers", "fused_graph"),
                       ("eager step", "eager"), ("decode attention, one layer", "attn")):
        if f"{key}_bf16_s" in res and f"{key}_fp8_s" in res:
            b, f = res[f"{key}_bf16_s"], res[f"{key}_fp8_s"]
            extra = ""
            if key == "attn":
                extra = f" ({res['attn_bf16_GBps']:.0f} / {res['attn_fp8_GBps']:.0f} GB/s of K/V read)"
            target = " (target <= 1.0)" if key in ("graph", "fused_graph") else ""
            print(f"{label}: bf16 KV {b * 1e3:.3f} ms (baseline), FP8 KV {f * 1e3:.3f} ms: ratio {f / b:.3f}"
                  f"{target}{extra}")
    print(f"logits, FP8 KV vs bf16 KV (random weights and K/V): relative difference {res['logits_rel_diff']:.2e}, "
          f"top-1 agreement {res['top1_agree']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
