"""What the transfer manager needs from a framework: memory, streams, events and the copy op.

Three backends implement it (``cupy``, ``paddle``, ``cpu``).  The transfer manager is written
once against this interface, so the ordering rules are enforced by one piece of code whatever
runs underneath.

Host-thread streams
-------------------
Without a GPU there are no CUDA streams, but the worker's ordering logic is the same, so the
CPU paths emulate them: a :class:`HostStream` is a FIFO worker thread (work submitted to it
runs in order, concurrently with the caller and with other streams), a :class:`HostEvent` is
set when the stream reaches the point where it was recorded, and "stream waits on event" is a
task that blocks that thread.  The caller's own thread plays the compute stream
(:data:`CALLER_STREAM`): recording on it yields an already-set event and waiting on it blocks
the caller.  A synchronous ``HostStream`` runs each task inline, which gives a deterministic
mode for simple tests.
"""

from __future__ import annotations

import abc
import contextlib
import ctypes
import logging
import queue
import threading
import time
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence

from fastdeploy_kvcache.core.metadata import CopyDirection

logger = logging.getLogger(__name__)

ErrorSink = Callable[[BaseException], None]

# Cache dtype -> the dtype an array library without bfloat16 (numpy, CuPy) stores it as.
# NOTE: one table for every backend: the copies move bytes only, so a bf16 cache held as
# uint16 round-trips exactly; Paddle keeps the real dtype but accepts the same names.
CACHE_DTYPES: dict[str, str] = {"bfloat16": "uint16", "float16": "float16", "float32": "float32", "uint8": "uint8"}


# Alignment of each buffer carved out of a cache slab (host or device): the copy kernels'
# widest vectors need 16 bytes; buffers of one size still sit at one pitch.
SLAB_ALIGN = 256


def slab_offsets(sizes: Iterable[int]) -> tuple[list[int], int]:
    """Offsets of buffers of ``sizes`` bytes laid back to back in one allocation, each
    SLAB_ALIGN-aligned, and the allocation's size (the host and device cache slabs)."""
    offsets, total = [], 0
    for nbytes in sizes:
        offsets.append(total)
        total += -(-int(nbytes) // SLAB_ALIGN) * SLAB_ALIGN
    return offsets, total


def storage_dtype(dtype: str) -> str:
    """The storage dtype of cache dtype ``dtype`` (ValueError naming the accepted ones)."""
    try:
        return CACHE_DTYPES[dtype]
    except (KeyError, TypeError):
        raise ValueError(f"unsupported cache dtype {dtype!r}; expected one of {sorted(CACHE_DTYPES)}") from None


class Backend(abc.ABC):
    """Framework adapter used by ``TransferManager`` and ``CacheController``.

    Streams and events are opaque objects of the backend.  ``launch`` runs ``fn`` "on" a
    stream: a GPU backend calls it at once (it only enqueues device work); a host-thread
    backend queues it on the stream's thread.  An exception from ``fn`` goes to ``on_error``
    (for a GPU backend synchronously, for a thread later), never to the forward pass.
    """

    name: str = "base"
    #: True when device memory is a GPU's and copies are asynchronous on CUDA streams.
    is_cuda: bool = False

    def __init__(self, device_id: int = 0) -> None:
        self.device_id = device_id

    # ------------------------------------------------------------------ memory
    @abc.abstractmethod
    def alloc_device(self, shape: Sequence[int], dtype: str) -> Any:
        """A zero-filled device array of the cache dtype (bf16 may be stored as uint16)."""

    def alloc_device_lanes(self, shapes: Sequence[tuple[Sequence[int], str]]) -> list[Any]:
        """Zero-filled device arrays, one per ``(shape, dtype)``, in this order.

        Backends that can carve views from one allocation do, at one pitch (the copy op then
        moves a run of blocks of every layer as one 2D copy: docs/ops.md, "Lanes at one
        pitch"): CuPy always, Paddle for arrays of one shape and dtype.  This default
        allocates each array on its own.
        """
        return [self.alloc_device(shape, dtype) for shape, dtype in shapes]

    @abc.abstractmethod
    def fill_zero(self, array: Any) -> None:
        """Zero a device array in place (reset_cache)."""

    def release_device(self) -> None:  # noqa: B027 - optional hook
        """Return unused device memory to the driver, where the framework has a way to.

        Callers drop every reference to the arrays first; the framework's pool can only
        return blocks that no live array holds.
        """

    @abc.abstractmethod
    def host_alloc(self, nbytes: int) -> int:
        """Pinned host memory (an aligned allocation without CUDA); returns the address."""

    @abc.abstractmethod
    def host_free(self, ptr: int) -> None:
        """Free memory from :meth:`host_alloc` or :meth:`host_reserve`."""

    def host_reserve(self, nbytes: int) -> int:
        """Address space for a host buffer that :meth:`host_pin` pins piece by piece, so the
        host tier can serve from the pieces pinned so far while the rest is pinned.  Freed
        by :meth:`host_free`.  This default pins the whole buffer now (:meth:`host_alloc`)."""
        return self.host_alloc(nbytes)

    def host_pin(self, base: int, ranges: Sequence[tuple[int, int]]) -> int:
        """Make the ``(offset, length)`` byte ranges of a :meth:`host_reserve` buffer resident
        and pinned (rounded out to pages; pages pinned before are left alone).  Returns the
        bytes newly pinned.  The default has nothing to do: its reserve pinned everything."""
        return 0

    # ------------------------------------------------------------------ streams and events
    @abc.abstractmethod
    def create_stream(self) -> Any:
        """A stream that does not synchronize with the compute stream or any other."""

    @abc.abstractmethod
    def current_stream(self) -> Any:
        """The stream the calling thread's compute runs on."""

    @abc.abstractmethod
    def record_event(self, stream: Any, timing: bool = False) -> Any:
        """A new event recorded on ``stream`` (``timing`` asks for one usable in elapsed_s)."""

    @abc.abstractmethod
    def stream_wait_event(self, stream: Any, event: Any, timeout_s: Optional[float] = None) -> None:
        """Make later work on ``stream`` wait for ``event``.

        A device-side wait on GPUs (returns at once, ``timeout_s`` unused); on the caller
        stream of a host-thread backend, a blocking wait that raises TimeoutError.
        """

    @abc.abstractmethod
    def event_done(self, event: Any) -> bool:
        """Non-blocking completion query; raises if the device reported an error."""

    @abc.abstractmethod
    def event_wait_host(self, event: Any, timeout_s: float) -> bool:
        """Block the host until ``event`` completes; False on timeout."""

    @abc.abstractmethod
    def elapsed_s(self, start: Any, end: Any) -> float:
        """Seconds between two completed timing events."""

    @abc.abstractmethod
    def launch(self, stream: Any, fn: Callable[[], None], on_error: ErrorSink) -> None:
        """Run ``fn`` on ``stream``; exceptions go to ``on_error``."""

    def synchronize(self) -> None:  # noqa: B027 - optional hook
        """Wait for all device work (shutdown and tests only)."""

    def bind_thread(self) -> None:  # noqa: B027 - optional hook
        """Make the calling thread use this backend's device (run first on the launcher)."""

    # ------------------------------------------------------------------ copy
    def prepare_ids(self, ids: Sequence[int]) -> Any:
        """Convert a block-id list once per task into what :meth:`swap_blocks` takes."""
        return list(ids)

    @abc.abstractmethod
    def swap_blocks(
        self,
        device_arrays: Sequence[Any],
        host_ptrs: Sequence[int],
        num_host_blocks: int,
        device_ids: Any,
        host_ids: Any,
        direction: CopyDirection,
        stream: Any,
        path: Optional[int] = None,
    ) -> None:
        """Copy blocks between each device array and its host buffer, in one op launch.

        ``device_ids[j]`` of every array pairs with ``host_ids[j]`` of its host buffer (ids
        as returned by :meth:`prepare_ids`).  Arrays may differ in block size (K/V versus
        scales).  ``direction`` (a CopyDirection, or its int value: the ops' ``mode``) says
        which way.  Enqueued on ``stream``; never synchronizes the host on a GPU.  ``path``
        is the op's per-call copy path (``ops.COPY_PATH_*``; None: the process-wide option).
        """

    def last_path(self) -> int:
        """``ops.PATH_*`` bits of the calling thread's last :meth:`swap_blocks` (0: unknown)."""
        return 0

    def describe_arrays(self, arrays: Sequence[Any], host_ptrs: Optional[Sequence[int]] = None) -> Sequence[Any]:
        """What :meth:`swap_blocks` takes for ``arrays``, worked out once (the transfer manager
        keeps one per layout): backends that pass raw pointers read them here, not on every
        call (an all-layer call has ~100 arrays).  ``host_ptrs``: the host buffers the
        arrays are always copied with, if fixed (a call that passes this very list then
        skips converting it)."""
        return tuple(arrays)

    #: True where :meth:`prepare_layer_stack` enqueues a whole layer stack natively.
    has_layer_groups = False

    def create_stack_launcher(self) -> Any:
        """A native launcher thread for :meth:`prepare_layer_stack` (``ops.StackLauncher``),
        owned by the caller, who closes it (only where :attr:`has_layer_groups`)."""
        raise NotImplementedError(f"the {type(self).__name__} backend has no native layer-group copy")

    def layer_stack_handles(self, num_layers: int) -> "LayerStackHandles":
        """The events and progress object of one :meth:`PreparedLayerStack.launch` (only where
        :attr:`has_layer_groups`).  Every event is one no earlier call's consumer can still
        see: a layer event comes back for reuse only through :meth:`recycle_layer_events`."""
        raise NotImplementedError(f"the {type(self).__name__} backend has no native layer-group copy")

    def recycle_layer_events(self, events: Sequence[Any], event_array: Any) -> None:  # noqa: B027 - optional hook
        """Take back a call's layer events (and their ``LayerStackHandles.event_array``) once
        nothing can wait on them any more."""

    def prepare_layer_stack(
        self,
        launcher: Any,
        device_arrays: Sequence[Any],
        host_ptrs: Sequence[int],
        group_size: int,
        num_host_blocks: int,
        direction: CopyDirection,
        stream: Any,
        path: Optional[int] = None,
    ) -> "PreparedLayerStack":
        """A layer stack's launch with everything but the ids, handles and waits bound and
        converted once (a worker launches every load with the same arrays and stream):
        :meth:`PreparedLayerStack.launch` enqueues one stack.  ``device_arrays`` (as from
        :meth:`describe_arrays`) and ``host_ptrs`` hold every layer's arrays in layer order,
        ``group_size`` per layer (only where :attr:`has_layer_groups`)."""
        raise NotImplementedError(f"the {type(self).__name__} backend has no native layer-group copy")


class PreparedLayerStack:
    """A layer stack's fixed arguments (:meth:`Backend.prepare_layer_stack`); :meth:`launch`
    enqueues one stack."""

    __slots__ = ("_call", "_scope")

    def __init__(self, call: Any, scope: Callable[[], Any]) -> None:
        self._call = call  # ops.LayerStackCall
        self._scope = scope  # a context manager factory: the backend's device, where it has one

    def launch(self, device_ids: Any, host_ids: Any, handles: "LayerStackHandles", waits: Sequence[Any]) -> None:
        """Enqueue a layer stack without waiting for it: a wait on each event of ``waits``,
        ``handles.start_event``, each layer's copies followed by its event
        (``handles.events[l]``), ``handles.done_event``.  ``handles.progress`` advances per
        layer, closes once the done event is recorded, and carries a CUDA failure
        (``ops.LayerStackCall.launch``).  With an idle launcher
        (:meth:`Backend.create_stack_launcher`) the calling thread enqueues the waits and the
        first layer, the launcher's thread the rest; no launcher: all of it here.  Raises on a
        bad argument (nothing enqueued).  The caller keeps ``waits`` and ``handles`` alive
        until the progress is closed.

        Why: a Python loop per layer pays ctypes, checks and the GIL per layer, and a Python
        launcher thread made the first layer wait for its wake-up and the GIL; the native
        launcher takes the stack as one checked job.
        """
        with self._scope():
            self._call.launch(device_ids, host_ids, handles.progress, handles.event_array,
                              [w.ptr for w in waits], handles.start_event.ptr, handles.done_event.ptr)


class LayerStackHandles(NamedTuple):
    """What one :meth:`PreparedLayerStack.launch` records and reports through."""

    events: list[Any]  # one per layer, recorded after its copies
    progress: Any  # ops.GroupProgress
    start_event: Any  # timing events around the whole stack
    done_event: Any
    event_array: Any  # ops.HandleArray of ``events``, converted once per event set


# ---------------------------------------------------------------------- host-thread streams
class HostEvent:
    """A point on a :class:`HostStream`: set once the stream has run everything before it."""

    __slots__ = ("_flag", "t")

    def __init__(self, already_set: bool = False) -> None:
        self._flag = threading.Event()
        self.t = 0.0
        if already_set:
            self.set()

    def set(self) -> None:
        self.t = time.perf_counter()
        self._flag.set()

    def is_set(self) -> bool:
        return self._flag.is_set()

    def wait(self, timeout_s: Optional[float]) -> bool:
        return self._flag.wait(timeout_s)


class _CallerStream:
    """The calling thread, which is the compute stream of a host-thread backend."""

    def __repr__(self) -> str:
        return "CALLER_STREAM"


CALLER_STREAM = _CallerStream()


class HostStream:
    """An in-order queue of work run by one daemon thread (or inline when synchronous).

    ``pause()`` / ``resume()`` hold the thread between tasks; tests use them to widen race
    windows deterministically, the way a spin kernel does on a GPU.
    """

    def __init__(self, name: str, synchronous: bool = False) -> None:
        self.name = name
        self.synchronous = synchronous
        self._gate = threading.Event()
        self._gate.set()
        self._queue: "queue.Queue[Optional[Callable[[], None]]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        if not synchronous:
            self._thread = threading.Thread(target=self._run, name=f"fdkv-{name}", daemon=True)
            self._thread.start()

    def submit(self, fn: Callable[[], None]) -> None:
        if self.synchronous:
            fn()
        else:
            self._queue.put(fn)

    def pause(self) -> None:
        """Hold the stream: the next task waits until :meth:`resume` (tests only)."""
        if self.synchronous:
            raise RuntimeError("a synchronous HostStream cannot be paused")
        self._gate.clear()

    def resume(self) -> None:
        self._gate.set()

    def idle(self) -> bool:
        """True once every submitted task has run (a synchronous stream always is)."""
        return self._queue.unfinished_tasks == 0

    def close(self) -> None:
        if self._thread is not None:
            self._gate.set()
            self._queue.put(None)
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            self._gate.wait()
            try:
                fn()
            except BaseException:  # noqa: BLE001 - tasks route their own errors; keep serving
                logger.exception("unhandled error on host stream %s", self.name)
            finally:
                self._queue.task_done()  # idle() counts what is still queued or running

    def __repr__(self) -> str:
        mode = "sync" if self.synchronous else "thread"
        return f"HostStream({self.name}, {mode})"


class HostThreadBackend(Backend):
    """Shared stream/event emulation of the CPU backends (``cpu`` and CPU ``paddle``)."""

    is_cuda = False

    def __init__(self, device_id: int = 0, threaded: bool = True) -> None:
        super().__init__(device_id)
        self.threaded = threaded
        self._tls = threading.local()
        self._streams: list[HostStream] = []

    # NOTE: tests may run "compute" on a HostStream of its own (use_compute_stream) so that
    # ordering rule 1 (copy after the compute that wrote the block) is observable on CPU too.
    def use_compute_stream(self, stream: Optional[HostStream]) -> None:
        """Make ``stream`` the calling thread's compute stream (None: the caller itself)."""
        self._tls.stream = stream

    def create_stream(self) -> HostStream:
        stream = HostStream(f"stream{len(self._streams)}", synchronous=not self.threaded)
        self._streams.append(stream)
        return stream

    def current_stream(self) -> Any:
        return getattr(self._tls, "stream", None) or CALLER_STREAM

    def record_event(self, stream: Any, timing: bool = False) -> HostEvent:
        if stream is CALLER_STREAM:
            return HostEvent(already_set=True)
        event = HostEvent()
        stream.submit(event.set)
        return event

    def stream_wait_event(self, stream: Any, event: Any, timeout_s: Optional[float] = None) -> None:
        if stream is CALLER_STREAM:
            if not event.wait(timeout_s):
                raise TimeoutError(f"event not reached within {timeout_s}s")
            return
        if stream.synchronous:
            # Inline streams run everything at submit; an unset event here would deadlock.
            if not event.wait(timeout_s):
                raise TimeoutError(f"event not reached within {timeout_s}s")
            return
        stream.submit(lambda: event.wait(None))

    def event_done(self, event: Any) -> bool:
        return event.is_set()

    def event_wait_host(self, event: Any, timeout_s: float) -> bool:
        return event.wait(timeout_s)

    def elapsed_s(self, start: Any, end: Any) -> float:
        return max(0.0, end.t - start.t)

    def launch(self, stream: Any, fn: Callable[[], None], on_error: ErrorSink) -> None:
        def task() -> None:
            try:
                fn()
            except Exception as exc:  # noqa: BLE001 - reported to the task's metadata
                on_error(exc)

        if stream is CALLER_STREAM:
            task()
        else:
            stream.submit(task)

    def close_streams(self) -> None:
        for stream in self._streams:
            stream.close()
        self._streams.clear()


class CudaBackend(Backend):
    """Shared behaviour of the GPU backends (CuPy, Paddle-GPU).

    A launch only enqueues device work, so it runs at once on the calling thread, and a
    host-side timed wait has to poll the event.
    """

    is_cuda = True

    def stream_wait_event(self, stream: Any, event: Any, timeout_s: Optional[float] = None) -> None:
        # A device-side wait: returns at once (CuPy and Paddle streams both spell it so).
        stream.wait_event(event)

    def launch(self, stream: Any, fn: Callable[[], None], on_error: ErrorSink) -> None:
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - routed to the task's metadata
            on_error(exc)

    def event_wait_host(self, event: Any, timeout_s: float) -> bool:
        # NOTE: CUDA has no timed event wait.  Host-side waits (wait_all, shutdown) poll
        # with a backoff so they can honour the timeout; the compute path never does this,
        # it waits on the device (stream_wait_event).
        deadline = time.monotonic() + timeout_s
        delay = 20e-6
        while not self.event_done(event):
            if time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, 1e-3)
        return True


class CapiCopies:
    """Copies through a ctypes C ABI library (``ops.load_capi``): the ``cpu`` and ``cupy`` backends.

    Subclasses set ``_capi`` and say how to get a device address and a stream handle, and
    whether a call must finish before it returns (the CPU build runs on host-thread streams,
    so it copies synchronously inside the stream's task).
    """

    _capi: Any
    _sync_copies: bool = False

    def _device_ptr(self, array: Any) -> int:
        raise NotImplementedError

    def _stream_handle(self, stream: Any) -> int:
        raise NotImplementedError

    def host_alloc(self, nbytes: int) -> int:
        # The library's memory reads as zero (fresh anonymous pages): no memset of the tier.
        return self._capi.host_alloc(nbytes)

    def host_reserve(self, nbytes: int) -> int:
        return self._capi.host_reserve(nbytes)

    def host_pin(self, base: int, ranges: Sequence[tuple[int, int]]) -> int:
        return self._capi.host_pin_ranges(base, ranges, device=self.device_id if self.is_cuda else -1)

    def host_free(self, ptr: int) -> None:
        self._capi.host_free(ptr)

    def prepare_ids(self, ids: Sequence[int]) -> Any:
        import numpy as np

        return np.ascontiguousarray(ids, dtype=np.int64)

    def describe_arrays(self, arrays: Sequence[Any], host_ptrs: Optional[Sequence[int]] = None) -> "ArrayTable":
        from fastdeploy_kvcache import ops

        return ArrayTable(
            tuple(arrays),
            ops.TensorTable(
                [self._device_ptr(a) for a in arrays],
                [a.shape[0] for a in arrays],
                [a.nbytes // a.shape[0] for a in arrays],
                host_ptrs,
            ),
            host_ptrs,
        )

    def _table(self, device_arrays: Sequence[Any]) -> "ArrayTable":
        return device_arrays if isinstance(device_arrays, ArrayTable) else self.describe_arrays(device_arrays)

    @staticmethod
    def _host_arg(table: "ArrayTable", host_ptrs: Sequence[int]) -> Optional[Sequence[int]]:
        """None (the table's converted copy) when ``host_ptrs`` is the very list the table was
        made with; the list otherwise."""
        return None if table.host_list is not None and host_ptrs is table.host_list else host_ptrs

    def swap_blocks(
        self,
        device_arrays: Sequence[Any],
        host_ptrs: Sequence[int],
        num_host_blocks: int,
        device_ids: Any,
        host_ids: Any,
        direction: CopyDirection,
        stream: Any,
        path: Optional[int] = None,
    ) -> None:
        table = self._table(device_arrays)
        self._capi.swap_all_layers(
            table.tensors,
            self._host_arg(table, host_ptrs),
            0,  # block counts and sizes: in the table
            0,
            num_host_blocks,
            device_ids,
            host_ids,
            int(direction),
            stream=self._stream_handle(stream),
            sync=self._sync_copies,
            path=path,
        )

    def last_path(self) -> int:
        return self._capi.last_path()

    def _new_events(self, count: int, timing: bool = False) -> list[Any]:
        """``count`` unrecorded events with a ``ptr`` (the cudaEvent_t handle); ``timing``:
        ones :meth:`elapsed_s` can time."""
        raise NotImplementedError

    #: layer event sets kept for reuse (recycle_layer_events), per layer count
    _MAX_SPARE_EVENT_SETS = 4

    def create_stack_launcher(self) -> Any:
        return self._capi.stack_launcher()

    def layer_stack_handles(self, num_layers: int) -> LayerStackHandles:
        # NOTE: a load's first layer waited for these: making 48 CuPy events took 150-200 us
        # on an H100 host (docs/ops.md, "Measured costs"), now on the thread that
        # enqueues the first copy.  Layer events come back for reuse once their load's
        # counter is gone (recycle_layer_events), with their C array; the two timing events
        # are always new, since a later task may still hold a finished task's done event as
        # a fence.
        from fastdeploy_kvcache import ops

        spare = self._spare_layer_events().get(num_layers)
        if spare:
            events, array = spare.pop()  # list.pop: one taker per set
        else:
            events = self._new_events(num_layers)
            array = ops.HandleArray([e.ptr for e in events], "layer_stack_handles", "events")
        start, done = self._new_events(2, timing=True)
        return LayerStackHandles(events, self._capi.group_progress(), start, done, array)

    def recycle_layer_events(self, events: Sequence[Any], event_array: Any) -> None:
        spare = self._spare_layer_events().setdefault(len(events), [])
        if len(spare) < self._MAX_SPARE_EVENT_SETS:
            spare.append((list(events), event_array))

    def _spare_layer_events(self) -> dict[int, list[tuple[list[Any], Any]]]:
        return self.__dict__.setdefault("_spare_event_sets", {})

    def prepare_layer_stack(
        self,
        launcher: Any,
        device_arrays: Sequence[Any],
        host_ptrs: Sequence[int],
        group_size: int,
        num_host_blocks: int,
        direction: CopyDirection,
        stream: Any,
        path: Optional[int] = None,
    ) -> PreparedLayerStack:
        table = self._table(device_arrays)
        call = self._capi.layer_stack_call(
            launcher,
            table.tensors,
            self._host_arg(table, host_ptrs),
            group_size,
            0,  # block counts and sizes: in the table
            0,
            num_host_blocks,
            int(direction),
            stream=self._stream_handle(stream),
            path=path,
        )
        return PreparedLayerStack(call, self._launch_scope)

    def _launch_scope(self) -> Any:
        """The context a launch runs in (CuPy: its device, which the launch records)."""
        return contextlib.nullcontext()


class ArrayTable(tuple):
    """Device arrays with their addresses, block counts and block sizes converted once into
    the C ABI's arrays (:meth:`CapiCopies.describe_arrays`).  A tuple of the arrays, so it
    also iterates as one; holding them keeps the addresses valid while the table lives."""

    tensors: Any  # ops.TensorTable
    host_list: Optional[Sequence[int]]  # the host pointer list the table converted, if any

    def __new__(cls, arrays: tuple[Any, ...], tensors: Any, host_list: Optional[Sequence[int]] = None) -> "ArrayTable":
        table = super().__new__(cls, arrays)
        table.tensors = tensors
        table.host_list = host_list
        return table
