"""The transformers model runner (``--model-impl transformers``): one forward pass of a step.

The ``ModelRunner`` protocol (``engine/runner.py``), as the paddleformers runner
(``engine/paddleformers_runner/paddle_runner.py``): the engine hands it the step's
:class:`~fastdeploy_kvcache.engine.runner.ScheduledSeq` list, the
controller's per-layer caches and the step's ``LayerDoneCounter``; it returns float32 logits
for the seqs that sample.  The model is transformers' ``LlamaForCausalLM``, unmodified, with
the paged attention of ``engine/transformers_runner/torch_attention.py``.

The caches are the torch tensors the worker allocated (``worker/backends/torch_backend.py``);
they are never copied.  The step's indices (token ids, positions, K/V slots, block tables)
go to the device in one copy from a reused pinned buffer.  The engine calls
:meth:`TorchModelRunner.forward_sample`: the sampling rows' tokens are picked on the device
(``engine/transformers_runner/torch_sampling.py``), and the only host sync of a step reads back
those int64 ids (a step that samples nothing has none).  :meth:`TorchModelRunner.forward` returns the float32
logits instead, for tests and benchmarks.

With :meth:`TorchModelRunner.enable_decode_graphs` (``--use-cudagraph``) a step whose seqs
all decode one token replays a CUDA graph captured at start for the next batch size up
(``engine/transformers_runner/decode_graphs.py``); every other step (any prompt chunk, more seqs
than the largest graph, a table wider than ``max_model_len``) runs eagerly as before.
With fused layers, :meth:`TorchModelRunner.enable_piecewise_graphs` (also ``--use-cudagraph``)
takes those other steps: the model's pieces between attentions replay from graphs captured
per token count, the attention runs eagerly between them
(``engine/transformers_runner/piecewise_graphs.py``).

With ``kv_cache_quant="block_wise_fp8"`` (or ``"block_wise_int8"``) the caches are 8-bit
(uint8 E4M3, or int8, K/V with float32 scales per block, head and token:
``engine/transformers_runner/fp8_kv.py``); every attention
path quantizes what it writes and dequantizes what it reads, the graphs included.

Nothing here or in the modules it imports imports Paddle: this path runs where only torch is.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from fastdeploy_kvcache import envs
from fastdeploy_kvcache.engine.model_loader import LoadedModel
from fastdeploy_kvcache.engine.runner import ScheduledSeq
from fastdeploy_kvcache.engine.attention import step_context
from fastdeploy_kvcache.engine.transformers_runner.decode_graphs import DecodeGraphs, GraphBucket
from fastdeploy_kvcache.config import BLOCK_WISE_FP8
from fastdeploy_kvcache.engine.transformers_runner.fp8_kv import check_fp8_layer_caches, check_kv_cache_quant
from fastdeploy_kvcache.engine.transformers_runner.piecewise_graphs import PiecewiseGraphs, TokenBucket
from fastdeploy_kvcache.engine.sampling import StepSampling
from fastdeploy_kvcache.engine.transformers_runner.torch_sampling import sample_on_device
from fastdeploy_kvcache.engine.transformers_runner.torch_attention import (
    PrefillChunk,
    TorchStep,
    attend_layer,
    decode_mask,
    register_paged_attention,
    step_rows,
)

logger = logging.getLogger(__name__)


def select_device(device: str) -> str:
    """``"gpu"`` when torch sees a CUDA device (``auto``), else ``"cpu"``; ValueError for an
    impossible ``"gpu"``."""
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as exc:
        raise ValueError(f"model_impl: 'transformers' needs PyTorch and transformers ({exc}); install them "
                         "(pip install torch transformers) or use --model-impl paddleformers") from None
    has_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    if device == "gpu" and not has_cuda:
        raise ValueError("device: 'gpu' asked for, but torch sees no CUDA device")
    return "gpu" if device == "gpu" or (device == "auto" and has_cuda) else "cpu"


def model_dtype(dtype: str, device: str) -> str:
    """``auto``: bfloat16 on the GPU, float32 on the CPU (bf16 matmuls are slow on CPUs)."""
    if dtype == "auto":
        return "bfloat16" if device == "gpu" else "float32"
    return dtype


def torch_device(device: str) -> Any:
    import torch

    return torch.device("cuda", 0) if device == "gpu" else torch.device("cpu")


ATTENTION_CHOICES = ("auto", "triton", "torch")


def decode_kernel_for(device: Any, choice: str = "auto") -> Optional[Any]:
    """The paged attention's Triton decode kernel for ``choice`` (the runner's ``attention``):
    on CUDA where Triton imports (``auto``), else None (the torch fallback).  ``triton``
    insists (ValueError where it cannot run), ``torch`` picks the fallback (benchmarks
    compare the two)."""
    if choice not in ATTENTION_CHOICES:
        raise ValueError(f"attention {choice!r}: expected one of {', '.join(ATTENTION_CHOICES)}")
    if choice == "torch" or (choice == "auto" and device.type != "cuda"):
        return None
    try:
        from fastdeploy_kvcache.engine.transformers_runner.triton_paged_attention import paged_decode_attention
    except ImportError as exc:
        if choice == "triton":
            raise ValueError(f"attention 'triton': Triton does not import ({exc})") from None
        logger.info("Triton does not import (%s): the paged attention uses torch ops", exc)
        return None
    if device.type != "cuda" and choice == "triton":
        if not envs.triton_interpreter():
            raise ValueError("attention 'triton' on the CPU runs only in Triton's interpreter "
                             "(TRITON_INTERPRET=1 before Triton is imported)")
    return paged_decode_attention


def load_model_for(args: Any, device: str) -> LoadedModel:
    """The engine's model on this path (``args``: EngineArgs)."""
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model

    return load_torch_model(args.model, seed=args.seed, device=torch_device(device),
                            dtype=model_dtype(args.model_dtype, device))


@dataclass
class StepHostTimes:
    """Where the host's time of the last step went before its sync (seconds; what a
    benchmark prints to show what a step's launch costs).  A decode step replayed from its
    graph fills none of them."""

    build_s: float = 0.0  # the step's indices built on the host and uploaded
    pieces_s: float = 0.0  # the piecewise graphs' replays (their pieces' calls without capture)
    between_s: float = 0.0  # everything else of the forward pass: between the pieces (each layer's
    # attention), or the whole eager forward pass
    head_s: float = 0.0  # lm_head over the sampled rows
    sample_s: float = 0.0  # the device sampling's launch (forward_sample on a GPU)


class TorchModelRunner:
    """Runs ``LlamaForCausalLM`` over the paged cache; see the module docstring."""

    # The ModelRunner figures (engine/runner.py), set by each step.
    last_layers_waited: int = 0
    last_gpu_wait_s: float = 0.0
    last_load_wait_gpu_s: float = 0.0
    last_step_replayed: bool = False

    def __init__(self, loaded: LoadedModel, block_size: int, device: str, attention: str = "auto",
                 fused_layers: bool = False, kv_cache_quant: Optional[str] = None) -> None:
        """``attention``: the paged attention's kernels, ``auto`` / ``triton`` / ``torch``
        (:func:`decode_kernel_for`); with Triton, the decode batch and short chunks after
        cached context run Triton kernels that read the blocks in place.  ``fused_layers``:
        fuse the model's decoder layers (``engine/transformers_runner/torch_fused.py``; kernels compiled on a GPU).
        The model is changed in place, for every runner over it.  ``kv_cache_quant``: the
        cache's format (``CacheConfig.kv_cache_quant``): None (the caches hold K/V in a float
        dtype), ``block_wise_fp8`` or ``block_wise_int8`` (``fp8_kv.py``); ValueError for any other."""
        import torch

        # The 8-bit cache's encoding (block_wise_fp8, block_wise_int8), None for a float cache.
        self.kv_quant: Optional[str] = kv_cache_quant if check_kv_cache_quant(kv_cache_quant) else None
        self._checked_caches: Optional[int] = None  # data_ptr of the last layer-0 key cache checked

        self.torch = torch
        self.loaded = loaded
        self.model = loaded.model
        self.block_size = block_size
        self.device = torch_device(device)
        self.on_gpu = self.device.type == "cuda"
        self.decode_kernel = decode_kernel_for(self.device, attention)
        if self.kv_quant == BLOCK_WISE_FP8 and self.decode_kernel is not None and self.on_gpu \
                and torch.cuda.get_device_capability(self.device) < (8, 9):
            # Triton converts E4M3 only on compute capability 8.9 and later (Ada, Hopper).
            cap = "%d.%d" % torch.cuda.get_device_capability(self.device)
            if attention == "triton":
                raise ValueError(f"attention 'triton' with an FP8 KV cache needs compute capability >= 8.9; "
                                 f"this GPU has {cap}")
            logger.warning("FP8 KV cache on a GPU of compute capability %s (< 8.9): the paged attention uses "
                           "torch ops, not the Triton kernels", cap)
            self.decode_kernel = None
        # The decode kernel prepared once per step for all its layers (the Triton kernel's).
        self.decode_launcher: Optional[Any] = None
        self.prefill_kernel: Optional[Any] = None
        self.prefill_kernel_max_tokens = 0
        if self.decode_kernel is not None:
            from fastdeploy_kvcache.engine.transformers_runner.triton_paged_attention import (
                PAGED_PREFILL_MAX_TOKENS,
                paged_decode_launcher,
                paged_prefill_attention,
            )

            self.decode_launcher = paged_decode_launcher
            self.prefill_kernel = paged_prefill_attention
            self.prefill_kernel_max_tokens = PAGED_PREFILL_MAX_TOKENS
        self.last_layers_waited = 0
        self.last_gpu_wait_s = 0.0  # host time the last step spent waiting for the device
        self.last_load_wait_gpu_s = 0.0  # device time its compute stream waited for loads
        # Pinned int64 buffers by use ("step": the step's indices, "sampling": its sampling
        # rows), each with the CUDA event after the last copy out of it.
        self._staging: dict[str, tuple[Any, Optional[Any]]] = {}
        self._pending_wait_events: Optional[list[tuple[Any, Any]]] = None
        self._arange: Any = torch.arange(0, device=self.device)
        self.decode_graphs: Optional[DecodeGraphs] = None  # enable_decode_graphs
        self.graph_replays = 0  # steps run through decode_graphs (replayed, or padded eagerly without capture)
        self.piecewise_graphs: Optional[PiecewiseGraphs] = None  # enable_piecewise_graphs
        self.piecewise_steps = 0  # steps run through piecewise_graphs (replayed, or its pieces called without capture)
        self.last_step_replayed = False
        self.last_host_times = StepHostTimes()
        register_paged_attention(self.model.config)
        self.fused_layers = 0
        if fused_layers:
            from fastdeploy_kvcache.engine.transformers_runner.torch_fused import fuse_decoder_layers

            self.fused_layers = fuse_decoder_layers(self.model, compile_kernels=self.on_gpu)
            logger.info("fused %d decoder layers (%s)", self.fused_layers,
                        "kernels compiled by torch.compile" if self.on_gpu else "eager elementwise pieces")

    @property
    def fp8_kv(self) -> bool:
        """The caches are 8-bit (either encoding: :attr:`kv_quant`)."""
        return self.kv_quant is not None

    # ------------------------------------------------------------------ CUDA graphs
    def enable_decode_graphs(self, kv_caches: Sequence[Sequence[Any]], max_num_seqs: int, max_model_len: int,
                             capture: Optional[bool] = None) -> bool:
        """Capture the decode-only step's CUDA graphs over ``kv_caches``
        (``engine/transformers_runner/decode_graphs.py``);
        True when later decode-only steps go through them.

        ``capture``: None captures on CUDA and, elsewhere, logs that steps stay eager;
        ``False`` (the CPU tests) runs the same padded static-buffer path eagerly instead of
        replaying.  Capture needs the Triton decode kernel (the padded rows' length-0 guard is
        the kernel's).  A capture that fails (a host sync in the forward pass, an op CUDA
        cannot capture) is logged once and every step then runs eagerly, for good.
        """
        if capture is None:
            capture = self.on_gpu
            if not capture:
                logger.warning("--use-cudagraph: no CUDA device (the model runs on the %s); every step runs eagerly",
                               self.device.type)
                return False
        elif capture and not self.on_gpu:
            raise ValueError("CUDA graphs need a CUDA device; the runner is on the CPU")
        if self.decode_kernel is None:
            logger.warning("--use-cudagraph: the decode attention is not the Triton kernel (Triton missing, or "
                           "attention 'torch'); every step runs eagerly")
            return False
        self._check_caches(kv_caches)
        graphs = DecodeGraphs(self.model, kv_caches, self.block_size, max_num_seqs, max_model_len,
                              self.decode_kernel, self.device, capture, kv_quant=self.kv_quant)
        if capture:
            if not self._captured(graphs, "every step runs eagerly"):
                return False
            logger.info("CUDA graphs: decode steps of %s seqs captured in %.1f s (tables of %d blocks); "
                        "%.1f MiB of device memory taken", ",".join(map(str, graphs.sizes)), graphs.capture_s,
                        graphs.width, graphs.pool_bytes / (1 << 20))
        self.decode_graphs = graphs
        return True

    def enable_piecewise_graphs(self, max_tokens: int, capture: Optional[bool] = None) -> bool:
        """Capture the pieces between attentions for steps of up to ``max_tokens`` tokens
        (``engine/transformers_runner/piecewise_graphs.py``); True when later steps the
        decode graphs do not take go through them.

        Needs fused layers (the pieces are the fused layers' halves); without them, a
        warning and eager steps.  ``capture`` as for :meth:`enable_decode_graphs`.  A capture
        that fails is logged once and those steps then run eagerly, for good.
        """
        if capture is None:
            capture = self.on_gpu
            if not capture:
                return False
        elif capture and not self.on_gpu:
            raise ValueError("CUDA graphs need a CUDA device; the runner is on the CPU")
        if not self.fused_layers or self.fused_layers != len(self.model.model.layers):
            logger.warning("--use-cudagraph: steps with prompt chunks run eagerly (piecewise graphs need every "
                           "decoder layer fused: --fused-layers on)")
            return False
        graphs = PiecewiseGraphs(self.model, max_tokens, self.device, capture)
        if capture:
            if not self._captured(graphs, "steps with prompt chunks run eagerly"):
                return False
            logger.info("CUDA graphs: %d pieces for steps of up to %d tokens (%d sizes) captured in %.1f s; "
                        "%.1f MiB of device memory taken", graphs.num_pieces, graphs.sizes[-1], len(graphs.sizes),
                        graphs.capture_s, graphs.pool_bytes / (1 << 20))
        self.piecewise_graphs = graphs
        return True

    def _captured(self, graphs: Any, otherwise: str) -> bool:
        """``graphs.capture_all()``; a failure (a host sync in the forward pass, an op CUDA
        cannot capture) releases them and logs once what runs eagerly instead: never a crash."""
        try:
            graphs.capture_all()
            return True
        except Exception as exc:  # noqa: BLE001 - any capture failure means eager, never a crash
            graphs.release()
            logger.warning("CUDA graph capture failed (%s, %s: %s); %s", type(graphs).__name__,
                           type(exc).__name__, exc, otherwise)
            try:
                self.torch.cuda.synchronize()
            except Exception:  # noqa: BLE001
                logger.debug("synchronize after the failed capture raised", exc_info=True)
            return False

    # ------------------------------------------------------------------ indices
    def _upload(self, host: np.ndarray, use: str = "step") -> Any:
        """One int64 host array to the device: through a reused pinned buffer on a GPU.

        The buffer is written again only once the last step's copy out of it has completed
        (its event; normally long done, since a step that samples ends with a host sync, but
        a step that only prefills does not).  Each ``use`` has its own buffer, so a second
        upload in the same step does not wait for the first one's copy.
        """
        torch = self.torch
        src = torch.from_numpy(host)
        if not self.on_gpu:
            return src
        buf, done = self._staging.get(use, (None, None))
        if done is not None:
            done.synchronize()
        if buf is None or buf.numel() < host.size:
            # The old buffer may still be read by a copy: torch's pinned allocator keeps it
            # until that copy's stream has passed it.
            buf = torch.empty(max(4096, 2 * host.size), dtype=torch.int64, pin_memory=True)
        part = buf[: host.size]
        part.copy_(src)
        out = part.to(self.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        self._staging[use] = (buf, done)
        return out

    def _check_caches(self, kv_caches: Sequence[Sequence[Any]]) -> None:
        """ValueError when the caches are not of the runner's format (FP8 lanes with
        ``kv_cache_quant``, float K/V without); checked once per set of caches."""
        if not kv_caches:
            raise ValueError("kv_caches: no layers")
        ptr = int(kv_caches[0][0].data_ptr())
        if ptr == self._checked_caches:
            return
        for layer, caches in enumerate(kv_caches):
            if self.fp8_kv:
                check_fp8_layer_caches(caches, layer)
            elif caches[0].dtype == self.torch.uint8:
                raise ValueError(f"layer {layer}: uint8 caches without kv_cache_quant; the runner was built for "
                                 "K/V in a float dtype (kv_cache_quant 'block_wise_fp8' serves uint8 caches)")
        self._checked_caches = ptr

    def _positions(self, length: int) -> Any:
        if self._arange.numel() < length:
            self._arange = self.torch.arange(max(length, 2 * self._arange.numel()), device=self.device)
        return self._arange[:length]

    def _build(self, seqs: Sequence[ScheduledSeq], kv_caches: Sequence[Sequence[Any]],
               layer_done: Optional[Any]) -> tuple[TorchStep, Any, Any, Any, list[int]]:
        """The step's TorchStep, input ids, positions and sampled rows (device), and the row order."""
        self._check_caches(kv_caches)
        bs = self.block_size
        # One-token seqs (decodes) first: the attention batches that leading run.  The host
        # arrays are built with numpy per group of seqs, not per token (a 2k-token chunk's
        # ids one by one cost the step about a millisecond of host time).
        dec = [i for i, s in enumerate(seqs) if len(s.token_ids) == 1]
        rest = [i for i, s in enumerate(seqs) if len(s.token_ids) != 1]
        num_dec = len(dec)
        ids: list[np.ndarray] = []
        pos: list[np.ndarray] = []
        slot_blk: list[np.ndarray] = []
        picked: list[tuple[int, int]] = []  # (index in seqs, row)
        width = 0
        table = lens = None
        if num_dec:
            dseqs = [seqs[i] for i in dec]
            ctx = np.fromiter((s.context_len for s in dseqs), dtype=np.int64, count=num_dec)
            lens = ctx + 1
            width = int(-(-int(lens.max()) // bs))
            nbs = (-(-lens // bs)).tolist()
            # Padding past each seq's blocks: its first block (read, then masked out).
            table = np.array([list(s.block_ids[:nb]) + [s.block_ids[0]] * (width - nb) for s, nb in zip(dseqs, nbs)],
                             dtype=np.int64).reshape(num_dec, width)
            ids.append(np.fromiter((s.token_ids[0] for s in dseqs), dtype=np.int64, count=num_dec))
            pos.append(ctx)
            slot_blk.append(table[np.arange(num_dec), ctx // bs])
            picked.extend((i, r) for r, i in enumerate(dec) if seqs[i].wants_logits)
        chunks: list[tuple[int, int, int, Any]] = []
        start = num_dec
        for i in rest:
            s = seqs[i]
            n, c = len(s.token_ids), s.context_len
            ids.append(np.fromiter(s.token_ids, dtype=np.int64, count=n))
            p = np.arange(c, c + n, dtype=np.int64)
            pos.append(p)
            blocks = np.asarray(s.block_ids, dtype=np.int64)
            slot_blk.append(blocks[p // bs])
            chunks.append((start, n, c, blocks))
            if s.wants_logits:
                picked.append((i, start + n - 1))
            start += n
        positions = np.concatenate(pos)
        parts = [np.concatenate(ids), positions, np.concatenate(slot_blk), positions % bs]
        if num_dec:
            parts += [table.ravel(), lens]
        tables = []
        for _, n, c, blocks in chunks:
            if c > 0:
                tables.append(blocks[: -(-(c + n) // bs)])
                parts.append(tables[-1])
            else:
                tables.append(None)
        rows = [row for _, row in sorted(picked)]
        parts.append(np.asarray(rows, dtype=np.int64))
        # One upload, then every part a view of it (one split, not a slice per part).
        views = self._upload(np.concatenate(parts)).split([a.size for a in parts])
        step = TorchStep(kv_caches, bs, views[2], views[3], num_dec, layer_done=layer_done,
                         wait_events=[] if layer_done is not None and self.on_gpu else None,
                         kv_quant=self.kv_quant)
        k = 4
        if num_dec:
            step.decode_table = views[4].view(num_dec, width)
            step.decode_lens = views[5]
            step.decode_kernel = self.decode_kernel
            step.decode_launcher = self.decode_launcher
            if self.decode_kernel is None:
                step.decode_mask = decode_mask(step.decode_lens, width, bs, self._positions(width * bs))
            k = 6
        for (a, n, c, _), tbl in zip(chunks, tables):
            chunk = PrefillChunk(a, n, c)
            if tbl is not None:
                chunk.table = views[k]
                k += 1
                if n <= self.prefill_kernel_max_tokens:
                    chunk.kernel = self.prefill_kernel
            step.prefills.append(chunk)
        return step, views[0], views[1], views[-1], rows

    def _to_host(self, logits: Any) -> np.ndarray:
        """The step's logits as a numpy array: on a GPU through pinned memory, at link speed.

        A pageable destination makes CUDA stage the copy through its own pinned bounce
        buffer in small pieces (for [32, 128256] float32, 16 MB, tens of times slower than a
        pinned copy).  Each step takes its destination from torch's caching pinned-memory
        allocator rather than from one buffer of the runner's: the returned array keeps its
        tensor alive, so the block goes back to the allocator (and to a later step) only
        once the caller has dropped the array.  A kept array is never overwritten, with no
        copy on the host, and in steady state the allocator hands the same few blocks round
        (no cudaHostAlloc per step).
        """
        torch = self.torch
        if not logits.is_cuda:
            return logits.numpy()
        host = torch.empty(logits.shape, dtype=logits.dtype, pin_memory=True)
        host.copy_(logits, non_blocking=True)
        torch.cuda.current_stream().synchronize()
        return host.numpy()

    # ------------------------------------------------------------------ forward
    def forward(self, seqs: list[ScheduledSeq], kv_caches: Sequence[Sequence[Any]],
                layer_done: Optional[Any]) -> np.ndarray:
        """Run the step; returns float32 logits, one row per seq with ``wants_logits``, in ``seqs`` order."""
        logits = self._forward_logits(seqs, kv_caches, layer_done)
        if logits is None:
            return np.zeros((0, self.loaded.vocab_size), dtype=np.float32)
        return self._sync_to_host(logits)

    def forward_sample(self, seqs: list[ScheduledSeq], kv_caches: Sequence[Sequence[Any]],
                       layer_done: Optional[Any], sampling: StepSampling) -> np.ndarray:
        """Run the step and pick each sampling row's token where the logits are: on a GPU
        the step's one host sync reads back the int64 ids, not ``[rows, vocab]`` floats."""
        logits = self._forward_logits(seqs, kv_caches, layer_done)
        if logits is None:
            return np.zeros(0, dtype=np.int64)
        if not logits.is_cuda:
            return sampling.sample_host(logits.numpy())
        t0 = time.perf_counter()
        # An all-greedy step uploads nothing: its rows take the argmax.
        packed = None if sampling.all_greedy else self._upload(sampling.packed(), "sampling")
        ids = sample_on_device(self.torch, logits, sampling, packed)
        self.last_host_times.sample_s = time.perf_counter() - t0
        return self._sync_to_host(ids)

    def _sync_to_host(self, out: Any) -> np.ndarray:
        """The step's one host sync: ``out`` read back, the wait timed, the load waits summed."""
        t_launched = time.perf_counter()
        host = self._to_host(out)
        self.last_gpu_wait_s = time.perf_counter() - t_launched
        events, self._pending_wait_events = self._pending_wait_events, None
        if events:
            self.last_load_wait_gpu_s = sum(a.elapsed_time(b) for a, b in events) / 1e3
        return host

    def _forward_logits(self, seqs: list[ScheduledSeq], kv_caches: Sequence[Sequence[Any]],
                        layer_done: Optional[Any]) -> Optional[Any]:
        """The step's float32 logits on the device (None when no seq samples), launched and
        not waited for."""
        torch = self.torch
        self.last_layers_waited = 0
        self.last_gpu_wait_s = 0.0
        self.last_load_wait_gpu_s = 0.0
        self.last_step_replayed = False
        self._pending_wait_events = None
        bucket = self._graph_bucket(seqs, kv_caches)
        if bucket is not None:
            return self._forward_graph(bucket, seqs, layer_done)
        pieces = self._piecewise_bucket(seqs)
        times = self.last_host_times = StepHostTimes()
        t0 = time.perf_counter()
        with torch.inference_mode():
            step, input_ids, position_ids, rows, row_list = self._build(seqs, kv_caches, layer_done)
            t1 = time.perf_counter()
            times.build_s = t1 - t0
            with step_context(step):
                try:
                    if pieces is not None:
                        assert self.piecewise_graphs is not None
                        hidden = self.piecewise_graphs.run(pieces, input_ids, position_ids, _binder(step))
                        self.piecewise_steps += 1
                        self.last_step_replayed = bool(pieces.graphs)
                        times.pieces_s = self.piecewise_graphs.last_pieces_s
                    else:
                        hidden = self.model.model(input_ids=input_ids[None], position_ids=position_ids[None],
                                                  use_cache=False).last_hidden_state[0]
                finally:
                    self.last_layers_waited = step.layers_waited
            t2 = time.perf_counter()
            times.between_s = t2 - t1 - times.pieces_s
            if step.wait_events:
                # Their times can be read only once the step's sync has passed them.
                self._pending_wait_events = step.wait_events
            if not row_list:
                return None
            logits = self.model.lm_head(hidden.index_select(0, rows)).float()
            times.head_s = time.perf_counter() - t2
            return logits

    def _piecewise_bucket(self, seqs: Sequence[ScheduledSeq]) -> Optional[TokenBucket]:
        """The piecewise graphs' size for a step the decode graphs did not take (None: eager)."""
        graphs = self.piecewise_graphs
        if graphs is None or not seqs:
            return None
        return graphs.bucket_for(sum(len(s.token_ids) for s in seqs))

    # ------------------------------------------------------------------ graph path
    def _graph_bucket(self, seqs: Sequence[ScheduledSeq],
                      kv_caches: Sequence[Sequence[Any]]) -> Optional[GraphBucket]:
        """The graph a step replays: only a decode-only step (every seq one token) over the
        caches the graphs were captured on that fits a captured batch size and
        ``max_model_len``'s table; None runs it eagerly."""
        graphs = self.decode_graphs
        if graphs is None or not seqs or any(len(s.token_ids) != 1 for s in seqs):
            return None
        if int(kv_caches[0][0].data_ptr()) != graphs.cache_ptr:
            return None
        if max(s.context_len for s in seqs) + 1 > graphs.width * self.block_size:
            return None
        return graphs.bucket_for(len(seqs))

    def _forward_graph(self, bucket: GraphBucket, seqs: Sequence[ScheduledSeq],
                       layer_done: Optional[Any]) -> Optional[Any]:
        """A decode-only step through its graph: the inputs into the static buffers (one
        host-to-device copy, then two device copies), a replay; the sampling rows' logits
        (a view of the graph's output, valid until the next replay), or None."""
        graphs = self.decode_graphs
        assert graphs is not None
        bs, b, n = self.block_size, bucket.size, len(seqs)
        if layer_done is not None:
            # NOTE: a graph cannot wait per layer (the events are new each step), so the compute
            # stream waits for every layer's load before the replay (a GPU-side wait per layer,
            # as in the eager path, only all of them up front).
            # A decode-only step rarely loads at all (loads come with a prefix hit's prompt
            # chunk), so the lost overlap of load and compute costs next to nothing.
            for layer in range(len(bucket.step.kv_caches)):
                layer_done.wait_for_layer(layer)
            self.last_layers_waited = len(bucket.step.kv_caches)
        lens = np.fromiter((s.context_len + 1 for s in seqs), dtype=np.int64, count=n)
        head = np.zeros((3, b), dtype=np.int64)
        head[0, :n] = [int(s.token_ids[0]) for s in seqs]
        head[1, :n] = lens - 1
        head[2, :n] = lens
        width = int(-(-lens.max() // bs))
        table = np.empty((n, width), dtype=np.int64)
        for r, s in enumerate(seqs):
            nb = -(-int(lens[r]) // bs)
            table[r, :nb] = s.block_ids[:nb]
            table[r, nb:] = s.block_ids[0]
        rows = [r for r, s in enumerate(seqs) if s.wants_logits]
        with self.torch.inference_mode():
            dev = self._upload(np.concatenate([head.ravel(), table.ravel(), np.asarray(rows, dtype=np.int64)]))
            graphs.load(bucket, dev[:3 * b].view(3, b), dev[3 * b:3 * b + n * width].view(n, width))
            logits = graphs.run(bucket)
            self.graph_replays += 1
            self.last_step_replayed = True
            if not rows:
                return None
            return logits[:n] if len(rows) == n else logits.index_select(0, dev[3 * b + n * width:])


def _binder(step: TorchStep) -> Any:
    """The piecewise run's ``bind``: the step's row views built once, then each layer's
    attention over them (``torch_attention.attend_layer``)."""
    def bind(q: Any, k: Any, v: Any, out: Any) -> Any:
        rows = step_rows(step, q, k, v, out)
        return lambda layer_idx, scale: attend_layer(step, rows, layer_idx, scale)

    return bind
