"""The bridge from the engine thread's callbacks to the server's asyncio loop.

The engine runs in its own thread and calls ``on_output`` from there.  asyncio objects
are not thread-safe, so each output is handed to the loop (:class:`LoopHandoff`: one
``loop.call_soon_threadsafe`` per burst of outputs, not per output) and lands on a
per-HTTP-request ``asyncio.Queue``.  The event loop therefore never blocks on the engine,
and the engine never waits for a slow client: a client that stops reading only grows its
own queue.

One HTTP request may fan out into several engine requests (``n > 1``, or a list of
prompts); they share one queue and are told apart by their choice index.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional

if TYPE_CHECKING:  # the engine imports Paddle; the server imports it lazily at start-up
    from fastdeploy_kvcache.engine.llm_engine import LLMEngine, RequestOutput
    from fastdeploy_kvcache.engine.sampling import SamplingParams

logger = logging.getLogger(__name__)


class LoopHandoff:
    """Calls handed from other threads (the engine's) to one asyncio loop, run there in order.

    NOTE: ``loop.call_soon_threadsafe`` per call writes to the loop's wake-up pipe and wakes
    its thread each time: about 2.4 us of the engine thread per output, and a handoff of the
    GIL to the loop's thread in the middle of the engine's step.  A step emits one output per
    running request in a burst, so calls queue here and only the first of a burst schedules
    a drain; the drain runs everything queued until it ends.  The server goes one further
    (:meth:`wait_for_flush`): the engine wakes the loop once per step, as its forward starts.
    """

    _of_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopHandoff]" = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._pending: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._scheduled = False
        self._wait_for_flush = False

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "LoopHandoff":
        """The one handoff of ``loop`` (made on first use), so all its requests share a drain."""
        handoff = cls._of_loop.get(loop)
        if handoff is None:
            handoff = cls._of_loop[loop] = cls(loop)
        return handoff

    def call(self, fn: Callable[..., None], *args: Any) -> bool:
        """From any thread: run ``fn(*args)`` on the loop, after the calls handed over before
        it.  False (nothing queued) once the loop is closed."""
        if self._loop.is_closed():
            return False
        self._pending.append((fn, args))
        return self._wait_for_flush or self._wake()

    def wait_for_flush(self) -> None:
        """From now on, calls wait for :meth:`flush` instead of waking the loop themselves.

        The engine flushes as its next forward pass starts (``LLMEngine.add_output_flush_hook``):
        the loop's thread then serialises a step's outputs while the engine waits for the GPU,
        not in the middle of the step, where both would want the GIL.
        """
        self._wait_for_flush = True

    def flush(self) -> None:
        """From any thread: wake the loop for the calls queued so far (once)."""
        if self._pending and not self._loop.is_closed():
            self._wake()

    def _wake(self) -> bool:
        # NOTE: called after the append; _drain clears the flag before popping, so a call
        # that finds it set is popped by that drain (no lost wake-up without a lock).
        if not self._scheduled:
            self._scheduled = True
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # closed meanwhile: nobody is left to run them
                self._pending.clear()
                return False
        return True

    def _drain(self) -> None:
        """On the loop's thread: run every queued call."""
        self._scheduled = False
        pending = self._pending
        while pending:
            fn, args = pending.popleft()
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - one bad call must not drop the others
                logger.exception("a call handed to the event loop failed")


@dataclass
class SubRequest:
    """One engine request of an HTTP request: its choice index, id, prompt and parameters."""

    index: int
    request_id: str
    prompt_token_ids: list[int]
    params: "SamplingParams"
    kv_transfer: Optional[Any] = None  # PD decode: engine/pd.py KVTransferParams
    cache_salt: Optional[str] = None  # hashed into the first block (core/hashing.py)
    tenant: Optional[str] = None  # the API key's tenant (entrypoints/auth.py)


class RequestGroup:
    """The engine requests of one HTTP request, as one async stream of ``(index, output)``.

    Iterate it to get every ``RequestOutput`` in arrival order; iteration ends once each
    sub-request has delivered its ``finished=True`` output.  :meth:`abort` (called by the
    server when the client goes away, or on any error) aborts whatever has not finished;
    it is idempotent and safe after completion.
    """

    def __init__(self, engine: "LLMEngine", subs: list[SubRequest],
                 on_abandoned_finish: Optional[Callable[["RequestOutput"], None]] = None) -> None:
        self._engine = engine
        self._subs = subs
        self._queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self._unfinished = {s.request_id: s.index for s in subs}
        self._loop = asyncio.get_running_loop()
        # After abort() nobody reads the queue; the aborted requests' final outputs still
        # go here (the server's metrics count them), on the loop's thread.
        self._abandoned = False
        self._on_abandoned_finish = on_abandoned_finish

    def submit(self) -> None:
        """Add every sub-request to the engine at once (by :meth:`EngineClient.submit`): the
        engine checks them all before it queues any, so a bad one leaves nothing to abort."""
        try:
            self._engine.add_requests([(sub.request_id, sub.prompt_token_ids, sub.params,
                                        self._make_callback(sub.index), sub.kv_transfer, sub.cache_salt, sub.tenant)
                                       for sub in self._subs])
        except BaseException:
            self._abandoned = True
            self._unfinished.clear()
            raise

    def _make_callback(self, index: int) -> Callable[["RequestOutput"], None]:
        handoff = LoopHandoff.of(self._loop)

        def on_output(output: "RequestOutput") -> None:
            # Runs on the engine thread.  A closed loop (server shutting down) drops the
            # output: nobody is left to read it, and the engine must not crash.
            if not handoff.call(self._deliver, index, output):
                logger.debug("event loop closed; output of %s dropped", output.request_id)

        return on_output

    def _deliver(self, index: int, output: "RequestOutput") -> None:
        """On the loop's thread: queue the output, or, once abandoned, report its finish."""
        if not self._abandoned:
            self._queue.put_nowait((index, output))
        elif output.finished and self._on_abandoned_finish is not None:
            try:
                self._on_abandoned_finish(output)
            except Exception:  # noqa: BLE001 - metrics must not break the loop
                logger.exception("recording the finish of aborted request %s failed", output.request_id)

    def __aiter__(self) -> AsyncIterator[tuple[int, "RequestOutput"]]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[tuple[int, "RequestOutput"]]:
        while self._unfinished:
            index, output = await self._queue.get()
            if output.finished:
                self._unfinished.pop(output.request_id, None)
            yield index, output

    @property
    def num_choices(self) -> int:
        return len(self._subs)

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def end_early(self) -> int:
        """Ask the engine to abort the unfinished sub-requests, but keep reading: each still
        delivers its final output (``finish_reason`` "abort"), so a stream ends cleanly.
        Returns how many were asked."""
        for rid in self._unfinished:
            self._engine.abort(rid)
        return len(self._unfinished)

    def abort(self) -> None:
        """Abort every sub-request that has not finished (the engine frees its blocks)."""
        self._abandoned = True
        for rid in list(self._unfinished):
            logger.info("aborting request %s", rid)
            self._engine.abort(rid)
        self._unfinished.clear()


class EngineDraining(RuntimeError):
    """The server is shutting down: the engine takes no new requests."""


class AsyncEngineClient:
    """Owns the engine's life cycle (start in the lifespan, shutdown at exit) for the server."""

    def __init__(self, engine: "LLMEngine") -> None:
        self.engine = engine
        self._groups: "weakref.WeakSet[RequestGroup]" = weakref.WeakSet()
        self._draining = False

    def start(self) -> None:
        """Start the engine; called on the event loop's thread (the server's lifespan), whose
        handoff then wakes the loop once per engine step."""
        try:
            handoff = LoopHandoff.of(asyncio.get_running_loop())
        except RuntimeError:  # no running loop: every output wakes its loop itself
            handoff = None
        if handoff is not None:
            handoff.wait_for_flush()
            self.engine.add_output_flush_hook(handoff.flush)
        self.engine.start()

    def shutdown(self, timeout_s: float = 30.0) -> None:
        """Stop the engine within ``timeout_s`` (it flushes what the storage tier owes)."""
        self._draining = True
        self.engine.shutdown(timeout_s)

    def end_inflight(self) -> int:
        """Stop taking requests and end every one in flight (abort in the engine; their
        responses still get their last output).  Call on the loop's thread.  Returns how
        many engine requests were asked to stop."""
        self._draining = True
        return sum(group.end_early() for group in list(self._groups) if not group.finished)

    def submit(self, subs: list[SubRequest],
               on_abandoned_finish: Optional[Callable[["RequestOutput"], None]] = None) -> RequestGroup:
        """Add the sub-requests to the engine; raises ValueError (bad request) before any runs.

        Must be called from the event loop's thread.  ``on_abandoned_finish`` receives the
        final output of each sub-request that finishes after the group was aborted.
        """
        if self._draining:
            raise EngineDraining("the server is shutting down and takes no new requests")
        group = RequestGroup(self.engine, subs, on_abandoned_finish)
        group.submit()
        self._groups.add(group)
        return group

    def get_stats(self) -> dict[str, Any]:
        return self.engine.get_stats()

    def kv_cache_blocks(self) -> dict[str, Any]:
        return self.engine.kv_cache_blocks()

    def storage_health(self) -> Optional[dict[str, Any]]:
        return self.engine.storage_health()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def model_name(self) -> str:
        return self.engine.model_name

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def block_size(self) -> int:
        """Tokens per KV block: the engine's cache config (``--block-size``)."""
        return self.engine.cache_config.block_size

    @property
    def max_request_tokens(self) -> int:
        """Most tokens (prompt + output) one request can hold: the context and the device pool."""
        cfg = getattr(self.engine, "cache_config", None)
        if cfg is None or not getattr(cfg, "num_gpu_blocks", 0):
            return self.engine.max_model_len
        return min(self.engine.max_model_len, cfg.num_gpu_blocks * cfg.block_size)


def first_token_latency(output: "RequestOutput") -> Optional[float]:
    """Engine-measured seconds from arrival to the first token, when the engine stamps both."""
    first = getattr(output, "first_token_time", None)
    arrival = getattr(output, "arrival_time", None)
    if first is None or arrival is None:
        return None
    return max(0.0, float(first) - float(arrival))
