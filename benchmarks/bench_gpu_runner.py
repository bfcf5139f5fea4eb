"""The transformers runner's forward pass against transformers' own, on one GPU.

``llama3-8b-random`` (Llama-3-8B shapes, random bf16 weights) runs twice in the same process:

* **baseline**: transformers' ``LlamaForCausalLM`` with its own ``sdpa`` attention and a
  ``DynamicCache`` (what a plain transformers user gets);
* **runner**: the engine's ``TorchModelRunner`` over a paged cache (blocks of
  ``--block-size`` tokens, scattered block ids), with its registered paged attention.

Figures (median of ``--repeat`` timed runs, CUDA-synchronised, logits read back to the host
on both sides as an engine must):

* prefill of one ``--prefill`` -token prompt: tokens/s of each, and runner / baseline
  (target >= 0.8);
* decode of ``--batch`` seqs at ``--context`` tokens of context: ms per step of each, and
  runner / baseline (target <= 1.25).

    python benchmarks/bench_gpu_runner.py [--prefill 4096] [--batch 32] [--context 2048]

Writes ``bench_gpu_runner.json`` under ``--out``.  Exits 0 with a message without a GPU or torch.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def timed(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (synchronised before and after each run)."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    try:
        import torch
    except ImportError:
        print("bench_gpu_runner: needs torch; skipped")
        return 0
    if not torch.cuda.is_available():
        print("bench_gpu_runner: needs a CUDA GPU; skipped")
        return 0
    from transformers import DynamicCache

    from fastdeploy_kvcache.engine.model_runner import ScheduledSeq
    from fastdeploy_kvcache.engine.torch_models import LLAMA3_8B_RANDOM, load_torch_model
    from fastdeploy_kvcache.engine.torch_runner import TorchModelRunner

    dev = torch.device("cuda", 0)
    t0 = time.perf_counter()
    lm = load_torch_model(LLAMA3_8B_RANDOM, seed=0, device=dev, dtype="bfloat16")
    torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    model, bs = lm.model, a.block_size
    gen = torch.Generator(device=dev).manual_seed(1)
    res: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "model": LLAMA3_8B_RANDOM, "build_s": build_s,
                           "args": vars(a)}

    # ---- baseline: transformers' own sdpa + DynamicCache
    model.config._attn_implementation = "sdpa"
    prompt = torch.randint(0, 50000, (1, a.prefill), device=dev, generator=gen)

    def hf_prefill() -> None:
        with torch.inference_mode():
            out = model(prompt, use_cache=True, past_key_values=DynamicCache(), logits_to_keep=1)
            out.logits.float().cpu()

    res["baseline_prefill_s"] = timed(hf_prefill, a.repeat)
    ctx = torch.randint(0, 50000, (a.batch, a.context), device=dev, generator=gen)
    with torch.inference_mode():
        cache = DynamicCache()
        model(ctx, use_cache=True, past_key_values=cache, logits_to_keep=1)
        nxt = torch.randint(0, 50000, (a.batch, 1), device=dev, generator=gen)
        # Each decode step appends to the cache, as serving does; crop back so all runs see
        # the same context length.
        def hf_decode() -> None:
            out = model(nxt, use_cache=True, past_key_values=cache)
            out.logits[:, -1].float().cpu()
            cache.crop(a.context)

        res["baseline_decode_s"] = timed(hf_decode, a.repeat * 4)
    del cache
    torch.cuda.empty_cache()

    # ---- the runner over a paged cache
    nb_prefill = -(-a.prefill // bs)
    nb_seq = -(-(a.context + 1) // bs)
    num_blocks = max(nb_prefill, a.batch * nb_seq) + 8
    shape = (num_blocks, lm.num_kv_heads, bs, lm.head_dim)
    caches = [[torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2)]
              for _ in range(lm.num_layers)]
    perm = torch.randperm(num_blocks, device=dev, generator=gen).tolist()
    runner = TorchModelRunner(lm, bs, "gpu")
    ids = prompt[0].tolist()
    seq = [ScheduledSeq(ids, 0, perm[:nb_prefill], True)]
    res["runner_prefill_s"] = timed(lambda: runner.forward(seq, caches, None), a.repeat)
    toks = nxt[:, 0].tolist()
    dec = [ScheduledSeq([toks[i]], a.context, perm[i * nb_seq:(i + 1) * nb_seq], True) for i in range(a.batch)]
    res["runner_decode_s"] = timed(lambda: runner.forward(dec, caches, None), a.repeat * 4)

    res["prefill_tok_s"] = {"baseline": a.prefill / res["baseline_prefill_s"], "runner": a.prefill / res["runner_prefill_s"]}
    res["prefill_ratio"] = res["baseline_prefill_s"] / res["runner_prefill_s"]
    res["decode_ratio"] = res["runner_decode_s"] / res["baseline_decode_s"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu_runner.json").write_text(json.dumps(res, indent=1))
    print(f"{res['device']}: {LLAMA3_8B_RANDOM} built in {build_s:.2f} s")
    print(f"prefill {a.prefill} tokens: baseline {res['baseline_prefill_s'] * 1e3:.1f} ms "
          f"({res['prefill_tok_s']['baseline']:.0f} tok/s), runner {res['runner_prefill_s'] * 1e3:.1f} ms "
          f"({res['prefill_tok_s']['runner']:.0f} tok/s): throughput ratio {res['prefill_ratio']:.3f} (target >= 0.8)")
    print(f"decode {a.batch} seqs at {a.context}: baseline {res['baseline_decode_s'] * 1e3:.2f} ms/step, "
          f"runner {res['runner_decode_s'] * 1e3:.2f} ms/step: ratio {res['decode_ratio']:.3f} (target <= 1.25)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
