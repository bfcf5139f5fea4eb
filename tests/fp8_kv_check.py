"""The 8-bit KV caches (``block_wise_fp8``, ``block_wise_int8``) through the Triton kernels and the runner.

Shared by the CPU test (tests/engine_torch/test_fp8_kv.py, which runs :func:`main` in a
subprocess with ``TRITON_INTERPRET=1``) and the GPU test (tests/gpu/test_fp8_kv_gpu.py).

* the kernel cases of tests/triton_decode_cases.py with FP8 caches (``FP8_DTYPES``): against
  float64 over the dequantized values and against the torch fallbacks;
* :func:`reuse_tokens`: tiny-llama-random with an FP8 cache, greedy tokens after reusing
  cached blocks (written by a prefill and by decode steps) against recomputing them;
* the CUDA-graph decode path's static buffers over FP8 caches (tests/decode_graph_check.py).

    TRITON_INTERPRET=1 python -m tests.fp8_kv_check   # everything on the CPU, as JSON
"""

from __future__ import annotations

import json
import sys
from typing import Any

from tests.triton_decode_cases import (
    CASES,
    FP8_DTYPES,
    PREFILL_CASES,
    case_errors,
    prefill_case_errors,
    zero_length_errors,
)

BLOCK = 16
PROMPT = 40  # 2.5 blocks
FIRST_GEN = 24  # decode steps of the first request: they fill block 2's second half and block 3
REUSED_GEN = 16  # of those, how many the second request's prompt repeats (a 3.5-block prompt)
SECOND_GEN = 8


def reuse_tokens(loaded: Any, attention: str, device: str = "cpu", seed: int = 0,
                 kv_quant: str = "block_wise_fp8") -> dict[str, Any]:
    """Greedy tokens of one runner over one 8-bit cache of ``kv_quant`` (block_wise_fp8 or block_wise_int8):

    * ``first``: a prompt of :data:`PROMPT` tokens, then :data:`FIRST_GEN` greedy tokens (its
      blocks 0-1 written by the prefill, blocks 2-3 partly or wholly by decode steps);
    * the second request's prompt is the first's plus its first :data:`REUSED_GEN` tokens;
      ``reused``: its continuation with blocks 0-2 of the first request reused (48 tokens of
      context, a chunk of 8 after them); ``recomputed``: from fresh blocks in one chunk;
      ``chunked``: from fresh blocks in chunks of 16 tokens (chunks after cached context);
    * ``expected``: the first request's own tokens past :data:`REUSED_GEN` (the same
      sequence, decoded);
    * ``logits``: the last step's logits of ``reused`` (to compare attention paths).
    """
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import make_layer_caches
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    runner = TorchModelRunner(loaded, BLOCK, device, attention, kv_cache_quant=kv_quant)
    dev = runner.device
    dtype = next(loaded.model.parameters()).dtype
    caches = make_layer_caches(loaded.num_layers, 24, loaded.num_kv_heads, BLOCK, loaded.head_dim, dtype, dev, True)
    gen = torch.Generator().manual_seed(seed)
    vocab = min(loaded.vocab_size, loaded.tokenizer.vocab_size)
    prompt = torch.randint(3, vocab, (PROMPT,), generator=gen).tolist()
    last: dict[str, Any] = {}

    def generate(ids: list[int], blocks: list[int], n: int, context: int = 0, chunk: int = 1 << 30) -> list[int]:
        pos = context
        while pos < len(ids):
            take = ids[pos:pos + chunk]
            logits = runner.forward([ScheduledSeq(take, pos, blocks, True)], caches, None)
            pos += len(take)
        out = [int(logits[0].argmax())]
        for i in range(n - 1):
            logits = runner.forward([ScheduledSeq(out[-1:], len(ids) + i, blocks, True)], caches, None)
            out.append(int(logits[0].argmax()))
        last["logits"] = torch.from_numpy(logits[0].copy())
        return out

    first = generate(prompt, [3, 9, 5, 12], FIRST_GEN)
    second = prompt + first[:REUSED_GEN]
    res: dict[str, Any] = {"first": first, "expected": first[REUSED_GEN:REUSED_GEN + SECOND_GEN]}
    res["recomputed"] = generate(second, [20, 1, 17, 7], SECOND_GEN)
    res["chunked"] = generate(second, [2, 14, 8, 22], SECOND_GEN, chunk=16)
    res["reused"] = generate(second, [3, 9, 5, 15], SECOND_GEN, context=3 * BLOCK)
    res["logits"] = last["logits"]
    return res


def main() -> int:
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from tests.decode_graph_check import padded_decode_results

    cpu = torch.device("cpu")
    out: dict[str, Any] = {f"{name}/{dtype}": case_errors(name, dtype, cpu) for name in CASES for dtype in FP8_DTYPES}
    out.update({f"prefill/{name}/{dtype}": prefill_case_errors(name, dtype, cpu)
                for name in PREFILL_CASES for dtype in FP8_DTYPES})
    out.update({f"zero_length/{dtype}": zero_length_errors(dtype, cpu) for dtype in FP8_DTYPES})
    loaded = load_torch_model("tiny-llama-random", seed=0, device=cpu, dtype="float32")
    runs = {attention: reuse_tokens(loaded, attention) for attention in ("triton", "torch")}
    out["reuse"] = {attention: {k: v for k, v in r.items() if k != "logits"} for attention, r in runs.items()}
    a, b = runs["triton"]["logits"], runs["torch"]["logits"]
    out["reuse_paths_logits_err"] = float((a - b).norm() / b.norm())
    runs = {attention: reuse_tokens(loaded, attention, kv_quant="block_wise_int8") for attention in ("triton", "torch")}
    out["reuse_int8"] = {attention: {k: v for k, v in r.items() if k != "logits"} for attention, r in runs.items()}
    a, b = runs["triton"]["logits"], runs["torch"]["logits"]
    out["reuse_int8_paths_logits_err"] = float((a - b).norm() / b.norm())
    out["graphs"] = padded_decode_results(fp8=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
