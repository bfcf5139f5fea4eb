"""``LLMEngine``: continuous batching on one engine thread, over the tiered KV cache or the baseline.

One step of the loop:

1. **Inbox.** New requests and aborts arrive through a queue (``add_request`` and ``abort``
   are thread-safe and never wait for a step); with a storage tier, a new request's storage
   prefetch starts as it is queued.
2. **Schedule** under ``--max-num-batched-tokens``: running requests first (decodes, or the
   next chunk of a prefill), then admissions while there is budget and fewer than
   ``--max-num-seqs`` run.  Admission is ``match_prefix`` then ``ensure_resident``; a waiting
   request whose next uncached block another running request is computing is held (in-batch
   prefix sharing, ``core/prefix_sharing.py``) and the next one is tried.  When blocks run out,
   the most recently admitted request is preempted (its computed blocks stay cached, so it
   resumes cheaply) and requeued at the front.
3. **Batch and copies.** ``BatchRequest`` of the scheduled requests plus the pending backups;
   ``submit_swap_tasks`` starts this step's device->host and host->device copies.
4. **Forward.** All scheduled tokens as one flattened sequence; the paged attention waits
   per layer for the loads.  A failed load raises inside the forward: the step is dropped,
   the copies are drained and handed to ``complete_swap``, and the affected requests
   recompute from their lowered ``num_computed_tokens`` in the next step.
5. **Advance** ``num_computed_tokens``, hand finished copies to ``complete_swap``, make the
   prompt blocks a prefill completed reusable (``commit``), then sample
   for the requests whose tokens are all computed (not the ones a failed load rewound).
6. **Finish** on eos / stop token / stop string / max_tokens / max_model_len:
   ``request_finish`` caches the request's blocks.

Nothing in one request (bad output callback, a sampling error) stops the thread: that
request finishes with ``finish_reason="error"``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import itertools
import logging
import queue
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np

from fastdeploy_kvcache import envs
from fastdeploy_kvcache.config import AUTO_DTYPE, CacheConfig
from fastdeploy_kvcache.core.block_pool import NoFreeBlocksError
from fastdeploy_kvcache.core.prefix_sharing import PrefixSharing
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.engine.args import EngineArgs
from fastdeploy_kvcache.engine.kv_event_stream import kv_cache_blocks, make_kv_event_stream
from fastdeploy_kvcache.engine.kv_pool import KVPool, ManagedKVPool, PlainKVPool
from fastdeploy_kvcache.engine.model_loader import LoadedModel, load_model
from fastdeploy_kvcache.engine.model_runner import ModelRunner, ScheduledSeq
from fastdeploy_kvcache.engine.outputs import RequestOutput
from fastdeploy_kvcache.engine.request_checks import RequestRejected, check_fits_device_pool, check_prompt
from fastdeploy_kvcache.engine.request_timing import RecentTimings, request_timing
from fastdeploy_kvcache.engine.sampling import RequestSampler, SamplingParams, StepSampling
from fastdeploy_kvcache.engine.step_timing import StepTimes
from fastdeploy_kvcache.engine.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestOutput", "RequestRejected", "SamplingParams", "EngineArgs"]

OutputCallback = Callable[[RequestOutput], None]

# While idle with copies or storage jobs in flight, the loop polls for them between these
# bounds (doubling), so a new request is picked up at once and finished copies soon after.
_IDLE_POLL_MIN_S = 0.0005
_IDLE_POLL_MAX_S = 0.01
# While requests run, the stats snapshot (get_stats) is rebuilt at most this often: building
# it is tens of microseconds, a share of a short GPU step.  An idle engine, a step by hand
# (step()) and the step that runs the last request refresh it at once.
_STATS_PERIOD_S = 0.05


class _EngineRequest:
    """A request as the engine tracks it: the cache fields (``req``) plus generation state."""

    def __init__(
        self, req: Request, params: SamplingParams, on_output: OutputCallback, sampler: RequestSampler,
        detok: IncrementalDetokenizer, arrival_time: float,
    ) -> None:
        self.req = req
        self.params = params
        self.on_output = on_output
        self.sampler = sampler
        self.detok = detok
        self.arrival_time = arrival_time
        self.first_token_time: Optional[float] = None
        self.cached_device = 0
        self.cached_host = 0
        self.cached_storage = 0  # host hits that this request's storage prefetch brought in
        self.admitted = False  # got its first blocks at least once
        self.admitted_time: Optional[float] = None  # time.monotonic() of that first admission
        self.fetch: Optional[dict[str, Any]] = None  # the storage fetch it waited for (StorageTier.fetch_timing)
        self.first_step: Optional[dict[str, Any]] = None  # the admitting step's phases (request_timing.py)
        self.text_sent = 0  # chars of detok.text already emitted
        self.stop_at: Optional[int] = None  # where a stop string starts in detok.text
        self.finished = False
        self.max_stop_len = max((len(s) for s in params.stop), default=0)
        self.kv_transfer: Optional[Any] = None  # PD decode: engine/pd.py KVTransferParams

    @property
    def request_id(self) -> str:
        return self.req.request_id

    @property
    def num_cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + self.cached_storage


def wants_gpu(device: str) -> bool:
    """Whether ``--device`` puts the model on the GPU; ValueError when it asks for one that is not there."""
    from fastdeploy_kvcache.engine.dependency_notices import import_paddle

    paddle = import_paddle()
    has_cuda = paddle.is_compiled_with_cuda()
    if device == "gpu" and not has_cuda:
        raise ValueError(f"device: 'gpu' asked for, but this Paddle ({paddle.__version__}) is a CPU build "
                         "(no CUDA); use --device cpu or auto")
    return device == "gpu" or (device == "auto" and has_cuda and paddle.device.cuda.device_count() > 0)


class LLMEngine:
    """Continuous-batching engine over a paddleformers Llama (see the module docstring)."""

    def __init__(self, args: EngineArgs, *, loaded_model: Optional[LoadedModel] = None) -> None:
        args.validate()
        self.args = args
        worker_backend = "paddle"
        if args.model_impl == "transformers":
            # torch only (engine/torch_runner.py): no Paddle import on this path.
            from fastdeploy_kvcache.engine import torch_runner

            self.device = torch_runner.select_device(args.device)
            worker_backend = "torch"
            self.loaded = loaded_model or torch_runner.load_model_for(args, self.device)
        else:
            from fastdeploy_kvcache.engine.dependency_notices import import_paddle

            paddle = import_paddle()
            use_gpu = wants_gpu(args.device)
            paddle.set_device("gpu:0" if use_gpu else "cpu")
            self.device = "gpu" if use_gpu else "cpu"
            self.loaded = loaded_model or load_model(args.model, args.model_cache_dir or "", seed=args.seed, device_is_gpu=use_gpu)
        self.tokenizer = self.loaded.tokenizer
        built_in = args.model in ("smollm2-135m-instruct", "tiny-llama-random")
        self.model_name = args.model if built_in else self.loaded.name
        if args.model_cache_dir and loaded_model is None:
            self._publish_tokenizer(args.model_cache_dir)
        if args.gpu_memory_utilization is not None and self.device != "gpu":
            logger.info("--gpu-memory-utilization %g: not used on the CPU (the device pool is capped at "
                        "--kv-cache-memory-gib)", args.gpu_memory_utilization)
        # The device's defaults; a max_model_len past the model's positions is a ValueError.
        args = self.args = args.resolved(self.device, self.loaded.max_position_embeddings)
        self.max_model_len: int = args.max_model_len
        self.use_v1 = envs.enable_v1_kvcache_manager()
        # The runner comes before the pool: on a GPU it runs the step that sizes the pool.
        self.cache_config = self._model_cache_config()
        if args.model_impl == "transformers":
            fused = args.fused_layers == "on" or (args.fused_layers == "auto" and self.device == "gpu")
            self.runner: Any = torch_runner.TorchModelRunner(self.loaded, self.cache_config.block_size, self.device,
                                                             fused_layers=fused)
        else:
            self.runner = ModelRunner(self.loaded, self.cache_config.block_size, self.device)
        self.cache_config.num_gpu_blocks = self._device_pool_blocks()
        storage = getattr(args, "storage", None)
        if self.use_v1 and storage is not None and storage.enabled:
            from fastdeploy_kvcache.engine.storage_pool import StorageKVPool, model_fingerprint

            self.pool: KVPool = StorageKVPool(self.cache_config, storage, self.model_name,
                                              model_fingerprint(args.model, args.seed), backend=worker_backend,
                                              arrival_prefetch_blocks=args.arrival_prefetch_host_blocks)
        elif self.use_v1:
            self.pool = ManagedKVPool(self.cache_config, backend=worker_backend)
        else:
            self.pool = PlainKVPool(self.cache_config, backend=worker_backend)
            logger.info(
                "ENABLE_V1_KVCACHE_MANAGER=0: plain device block allocator, no reuse between requests; "
                "the cache flags (--swap-space %s, --write-policy %s, --write-through-threshold %s, "
                "prefix caching %s, output caching %s) are inactive",
                args.cache.swap_space, args.cache.write_policy, args.cache.write_through_threshold,
                args.cache.enable_prefix_caching, args.cache.enable_output_caching,
            )
        if args.model_impl == "transformers" and args.use_cudagraph:
            # Once the pool exists (the graphs hold its caches' addresses), before serving.
            self.runner.enable_decode_graphs(self.pool.layer_caches, args.max_num_seqs, self.max_model_len)
        # PD disaggregation (--splitwise-role prefill|decode): engine/pd.py; None when mixed.
        from fastdeploy_kvcache.engine.pd import make_pd_coordinator

        try:
            self.pd = make_pd_coordinator(self)
            # KV cache events (--kv-events-config): None when off.
            self.kv_events = make_kv_event_stream(getattr(args, "kv_events_config", None), self.pool)
        except BaseException:
            if getattr(self, "pd", None) is not None:
                self.pd.close()
            self.pool.close()
            raise
        self._seed_rng = np.random.default_rng(args.seed)
        # In-batch prefix sharing: only where blocks are reused at all.
        share = self.use_v1 and self.cache_config.enable_prefix_caching and self.pd is None
        self.sharing = PrefixSharing(self.cache_config.block_size, args.max_prefix_hold_s if share else 0.0)

        self._inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _live_ids and the stats snapshot
        self._live_ids: set[str] = set()
        self.waiting: collections.deque[_EngineRequest] = collections.deque()
        # Arrivals whose storage lookup waits until the next two steps may admit them
        # (_prefetch_arrivals).
        self._later_arrivals: list[_EngineRequest] = []
        self.running: list[_EngineRequest] = []
        self._requests: dict[str, _EngineRequest] = {}
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()
        self._step_count = itertools.count()
        self._output_flush_hooks: list[Callable[[], None]] = []
        self._counters = {"num_steps": 0, "num_preemptions": 0, "num_failed_load_steps": 0,
                          "prompt_tokens_computed": 0, "output_tokens": 0, "num_finished": 0,
                          "steps_with_loads": 0, "layer_waits": 0, "cudagraph_replays": 0}
        self._stats_snapshot: dict[str, Any] = {}
        self._stats_time = 0.0  # time.monotonic() of the snapshot
        self.step_times = StepTimes()
        self.request_timings = RecentTimings()
        self._refresh_stats()
        logger.info(
            "LLMEngine: model %s on %s, %d layers, KV %s, %d device blocks of %d tokens, %d host blocks, v1 manager %s",
            self.model_name, self.device, self.loaded.num_layers, self.cache_config.dtype,
            self.cache_config.num_gpu_blocks, self.cache_config.block_size,
            self.cache_config.host_block_count if self.use_v1 else 0, "on" if self.use_v1 else "off",
        )

    # ------------------------------------------------------------------ setup
    def _model_cache_config(self) -> CacheConfig:
        """``args.cache`` with the model's shape and dtype filled in: the one CacheConfig the
        pool, manager and runner read (its device block count is set next)."""
        a, lm = self.args, self.loaded
        dtype = lm.dtype if a.cache.dtype == AUTO_DTYPE else a.cache.dtype
        return dataclasses.replace(a.cache, num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads,
                                   head_dim=lm.head_dim, dtype=dtype)

    def _device_pool_blocks(self) -> int:
        """The device pool's size (``engine/kv_sizing.py``): the override, the GiB cap, or on a
        GPU with the transformers runner what ``--gpu-memory-utilization`` leaves after a
        profiled worst-case step."""
        from fastdeploy_kvcache.engine import kv_sizing

        a, config = self.args, self.cache_config
        per_seq = kv_sizing.blocks_per_sequence(self.max_model_len, config.block_size)
        if config.num_gpu_blocks:
            if config.num_gpu_blocks < per_seq:
                logger.warning("%d device blocks hold fewer than max_model_len=%d tokens: long requests will fail",
                               config.num_gpu_blocks, self.max_model_len)
            return config.num_gpu_blocks
        sizes = dict(bytes_per_block=config.bytes_per_block, block_size=config.block_size,
                     max_model_len=self.max_model_len, max_num_seqs=a.max_num_seqs)
        if a.kv_cache_memory_gib is not None or self.device != "gpu" or a.model_impl != "transformers":
            gib = kv_sizing.CPU_KV_CACHE_MEMORY_GIB if a.kv_cache_memory_gib is None else a.kv_cache_memory_gib
            return kv_sizing.device_pool_blocks(kv_cache_memory_gib=gib, **sizes)
        from fastdeploy_kvcache.engine.decode_graphs import graph_batch_sizes
        from fastdeploy_kvcache.engine.gpu_memory import profile_device_memory

        graphs = (kv_sizing.graph_reserve_bytes(graph_batch_sizes(a.max_num_seqs), self.loaded.vocab_size)
                  if a.use_cudagraph else 0)
        mem = profile_device_memory(self.runner, config, min(a.max_num_batched_tokens, self.max_model_len),
                                    a.max_num_seqs, graphs)
        budget = kv_sizing.kv_budget_bytes(mem, a.gpu_memory_utilization)
        blocks = kv_sizing.device_pool_blocks(kv_budget=budget, **sizes)
        logger.info("--gpu-memory-utilization %g: %d device blocks (%.2f GiB of KV)", a.gpu_memory_utilization,
                    blocks, blocks * config.bytes_per_block / (1 << 30))
        return blocks

    # ------------------------------------------------------------------ public API
    def _publish_tokenizer(self, cache_dir: str) -> None:
        """The model's tokenizer where clients can load it (engine/tokenizer.py)."""
        from fastdeploy_kvcache.engine.tokenizer import publish_tokenizer

        try:
            path = publish_tokenizer(self.tokenizer, cache_dir, self.model_name, self.loaded.max_position_embeddings)
        except OSError as exc:
            logger.warning("could not save the tokenizer for clients under %s: %s", cache_dir, exc)
            return
        logger.info("tokenizer for clients: %s", path)

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="fdkv-engine", daemon=True)
        self._thread.start()

    def step(self) -> None:
        """Run one engine step on the calling thread: take the queued requests and aborts,
        schedule and run one forward pass, refresh the stats.

        For a caller that drives the engine by hand (a test that must see the state between
        two steps) before :meth:`start`; the engine thread does the same in its loop.
        """
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("step(): the engine thread is running; step by hand only before start()")
        if self._stop.is_set():
            raise RuntimeError("step(): the engine is shut down")
        self._drain_inbox()
        self._step()
        self._flush_outputs()
        self._refresh_stats()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the thread, abort what is left, drain copies, let the pool write what it owes
        (the storage tier's puts) and free the caches, all within ``timeout_s`` (idempotent).

        The server passes what is left of its grace period (``--graceful-shutdown-timeout``).
        """
        if self._closed:
            return
        deadline = time.monotonic() + timeout_s
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
            if self._thread.is_alive():
                logger.error("engine thread did not stop within %.1f s", timeout_s)
                return
        self._thread = None
        self._drain_inbox()
        for er in list(self.running) + list(self.waiting):
            self._finish(er, "abort")
        self._flush_outputs()
        try:
            self.pool.complete_finished(wait=True)
        except Exception:  # noqa: BLE001 - shutting down anyway
            logger.warning("draining copies at shutdown failed", exc_info=True)
        self._closed = True
        if self.kv_events is not None:
            self.kv_events.close()
        if self.pd is not None:
            self.pd.close()
        self.pool.close(timeout_s=max(0.0, deadline - time.monotonic()))

    def add_request(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
        on_output: OutputCallback, kv_transfer: Optional[Any] = None,
    ) -> None:
        """Queue a request; raises ValueError (nothing queued) for bad input or a duplicate id.

        ``kv_transfer``: a decode server's ``kv_transfer_params`` (engine/pd.py).  Errors about
        the prompt or its fit are :class:`RequestRejected` (``param``, ``code``).
        """
        self.add_requests([(request_id, prompt_token_ids, params, on_output, kv_transfer)])

    def add_requests(self, requests: Sequence[tuple[str, list[int], SamplingParams, OutputCallback,
                                                    Optional[Any]]]) -> None:
        """Queue several requests, all or none: every one is checked before any is queued.

        Each item is ``(request_id, prompt_token_ids, params, on_output, kv_transfer)``.  This is
        the one place a prompt is checked (``engine/request_checks.py``); requests that share
        one prompt list (the choices of ``n > 1``) have it checked once.
        """
        if self._stop.is_set():
            raise RuntimeError("the engine is shut down")
        vocab = self.loaded.vocab_size
        checked_prompts: set[int] = set()
        ready: list[tuple[str, list[int], SamplingParams, OutputCallback, Any]] = []
        ids_seen: set[str] = set()
        for request_id, prompt_token_ids, params, on_output, kv_transfer in requests:
            if not isinstance(request_id, str) or not request_id:
                raise ValueError(f"request_id: must be a non-empty string, got {request_id!r}")
            if request_id in ids_seen:
                raise ValueError(f"request_id: {request_id!r} is already in use")
            ids_seen.add(request_id)
            if not isinstance(params, SamplingParams):
                raise ValueError(f"params: must be a SamplingParams, got {type(params).__name__}")
            if not callable(on_output):
                raise ValueError("on_output: must be callable")
            if id(prompt_token_ids) not in checked_prompts:
                check_prompt(prompt_token_ids, vocab, self.max_model_len)
                checked_prompts.add(id(prompt_token_ids))
            params.validate(vocab_size=vocab)
            pd_params = None
            if kv_transfer is not None:
                if self.pd is None:
                    raise ValueError("kv_transfer_params: only a --splitwise-role decode server takes them")
                pd_params = self.pd.check_request(kv_transfer)
            check_fits_device_pool(len(prompt_token_ids), params.max_tokens, self.max_model_len,
                                   self.cache_config.block_size, self.cache_config.num_gpu_blocks)
            ready.append((request_id, prompt_token_ids, params, on_output, pd_params))
        with self._lock:
            in_use = [rid for rid, *_ in ready if rid in self._live_ids]
            if in_use:
                raise ValueError(f"request_id: {in_use[0]!r} is already in use")
            self._live_ids.update(rid for rid, *_ in ready)
            self._idle.clear()
        for request_id, prompt_token_ids, params, on_output, pd_params in ready:
            req = Request(request_id, [int(t) for t in prompt_token_ids])
            seed = int(self._seed_rng.integers(0, 2**63 - 1))
            er = _EngineRequest(req, params, on_output, RequestSampler(params, seed),
                                IncrementalDetokenizer(self.tokenizer), time.monotonic())
            er.kv_transfer = pd_params
            self._inbox.put(("add", er))
        self._wake.set()

    def add_output_flush_hook(self, hook: Callable[[], None]) -> None:
        """Call ``hook()`` on the engine thread where the outputs emitted so far should go to
        their consumer: as each forward pass starts (the previous step's outputs), before the
        engine waits for anything else, when no request is left running, and at shutdown.

        For a consumer that queues the ``on_output`` calls and wakes its reader once per
        burst (the server's ``LoopHandoff``) instead of once per output.  Add it before the
        requests whose outputs it flushes.  A hook that raises is logged and the engine goes on.
        """
        self._output_flush_hooks.append(hook)

    def _flush_outputs(self) -> None:
        for hook in self._output_flush_hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a consumer's bug must not stop the engine
                logger.exception("output flush hook %r failed", hook)

    def abort(self, request_id: str) -> None:
        """Stop a request at the next step; its blocks are freed and it finishes with "abort"."""
        self._inbox.put(("abort", request_id))
        self._wake.set()

    def storage_health(self) -> Optional[dict[str, Any]]:
        """The storage tier's state right now (None without one); safe from any thread."""
        health = getattr(self.pool, "storage_health", None)
        return health() if health is not None else None

    def get_stats(self) -> dict[str, Any]:
        """A snapshot the engine thread refreshes (safe from any thread): at most every 50 ms while
        requests run, at once when the last one finishes or the engine is idle, after a step()."""
        with self._lock:
            return dict(self._stats_snapshot)

    def kv_cache_blocks(self, timeout_s: float = 30.0) -> dict[str, Any]:
        """What the cache holds per medium, as KV cache events name it (any thread).

        ``{"block_size", "mediums": {medium: sorted event hashes}, "next_seq"}``: after the
        events up to ``next_seq - 1`` (None when events are off), a subscriber's view of this
        instance equals ``mediums``.  Runs on the engine thread, between two steps, after
        publishing that step's events.  O(cache size): a debugging and testing view.
        """

        def view() -> dict[str, Any]:
            self._flush_kv_events()
            return {
                "block_size": self.cache_config.block_size,
                "mediums": kv_cache_blocks(self.pool),
                "next_seq": self.kv_events.publisher.stats()["next_seq"] if self.kv_events is not None else None,
            }

        return self._call_on_engine_thread(view, timeout_s)

    def _call_on_engine_thread(self, fn: Callable[[], Any], timeout_s: float) -> Any:
        """Run ``fn`` on the engine thread between two steps; its result (or exception)."""
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the engine thread is not running")
        future: "concurrent.futures.Future[Any]" = concurrent.futures.Future()
        self._inbox.put(("call", (fn, future)))
        self._wake.set()
        return future.result(timeout_s)

    def _flush_kv_events(self) -> None:
        """Hand this step's KV cache events to the publisher (never waits)."""
        if self.kv_events is not None:
            self.kv_events.flush()

    def wait_idle(self, timeout_s: float = 60.0) -> bool:
        """True once no request is running or waiting and no copy is in flight."""
        return self._idle.wait(timeout_s)

    # ------------------------------------------------------------------ loop
    def _loop(self) -> None:
        logger.debug("engine thread started")
        poll_s = _IDLE_POLL_MIN_S
        while not self._stop.is_set():
            try:
                self._drain_inbox()
                if not self.running:
                    self._flush_outputs()  # aborts, before any idle wait below; else the step flushes
                if not self.running and not self.waiting:
                    if self.pool.copies_in_flight:
                        # NOTE: poll, never drain, while idle: a request arriving now would
                        # otherwise wait for the last requests' backups (and storage puts)
                        # before its first step, so a miss paid for the cache's copies.
                        self._complete_copies(wait=False)
                        if self.pool.copies_in_flight:
                            self._flush_kv_events()
                            if self._inbox.empty():
                                self._wake.wait(poll_s)
                                self._wake.clear()
                            poll_s = min(2 * poll_s, _IDLE_POLL_MAX_S)
                            continue
                    self._flush_kv_events()
                    poll_s = _IDLE_POLL_MIN_S
                    self._refresh_stats()
                    with self._lock:
                        # Under the lock add_request takes too: a request added after this
                        # check clears the flag again, so wait_idle never returns early.
                        if not self._live_ids:
                            self._idle.set()
                    if self._inbox.empty():
                        self._wake.wait(0.5)
                        self._wake.clear()
                    continue
                self._step()
                if not self.running:
                    self._flush_outputs()  # the last outputs: no next step will flush them
            except Exception:  # noqa: BLE001 - the thread must survive anything
                logger.exception("engine step failed; failing the requests of this step")
                for er in list(self.running):
                    self._finish(er, "error", error="internal engine error (see the server log)")
                self._flush_outputs()
                try:
                    self._complete_copies(wait=True)
                except Exception:  # noqa: BLE001
                    logger.exception("draining copies after a failed step failed")
        logger.info("engine thread stopped")

    def _drain_inbox(self) -> None:
        arrived: list[_EngineRequest] = []
        try:
            while True:
                try:
                    kind, item = self._inbox.get_nowait()
                except queue.Empty:
                    return
                if kind == "add":
                    self._requests[item.request_id] = item
                    if self.pd is not None and not self.pd.on_add(item):
                        continue  # PD decode: finished by the prefill's token (eos, max_tokens)
                    self.waiting.append(item)
                    if item.kv_transfer is None:
                        arrived.append(item)
                elif kind == "abort":
                    er = self._requests.get(item)
                    if er is not None and not er.finished:
                        self._finish(er, "abort")
                elif kind == "call":
                    fn, future = item
                    if future.set_running_or_notify_cancel():
                        try:
                            future.set_result(fn())
                        except Exception as exc:  # noqa: BLE001 - the caller gets it
                            future.set_exception(exc)
        finally:
            self._prefetch_arrivals(arrived)

    def _prefetch_arrivals(self, arrived: list[_EngineRequest]) -> None:
        """Start the storage lookup and fetch of requests just queued, while they wait.

        NOTE: after the inbox is empty, not per item: a lookup takes a millisecond or more,
        and a burst whose requests keep arriving during their own lookups would otherwise
        keep the engine in the inbox, its first request ready but not scheduled.  Requests
        arriving meanwhile are looked up after the next step.

        Only arrivals among the first ``2 * max_num_seqs`` waiting (those the next two steps
        may admit) are looked up now; the others wait in ``_later_arrivals`` until they are,
        since their lookups (a few tenths of a millisecond each, on this thread) would only
        delay the next step, and their fetches would slow its forward pass on a small machine.
        On an idle engine the fetches of those the next step admits are read here at once, on
        this thread, as one batch; the fetches of the step after
        run on the storage thread during the next step.
        NOTE: measured on a burst of 8 storage hits with ``--max-num-seqs 2`` on 2 cores:
        with every arrival looked up before the first step, that step started 22 ms after
        the burst (a burst of host hits: 5 ms) and its forward took 30 ms instead of 17
        (the other six fetches ran beside it); with only the first fetch read here, the
        second missed the first step and the whole burst ran a step late.
        """
        arrive = getattr(self.pool, "prefetch_on_arrival", None)
        if arrive is None:
            return
        slots = self.args.max_num_seqs
        position = {id(er): i for i, er in enumerate(itertools.islice(self.waiting, 2 * slots))}
        free = max(0, slots - len(self.running))
        idle = not self.running
        later, self._later_arrivals = self._later_arrivals, []
        ahead: list[tuple[int, _EngineRequest]] = []
        for er in later + arrived:
            if er.finished or er.admitted:
                continue  # admitted meanwhile: its lookup ran at admission
            at = position.get(id(er))
            if at is None:
                self._later_arrivals.append(er)
            else:
                ahead.append((at, er))
        ahead.sort(key=lambda item: item[0])
        now = [er.req for at, er in ahead if idle and at < free]  # the next step's, on an idle engine
        rest = [er.req for at, er in ahead if not (idle and at < free)]
        for group, here in ((now, True), (rest, False)):
            if not group:
                continue
            try:
                arrive(group, engine_idle=here)
            except Exception:  # noqa: BLE001 - a prefetch never keeps a request out
                logger.warning("prefetch on arrival of %s failed", [r.request_id for r in group], exc_info=True)

    # ------------------------------------------------------------------ one step
    def _step(self) -> None:
        t0 = time.perf_counter()
        scheduled = self._schedule()
        t_sched = time.perf_counter()
        if not scheduled:
            # Nothing fits right now: copies in flight pin blocks; wait for them.
            self._flush_outputs()
            self._complete_copies(wait=True)
            return
        next(self._step_count)
        self._counters["num_steps"] += 1
        reqs = [er.req for er, _ in scheduled]
        _, counter = self.pool.begin_step(reqs)
        t_submit = time.perf_counter()
        seqs = []
        for er, n in scheduled:
            r = er.req
            c = r.num_computed_tokens
            seqs.append(ScheduledSeq(r.token_slice(c, c + n), c, list(r.block_tables), c + n == r.num_total_tokens))
        # NOTE: the previous step's outputs go to their consumer here, as the forward pass
        # starts: a consumer on another thread (the server's event loop) then runs while this
        # thread waits for the device, instead of taking the GIL in the middle of a step.
        # Each sampling row's draw is taken before the forward pass, so a runner on a GPU
        # samples there and returns only the ids.
        sampling = StepSampling.for_samplers([er.sampler for (er, _), s in zip(scheduled, seqs) if s.wants_logits])
        self._flush_outputs()
        try:
            token_ids = self.runner.forward_sample(seqs, self.pool.layer_caches, counter, sampling)
        except Exception as exc:
            from fastdeploy_kvcache.worker.layer_done import LayerSwapError, LayerSwapTimeoutError

            if isinstance(exc, (LayerSwapError, LayerSwapTimeoutError)):
                # A load failed (or hung): drop the whole step; nothing advanced.  The
                # manager lowers the affected requests' computed length; the others just
                # redo the same tokens next step.
                logger.warning("step dropped: %s", exc)
                self._counters["num_failed_load_steps"] += 1
                self._flush_outputs()
                self._complete_copies(wait=True)
                return
            raise
        t_forward = time.perf_counter()
        if hasattr(self.pool, "observe_forward"):  # the storage tier's fetch-or-recompute rates
            self.pool.observe_forward(seqs, t_forward - t_submit)
        if self.pd is not None:
            self.pd.count_recomputed(scheduled)
        if getattr(self.runner, "last_step_replayed", False):
            self._counters["cudagraph_replays"] += 1
        if counter is not None:
            self._counters["steps_with_loads"] += 1
            self._counters["layer_waits"] += self.runner.last_layers_waited
        for er, n in scheduled:
            if er.first_step is None:
                er.first_step = {"schedule_s": t_sched - t0, "submit_s": t_submit - t_sched,
                                 "forward_s": t_forward - t_submit, "batch": len(scheduled), "tokens": n}
            er.req.num_computed_tokens += n
            if not er.req.output_token_ids:
                self._counters["prompt_tokens_computed"] += n
        rewound = self._complete_copies(wait=False)
        self._commit_prefill(scheduled)
        t_complete = time.perf_counter()
        token_list = token_ids.tolist()
        k = 0
        for (er, n), s in zip(scheduled, seqs):
            if not s.wants_logits:
                continue
            k += 1
            if er.finished or (rewound and er.req.request_id in rewound):
                continue
            er.sampler.consume()  # a dropped token (rewound above) keeps its draw for the redo
            try:
                self.append_token(er, token_list[k - 1])
            except Exception as exc:  # noqa: BLE001 - one request's failure is its own
                logger.exception("request %s failed", er.request_id)
                self._finish(er, "error", error=f"{type(exc).__name__}: {exc}")
        # The runner splits its forward pass into host launch and the wait for the device.
        wait_s = getattr(self.runner, "last_gpu_wait_s", 0.0)
        self.step_times.add(
            {"schedule": t_sched - t0, "submit": t_submit - t_sched, "launch": t_forward - t_submit - wait_s,
             "gpu_wait": wait_s, "complete": t_complete - t_forward, "sample": time.perf_counter() - t_complete},
            getattr(self.runner, "last_load_wait_gpu_s", 0.0), len(scheduled))
        self._flush_kv_events()
        if not self.running or time.monotonic() - self._stats_time >= _STATS_PERIOD_S:
            self._refresh_stats()

    def _commit_prefill(self, scheduled: list[tuple[_EngineRequest, int]]) -> None:
        """Make the prompt blocks this step completed reusable now (requests held for them
        start as soon as they are in, chunked prefill included).  Off with the sharing: a
        request's blocks are then reusable once it finishes, as before."""
        if not self.sharing.enabled:
            return
        for er, _ in scheduled:
            r = er.req
            if er.finished or r.num_computed_tokens > r.num_prompt_tokens + 1:
                continue  # decoding: its prompt blocks were committed already
            try:
                committed = self.pool.commit(r)
            except Exception:  # noqa: BLE001 - a missed commit only loses reuse
                logger.exception("committing the blocks of %s failed", er.request_id)
                continue
            self.sharing.leader_progress(er.request_id, committed)

    def _schedule(self) -> list[tuple[_EngineRequest, int]]:
        """Pick this step's requests and token counts; make their blocks resident."""
        budget = self.args.max_num_batched_tokens
        block_size = self.cache_config.block_size
        out: list[tuple[_EngineRequest, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            er = self.running[i]
            r = er.req
            n = min(r.num_total_tokens - r.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            if len(r.block_tables) * block_size >= r.num_computed_tokens + n:
                # NOTE: most decode steps need no new block: skip the pool's call (it would
                # only check the table and find nothing to do), the one per-request cost of
                # scheduling a running request.  Copies the pool queued meanwhile still go
                # with this step's batch (begin_step issues them).
                out.append((er, n))
                budget -= n
                i += 1
                continue
            try:
                self.pool.ensure_resident(r, r.num_computed_tokens + n)
            except NoFreeBlocksError as exc:
                if exc.retryable and self.pool.copies_in_flight:
                    self._complete_copies(wait=True)
                    continue
                victim = self.running[-1]
                if victim is er and len(self.running) == 1:
                    self._finish(er, "error", error=f"not enough KV blocks: {exc}")
                    continue
                self._preempt(victim)
                preempted = True
                continue  # retry er (or, if er was the victim, the next one)
            out.append((er, n))
            budget -= n
            i += 1
        if preempted:
            return out
        sharing = self.sharing
        sharing.begin_pass()
        k = 0  # requests held for a prefix another one computes stay in place; the next go first
        while k < len(self.waiting) and budget > 0 and len(self.running) < self.args.max_num_seqs:
            er = self.waiting[k]
            if er.finished:
                del self.waiting[k]
                continue
            r = er.req
            prefetch_ready = getattr(self.pool, "prefetch_ready", None)
            if prefetch_ready is not None and not prefetch_ready(r, engine_idle=not self.running and not out):
                break  # the storage prefetch policy holds it until its blocks are on host
            try:
                matched = self.pool.admit(r)
                if sharing.should_hold(r, matched):
                    k += 1
                    continue
                want = min(r.num_total_tokens, matched + budget)
                plan = self.pool.ensure_resident(r, want)
            except NoFreeBlocksError as exc:
                if not self.running and not out:
                    if exc.retryable or self.pool.copies_in_flight:
                        self._complete_copies(wait=True)
                    else:
                        del self.waiting[k]
                        self._finish(er, "error", error=f"not enough KV blocks: {exc}")
                break
            except Exception as exc:  # noqa: BLE001 - a bad request fails alone
                logger.exception("admission of %s failed", er.request_id)
                del self.waiting[k]
                self._finish(er, "error", error=f"{type(exc).__name__}: {exc}")
                continue
            del self.waiting[k]
            if not er.admitted:
                er.admitted = True
                er.admitted_time = time.monotonic()
                er.fetch = getattr(plan, "storage_fetch", None)
                er.cached_device = plan.num_device_hit_tokens
                er.cached_host = plan.num_host_hit_tokens
                er.cached_storage = plan.num_storage_hit_tokens
            sharing.admitted(r, r.num_computed_tokens)
            self.running.append(er)
            if self.pd is not None:
                self.pd.after_admit(er)  # PD decode: the partial block from the store
            n = min(r.num_total_tokens - r.num_computed_tokens, budget, len(r.block_tables) * self.cache_config.block_size - r.num_computed_tokens)
            if n <= 0:
                continue
            out.append((er, n))
            budget -= n
        sharing.end_pass()
        return out

    def _preempt(self, er: _EngineRequest) -> None:
        self.running.remove(er)
        self.sharing.leader_gone(er.request_id)
        self.pool.preempt(er.req)
        self.waiting.appendleft(er)
        self._counters["num_preemptions"] += 1
        logger.debug("preempted %s", er.request_id)

    def _complete_copies(self, wait: bool) -> set[str]:
        """Hand finished copies to the manager; adjust the reuse counts of rewound requests."""
        rewound = self.pool.complete_finished(wait=wait)
        for rid in rewound:
            er = self._requests.get(rid)
            if er is None:
                continue
            # A failed load: those tokens are recomputed, so they were not reused.
            total = min(er.num_cached_tokens, er.req.num_cached_tokens)
            er.cached_device = min(er.cached_device, total)
            er.cached_host = min(er.cached_host, total - er.cached_device)
            er.cached_storage = max(0, total - er.cached_device - er.cached_host)
        return rewound

    # ------------------------------------------------------------------ tokens and finishing
    def append_token(self, er: _EngineRequest, token: int) -> None:
        """Give ``er`` its next output token: emit its text, or finish it (EOS, stop, length).

        The engine's own sampler calls it each step; a PD decode server (engine/pd.py) calls
        it for the tokens the prefill server already sampled, so they stream the same way.
        """
        r, p = er.req, er.params
        r.output_token_ids.append(token)
        self._counters["output_tokens"] += 1
        if er.first_token_time is None:
            er.first_token_time = time.monotonic()
        reason: Optional[str] = None
        is_eos = (not p.ignore_eos and token in self.tokenizer.eos_token_ids) or token in p.stop_token_ids
        if not is_eos:
            er.detok.add(token)
            if p.stop:
                text = er.detok.text
                # Only the tail can hold a new match.
                lo = max(0, er.text_sent - er.max_stop_len)
                hits = [i for i in (text.find(s, lo) for s in p.stop) if i >= 0]
                if hits:
                    er.stop_at = min(hits)
                    reason = "stop"
        else:
            reason = "stop"
        if reason is None and (len(r.output_token_ids) >= p.max_tokens or r.num_total_tokens >= self.max_model_len):
            reason = "length"
        if reason is None:
            text = er.detok.text
            # Hold back what could be the start of a stop string.
            safe = len(text) - (er.max_stop_len - 1 if er.max_stop_len else 0)
            delta = text[er.text_sent : max(er.text_sent, safe)]
            er.text_sent += len(delta)
            self._emit(er, [token], delta)
            return
        self._finish(er, reason, new_token_ids=[token])

    def _finish(self, er: _EngineRequest, reason: str, new_token_ids: Optional[list[int]] = None,
                error: Optional[str] = None) -> None:
        if er.finished:
            return
        er.finished = True
        r = er.req
        self.sharing.forget(er.request_id)
        try:
            if er in self.running:
                self.running.remove(er)
            if er in self.waiting:
                self.waiting.remove(er)
            if self.pd is not None:
                self.pd.on_finish(er, reason)  # PD prefill: KV to the store, before release and emit
            if self.pool.is_running(r):
                self.pool.finish(r)
            forget = getattr(self.pool, "forget_request", None)
            if forget is not None:
                forget(r)  # a storage prefetch it waited for goes on for others
        except Exception:  # noqa: BLE001 - never leave the loop because of one request
            logger.exception("releasing the blocks of %s failed", er.request_id)
        if reason in ("stop", "length"):
            er.detok.flush()
        text = er.detok.text
        end = er.stop_at if er.stop_at is not None else len(text)
        delta = text[er.text_sent : max(er.text_sent, end)] if reason != "error" else ""
        er.text_sent = max(er.text_sent, end)
        self._counters["num_finished"] += 1
        if er.admitted_time is not None:
            self.request_timings.add(request_timing(
                er.request_id, er.arrival_time, er.admitted_time, er.first_token_time, er.fetch, er.first_step,
                {"device": er.cached_device, "host": er.cached_host, "storage": er.cached_storage}))
        self._emit(er, list(new_token_ids or []), delta, finished=True, finish_reason=reason, error=error)
        self._requests.pop(er.request_id, None)
        with self._lock:
            self._live_ids.discard(er.request_id)

    def _emit(self, er: _EngineRequest, new_token_ids: list[int], text: str, finished: bool = False,
              finish_reason: Optional[str] = None, error: Optional[str] = None) -> None:
        """Hand ``er``'s output of this step to its callback (built in one call: it runs per token)."""
        r = er.req
        dev, host, storage = er.cached_device, er.cached_host, er.cached_storage
        out = RequestOutput(request_id=r.request_id, new_token_ids=new_token_ids, text=text, finished=finished,
                            finish_reason=finish_reason, num_prompt_tokens=len(r.prompt_token_ids),
                            num_output_tokens=len(r.output_token_ids), num_cached_tokens=dev + host + storage,
                            cached_tokens_by_tier={"device": dev, "host": host, "storage": storage},
                            first_token_time=er.first_token_time, arrival_time=er.arrival_time, error=error)
        try:
            er.on_output(out)
        except Exception:  # noqa: BLE001 - a broken callback must not stop the engine
            logger.exception("on_output of %s raised; aborting it", er.request_id)
            if not out.finished:
                self._finish(er, "abort", error="output callback raised")

    # ------------------------------------------------------------------ stats
    def _refresh_stats(self) -> None:
        try:
            pool = self.pool.stats()
        except Exception:  # noqa: BLE001
            logger.debug("pool stats failed", exc_info=True)
            pool = {}
        snap: dict[str, Any] = {
            "num_requests_running": len(self.running),
            "num_requests_waiting": len(self.waiting),
            "v1_kvcache_manager": self.use_v1,
            "model": self.model_name,
            "device": self.device,
            "engine": dict(self._counters),
            "step_times": self.step_times.snapshot(),
            "request_timings": self.request_timings.snapshot(),
            "prefix_sharing": self.sharing.stats.as_dict(),
            **pool,
        }
        if getattr(self, "pd", None) is not None:
            snap["pd"] = self.pd.stats()
        if getattr(self, "kv_events", None) is not None:
            snap["kv_events"] = self.kv_events.stats()
        with self._lock:
            self._stats_snapshot = snap
        self._stats_time = time.monotonic()
