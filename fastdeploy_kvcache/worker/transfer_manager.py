"""Dual-stream block copies between the device cache and the pinned host cache.

Two streams, created once and owned here:

* the **output stream** runs device->host copies (write_back evictions and write-through
  backups), all layers in one op launch per task;
* the **input stream** runs host->device loads, one launch per layer, with an event after each
  layer so the forward pass can start layer ``i`` as soon as its blocks have landed (on
  backends with ``has_layer_groups``, one native call for the whole stack that records
  every layer's event itself).

Neither stream synchronizes with the compute stream or with the other except through the
events listed below, which implement the ordering rules of ``docs/architecture.md``, "Worker side":

1. A device->host copy starts after the compute that wrote its blocks: an event recorded on the
   compute stream at submit time, waited on by the output stream.  Loads wait on the same
   event, so a load never overwrites a block that compute enqueued earlier still reads
   (a block a finished request read in the previous step may be the load's destination).
2. Nothing overwrites a device block an in-flight device->host copy still reads.  For an
   eviction (its device blocks were freed and may be handed out again in this very step; the
   metadata says so with ``frees_device_blocks``) the compute stream waits on the copy's done
   event; a load whose destination overlaps an in-flight copy's source makes the input
   stream wait too.  Backups of blocks that stay cached need no fence: the scheduler never
   rewrites a full cached block, nor frees one while its copy is in flight.
3. Layer ``i``'s attention reads its blocks after layer ``i``'s load: the compute stream
   waits on the layer's event (``LayerDoneCounter.wait_for_layer``).
4. A host block an in-flight load reads is not overwritten: the scheduler does not reallocate
   it before ``complete_swap``, and as a cheap second guard a device->host copy into such a
   block makes the output stream wait on that load.
5. A load from host blocks that an in-flight device->host copy writes (a write_back eviction of
   this step or an earlier one) starts after that copy: the input stream waits on its event.

Fences 2, 4 and 5 are per block: a stream waits only on in-flight tasks of the other stream
that share a block with the new one, so unrelated loads and evictions keep overlapping.

Backups after loads (a scheduling choice, not an ordering rule).  A write-through backup
submitted in the same step as a load, sharing no block with it, waits on the output stream
for the load's done event (``backups_after_loads``, default on).  Both directions at
once share the host link (84-94 GB/s both ways against 55 one way on an H100), so a load that
runs beside a backup lands later and the forward pass, which waits for it layer by layer,
stalls; nothing waits for a backup.  Evictions that free device blocks never wait: this
step's compute waits for them (rule 2).

Launches.  On GPU backends the copies are launched by two launcher threads, one per
direction, each in submit order, so ``submit`` returns at once and the forward pass can start
while later layers are still being launched.  A ``wait_for_layer(i)`` that arrives before
layer ``i``'s event exists waits on a condition variable (no polling) until the launcher
records it, then enqueues the device-side wait.  This matters because one op launch costs
tens to hundreds of microseconds of host time: launching every layer before the forward
starts would delay compute by the sum.  ``async_launch=False`` launches on the calling
thread instead (the default for the host-thread CPU backends).  On backends that enqueue a
whole layer stack natively (``has_layer_groups``), a load skips the Python launcher: submit
hands it, fences included, to the C library's launcher thread, and enqueues its waits and
first layer itself when that thread is idle (``_launch_stack``; docs/architecture.md).

Copy paths.  Device->host copies name their copy path per call (``d2h_copy_path``,
default the DMA batch); loads follow the process-wide ``copy_path`` option.  The two
launcher threads issue both directions at once, which is why the choice travels with each
call instead of through the process-wide option.
"""

from __future__ import annotations

import array
import itertools
import logging
import numbers
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, NamedTuple, Optional, Sequence, TypeVar

from fastdeploy_kvcache import ops
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, CopyDirection
from fastdeploy_kvcache.worker.backends.base import Backend, HostEvent, HostStream, LayerStackHandles
from fastdeploy_kvcache.worker.layer_done import (
    LayerDoneCounter,
    LayerSwapTimeoutError,
    check_timeout,
    default_timeout_s,
)

logger = logging.getLogger(__name__)

ORDERING_RULES: dict[int, str] = {
    1: "device->host copy waits for the compute that wrote its blocks",
    2: "no write to a device block an in-flight device->host copy reads",
    3: "layer i's compute waits for layer i's load",
    4: "no device->host write into a host block an in-flight load reads",
    5: "a load waits for in-flight device->host copies into its host blocks",
}

_INT_TYPE = {int}  # the one id type _plain_int_ids lets through where a bool could hide


def _plain_int_ids(ids: Any, limit: int) -> Any:
    """``ids`` as an int64 numpy array when every one is an integer (not a bool) in
    ``[0, limit)``; None otherwise (the caller's loop then names the bad one).

    Why: one C-speed pass (``array('q')`` refuses floats, strings, None and overflow) where
    a load of 512 ids paid a type scan, ``min``, ``max`` and the backend's conversion, each
    a pass of its own; on the GPU hosts that Python ran ahead of the first copy at 4-8x
    its loop speed (docs/ops.md, "Measured costs").
    """
    import numpy as np

    try:
        arr = np.frombuffer(array.array("q", ids), dtype=np.int64)
    except (TypeError, OverflowError, ValueError):
        return None
    if arr.size == 0:
        return arr
    lo = int(arr.min())
    # A bool is 0 or 1: only a list whose least id is <= 1 can hold one.
    if lo <= 1 and not set(map(type, ids)) <= _INT_TYPE:
        return None
    return arr if 0 <= lo and int(arr.max()) < limit else None


class _CheckedIds(NamedTuple):
    """What :meth:`TransferManager._validate` found: an error, or the ids as the backend takes them."""

    error: Optional[str]
    device: Any = None
    host: Any = None


#: What :meth:`TransferManager.wrap_backend` returns: the wrapper it was given.
WrappedBackend = TypeVar("WrappedBackend")


def _check_metadata_arg(name: str, value: object) -> None:
    """TypeError unless ``value`` is None or a CacheSwapMetadata (checked before any work)."""
    if value is not None and not isinstance(value, CacheSwapMetadata):
        raise TypeError(f"{name} must be a CacheSwapMetadata or None, got {type(value).__name__} {value!r:.80}")


class ControllerClosedError(RuntimeError):
    """The worker was closed: its copy streams and launcher threads are gone.

    Raised at once by every call that would need them, instead of queueing work that
    nothing will ever run (which used to surface a minute later as a timeout).
    """


@dataclass
class CacheLayout:
    """The caches a transfer moves: per layer, the device arrays and their host buffers.

    ``device[l]`` lists layer ``l``'s arrays (key, value, then key/value scales when the
    cache is quantized) and ``host[l]`` the matching pinned buffers, each holding
    ``num_host_blocks`` blocks of the same per-block size as its device array.
    """

    device: list[list[Any]]
    host: list[list[int]]
    num_device_blocks: int
    num_host_blocks: int
    bytes_per_block: int

    @property
    def num_layers(self) -> int:
        return len(self.device)


class _Task:
    """One CacheSwapMetadata being carried out."""

    __slots__ = (
        "meta", "direction", "seq", "_id_sets", "counter", "error", "start_event",
        "done_event", "launched", "paths", "progress", "fences", "_lock",
    )

    def __init__(
        self,
        meta: CacheSwapMetadata,
        direction: CopyDirection,
        seq: int,
        counter: Optional[LayerDoneCounter],
        id_sets: Optional[tuple[frozenset, frozenset]] = None,
    ) -> None:
        """``id_sets``: the (device, host) id sets when the caller has made them already."""
        self.meta = meta
        self.direction = direction
        self.seq = seq
        # Made on first use (_conflicting_priors): most tasks never meet a conflicting one,
        # and 512 ids cost a load's start-up ~15-30 us of host time (docs/ops.md, "Measured costs").
        self._id_sets = id_sets
        self.counter = counter
        self.error: Optional[str] = None
        self.start_event: Any = None
        self.done_event: Any = None
        # Set by the launcher once every launch and event of the task has been enqueued
        # (a launched layer stack's: its progress, closed by the native launcher).
        self.launched: Any = threading.Event()
        # ops.PATH_* bits of the copy paths the task's launches used (0: unknown/none).
        self.paths = 0
        self.progress: Any = None  # a launched layer stack's ops.GroupProgress
        # The events a launched stack's stream waits on: kept alive until it is closed,
        # since the native launcher may enqueue the waits after submit returns.
        self.fences: Sequence[Any] = ()
        self._lock = threading.Lock()

    @property
    def device_ids(self) -> frozenset:
        return self._ids()[0]

    @property
    def host_ids(self) -> frozenset:
        return self._ids()[1]

    def _ids(self) -> tuple[frozenset, frozenset]:
        """The (device, host) block id sets (made once, under the manager's lock)."""
        if self._id_sets is None:
            meta = self.meta
            if self.direction is CopyDirection.DEVICE_TO_HOST:
                self._id_sets = frozenset(meta.src_block_ids), frozenset(meta.dst_block_ids)
            else:
                self._id_sets = frozenset(meta.dst_block_ids), frozenset(meta.src_block_ids)
        return self._id_sets

    def attach_stack(self, handles: LayerStackHandles) -> None:
        """The task goes as a launched layer stack: its events and launch state are the stack's."""
        self.progress = handles.progress
        self.start_event, self.done_event = handles.start_event, handles.done_event
        self.launched = _StackClosed(handles.progress)

    def take_stack_outcome(self) -> None:
        """Once launched: the paths a layer stack used, and its failure if it failed."""
        if self.progress is None:
            return
        state = self.progress.state()
        self.paths |= state.paths
        if state.failed:
            self.fail(self.progress.error() or "the layer stack failed", state.failed_group)

    def fail(self, error: Any, layer: int = -1) -> None:
        """Record the first failure (thread-safe: launcher and stream threads call this)."""
        text = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
        with self._lock:
            if self.error is not None:
                return
            self.error = text
        logger.error("%s task %d failed at layer %d: %s", self.direction.short, self.meta.task_id, layer, text)
        if self.counter is not None:
            self.counter.fail(layer, text)


class _StackClosed:
    """A launched layer stack's ``launched`` flag: its progress is closed once every stream
    operation of the stack (the done event included) is enqueued, or it failed."""

    __slots__ = ("_progress",)

    def __init__(self, progress: Any) -> None:
        self._progress = progress

    def is_set(self) -> bool:
        return bool(self._progress.is_closed())

    def wait(self, timeout_s: Optional[float]) -> bool:
        return bool(self._progress.wait_closed(1e9 if timeout_s is None else timeout_s))

    def set(self) -> None:
        """Nothing to do: only the native launcher (or an abandoned launch) closes it."""


@dataclass
class _LayoutTables:
    """A layout's arrays as the backend takes them (``Backend.describe_arrays``), made once
    per layout: an all-layer call has ~100 arrays, and reading their addresses on every
    call cost more host time than the native submit it feeds (docs/ops.md, "Measured costs")."""

    all_arrays: Sequence[Any]
    all_host: list[int]
    layers: list[Sequence[Any]]
    group_size: int  # arrays per layer, the same for every layer; 0 if the layers differ

    @classmethod
    def of(cls, layout: "CacheLayout", backend: Backend) -> "_LayoutTables":
        all_host = [p for layer in layout.host for p in layer]
        sizes = {len(a) for a in layout.device} | {len(p) for p in layout.host}
        return cls(
            backend.describe_arrays([a for layer in layout.device for a in layer], all_host),
            all_host,
            [backend.describe_arrays(layer, host) for layer, host in zip(layout.device, layout.host)],
            sizes.pop() if len(sizes) == 1 else 0,
        )


@dataclass
class _DirectionStats:
    tasks: int = 0
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0
    failed: int = 0
    paths: int = 0  # ops.PATH_* bits of every finished task's launches

    def as_dict(self) -> dict[str, float]:
        gbps = self.bytes / self.seconds / 1e9 if self.seconds > 0 else 0.0
        return {"tasks": self.tasks, "blocks": self.blocks, "bytes": self.bytes,
                "seconds": self.seconds, "failed": self.failed, "GB_per_s": gbps, "paths": self.paths}


class TransferManager:
    """Carries out swap metadata on the input/output streams and reports completions.

    Args:
        backend: framework adapter (streams, events, the copy op).
        disabled_rules: ordering rules whose fences are switched off (race tests only;
            default none).
        timeout_s: limit of host-side waits (default FDKV_LAYER_WAIT_TIMEOUT_S).
        async_launch: launch copies from a launcher thread (default: on GPU backends).
        d2h_copy_path: copy path of device->host copies, "dma", "auto", "kernel", "staged"
            or "process" (the process-wide ``copy_path`` option); default
            :attr:`DEFAULT_D2H_COPY_PATH` ("dma").  Loads always follow the process-wide option.
        backups_after_loads: start a backup of a step behind the step's load (module
            docstring); default on.
    """

    DEFAULT_D2H_COPY_PATH = "dma"
    D2H_COPY_PATHS = ("process", "auto", "kernel", "dma", "staged")

    def __init__(
        self,
        backend: Backend,
        disabled_rules: Optional[Iterable[int]] = None,
        timeout_s: Optional[float] = None,
        async_launch: Optional[bool] = None,
        d2h_copy_path: Optional[str] = None,
        backups_after_loads: Optional[bool] = None,
    ) -> None:
        self.backend = backend
        self.backups_after_loads = True if backups_after_loads is None else bool(backups_after_loads)
        # NOTE: evictions and write-through backups take the DMA batch by default, whatever
        # the block size.  They are background traffic beside the forward pass, and the copy
        # kernel (what the auto rule picks below 64 KiB) keeps its CTAs resident for the
        # whole copy: on an H100 a cuBLAS forward pass ran +218% slower next to 16 KiB-block
        # evictions on it, against +0.6% next to the DMA batch, which uses copy engines and
        # no SMs (docs/architecture.md, "Copy path per direction").
        # The price is device->host bandwidth at small blocks (~0.47 of the link at 16 KiB), which
        # only delays when a host copy is ready, and a write_back eviction's rule-2 fence.
        # Loads stay on the process-wide rule: the forward pass waits for them.
        name = self.DEFAULT_D2H_COPY_PATH if d2h_copy_path is None else str(d2h_copy_path).strip().lower()
        if name not in self.D2H_COPY_PATHS:
            raise ValueError(f"d2h_copy_path: {d2h_copy_path!r} is not one of {', '.join(self.D2H_COPY_PATHS)}")
        self.d2h_copy_path = name
        self._d2h_path_code = ops.copy_path_code(name)
        self.disabled_rules = frozenset() if disabled_rules is None else frozenset(disabled_rules)
        for rule in self.disabled_rules:
            if rule not in ORDERING_RULES:
                raise ValueError(f"unknown ordering rule {rule}; expected 1-5")
        if self.disabled_rules:
            logger.warning(
                "worker ordering fences DISABLED for rules %s: KV may be corrupted (tests only)",
                sorted(self.disabled_rules),
            )
        self.timeout_s = default_timeout_s() if timeout_s is None else check_timeout(timeout_s)
        self.input_stream = backend.create_stream()
        self.output_stream = backend.create_stream()
        self.layout: Optional[CacheLayout] = None
        self._tables: Optional[_LayoutTables] = None
        # A load's launch with the layout's arrays, stream and launcher bound (made at the
        # first load of a layout).
        self._load_stack: Any = None
        self._inflight: list[_Task] = []
        self._finished: list[CacheSwapMetadata] = []
        self._stats = {direction: _DirectionStats() for direction in CopyDirection}
        self._lock = threading.RLock()
        self._seq = itertools.count()
        self.async_launch = backend.is_cuda if async_launch is None else bool(async_launch)
        # NOTE: one launcher per direction, so that a slow eviction launch (a DMA batch of
        # thousands of copies costs milliseconds of host time) never delays the launches of
        # a load the forward pass is waiting for.  Cross-direction order is kept per task:
        # a task waits only for the launch of earlier other-direction tasks it conflicts with.
        self._launchers: dict[CopyDirection, HostStream] = {}
        self._closed = False
        # NOTE: where the backend enqueues a whole layer stack natively, loads go to a
        # native launcher thread: the submitting thread checks the stack and enqueues its
        # fences and first layer itself, with no Python thread hand-off before the first
        # copy (docs/architecture.md, "Launches").
        self._stack_launcher: Any = None
        if self.async_launch:
            for direction in (CopyDirection.DEVICE_TO_HOST, CopyDirection.HOST_TO_DEVICE):
                launcher = HostStream(f"launch-{direction.short}")
                launcher.submit(backend.bind_thread)
                self._launchers[direction] = launcher
            if backend.has_layer_groups:
                self._stack_launcher = backend.create_stack_launcher()

    # ------------------------------------------------------------------ setup
    def set_layout(self, layout: Optional[CacheLayout]) -> None:
        """Attach (or, with None, detach) the caches; only with nothing in flight."""
        with self._lock:
            if self._inflight:
                raise RuntimeError("cannot change the cache layout with copies in flight; drain() first")
            self.layout = layout
            self._tables = None if layout is None else _LayoutTables.of(layout, self.backend)
            self._load_stack = None

    def wrap_backend(self, wrap: Callable[[Backend], WrappedBackend]) -> WrappedBackend:
        """Put ``wrap(backend)`` between this manager and its backend, and return it.

        For a wrapper that delegates to the backend it wraps (fault injection in tests:
        ``worker.backends.faulty``): the streams, events and launchers made by the backend
        stay in use, and every later copy goes through the wrapper on the normal launch
        path.  Only with nothing in flight (RuntimeError otherwise): the layout's tables
        are made again through the wrapper.
        """
        with self._lock:
            self._reap()
            if self._inflight:
                raise RuntimeError("cannot wrap the backend with copies in flight; drain() first")
            wrapped = wrap(self.backend)
            self.backend = wrapped
            self.set_layout(self.layout)
            return wrapped

    # ------------------------------------------------------------------ submit
    def submit(
        self,
        evict_metadata: Optional[CacheSwapMetadata],
        swap_in_metadata: Optional[CacheSwapMetadata],
    ) -> Optional[LayerDoneCounter]:
        """Enqueue this step's device->host task, then its host->device task.

        Returns the load's LayerDoneCounter (None without a load).  The device->host task is
        enqueued first so that rule 5 can order a load after an eviction of the same step;
        a backup that shares no block with the step's load goes second and waits for it
        (``backups_after_loads``).
        Raises TypeError when an argument is neither None nor a CacheSwapMetadata, and
        ControllerClosedError after :meth:`close`; in both cases nothing is enqueued.
        """
        _check_metadata_arg("evict_metadata", evict_metadata)
        _check_metadata_arg("swap_in_metadata", swap_in_metadata)
        with self._lock:
            self._check_open()
            self._reap()
            compute = self.backend.current_stream()
            # Rule 1: one event marks "all compute enqueued so far"; both copy streams wait on it.
            compute_done = None
            if 1 not in self.disabled_rules and (evict_metadata is not None or swap_in_metadata is not None):
                compute_done = self.backend.record_event(compute)
            evict_task: Optional[_Task] = None
            load_task: Optional[_Task] = None
            backup_ids = self._backup_after_load_ids(evict_metadata, swap_in_metadata)
            if backup_ids is not None:
                assert evict_metadata is not None and swap_in_metadata is not None
                load_task = self._submit_h2d(swap_in_metadata, compute_done)
                evict_task = self._submit_d2h(evict_metadata, compute_done, after=load_task, id_sets=backup_ids)
            else:
                if evict_metadata is not None:
                    evict_task = self._submit_d2h(evict_metadata, compute_done)
                if swap_in_metadata is not None:
                    load_task = self._submit_h2d(swap_in_metadata, compute_done)
            counter = None if load_task is None else load_task.counter
        if (
            evict_task is not None
            and evict_metadata is not None
            and evict_metadata.frees_device_blocks
            and 2 not in self.disabled_rules
        ):
            # Rule 2: blocks of an eviction were freed by the scheduler and may be written by
            # this step's compute; the compute stream waits for the copy to have read them.
            # The scheduler says so explicitly (frees_device_blocks, kept through merges);
            # a backup-only copy reads blocks that stay allocated and needs no fence.
            # (Outside the lock: the launcher needs it to record the event we wait for.)
            task_id = evict_task.meta.task_id
            to_host = CopyDirection.DEVICE_TO_HOST
            if not evict_task.launched.wait(self.timeout_s):
                raise LayerSwapTimeoutError(-1, task_id, self.timeout_s, to_host)
            if evict_task.done_event is not None:
                try:
                    self.backend.stream_wait_event(compute, evict_task.done_event, self.timeout_s)
                except TimeoutError:
                    raise LayerSwapTimeoutError(-1, task_id, self.timeout_s, to_host) from None
        return counter

    def _backup_after_load_ids(
        self, evict_metadata: Optional[CacheSwapMetadata], swap_in_metadata: Optional[CacheSwapMetadata]
    ) -> Optional[tuple[frozenset, frozenset]]:
        """The backup's (device, host) id sets if this step's device->host task is a backup
        to start behind its load, else None (the sets go on to its task, made once).

        Only a backup (no device block freed: nothing in this step waits for it) that shares
        no device or host block with the load: with a shared block, rules 2, 4 and 5 order
        the two, and the backup must keep its place ahead of the load.
        """
        if not self.backups_after_loads or evict_metadata is None or swap_in_metadata is None:
            return None
        if evict_metadata.frees_device_blocks or evict_metadata.is_empty or swap_in_metadata.is_empty:
            return None
        try:
            device_ids = frozenset(evict_metadata.src_block_ids)
            host_ids = frozenset(evict_metadata.dst_block_ids)
            if device_ids.isdisjoint(swap_in_metadata.dst_block_ids) and host_ids.isdisjoint(
                swap_in_metadata.src_block_ids
            ):
                return device_ids, host_ids
        except TypeError:  # unhashable ids: validation fails the task; keep the plain order
            pass
        return None

    def _dispatch(self, direction: CopyDirection, job: Callable[[], None]) -> None:
        """Run a launch job on the direction's launcher thread (in submit order) or right here."""
        launcher = self._launchers.get(direction)
        if launcher is not None:
            launcher.submit(job)
        else:
            job()

    def _validate(self, meta: CacheSwapMetadata, direction: CopyDirection) -> "_CheckedIds":
        """The metadata's ids checked and converted for the backend, or the reason it cannot be
        carried out (``error``; nothing is launched then)."""
        layout = self.layout
        if layout is None:
            return _CheckedIds("the host cache is not initialized (initialize_kv_cache/initialize_host_cache)")
        to_host = direction is CopyDirection.DEVICE_TO_HOST
        want = (CacheLevel.DEVICE, CacheLevel.HOST) if to_host else (CacheLevel.HOST, CacheLevel.DEVICE)
        if (meta.src_type, meta.dst_type) != want:
            return _CheckedIds(
                f"{direction.short} task expects {want[0].name}->{want[1].name}, "
                f"got {meta.src_type.name}->{meta.dst_type.name}"
            )
        if len(meta.src_block_ids) != len(meta.dst_block_ids):
            return _CheckedIds(
                f"src_block_ids has {len(meta.src_block_ids)} ids, dst_block_ids {len(meta.dst_block_ids)}"
            )
        dev_ids, host_ids = (
            (meta.src_block_ids, meta.dst_block_ids) if to_host else (meta.dst_block_ids, meta.src_block_ids)
        )
        arrays = []
        for name, ids, limit in (("device", dev_ids, layout.num_device_blocks), ("host", host_ids, layout.num_host_blocks)):
            arr = _plain_int_ids(ids, limit)
            if arr is not None:
                arrays.append(arr)
                continue
            for index, block in enumerate(ids):
                if not isinstance(block, numbers.Integral) or isinstance(block, bool) or not 0 <= block < limit:
                    return _CheckedIds(f"{name} block id {block!r} at index {index} is out of range [0, {limit})")
            arrays.append(ids)  # numpy integers among them: valid, converted by the backend
        if len(set(meta.dst_block_ids)) != len(meta.dst_block_ids):
            seen: set[int] = set()
            for index, block in enumerate(meta.dst_block_ids):
                if block in seen:
                    return _CheckedIds(f"duplicate destination block id {block} at index {index}")
                seen.add(block)
        return _CheckedIds(None, self.backend.prepare_ids(arrays[0]), self.backend.prepare_ids(arrays[1]))

    def _conflicting_priors(self, task: _Task, rules: dict[str, int]) -> list[_Task]:
        """Earlier in-flight tasks of the other direction that share a block with ``task``.

        Called at submit, under the lock: every earlier task is in ``_inflight`` then, so
        the launcher needs neither the lock nor a scan (a task that finishes meanwhile
        costs one wait on a completed event).  ``rules`` maps "device"/"host" to the
        ordering rule that guards overlaps on that tier; a disabled rule's overlaps are
        ignored.
        """
        other = CopyDirection(1 - task.direction)
        check_dev = rules["device"] not in self.disabled_rules
        check_host = rules["host"] not in self.disabled_rules
        if not (check_dev or check_host):
            return []
        return [
            prior
            for prior in self._inflight
            if prior.seq < task.seq
            and prior.direction == other
            and (
                (check_dev and not task.device_ids.isdisjoint(prior.device_ids))
                or (check_host and not task.host_ids.isdisjoint(prior.host_ids))
            )
        ]

    def _wait_for_priors(self, stream: Any, priors: Sequence[_Task]) -> None:
        """Make ``stream`` wait for each prior's done event (on the launcher).

        A prior may still be in the other launcher's hands: we wait (host) for its launch
        first.  No cycle is possible: a prior only ever waits for tasks older than itself,
        and this launcher handled those before the current one.
        """
        self._wait_priors_launched(priors)
        for prior in priors:
            if prior.done_event is not None:
                self.backend.stream_wait_event(stream, prior.done_event, self.timeout_s)

    def _wait_priors_launched(self, priors: Sequence[_Task]) -> None:
        """Wait (host) until each prior's stream operations are enqueued, so its done event
        exists; raises LayerSwapTimeoutError naming the prior that did not make it."""
        for prior in priors:
            if not prior.launched.wait(self.timeout_s):
                raise LayerSwapTimeoutError(-1, prior.meta.task_id, self.timeout_s, prior.direction)

    def _submit_d2h(
        self,
        meta: CacheSwapMetadata,
        compute_done: Any,
        after: Optional[_Task] = None,
        id_sets: Optional[tuple[frozenset, frozenset]] = None,
    ) -> _Task:
        """Enqueue a device->host task; ``after``: a load of the same step to start behind."""
        task = _Task(meta, CopyDirection.DEVICE_TO_HOST, next(self._seq), None, id_sets)
        self._stats[CopyDirection.DEVICE_TO_HOST].tasks += 1
        if meta.is_empty:
            self._finish(task)
            return task
        checked = self._validate(meta, CopyDirection.DEVICE_TO_HOST)
        if checked.error is not None:
            task.fail(checked.error)
            self._finish(task)
            return task
        dev_ids, host_ids = checked.device, checked.host
        layout, tables = self.layout, self._tables
        assert layout is not None and tables is not None
        out = self.output_stream
        arrays, ptrs = tables.all_arrays, tables.all_host
        # Rule 2 (a load still writing a block we read) and rule 4 (a load still reading a
        # host block we are about to overwrite); a backup after loads waits for its step's
        # load the same way.
        priors = self._conflicting_priors(task, {"device": 2, "host": 4})
        if after is not None:
            priors.append(after)
        self._inflight.append(task)

        def run() -> None:
            self.backend.swap_blocks(
                arrays, ptrs, layout.num_host_blocks, dev_ids, host_ids, CopyDirection.DEVICE_TO_HOST, out,
                path=self._d2h_path_code,
            )
            task.paths |= self.backend.last_path()

        def job() -> None:
            try:
                if compute_done is not None:
                    # Rule 1: the compute that wrote these blocks was enqueued before submit.
                    self.backend.stream_wait_event(out, compute_done, self.timeout_s)
                self._wait_for_priors(out, priors)
                task.start_event = self.backend.record_event(out, timing=True)
                # NOTE: one launch moves every layer (a pointer table), so an eviction costs
                # one launch whatever the depth of the model.
                self.backend.launch(out, run, lambda exc: task.fail(exc, -1))
            except Exception as exc:  # noqa: BLE001 - an event/stream error fails the task
                task.fail(exc, -1)
            finally:
                self._close_task(task, out)

        self._dispatch(CopyDirection.DEVICE_TO_HOST, job)
        return task

    def _close_task(self, task: _Task, stream: Any) -> None:
        """Record the task's done event (even after a failure, so fences stay valid)."""
        try:
            task.done_event = self.backend.record_event(stream, timing=True)
        except Exception as exc:  # noqa: BLE001
            task.fail(exc)
        finally:
            task.launched.set()

    def _submit_h2d(self, meta: CacheSwapMetadata, compute_done: Any) -> _Task:
        """Enqueue a load; the task's ``counter`` is what submit returns (None if empty)."""
        layout = self.layout
        task = _Task(meta, CopyDirection.HOST_TO_DEVICE, next(self._seq), None)
        self._stats[CopyDirection.HOST_TO_DEVICE].tasks += 1
        if meta.is_empty:
            self._finish(task)  # nothing to wait for: submit returns no counter
            return task
        checked = self._validate(meta, CopyDirection.HOST_TO_DEVICE)
        if checked.error is not None:
            task.counter = self._new_counter(meta)
            task.fail(checked.error)
            self._finish(task)
            return task
        tables = self._tables
        assert layout is not None and tables is not None
        inp = self.input_stream
        dev_ids, host_ids = checked.device, checked.host
        # Rule 5 (an in-flight device->host copy still writing a host block we read) and
        # rule 2 (one still reading a device block we are about to overwrite).
        priors = self._conflicting_priors(task, {"device": 2, "host": 5})
        self._inflight.append(task)
        if self.backend.has_layer_groups and tables.group_size:
            # One native launch enqueues every layer and records its event.
            self._launch_stack(task, compute_done, priors, dev_ids, host_ids)
            return task
        num_layers = layout.num_layers
        task.counter = counter = self._new_counter(meta)

        def job() -> None:
            layer = -1
            try:
                if self._stack_launcher is not None and not self._stack_launcher.wait_idle(self.timeout_s):
                    # Stacks still being enqueued: our waits must not land between their layers.
                    raise LayerSwapTimeoutError(-1, meta.task_id, self.timeout_s, CopyDirection.HOST_TO_DEVICE)
                if compute_done is not None:
                    # Rule 1 for loads: earlier compute may still read a block we overwrite.
                    self.backend.stream_wait_event(inp, compute_done, self.timeout_s)
                self._wait_for_priors(inp, priors)
                task.start_event = self.backend.record_event(inp, timing=True)
                for layer in range(num_layers):
                    if task.error is not None:
                        break  # an earlier layer failed: the task is void, the counter failed
                    arrays, ptrs = tables.layers[layer], layout.host[layer]

                    def run(layer: int = layer, arrays: Sequence[Any] = arrays, ptrs: Sequence[int] = ptrs) -> None:
                        if task.error is not None:
                            return
                        self.backend.swap_blocks(
                            arrays, ptrs, layout.num_host_blocks, dev_ids, host_ids, CopyDirection.HOST_TO_DEVICE,
                            inp, path=ops.COPY_PATH_PROCESS,
                        )
                        task.paths |= self.backend.last_path()

                    self.backend.launch(inp, run, lambda exc, layer=layer: task.fail(exc, layer))
                    counter.set_layer_event(layer, self.backend.record_event(inp))
            except Exception as exc:  # noqa: BLE001 - an event/stream error fails the task
                task.fail(exc, layer)
            finally:
                self._close_task(task, inp)

        self._dispatch(CopyDirection.HOST_TO_DEVICE, job)
        return task

    def _launch_stack(
        self,
        task: _Task,
        compute_done: Any,
        priors: Sequence[_Task],
        dev_ids: Any,
        host_ids: Any,
    ) -> None:
        """Launch a load as one native layer stack (under the lock, at submit).

        Its fences travel with it: rule 1's compute event and the done events of its
        conflicting priors (rules 2 and 5).  Where every prior is launched and no earlier
        load waits on the Python launcher, this thread launches it, and the native launcher
        lets it enqueue the fences and the first layer itself when idle; otherwise the
        Python launcher waits (host-side) for the priors' launches first.  The load's
        counter is made after the launch: nothing reads it before submit returns, and the
        first copy waits for every line of Python ahead of it (docs/ops.md, "Measured
        costs").
        """
        layout, tables = self.layout, self._tables
        assert layout is not None and tables is not None
        handles = self.backend.layer_stack_handles(layout.num_layers)
        task.attach_stack(handles)
        if self._load_stack is None:
            self._load_stack = self.backend.prepare_layer_stack(
                self._stack_launcher, tables.all_arrays, tables.all_host, tables.group_size, layout.num_host_blocks,
                CopyDirection.HOST_TO_DEVICE, self.input_stream, path=ops.COPY_PATH_PROCESS,
            )
        stack = self._load_stack
        fences = [] if compute_done is None else [compute_done]

        def launch() -> None:
            waits = fences + [prior.done_event for prior in priors if prior.done_event is not None]
            task.fences = waits
            try:
                stack.launch(dev_ids, host_ids, handles, waits)
            except Exception as exc:  # noqa: BLE001 - a bad argument fails the task, nothing enqueued
                handles.progress.abandon(f"{type(exc).__name__}: {exc}")
                task.fail(exc, -1)

        # While an earlier load waits on the Python launcher, this one queues behind it there
        # (loads reach the native launcher in submit order).
        python_launcher = self._launchers.get(CopyDirection.HOST_TO_DEVICE)
        if (python_launcher is None or python_launcher.idle()) and all(prior.launched.is_set() for prior in priors):
            launch()
        else:

            def job() -> None:
                try:
                    self._wait_priors_launched(priors)
                except Exception as exc:  # noqa: BLE001 - never launched: the task fails
                    handles.progress.abandon(f"{type(exc).__name__}: {exc}")
                    task.fail(exc, -1)
                    return
                launch()

            self._dispatch(CopyDirection.HOST_TO_DEVICE, job)
        counter = self._new_counter(task.meta)
        counter.attach_layer_groups(handles.events, handles.progress)
        # The layer events serve again once no one can wait on them: the counter is gone.
        weakref.finalize(counter, self.backend.recycle_layer_events, handles.events, handles.event_array)
        task.counter = counter
        if task.error is not None:  # the launch was refused before the counter existed
            counter.fail(-1, task.error)

    def _new_counter(self, meta: CacheSwapMetadata) -> LayerDoneCounter:
        """A load's counter (what submit returns)."""
        num_layers = self.layout.num_layers if self.layout is not None else 0
        return LayerDoneCounter(
            meta.task_id, max(num_layers, 1), self.backend, self.timeout_s, enforce=3 not in self.disabled_rules
        )

    # ------------------------------------------------------------------ completion
    def _finish(self, task: _Task) -> None:
        """Mark the metadata (only now, after the bytes moved) and queue it for the engine."""
        task.launched.set()  # a task rejected before launch has nothing left to wait for
        task.take_stack_outcome()
        stats = self._stats[task.direction]
        ok = task.error is None
        task.meta.mark_done(ok, task.error)
        if ok:
            nbytes = len(task.meta) * (self.layout.bytes_per_block if self.layout is not None else 0)
            stats.paths |= task.paths
            stats.blocks += len(task.meta)
            stats.bytes += nbytes
            if task.start_event is not None and task.done_event is not None:
                try:
                    stats.seconds += self.backend.elapsed_s(task.start_event, task.done_event)
                except Exception:  # noqa: BLE001 - statistics must never fail a copy
                    logger.debug("elapsed time unavailable for task %d", task.meta.task_id, exc_info=True)
        else:
            stats.failed += 1
        self._finished.append(task.meta)

    def _reap(self) -> None:
        """Move completed in-flight tasks to the finished list (non-blocking)."""
        still: list[_Task] = []
        for task in self._inflight:
            if not task.launched.is_set():
                still.append(task)  # the launcher has not enqueued all of it yet
                continue
            if task.done_event is None:
                done = True  # failed before anything was enqueued
            else:
                try:
                    done = self.backend.event_done(task.done_event)
                except Exception as exc:  # noqa: BLE001 - a CUDA error surfaces here
                    task.fail(exc)
                    done = True
            if done:
                self._finish(task)
            else:
                still.append(task)
        self._inflight = still

    def poll(self) -> list[CacheSwapMetadata]:
        """Metadata whose copies finished since the last call, marked success or failure."""
        with self._lock:
            self._reap()
            finished, self._finished = self._finished, []
            return finished

    def flush_launches(self, timeout_s: Optional[float] = None) -> None:
        """Block until every submitted task is enqueued on its stream (tests, shutdown).

        Not needed for correctness: waits on a task's events already wait for its launch.
        """
        timeout_s = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        deadline = time.monotonic() + timeout_s
        for direction, launcher in list(self._launchers.items()):
            idle = HostEvent()
            launcher.submit(idle.set)
            if not idle.wait(max(0.0, deadline - time.monotonic())):
                raise LayerSwapTimeoutError(-1, -1, timeout_s, direction)
        # After the Python launchers: their loads are in the native launcher's hands by now.
        if self._stack_launcher is not None and not self._stack_launcher.wait_idle(
            max(0.0, deadline - time.monotonic())
        ):
            raise LayerSwapTimeoutError(-1, -1, timeout_s, CopyDirection.HOST_TO_DEVICE)

    def drain(self, timeout_s: Optional[float] = None) -> list[CacheSwapMetadata]:
        """Wait (host-side) for every in-flight task, then return all finished metadata."""
        timeout = self.timeout_s if timeout_s is None else check_timeout(timeout_s)
        deadline = time.monotonic() + timeout
        self.flush_launches(timeout)  # outside the lock: launch jobs take it
        with self._lock:
            tasks = list(self._inflight)
        for task in tasks:
            if not task.launched.wait(max(0.0, deadline - time.monotonic())):
                raise LayerSwapTimeoutError(-1, task.meta.task_id, timeout, task.direction)
            if task.done_event is None:
                continue
            try:
                ok = self.backend.event_wait_host(task.done_event, max(0.0, deadline - time.monotonic()))
            except Exception as exc:  # noqa: BLE001
                task.fail(exc)
                continue
            if not ok:
                # A load's last layer is the one still missing; an eviction moves all at once.
                last = self.layout.num_layers - 1 if self.layout is not None else -1
                layer = last if task.direction is CopyDirection.HOST_TO_DEVICE else -1
                raise LayerSwapTimeoutError(layer, task.meta.task_id, timeout, task.direction)
        self._wait_streams_idle(deadline, timeout)
        return self.poll()

    def _wait_streams_idle(self, deadline: float, timeout: float) -> None:
        """Wait until the copy streams have run everything queued on them.

        NOTE: a task can leave the in-flight list while its copy still runs (its done event
        reported an error: on a GPU the copy is dead then, on a host-thread stream it is
        not).  free_cache releases memory after drain, so drain must also know that nothing
        queued on either stream can still touch it.  Stopped streams (after close) ran their
        queue when they stopped.
        """
        if self._closed:
            return
        for stream, direction in ((self.input_stream, CopyDirection.HOST_TO_DEVICE),
                                  (self.output_stream, CopyDirection.DEVICE_TO_HOST)):
            event = self.backend.record_event(stream)
            if not self.backend.event_wait_host(event, max(0.0, deadline - time.monotonic())):
                raise LayerSwapTimeoutError(-1, -1, timeout, direction)

    # ------------------------------------------------------------------ introspection
    def in_flight_tasks(self) -> list[int]:
        with self._lock:
            return [t.meta.task_id for t in self._inflight]

    def get_stats(self) -> dict[str, Any]:
        with self._lock:
            return {
                **{direction.short: stats.as_dict() for direction, stats in self._stats.items()},
                "in_flight": len(self._inflight),
                "in_flight_tasks": [t.meta.task_id for t in self._inflight],
                "disabled_rules": sorted(self.disabled_rules),
                "d2h_copy_path": self.d2h_copy_path,
            }

    def reset_stats(self) -> None:
        with self._lock:
            self._stats = {direction: _DirectionStats() for direction in CopyDirection}

    @property
    def closed(self) -> bool:
        """True after :meth:`close`: nothing can be submitted any more."""
        return self._closed

    def _check_open(self) -> None:
        if self._closed:
            raise ControllerClosedError(
                "the transfer manager is closed (its streams are stopped); build a new CacheController"
            )

    def close(self) -> None:
        """Stop the launcher and host-thread streams (GPU streams go with the object).

        Idempotent.  Afterwards :meth:`submit` raises ControllerClosedError at once; what was
        submitted before still completes and can be collected with :meth:`poll`/:meth:`drain`.
        """
        self._closed = True
        for launcher in self._launchers.values():
            launcher.close()
        self._launchers.clear()
        if self._stack_launcher is not None:
            self._stack_launcher.close()  # enqueues what it still holds, then stops
        close = getattr(self.backend, "close_streams", None)
        if close is not None:
            close()
