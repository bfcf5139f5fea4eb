"""``LLMEngine``: continuous batching on one engine thread, over the tiered KV cache or the baseline.

One step of the loop:

1. **Inbox.** New requests and aborts arrive through a queue (``add_request`` and ``abort``
   are thread-safe and never wait for a step); with a storage tier, a new request's storage
   prefetch starts as it is queued.
2. **Schedule** (``engine/scheduler.py``): the ``Scheduler`` owns the waiting and running
   queues and picks the step's requests under ``--max-num-batched-tokens``: running requests
   first, then admissions (``match_prefix`` then ``ensure_resident``) while fewer than
   ``--max-num-seqs`` run, with in-batch prefix sharing and preemption when blocks run out.
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
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.engine.args import EngineArgs
from fastdeploy_kvcache.engine.engine_request import EngineRequest, OutputCallback
from fastdeploy_kvcache.engine.kv_event_stream import kv_cache_blocks, make_kv_event_stream
from fastdeploy_kvcache.engine.kv_pool import KVPool, ManagedKVPool, PlainKVPool
from fastdeploy_kvcache.engine.model_loader import LoadedModel, load_model
from fastdeploy_kvcache.engine.runner import ModelRunner, ScheduledSeq
from fastdeploy_kvcache.engine.outputs import RequestOutput
from fastdeploy_kvcache.engine.request_checks import RequestRejected, check_fits_device_pool, check_prompt
from fastdeploy_kvcache.engine.request_timing import RecentTimings, request_timing
from fastdeploy_kvcache.engine.sampling import RequestSampler, SamplingParams, StepSampling
from fastdeploy_kvcache.engine.scheduler import Scheduler
from fastdeploy_kvcache.engine.step_timing import StepTimes
from fastdeploy_kvcache.engine.tokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "RequestOutput", "RequestRejected", "SamplingParams", "EngineArgs"]

# While idle with copies or storage jobs in flight, the loop polls for them between these
# bounds (doubling), so a new request is picked up at once and finished copies soon after.
_IDLE_POLL_MIN_S = 0.0005
_IDLE_POLL_MAX_S = 0.01
# While requests run, the stats snapshot (get_stats) is rebuilt at most this often: building
# it is tens of microseconds, a share of a short GPU step.  An idle engine, a step by hand
# (step()) and the step that runs the last request refresh it at once.
_STATS_PERIOD_S = 0.05


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
            # torch only (engine/transformers_runner/torch_runner.py): no Paddle import on this path.
            from fastdeploy_kvcache.engine.transformers_runner import torch_runner

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
        torch_model_runner = None  # the transformers runner: it captures decode graphs once the pool exists
        if args.model_impl == "transformers":
            torch_model_runner = torch_runner.TorchModelRunner(self.loaded, self.cache_config.block_size,
                                                               self.device, fused_layers=self._fuse_layers(),
                                                               kv_cache_quant=self.cache_config.kv_cache_quant)
            self.runner: ModelRunner = torch_model_runner
        else:
            from fastdeploy_kvcache.engine.paddleformers_runner.paddle_runner import PaddleModelRunner

            if self.cache_config.kv_cache_quant is not None:
                from fastdeploy_kvcache.engine.paddleformers_runner.fp8_kv import gather_view_dtype

                gather_view_dtype(self.cache_config.head_dim)  # ValueError now, not at the first step
            self.runner = PaddleModelRunner(self.loaded, self.cache_config.block_size, self.device,
                                            kv_cache_quant=self.cache_config.kv_cache_quant)
        self.cache_config.num_gpu_blocks = self._device_pool_blocks()
        storage = getattr(args, "storage", None)
        if storage is not None and storage.fetch_plan == "auto":
            # Planning pays where recomputing can beat the store: on a GPU.
            storage = dataclasses.replace(storage, fetch_plan="on" if self.device == "gpu" else "off")
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
        if torch_model_runner is not None and args.use_cudagraph:
            # Once the pool exists (the graphs hold its caches' addresses), before serving.
            torch_model_runner.enable_decode_graphs(self.pool.layer_caches, args.max_num_seqs, self.max_model_len)
            torch_model_runner.enable_piecewise_graphs(args.max_num_batched_tokens)
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
        self.scheduler = Scheduler(
            self.pool, block_size=self.cache_config.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
            max_num_seqs=args.max_num_seqs, prefix_hold_s=args.max_prefix_hold_s if share else 0.0,
            fail=lambda er, error: self._finish(er, "error", error=error),
            drain_copies=lambda: self._complete_copies(wait=True),
            after_admit=self.pd.after_admit if self.pd is not None else None)

        self._inbox: "queue.SimpleQueue[tuple[str, Any]]" = queue.SimpleQueue()
        self._wake = threading.Event()
        self._lock = threading.Lock()  # guards _live_ids and the stats snapshot
        self._live_ids: set[str] = set()
        self._requests: dict[str, EngineRequest] = {}
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._closed = False
        self._idle = threading.Event()
        self._idle.set()
        self._step_count = itertools.count()
        self._output_flush_hooks: list[Callable[[], None]] = []
        self._counters = {"num_steps": 0, "num_failed_load_steps": 0,
                          "prompt_tokens_computed": 0, "output_tokens": 0, "num_finished": 0,
                          "steps_with_loads": 0, "layer_waits": 0, "cudagraph_replays": 0}
        self._stats_snapshot: dict[str, Any] = {}
        self._stats_time = 0.0  # time.monotonic() of the snapshot
        self.step_times = StepTimes()
        self.request_timings = RecentTimings()
        self._refresh_stats()
        logger.info(
            "LLMEngine: model %s on %s, %d layers, KV %s, %d device blocks of %d tokens, %d host blocks, v1 manager %s",
            self.model_name, self.device, self.loaded.num_layers,
            self.cache_config.dtype + (f"/{self.cache_config.kv_cache_quant}" if self.cache_config.kv_cache_quant else ""),
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
        from fastdeploy_kvcache.engine.transformers_runner.decode_graphs import graph_batch_sizes
        from fastdeploy_kvcache.engine.transformers_runner.gpu_memory import profile_device_memory

        graphs = 0
        if a.use_cudagraph:
            from fastdeploy_kvcache.engine.transformers_runner.piecewise_graphs import piecewise_reserve_bytes

            graphs = kv_sizing.graph_reserve_bytes(graph_batch_sizes(a.max_num_seqs), self.loaded.vocab_size)
            if self._fuse_layers():
                graphs += piecewise_reserve_bytes(a.max_num_batched_tokens, self.loaded.model.config)
        mem = profile_device_memory(self.runner, config, min(a.max_num_batched_tokens, self.max_model_len),
                                    a.max_num_seqs, graphs)
        budget = kv_sizing.kv_budget_bytes(mem, a.gpu_memory_utilization)
        blocks = kv_sizing.device_pool_blocks(kv_budget=budget, **sizes)
        logger.info("--gpu-memory-utilization %g: %d device blocks (%.2f GiB of KV)", a.gpu_memory_utilization,
                    blocks, blocks * config.bytes_per_block / (1 << 30))
        return blocks

    def _fuse_layers(self) -> bool:
        """Whether the transformers runner fuses its decoder layers (``--fused-layers``)."""
        choice = self.args.fused_layers
        return choice == "on" or (choice == "auto" and self.device == "gpu")

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
        for er in self.scheduler.requests():
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
        on_output: OutputCallback, kv_transfer: Optional[Any] = None, *,
        cache_salt: Optional[str] = None, tenant: Optional[str] = None, salt_from_token: int = 0,
    ) -> None:
        """Queue a request; raises ValueError (nothing queued) for bad input or a duplicate id.

        ``kv_transfer``: a decode server's ``kv_transfer_params`` (engine/pd.py).  ``cache_salt``:
        hashed into the first block, so the request reuses only blocks computed with the same
        salt, on every tier; ``salt_from_token``: the salt enters the block holding that token
        instead (the blocks wholly before it are shared unsalted).  ``tenant``: who sent it (the
        API key's tenant): the cache's k-anonymity counts tenants.  Errors about the prompt or
        its fit are :class:`RequestRejected` (``param``, ``code``).
        """
        self.add_requests([(request_id, prompt_token_ids, params, on_output, kv_transfer, cache_salt, tenant,
                            salt_from_token)])

    def add_requests(self, requests: Sequence[tuple[Any, ...]]) -> None:
        """Queue several requests, all or none: every one is checked before any is queued.

        Each item is ``(request_id, prompt_token_ids, params, on_output, kv_transfer)``,
        optionally followed by ``cache_salt`` and ``tenant``, and then ``salt_from_token`` (see
        :meth:`add_request`).  This is the one place a prompt is checked
        (``engine/request_checks.py``); requests that share one prompt list (the choices of
        ``n > 1``) have it checked once.
        """
        if self._stop.is_set():
            raise RuntimeError("the engine is shut down")
        vocab = self.loaded.vocab_size
        checked_prompts: set[int] = set()
        ready: list[tuple[str, list[int], SamplingParams, OutputCallback, Any, Optional[str], Optional[str],
                          int]] = []
        ids_seen: set[str] = set()
        for item in requests:
            if len(item) not in (5, 7, 8):
                raise ValueError(f"add_requests: an item is (request_id, prompt_token_ids, params, on_output, "
                                 f"kv_transfer[, cache_salt, tenant[, salt_from_token]]), got {len(item)} values")
            request_id, prompt_token_ids, params, on_output, kv_transfer = item[:5]
            cache_salt, tenant = item[5:7] if len(item) >= 7 else (None, None)
            salt_from_token = item[7] if len(item) == 8 else 0
            if not isinstance(salt_from_token, int) or isinstance(salt_from_token, bool) or salt_from_token < 0:
                raise ValueError(f"salt_from_token: must be an int >= 0, got {salt_from_token!r}")
            if cache_salt is not None and (not isinstance(cache_salt, str) or not cache_salt):
                raise ValueError(f"cache_salt: must be a non-empty string, got {cache_salt!r}")
            if tenant is not None and not isinstance(tenant, str):
                raise ValueError(f"tenant: must be a string, got {type(tenant).__name__}")
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
            ready.append((request_id, prompt_token_ids, params, on_output, pd_params, cache_salt, tenant,
                          salt_from_token))
        with self._lock:
            in_use = [rid for rid, *_ in ready if rid in self._live_ids]
            if in_use:
                raise ValueError(f"request_id: {in_use[0]!r} is already in use")
            self._live_ids.update(rid for rid, *_ in ready)
            self._idle.clear()
        for request_id, prompt_token_ids, params, on_output, pd_params, cache_salt, tenant, salt_from in ready:
            req = Request(request_id, [int(t) for t in prompt_token_ids], cache_salt=cache_salt, tenant=tenant,
                          salt_from_token=salt_from)
            seed = int(self._seed_rng.integers(0, 2**63 - 1))
            er = EngineRequest(req, params, on_output, RequestSampler(params, seed),
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
        return self.pool.storage_health()

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
                if not self.scheduler.num_running:
                    self._flush_outputs()  # aborts, before any idle wait below; else the step flushes
                if not self.scheduler.has_requests():
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
                if not self.scheduler.num_running:
                    self._flush_outputs()  # the last outputs: no next step will flush them
            except Exception:  # noqa: BLE001 - the thread must survive anything
                logger.exception("engine step failed; failing the requests of this step")
                for er in self.scheduler.running_requests():
                    self._finish(er, "error", error="internal engine error (see the server log)")
                self._flush_outputs()
                try:
                    self._complete_copies(wait=True)
                except Exception:  # noqa: BLE001
                    logger.exception("draining copies after a failed step failed")
        logger.info("engine thread stopped")

    def _drain_inbox(self) -> None:
        arrived: list[EngineRequest] = []
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
                    self.scheduler.add(item)
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
            self.scheduler.prefetch_arrivals(arrived)

    # ------------------------------------------------------------------ one step
    def _step(self) -> None:
        """One step: schedule, submit the copies, forward and sample, complete, emit (module docstring)."""
        t0 = time.perf_counter()
        scheduled = self.scheduler.schedule()
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
        self.pool.observe_forward(seqs, t_forward - t_submit)  # the storage tier's fetch-or-recompute rates
        if self.pd is not None:
            self.pd.count_recomputed(scheduled)
        if self.runner.last_step_replayed:
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
        self.scheduler.commit_prefill(scheduled)
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
        wait_s = self.runner.last_gpu_wait_s
        self.step_times.add(
            {"schedule": t_sched - t0, "submit": t_submit - t_sched, "launch": t_forward - t_submit - wait_s,
             "gpu_wait": wait_s, "complete": t_complete - t_forward, "sample": time.perf_counter() - t_complete},
            self.runner.last_load_wait_gpu_s, len(scheduled))
        self._flush_kv_events()
        if not self.scheduler.num_running or time.monotonic() - self._stats_time >= _STATS_PERIOD_S:
            self._refresh_stats()

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
    def append_token(self, er: EngineRequest, token: int) -> None:
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

    def _finish(self, er: EngineRequest, reason: str, new_token_ids: Optional[list[int]] = None,
                error: Optional[str] = None) -> None:
        if er.finished:
            return
        er.finished = True
        r = er.req
        self.scheduler.remove(er)
        try:
            if self.pd is not None:
                self.pd.on_finish(er, reason)  # PD prefill: KV to the store, before release and emit
            if self.pool.is_running(r):
                self.pool.finish(r)
            self.pool.forget_request(r)  # a storage prefetch it waited for goes on for others
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

    def _emit(self, er: EngineRequest, new_token_ids: list[int], text: str, finished: bool = False,
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
            "num_requests_running": self.scheduler.num_running,
            "num_requests_waiting": self.scheduler.num_waiting,
            "v1_kvcache_manager": self.use_v1,
            "model": self.model_name,
            "device": self.device,
            "engine": {**self._counters, "num_preemptions": self.scheduler.num_preemptions},
            "step_times": self.step_times.snapshot(),
            "request_timings": self.request_timings.snapshot(),
            "prefix_sharing": self.scheduler.sharing_stats(),
            **pool,
        }
        if getattr(self, "pd", None) is not None:
            snap["pd"] = self.pd.stats()
        if getattr(self, "kv_events", None) is not None:
            snap["kv_events"] = self.kv_events.stats()
        with self._lock:
            self._stats_snapshot = snap
        self._stats_time = time.monotonic()
