"""``PaddleModelRunner``: one forward pass of a step on paddleformers (the ``ModelRunner``
protocol, ``engine/runner.py``): flatten the scheduled tokens, run the model, return logits.

The model is paddleformers' ``LlamaForCausalLM``, unmodified; attention goes through the
registered paged attention (``engine/paddleformers_runner/attention.py``).  The LM head runs only on the rows
that produce a token (a request's last scheduled token when its prompt is complete), not on
every prefill token: on a 49k vocabulary that is most of a prefill's cost otherwise.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import numpy as np

from fastdeploy_kvcache.config import BLOCK_WISE_FP8
from fastdeploy_kvcache.engine.attention import step_context
from fastdeploy_kvcache.engine.model_loader import LoadedModel
from fastdeploy_kvcache.engine.paddleformers_runner import fp8_kv
from fastdeploy_kvcache.engine.paddleformers_runner.attention import SeqSlice, StepContext, register_paged_attention
from fastdeploy_kvcache.engine.paddleformers_runner.int64_staging import Int64Staging
from fastdeploy_kvcache.engine.runner import ScheduledSeq
from fastdeploy_kvcache.engine.sampling import StepSampling

logger = logging.getLogger(__name__)


class PaddleModelRunner:
    """Runs paddleformers' ``LlamaForCausalLM`` over the paged cache (see the module docstring)."""

    # The ModelRunner figures: the logits are read back inside forward (no separate device
    # wait to report), load waits are counted per layer, and there are no CUDA graphs.
    last_layers_waited: int = 0
    last_gpu_wait_s: float = 0.0
    last_load_wait_gpu_s: float = 0.0
    last_step_replayed: bool = False

    def __init__(self, loaded: LoadedModel, block_size: int, place: str, kv_cache_quant: Optional[str] = None) -> None:
        """``kv_cache_quant``: the cache's format (None, block_wise_fp8 or block_wise_int8):
        what a uint8 cache's bytes mean; ValueError for another."""
        import paddle

        self.kv_quant = fp8_kv.check_kv_quant(kv_cache_quant) if kv_cache_quant is not None else BLOCK_WISE_FP8

        self.paddle = paddle
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        self.place = place
        self.last_layers_waited = 0  # layers of the last forward that waited for a load
        # Every int64 tensor of a step goes through it: paddle.to_tensor leaks (int64_staging.py).
        self.staging = Int64Staging()
        register_paged_attention(self.model.config)

    def forward(
        self, seqs: list[ScheduledSeq], kv_caches: Sequence[Sequence[Any]], layer_done: Optional[Any]
    ) -> np.ndarray:
        """Run the step; returns float32 logits, one row per seq with ``wants_logits``, in ``seqs`` order."""
        paddle = self.paddle
        ids: list[int] = []
        pos: list[int] = []
        slices: list[SeqSlice] = []
        picked_rows: list[tuple[int, int]] = []  # (index in seqs, row in the flattened batch)
        # Single-token seqs (decodes) first: the attention batches that leading run.
        order = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        order += [i for i, s in enumerate(seqs) if len(s.token_ids) != 1]
        for i in order:
            s = seqs[i]
            start = len(ids)
            n = len(s.token_ids)
            ids.extend(int(t) for t in s.token_ids)
            pos.extend(range(s.context_len, s.context_len + n))
            slices.append(SeqSlice(start, n, s.context_len, s.block_ids))
            if s.wants_logits:
                picked_rows.append((i, start + n - 1))
        rows = [row for _, row in sorted(picked_rows)]
        ctx = StepContext(slices, kv_caches, self.block_size, self.staging, layer_done, kv_quant=self.kv_quant)
        # NOTE: only the count is kept: a kept StepContext would hold the cache tensors
        # (and the step's index tensors) alive past the engine's shutdown.
        self.last_layers_waited = 0
        with paddle.no_grad(), step_context(ctx):
            input_ids = self.staging.tensor(ids, [1, -1])
            position_ids = self.staging.tensor(pos, [1, -1])
            try:
                out = self.model.model(input_ids, position_ids=position_ids, use_cache=False, return_dict=False)
            finally:
                self.last_layers_waited = len(ctx.layers_waited)
            hidden = out[0] if isinstance(out, (tuple, list)) else out
            if not rows:
                return np.zeros((0, self.loaded.vocab_size), dtype=np.float32)
            picked = paddle.index_select(hidden[0], self.staging.tensor(rows), axis=0)
            logits = self.model.lm_head(picked.unsqueeze(0))[0]
            return logits.astype("float32").numpy()

    def forward_sample(self, seqs: list[ScheduledSeq], kv_caches: Sequence[Sequence[Any]],
                       layer_done: Optional[Any], sampling: StepSampling) -> np.ndarray:
        """Run the step and pick each sampling row's token on the host (the logits are
        already there on the CPU); returns int64 ids, one per seq with ``wants_logits``."""
        return sampling.sample_host(self.forward(seqs, kv_caches, layer_done))
