"""Per-layer completion of one host-to-device load: ``LayerDoneCounter``.

A swap-in is issued layer by layer on the input stream, and an event is recorded after each
layer's copy.  The forward pass calls :meth:`LayerDoneCounter.wait_for_layer` right before
layer ``i``'s attention reads the cache; on a GPU backend that enqueues a wait *on the compute
stream* (``cudaStreamWaitEvent``), so the host never blocks and nothing polls, and layer
``i``'s attention starts as soon as layer ``i``'s blocks have landed while later layers are
still in flight.

The counter owns its events for its whole lifetime.  A peer implementation dropped the
events when the copy thread finished, so a forward pass that reached ``wait_for_layer`` late
found no event and silently read half-loaded blocks.  Here the events die with the counter,
i.e. only once the transfer manager (which keeps it until the copy is confirmed) and every
forward pass holding it have let it go.
"""

from __future__ import annotations

import logging
import math
import numbers
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

from fastdeploy_kvcache import envs
from fastdeploy_kvcache.core.metadata import CopyDirection

if TYPE_CHECKING:
    from fastdeploy_kvcache.worker.backends.base import Backend

logger = logging.getLogger(__name__)


def describe(direction: CopyDirection) -> str:
    """``"d2h (device->host)"``: the short label plus the way the bytes go, for messages."""
    arrow = "device->host" if direction is CopyDirection.DEVICE_TO_HOST else "host->device"
    return f"{direction.short} ({arrow})"


class LayerSwapError(RuntimeError):
    """A copy failed: its blocks do not hold valid KV and must not be read.

    Raised by a load's waits (``direction`` is then HOST_TO_DEVICE); ``direction`` says which
    way the failed copy went.
    """

    def __init__(
        self,
        layer: int,
        task_id: int,
        error: str,
        direction: CopyDirection = CopyDirection.HOST_TO_DEVICE,
    ) -> None:
        where = f"layer {layer}" if layer >= 0 else "all layers"
        super().__init__(f"{describe(direction)} task {task_id} failed ({where}): {error}")
        self.layer = layer
        self.task_id = task_id
        self.error = error
        self.direction = direction


class LayerSwapTimeoutError(TimeoutError):
    """A host-side wait on a copy ran past its limit.

    ``direction`` is the direction of the copy waited for; ``layer`` is -1 when the wait was
    for the whole task (a device->host copy moves every layer in one launch) or for its
    launch rather than one layer's event.
    """

    def __init__(
        self,
        layer: int,
        task_id: int,
        timeout_s: float,
        direction: CopyDirection = CopyDirection.HOST_TO_DEVICE,
    ) -> None:
        where = f"layer {layer} of " if layer >= 0 else ""
        super().__init__(
            f"{where}{describe(direction)} task {task_id} not done after {timeout_s:.3f}s "
            f"(FDKV_LAYER_WAIT_TIMEOUT_S)"
        )
        self.layer = layer
        self.task_id = task_id
        self.timeout_s = timeout_s
        self.direction = direction


def default_timeout_s() -> float:
    return float(envs.get("FDKV_LAYER_WAIT_TIMEOUT_S"))  # type: ignore[arg-type]


def check_timeout(value: Any, name: str = "timeout_s") -> float:
    """``value`` as float seconds: a finite number >= 0, else TypeError / ValueError.

    NaN would make every deadline comparison false and infinity overflows the thread
    primitives' timeouts, so both are refused up front.
    """
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        raise TypeError(f"{name} must be a finite number of seconds >= 0, got {value!r} ({type(value).__name__})")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value!r}")
    return float(value)


class LayerDoneCounter:
    """Events of one layer-by-layer load, one per layer, plus the load's outcome.

    The transfer manager creates it, fills in each layer's event as soon as that layer's copy
    has been enqueued (:meth:`set_layer_event`) and records a failure with :meth:`fail`.
    Consumers only wait.  On GPU backends the layers are launched by a launcher thread by
    default (``async_launch``), so an event may not exist yet when ``submit_swap_tasks``
    returns; a wait then first blocks on a condition variable until it is set, bounded by the
    timeout.  With ``async_launch=False`` every event exists before ``submit_swap_tasks``
    returns.
    """

    def __init__(
        self,
        task_id: int,
        num_layers: int,
        backend: "Backend",
        timeout_s: Optional[float] = None,
        enforce: bool = True,
    ) -> None:
        self.task_id = task_id
        self.num_layers = num_layers
        self._backend = backend
        self._timeout_s = default_timeout_s() if timeout_s is None else check_timeout(timeout_s)
        # NOTE: ``enforce=False`` exists only so the GPU race test for ordering rule 3 can
        # show the corruption that appears without the wait; never set it in serving.
        self._enforce = enforce
        self._events: list[Any] = [None] * num_layers
        self._error: Optional[str] = None
        self._failed_layer: int = -1
        self._cond = threading.Condition()
        # A one-call layer stack (attach_layer_groups): its events, handed out as its
        # progress says they are recorded.
        self._group_events: Optional[list[Any]] = None
        self._group_progress: Any = None
        self._group_handed = 0  # group events handed to self._events so far

    # ------------------------------------------------------------------ producer side
    def set_layer_event(self, layer: int, event: Any) -> None:
        """Attach the event recorded after ``layer``'s copy (called by the transfer manager)."""
        with self._cond:
            self._events[layer] = event
            self._cond.notify_all()

    def attach_layer_groups(self, events: list[Any], progress: Any) -> None:
        """The load goes through one native call (``ops.LayerStackCall``): ``events[l]`` is
        recorded once ``progress`` reaches ``l + 1``.  Waits block on the progress object (the
        GIL released) instead of this condition variable."""
        with self._cond:
            self._group_events = list(events)
            self._group_progress = progress
            self._cond.notify_all()

    def fail(self, layer: int, error: str) -> None:
        """Record that the load failed at ``layer``; every later wait raises LayerSwapError."""
        with self._cond:
            if self._error is None:
                self._error = error
                self._failed_layer = layer
            self._cond.notify_all()

    # ------------------------------------------------------------------ state
    @property
    def failed(self) -> bool:
        return self._error is not None

    @property
    def error(self) -> Optional[str]:
        return self._error

    def is_layer_done(self, layer: int) -> bool:
        """Non-blocking: has layer ``layer``'s copy completed?  (False if failed.)"""
        self._check_layer(layer)
        if self._error is not None:
            return False
        event = self._events[layer]
        return event is not None and self._backend.event_done(event)

    def all_done(self) -> bool:
        return all(self.is_layer_done(i) for i in range(self.num_layers))

    # ------------------------------------------------------------------ consumer side
    def wait_for_layer(self, layer: int, stream: Any = None) -> None:
        """Order the compute stream after layer ``layer``'s copy.

        GPU backends: ``stream`` (default: the current compute stream) waits on the layer's
        event on the device; this returns at once.  Host-thread backends: the calling thread
        is the compute stream, so it blocks until the layer is copied (bounded by the timeout).
        Raises LayerSwapError if the load failed, so a failed copy is never read as KV.
        """
        event = self._event_for(layer)
        if not self._enforce:
            return
        # NOTE: one non-blocking query (not a poll loop).  A layer whose copy has already
        # completed needs no device-side wait; skipping it saves the small scheduling gap a
        # cross-stream wait puts between two compute kernels (~48 of them per forward).
        try:
            if self._backend.event_done(event):
                if self._error is not None:
                    raise LayerSwapError(self._failed_layer, self.task_id, self._error)
                return
        except LayerSwapError:
            raise
        except Exception:  # noqa: BLE001 - let the device-side wait surface any error later
            logger.debug("event query failed for layer %d of task %d", layer, self.task_id, exc_info=True)
        if stream is None:
            stream = self._backend.current_stream()
        try:
            self._backend.stream_wait_event(stream, event, self._timeout_s)
        except TimeoutError:
            raise LayerSwapTimeoutError(layer, self.task_id, self._timeout_s) from None
        if self._error is not None:  # a host-thread copy may fail while we waited
            raise LayerSwapError(self._failed_layer, self.task_id, self._error)

    def synchronize_layer(self, layer: int, timeout_s: Optional[float] = None) -> None:
        """Block the host until layer ``layer`` is copied (for host-side consumers)."""
        timeout = self._timeout_s if timeout_s is None else check_timeout(timeout_s)
        deadline = time.monotonic() + timeout
        event = self._event_for(layer, deadline, timeout)
        remaining = max(0.0, deadline - time.monotonic())
        if not self._backend.event_wait_host(event, remaining):
            raise LayerSwapTimeoutError(layer, self.task_id, timeout)
        if self._error is not None:
            raise LayerSwapError(self._failed_layer, self.task_id, self._error)

    def wait_all(self, timeout_s: Optional[float] = None) -> None:
        """Block the host until every layer is copied; raises on failure or timeout."""
        timeout = self._timeout_s if timeout_s is None else check_timeout(timeout_s)
        deadline = time.monotonic() + timeout
        for layer in range(self.num_layers):
            self.synchronize_layer(layer, max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ helpers
    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, numbers.Integral) or isinstance(layer, bool):
            raise TypeError(f"layer must be an int, got {layer!r} ({type(layer).__name__})")
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers}) for task {self.task_id}")

    def _event_for(self, layer: int, deadline: Optional[float] = None, timeout_s: Optional[float] = None) -> Any:
        """The layer's event, waiting (bounded) for the producer to attach it.

        ``timeout_s`` is the limit the caller's wait runs under (reported on timeout).
        """
        self._check_layer(layer)
        if timeout_s is None:
            timeout_s = self._timeout_s
        if deadline is None:
            deadline = time.monotonic() + timeout_s
        with self._cond:
            while self._events[layer] is None and self._error is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise LayerSwapTimeoutError(layer, self.task_id, timeout_s)
                progress, events = self._group_progress, self._group_events
                if progress is not None and events is not None:
                    self._cond.release()
                    try:
                        done = progress.wait(layer + 1, remaining)
                    finally:
                        self._cond.acquire()
                    if done < 0:
                        # The call failed: its progress says where and why (a launched
                        # stack has no Python launcher that would call fail()).
                        self._group_progress = None
                        self.fail(progress.state().failed_group, progress.error() or "the layer-group copy failed")
                        continue
                    for i in range(self._group_handed, min(done, self.num_layers)):
                        if self._events[i] is None:
                            self._events[i] = events[i]
                    self._group_handed = max(self._group_handed, min(done, self.num_layers))
                    continue
                self._cond.wait(remaining)
            if self._error is not None:
                # Even if this layer's copy landed, the task as a whole failed and the
                # scheduler will recompute all of its blocks: no layer of it may be served.
                raise LayerSwapError(self._failed_layer, self.task_id, self._error)
            return self._events[layer]

    def __repr__(self) -> str:
        state = "failed" if self.failed else "ok"
        return f"LayerDoneCounter(task={self.task_id}, layers={self.num_layers}, {state})"
