"""The transformers runner's forward pass against transformers' own, on one GPU.

``llama3-8b-random`` (Llama-3-8B shapes, random bf16 weights) runs twice in the same process:

* **baseline**: transformers' ``LlamaForCausalLM`` with its own ``sdpa`` attention and a
  ``DynamicCache`` (what a plain transformers user gets);
* **runner**: the engine's ``TorchModelRunner`` over a paged cache (blocks of
  ``--block-size`` tokens, scattered block ids), with its registered paged attention; its
  decode batch on the Triton paged kernel (the default on CUDA) and, in the same run, on the
  torch fallback (``attention="torch"``: gather + batched matmuls).

Figures (median of ``--repeat`` timed runs, CUDA-synchronised, logits read back to the host
on both sides as an engine must, both through pinned memory):

* prefill of one ``--prefill`` -token prompt: tokens/s of each, and runner / baseline
  (target >= 0.8);
* decode of ``--batch`` seqs at ``--context`` tokens of context: ms per step of each, and
  runner / baseline (target <= 1.25); the runner's Triton decode / its torch fallback;
* the same decode step replayed from a CUDA graph (``enable_decode_graphs``, as
  ``--use-cudagraph`` serves it; batch sizes up to ``--batch``, tables of
  ``--max-model-len``): ms per step, its ratio to the eager runner and to transformers' own,
  and its logits' difference from the eager runner's;
* a ``--hit-chunk`` -token chunk after cached context (a prefix hit): the runner's Triton
  prefill kernel / its torch fallback (gather + SDPA);
* a mixed step, ``--batch`` decodes beside a ``--mixed-chunk`` -token prompt chunk, with fused
  layers: eager, and through the piecewise graphs captured for steps of up to
  ``--max-num-batched-tokens`` tokens; ms per step and the share of the step the host spends
  launching it (everything but its wait for the GPU; target <= 0.10 with the graphs), and
  that host time split (the runner's ``last_host_times``): building the inputs, the piece
  replays, the rest of the forward pass (between the pieces: each layer's attention; eager:
  the whole model), ``lm_head``, the sampling's launch, and what is left (Python around them).

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


def _sync() -> None:
    """Wait for the GPU where torch has one (a runner on the CPU returns when done)."""
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Callable[[], Any], repeat: int, warmup: int = 2) -> float:
    """Median seconds of ``fn`` (synchronised before and after each run)."""
    for _ in range(warmup):
        fn()
    _sync()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def runner_prefill_s(runner: Any, caches: Any, block_ids: list[int], token_ids: list[int], repeat: int) -> float:
    """Median seconds of ``runner``'s forward pass over one prompt chunk with nothing cached
    before it (``token_ids`` into ``block_ids`` of ``caches``; logits read back, as a step does).

    Any :class:`~fastdeploy_kvcache.engine.runner.ModelRunner` on the CPU or a GPU: the prefill
    figure here and the forward-only baseline of ``bench_shared_prefix.py``.
    """
    from fastdeploy_kvcache.engine.runner import ScheduledSeq

    seq = [ScheduledSeq(token_ids, 0, block_ids, True)]
    return timed(lambda: runner.forward(seq, caches, None), repeat)


def to_host(t: Any) -> Any:
    """``t`` as float32 on the host through pinned memory (as the runner reads its logits)."""
    import torch

    host = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream().synchronize()
    return host


def _host_split(ms: dict[str, float]) -> str:
    """The host's time of a step before its sync, by part (medians, ms)."""
    names = {"build": "build inputs", "pieces": "piece replays", "between": "between pieces (attention)",
             "head": "lm_head", "sample": "sampling launch", "other": "other"}
    return ", ".join(f"{names[k]} {v:.2f}" for k, v in ms.items())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prefill", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--hit-chunk", type=int, default=64, help="tokens of the chunk after cached context")
    ap.add_argument("--max-model-len", type=int, default=8192,
                    help="the CUDA graphs' table width (blocks of this many tokens), as a server's flag")
    ap.add_argument("--mixed-chunk", type=int, default=2048, help="prompt tokens of the mixed step")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="the piecewise graphs' largest step, as the server's flag (its GPU default)")
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

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import LLAMA3_8B_RANDOM, load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

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
            to_host(out.logits.float())

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
            to_host(out.logits[:, -1].float())
            cache.crop(a.context)

        res["baseline_decode_s"] = timed(hf_decode, a.repeat * 4)
    del cache
    torch.cuda.empty_cache()

    # ---- the runner over a paged cache
    nb_prefill = -(-a.prefill // bs)
    nb_seq = -(-(a.context + 1) // bs)
    nb_mixed = -(-a.mixed_chunk // bs)
    num_blocks = max(nb_prefill, a.batch * nb_seq + nb_mixed) + 8
    shape = (num_blocks, lm.num_kv_heads, bs, lm.head_dim)
    caches = [[torch.randn(shape, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(2)]
              for _ in range(lm.num_layers)]
    perm = torch.randperm(num_blocks, device=dev, generator=gen).tolist()
    runner = TorchModelRunner(lm, bs, "gpu")
    res["runner_decode_attention"] = "triton" if runner.decode_kernel is not None else "torch (no Triton)"
    ids = prompt[0].tolist()
    res["runner_prefill_s"] = runner_prefill_s(runner, caches, perm[:nb_prefill], ids, a.repeat)
    toks = nxt[:, 0].tolist()
    dec = [ScheduledSeq([toks[i]], a.context, perm[i * nb_seq:(i + 1) * nb_seq], True) for i in range(a.batch)]
    res["runner_decode_s"] = timed(lambda: runner.forward(dec, caches, None), a.repeat * 4)
    fallback = TorchModelRunner(lm, bs, "gpu", attention="torch")
    res["runner_torch_decode_s"] = timed(lambda: fallback.forward(dec, caches, None), a.repeat * 4)
    # The same step's logits from both: the kernel and the fallback compute the same attention.
    with torch.inference_mode():
        la, lb = torch.from_numpy(runner.forward(dec, caches, None)), torch.from_numpy(fallback.forward(dec, caches, None))
    res["decode_logits_rel_diff"] = float((la - lb).norm() / lb.norm())
    # The same decode step replayed from a CUDA graph (captured here as the engine does at start).
    graphed = TorchModelRunner(lm, bs, "gpu")
    if graphed.enable_decode_graphs(caches, a.batch, max(a.max_model_len, a.context + 1)):
        res["graph_capture_s"] = graphed.decode_graphs.capture_s
        res["graph_pool_MiB"] = graphed.decode_graphs.pool_bytes / (1 << 20)
        res["runner_graph_decode_s"] = timed(lambda: graphed.forward(dec, caches, None), a.repeat * 4)
        with torch.inference_mode():
            lg = torch.from_numpy(graphed.forward(dec, caches, None))
        res["graph_replays"] = graphed.graph_replays
        res["graph_logits_rel_diff"] = float((lg - la).norm() / la.norm())
    # A short chunk after cached context (a prefix hit's question): the Triton prefill kernel
    # reads the blocks in place, the fallback gathers them for SDPA.
    ctx_len = max(1, a.prefill - a.hit_chunk)
    hit = [ScheduledSeq(ids[:a.hit_chunk], ctx_len, perm[:-(-(ctx_len + a.hit_chunk) // bs)], True)]
    res["hit_chunk_context"] = ctx_len
    res["runner_hit_chunk_s"] = timed(lambda: runner.forward(hit, caches, None), a.repeat * 4)
    res["runner_torch_hit_chunk_s"] = timed(lambda: fallback.forward(hit, caches, None), a.repeat * 4)

    # ---- the decode attention alone (one layer's caches): K/V bytes read per second, against a
    # device-to-device copy's bandwidth measured here (bytes read + written per second).
    if runner.decode_kernel is not None:
        from fastdeploy_kvcache.engine.transformers_runner.torch_attention import decode_attention_torch, decode_mask

        lens = torch.full((a.batch,), a.context + 1, dtype=torch.int64, device=dev)
        table = torch.tensor([perm[i * nb_seq:(i + 1) * nb_seq] for i in range(a.batch)], device=dev)
        q = torch.randn((a.batch, lm.num_heads, lm.head_dim), device=dev, dtype=torch.bfloat16, generator=gen)
        o = torch.empty_like(q)
        mask = decode_mask(lens, nb_seq, bs, torch.arange(nb_seq * bs, device=dev))
        k0, v0 = caches[0]
        calls = 20

        def kernel() -> None:
            for _ in range(calls):
                runner.decode_kernel(q, k0, v0, table, lens, o, lm.head_dim ** -0.5)

        def fallback_attn() -> None:
            for _ in range(calls):
                decode_attention_torch(q, k0, v0, table, mask, lm.head_dim ** -0.5)

        kv_bytes = 2 * a.batch * (a.context + 1) * lm.num_kv_heads * lm.head_dim * 2
        blob = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
        blob2 = torch.empty_like(blob)
        copy_s = timed(lambda: blob2.copy_(blob), a.repeat)
        del blob, blob2
        res["hbm_copy_GBps"] = 2 * (1 << 30) / copy_s / 1e9
        res["attn_kernel_s"] = timed(kernel, a.repeat) / calls
        res["attn_torch_s"] = timed(fallback_attn, a.repeat) / calls
        res["attn_kernel_GBps"] = kv_bytes / res["attn_kernel_s"] / 1e9

    # ---- the decode floor, and the same graph-replayed step with fused decoder layers: weights
    # plus the step's K/V read once, at the device copy's bandwidth measured here.
    if "runner_graph_decode_s" in res and "hbm_copy_GBps" in res:
        from fastdeploy_kvcache.engine.sampling import RequestSampler, SamplingParams, StepSampling

        greedy = StepSampling.for_samplers([RequestSampler(SamplingParams(temperature=0.0), 0)] * a.batch)
        res["runner_graph_sample_s"] = timed(lambda: graphed.forward_sample(dec, caches, None, greedy), a.repeat * 4)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        step_kv_bytes = lm.num_layers * 2 * a.batch * (a.context + 1) * lm.num_kv_heads * lm.head_dim * 2
        res["decode_floor_s"] = (weight_bytes + step_kv_bytes) / (res["hbm_copy_GBps"] * 1e9)
        fused = TorchModelRunner(lm, bs, "gpu", fused_layers=True)  # fuses lm's layers in place: measured last
        if fused.enable_decode_graphs(caches, a.batch, max(a.max_model_len, a.context + 1)):
            res["fused_graph_sample_s"] = timed(lambda: fused.forward_sample(dec, caches, None, greedy), a.repeat * 4)
            with torch.inference_mode():
                lf = torch.from_numpy(fused.forward(dec, caches, None))
            res["fused_logits_rel_diff"] = float((lf - la).norm() / la.norm())
        # A step of decodes beside a prompt chunk (its blocks apart from theirs): eager, then
        # through the piecewise graphs.  Launch share: the host's time in the step outside its
        # wait for the GPU (building inputs and enqueueing kernels), over the step's time.
        chunk_ids = torch.randint(0, 50000, (a.mixed_chunk,), device=dev, generator=gen).tolist()
        mixed = dec + [ScheduledSeq(chunk_ids, 0, perm[a.batch * nb_seq:a.batch * nb_seq + nb_mixed], True)]

        def launch_share(run: Any) -> tuple[float, float, dict[str, float]]:
            """Median step seconds, launch share, and the host's time split (median ms each)."""
            steps, shares, splits = [], [], []
            for _ in range(2):
                run.forward_sample(mixed, caches, None, greedy_mixed)
            for _ in range(a.repeat * 2):
                t0 = time.perf_counter()
                run.forward_sample(mixed, caches, None, greedy_mixed)
                dt = time.perf_counter() - t0
                steps.append(dt)
                shares.append(1.0 - run.last_gpu_wait_s / dt)
                h = run.last_host_times
                parts = {"build": h.build_s, "pieces": h.pieces_s, "between": h.between_s, "head": h.head_s,
                         "sample": h.sample_s}
                parts["other"] = dt - run.last_gpu_wait_s - sum(parts.values())
                splits.append(parts)
            split = {k: statistics.median(p[k] for p in splits) * 1e3 for k in splits[0]}
            return statistics.median(steps), statistics.median(shares), split

        greedy_mixed = StepSampling.for_samplers([RequestSampler(SamplingParams(temperature=0.0), 0)] * len(mixed))
        res["mixed_eager_s"], res["mixed_eager_launch_share"], res["mixed_eager_host_ms"] = launch_share(fused)
        if fused.enable_piecewise_graphs(a.max_num_batched_tokens):
            res["piecewise_capture_s"] = fused.piecewise_graphs.capture_s
            res["piecewise_pool_MiB"] = fused.piecewise_graphs.pool_bytes / (1 << 20)
            res["piecewise_sizes"] = len(fused.piecewise_graphs.sizes)
            (res["mixed_piecewise_s"], res["mixed_piecewise_launch_share"],
             res["mixed_piecewise_host_ms"]) = launch_share(fused)
            with torch.inference_mode():
                lp = torch.from_numpy(fused.forward(mixed, caches, None))
                fused.piecewise_graphs = None
                le = torch.from_numpy(fused.forward(mixed, caches, None))
            res["piecewise_logits_rel_diff"] = float((lp - le).norm() / le.norm())

    res["prefill_tok_s"] = {"baseline": a.prefill / res["baseline_prefill_s"], "runner": a.prefill / res["runner_prefill_s"]}
    res["prefill_ratio"] = res["baseline_prefill_s"] / res["runner_prefill_s"]
    res["decode_ratio"] = res["runner_decode_s"] / res["baseline_decode_s"]
    res["decode_triton_vs_torch"] = res["runner_decode_s"] / res["runner_torch_decode_s"]
    if "runner_graph_decode_s" in res:
        res["graph_vs_eager"] = res["runner_graph_decode_s"] / res["runner_decode_s"]
        res["graph_vs_baseline"] = res["runner_graph_decode_s"] / res["baseline_decode_s"]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_gpu_runner.json").write_text(json.dumps(res, indent=1))
    print(f"{res['device']}: {LLAMA3_8B_RANDOM} built in {build_s:.2f} s")
    print(f"prefill {a.prefill} tokens: baseline {res['baseline_prefill_s'] * 1e3:.1f} ms "
          f"({res['prefill_tok_s']['baseline']:.0f} tok/s), runner {res['runner_prefill_s'] * 1e3:.1f} ms "
          f"({res['prefill_tok_s']['runner']:.0f} tok/s): throughput ratio {res['prefill_ratio']:.3f} (target >= 0.8)")
    print(f"decode {a.batch} seqs at {a.context}: baseline {res['baseline_decode_s'] * 1e3:.2f} ms/step, "
          f"runner {res['runner_decode_s'] * 1e3:.2f} ms/step ({res['runner_decode_attention']}): "
          f"ratio {res['decode_ratio']:.3f} (target <= 1.25)")
    print(f"runner decode attention: {res['runner_decode_attention']} {res['runner_decode_s'] * 1e3:.2f} ms/step, "
          f"torch fallback {res['runner_torch_decode_s'] * 1e3:.2f} ms/step: ratio {res['decode_triton_vs_torch']:.3f}; "
          f"logits relative difference {res['decode_logits_rel_diff']:.2e}")
    print(f"{a.hit_chunk}-token chunk after {res['hit_chunk_context']} cached tokens: runner "
          f"{res['runner_hit_chunk_s'] * 1e3:.2f} ms ({res['runner_decode_attention']}), torch fallback "
          f"{res['runner_torch_hit_chunk_s'] * 1e3:.2f} ms: ratio "
          f"{res['runner_hit_chunk_s'] / res['runner_torch_hit_chunk_s']:.3f}")
    if "runner_graph_decode_s" in res:
        g = res["runner_graph_decode_s"]
        print(f"decode {a.batch} seqs at {a.context} replayed from a CUDA graph: {g * 1e3:.2f} ms/step "
              f"({res['graph_replays']} replays; captured in {res['graph_capture_s']:.1f} s, "
              f"{res['graph_pool_MiB']:.0f} MiB of device memory taken): ratio to the eager runner {res['graph_vs_eager']:.3f}, to "
              f"transformers' own {res['graph_vs_baseline']:.3f}; logits relative difference from the eager "
              f"runner {res['graph_logits_rel_diff']:.2e}")
    else:
        print("decode from a CUDA graph: not captured (see the warning above); no figure")
    if "decode_floor_s" in res:
        floor = res["decode_floor_s"]
        print(f"decode floor, {a.batch} seqs at {a.context} (weights + K/V at the device copy's bandwidth): "
              f"{floor * 1e3:.2f} ms; graph-replayed step with sampling on the GPU {res['runner_graph_sample_s'] * 1e3:.2f} ms "
              f"({floor / res['runner_graph_sample_s']:.2f} of the floor)")
        if "fused_graph_sample_s" in res:
            print(f"  with fused decoder layers (--fused-layers): {res['fused_graph_sample_s'] * 1e3:.2f} ms "
                  f"({floor / res['fused_graph_sample_s']:.2f} of the floor, target >= 0.75); logits relative "
                  f"difference from the unfused eager runner {res['fused_logits_rel_diff']:.2e}")
    if "mixed_eager_s" in res:
        print(f"mixed step, {a.batch} decodes at {a.context} + a {a.mixed_chunk}-token chunk, fused layers: eager "
              f"{res['mixed_eager_s'] * 1e3:.2f} ms, launch share {res['mixed_eager_launch_share']:.2f}")
        print(f"  eager host ms: {_host_split(res['mixed_eager_host_ms'])}")
        if "mixed_piecewise_s" in res:
            print(f"  through piecewise graphs ({res['piecewise_sizes']} sizes up to {a.max_num_batched_tokens} tokens, "
                  f"captured in {res['piecewise_capture_s']:.1f} s, {res['piecewise_pool_MiB']:.0f} MiB): "
                  f"{res['mixed_piecewise_s'] * 1e3:.2f} ms ({res['mixed_piecewise_s'] / res['mixed_eager_s']:.3f} of "
                  f"eager), launch share {res['mixed_piecewise_launch_share']:.2f} (target <= 0.10); logits relative "
                  f"difference from eager {res['piecewise_logits_rel_diff']:.2e}")
            print(f"  piecewise host ms: {_host_split(res['mixed_piecewise_host_ms'])}")
    if "attn_kernel_s" in res:
        print(f"decode attention alone, one layer, {a.batch} x {a.context + 1} tokens: Triton kernel "
              f"{res['attn_kernel_s'] * 1e6:.1f} us ({res['attn_kernel_GBps']:.0f} GB/s of K/V, "
              f"{res['attn_kernel_GBps'] / res['hbm_copy_GBps']:.2f}x the device copy's {res['hbm_copy_GBps']:.0f} GB/s "
              f"measured here), torch fallback {res['attn_torch_s'] * 1e6:.1f} us: "
              f"ratio {res['attn_kernel_s'] / res['attn_torch_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
