"""The transformers runner's paged attention against transformers' own ``sdpa`` attention.

Shared by the CPU test (tests/engine_torch) and the GPU test (tests/gpu): the same model runs
a prompt through the runner in pieces over a paged cache (a prefill, a chunk after cached
tokens, then batched one-token decodes of two seqs of different lengths) and whole through
transformers' sdpa forward; the function returns the largest relative error of the logits.
``attention`` picks the paged attention's kernels (``TorchModelRunner``).
"""

from __future__ import annotations

from typing import Any


def paged_vs_sdpa_error(loaded: Any, prefix: int, chunk: int, decodes: int, block_size: int, seed: int = 0,
                        attention: str = "auto") -> float:
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    model = loaded.model
    dev = next(model.parameters()).device
    dtype = next(model.parameters()).dtype
    gen = torch.Generator().manual_seed(seed)
    vocab = min(loaded.vocab_size, loaded.tokenizer.vocab_size)
    long_ids = torch.randint(3, vocab, (prefix + chunk + decodes,), generator=gen).tolist()
    short_ids = torch.randint(3, vocab, (prefix // 2 + decodes,), generator=gen).tolist()

    # Reference: transformers' own sdpa over each whole sequence.
    prev = model.config._attn_implementation
    model.config._attn_implementation = "sdpa"
    try:
        with torch.inference_mode():
            ref_long = model(torch.tensor([long_ids], device=dev)).logits[0].float().cpu()
            ref_short = model(torch.tensor([short_ids], device=dev)).logits[0].float().cpu()
    finally:
        model.config._attn_implementation = prev

    runner = TorchModelRunner(loaded, block_size, "gpu" if dev.type == "cuda" else "cpu", attention)
    nb = -(-(prefix + chunk + decodes) // block_size) + -(-len(short_ids) // block_size)
    shape = (nb + 3, loaded.num_kv_heads, block_size, loaded.head_dim)
    caches = [[torch.zeros(shape, dtype=dtype, device=dev), torch.zeros(shape, dtype=dtype, device=dev)]
              for _ in range(loaded.num_layers)]
    # Scattered, out-of-order block ids: the tables must be honoured, not the layout.
    ids = torch.randperm(nb + 3, generator=gen).tolist()
    n_long = -(-(prefix + chunk + decodes) // block_size)
    long_blocks, short_blocks = ids[:n_long], ids[n_long:nb]
    errs = []

    def err(got: Any, want: Any) -> float:
        got = torch.as_tensor(got)
        return float((got - want).norm() / want.norm())

    s_pre = len(short_ids) - decodes
    out = runner.forward([ScheduledSeq(long_ids[:prefix], 0, long_blocks, True),
                          ScheduledSeq(short_ids[:s_pre], 0, short_blocks, True)], caches, None)
    errs += [err(out[0], ref_long[prefix - 1]), err(out[1], ref_short[s_pre - 1])]
    out = runner.forward([ScheduledSeq(long_ids[prefix:prefix + chunk], prefix, long_blocks, True)], caches, None)
    errs.append(err(out[0], ref_long[prefix + chunk - 1]))
    for i in range(decodes):
        a, b = prefix + chunk + i, s_pre + i
        out = runner.forward([ScheduledSeq(long_ids[a:a + 1], a, long_blocks, True),
                              ScheduledSeq(short_ids[b:b + 1], b, short_blocks, True)], caches, None)
        errs += [err(out[0], ref_long[a]), err(out[1], ref_short[b])]
    return max(errs)
