"""The CUDA-graph decode path's static buffers and padding, without a GPU.

``TorchModelRunner.enable_decode_graphs(..., capture=False)`` runs the same path as a replay
(inputs copied into the static buffers, rows padded to a captured batch size with length 0,
the sampled rows read back) with an eager forward pass instead of the graph.  This runs
tiny-llama-random in float32 through it and through the ordinary eager path, each over its
own copy of one cache, and returns what the CPU test (tests/engine_torch/test_decode_graphs.py)
asserts.  The Triton decode kernel runs in Triton's interpreter, chosen before Triton is
first imported, hence a subprocess:

    TRITON_INTERPRET=1 python -m tests.decode_graph_check   # prints the result as JSON
"""

from __future__ import annotations

import json
import sys
from typing import Any

BLOCK = 16
MAX_MODEL_LEN = 256
# The CPU run: three seqs (prompt lengths), batch sizes 1, 2, 4; which seqs decode in each
# step: one (size 1), three (padded to 4), two (size 2), three again.
PROMPTS = (20, 33, 7)
DECODE_STEPS = ((0,), (0, 1, 2), (1, 2), (0, 1, 2))
# The GPU run (tests/gpu/test_torch_engine_gpu.py): 32 seqs, steps of 1, 3 and 32.
GPU_PROMPTS = tuple(5 + (i * 7) % 60 for i in range(32))
GPU_DECODE_STEPS = ((0,), (0, 1, 2), tuple(range(32)), (0, 1, 2))


def padded_decode_results(device: str = "cpu", dtype: str = "float32", prompts: tuple[int, ...] = PROMPTS,
                          steps: tuple[tuple[int, ...], ...] = DECODE_STEPS, max_num_seqs: int = 4,
                          fp8: bool = False) -> dict[str, Any]:
    """``logits_err``: the largest relative error of the graph path's logits against the eager
    path's; ``tokens_equal``: the greedy tokens of every step agree; ``untouched_changed``:
    1.0 when a cache block no seq owns changed (block 0, which the padded rows' tables point
    at, among them); ``replays`` / ``expected_replays``; ``eager_steps_replayed``: replays
    counted during the prefills and a step mixing a decode with a prompt chunk (must be 0);
    ``oversize_bucket``: whether a step of more seqs than the largest size found a graph;
    ``other_caches_bucket``: whether a step over caches other than the captured ones did.

    ``device`` ``"cpu"``: the static path without capture; ``"gpu"``: captured graphs.
    ``fp8``: block_wise_fp8 caches (uint8 K/V and their scale caches, all four checked for
    untouched blocks).
    """
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    dev = torch.device("cuda", 0) if device == "gpu" else torch.device("cpu")
    loaded = load_torch_model("tiny-llama-random", seed=0, device=dev, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    vocab = min(loaded.vocab_size, loaded.tokenizer.vocab_size)
    per_seq = -(-(max(prompts) + len(steps) + 1) // BLOCK)
    num_blocks = len(prompts) * per_seq + 8
    shape = (num_blocks, loaded.num_kv_heads, BLOCK, loaded.head_dim)
    dt = getattr(torch, dtype)
    # Random contents everywhere: a write into a block nobody owns shows.
    if fp8:
        from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import quantize_fp8

        base = [[t.to(dev) for pair in (quantize_fp8(torch.randn(shape, generator=gen)),
                                         quantize_fp8(torch.randn(shape, generator=gen))) for t in pair]
                for _ in range(loaded.num_layers)]
        base = [[k, v, ks, vs] for k, ks, v, vs in base]  # the controller's order
    else:
        base = [[torch.randn(shape, generator=gen).to(dev, dt), torch.randn(shape, generator=gen).to(dev, dt)]
                for _ in range(loaded.num_layers)]
    caches = {"eager": [[t.clone() for t in layer] for layer in base],
              "graph": [[t.clone() for t in layer] for layer in base]}
    attention = "triton" if device == "cpu" else "auto"
    quant = "block_wise_fp8" if fp8 else None
    runners = {"eager": TorchModelRunner(loaded, BLOCK, device, attention, kv_cache_quant=quant),
               "graph": TorchModelRunner(loaded, BLOCK, device, attention, kv_cache_quant=quant)}
    # capture: None captures on CUDA; False runs the static path eagerly (the CPU).
    assert runners["graph"].enable_decode_graphs(caches["graph"], max_num_seqs, MAX_MODEL_LEN,
                                                 capture=None if device == "gpu" else False)
    ids = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()  # block 0 belongs to nobody
    blocks = [ids[i * per_seq:(i + 1) * per_seq] for i in range(len(prompts))]
    owned = {b for bl in blocks for b in bl}
    prompt_ids = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in prompts]
    res: dict[str, Any] = {"logits_err": 0.0, "tokens_equal": True}
    tokens: dict[str, list[list[int]]] = {}
    for name, runner in runners.items():
        out = runner.forward([ScheduledSeq(p, 0, bl, True) for p, bl in zip(prompt_ids, blocks)], caches[name], None)
        tokens[name] = [list(p) + [int(out[i].argmax())] for i, p in enumerate(prompt_ids)]
    res["eager_steps_replayed"] = runners["graph"].graph_replays
    for step in steps:
        got = {}
        for name, runner in runners.items():
            seqs = [ScheduledSeq(tokens[name][i][-1:], len(tokens[name][i]) - 1, blocks[i], True) for i in step]
            got[name] = torch.from_numpy(runner.forward(seqs, caches[name], None).copy()).double()
        err = float((got["graph"] - got["eager"]).norm() / got["eager"].norm())
        res["logits_err"] = max(res["logits_err"], err)
        for name in runners:
            for r, i in enumerate(step):
                tokens[name][i].append(int(got[name][r].argmax()))
        res["tokens_equal"] = res["tokens_equal"] and tokens["graph"] == tokens["eager"]
    res["replays"] = runners["graph"].graph_replays
    res["expected_replays"] = len(steps)
    # A decode beside a prompt chunk: eager, not counted.
    g = runners["graph"]
    before = g.graph_replays
    spare = [b for b in ids if b not in owned][:2]
    g.forward([ScheduledSeq(tokens["graph"][0][-1:], len(tokens["graph"][0]) - 1, blocks[0], True),
               ScheduledSeq(prompt_ids[2][:5], 0, spare, True)], caches["graph"], None)
    res["eager_steps_replayed"] += g.graph_replays - before
    owned |= set(spare)
    changed = 0.0
    for layer, ref in zip(caches["graph"], base):
        for t, r in zip(layer, ref):
            for b in range(num_blocks):
                if b not in owned and not torch.equal(t[b].cpu(), r[b].cpu()):
                    changed = 1.0
    res["untouched_changed"] = changed
    many = [ScheduledSeq([1], 3, blocks[0], True)] * (max_num_seqs + 1)
    res["oversize_bucket"] = g._graph_bucket(many, caches["graph"]) is not None
    # Other caches than the captured ones: eager (a graph would write into the captured ones).
    res["other_caches_bucket"] = g._graph_bucket(many[:1], caches["eager"]) is not None
    return res


def engine_results() -> dict[str, Any]:
    """The engine with the static path on (tiny-llama-random, float32, the Triton kernels in
    the interpreter): tests/reuse_workloads.py's host-hit check under write_back (loads,
    evictions, device and host hits) against the eager runner's recompute tokens.
    ``error``: the check's assertion message, or None; ``replays``: steps through the path."""
    import gc
    import os

    import torch

    from fastdeploy_kvcache.engine.llm_engine import LLMEngine
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner
    from tests.engine_args import ENGINE_DEFAULTS, engine_args
    from tests.reuse_workloads import check_host_hits, recompute_tokens

    loaded = load_torch_model("tiny-llama-random", seed=0, device=torch.device("cpu"), dtype="float32")
    made: list[Any] = []

    def factory(graphs: bool) -> Any:
        def make(v1: bool = True, **kwargs: Any) -> Any:
            os.environ["ENABLE_V1_KVCACHE_MANAGER"] = "1" if v1 else "0"
            args = engine_args(**{**ENGINE_DEFAULTS, "model": "tiny-llama-random", "model_impl": "transformers",
                                  "device": "cpu", **kwargs})
            eng = LLMEngine(args, loaded_model=loaded)
            eng.runner = TorchModelRunner(loaded, eng.cache_config.block_size, "cpu", "triton")
            if graphs:
                assert eng.runner.enable_decode_graphs(eng.pool.layer_caches, args.max_num_seqs, eng.max_model_len,
                                                       capture=False)
            eng.start()
            made.append(eng)
            return eng
        return make

    res: dict[str, Any] = {"error": None}
    try:
        ref = recompute_tokens(factory(graphs=False))
        check_host_hits(factory(graphs=True), ref, "write_back")
    except AssertionError as exc:
        res["error"] = str(exc)[-2000:] or repr(exc)
    res["replays"] = sum(e.get_stats()["engine"]["cudagraph_replays"] for e in made)
    res["eager_engine_replays"] = made[0].get_stats()["engine"]["cudagraph_replays"] if made else -1
    for eng in made:
        eng.shutdown()
    gc.collect()
    return res


def main() -> int:
    out = padded_decode_results()
    out["engine"] = engine_results()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
