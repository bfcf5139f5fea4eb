"""The layer-stack call: one native call moves a whole stack of layers, group by group,
with an event recorded behind each group (docs/ops.md, "Layer groups").

:meth:`CApi.layer_stack_call <fastdeploy_kvcache.ops.capi.CApi.layer_stack_call>` binds what
stays the same from one stack to the next into a :class:`LayerStackCall`; its
:meth:`~LayerStackCall.run` enqueues a stack on the calling thread, its
:meth:`~LayerStackCall.launch` hands it to a :class:`StackLauncher`.  :class:`GroupProgress`
tells another thread how far a stack got.

This module only holds a :class:`~fastdeploy_kvcache.ops.capi.CApi` instance (it never
imports that module), so the binding can import it without a cycle.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, NamedTuple, Optional, Sequence, Union

from fastdeploy_kvcache.ops.checks import IdsLike, StreamLike, SwapOpError, id_buffer, int_arg, ptr_arg, stream_handle

if TYPE_CHECKING:
    from fastdeploy_kvcache.ops.capi import CApi, TensorTable


class TableArgs(NamedTuple):
    """A swap's id-independent C arguments (``CApi.table_args``)."""

    dev_ptrs: Any
    num_blocks: Any
    block_bytes: Any
    count: int
    host_ptrs: Any
    num_host_blocks: int
    mode: int
    path: int


class HandleArray:
    """Handles (``cudaEvent_t`` as ints) converted once into the C array (``void**``) that
    :meth:`LayerStackCall.run` and :meth:`LayerStackCall.launch` take as ``events`` or ``waits``.

    Why: a worker passes the same set of layer events with many loads (it reuses them), and
    converting 48 handles per load was a measurable part of a load's start-up.
    """

    __slots__ = ("pointer", "count", "_array")

    def __init__(self, handles: Sequence[int], op: str = "handle_array", name: str = "handles") -> None:
        values = [ptr_arg(h, op, name) for h in handles]
        self._array = (ctypes.c_void_p * max(len(values), 1))(*values)
        self.pointer = ctypes.cast(self._array, ctypes.POINTER(ctypes.c_void_p))
        self.count = len(values)

    def __len__(self) -> int:
        return self.count


def handles_arg(handles: Union[None, Sequence[int], HandleArray], op: str, name: str) -> tuple[Any, int]:
    """A C array of handles (``void**``) and its length; (None, 0) for None."""
    if handles is None:
        return None, 0
    if type(handles) is not HandleArray:
        handles = HandleArray(handles, op, name)  # the cast pointer keeps its array alive
    return handles.pointer, handles.count


class LayerStackCall:
    """A layer stack's fixed arguments, checked and converted once (made by
    :meth:`CApi.layer_stack_call`): each :meth:`run` or :meth:`launch` converts only the ids,
    the events and the progress.

    Errors name the op ``layer_stack_call`` (the fixed arguments), ``layer_stack_call.run``
    or ``layer_stack_call.launch`` (the per-stack ones).
    """

    _OP = "layer_stack_call"
    _RUN = "layer_stack_call.run"
    _LAUNCH = "layer_stack_call.launch"

    def __init__(
        self,
        capi: "CApi",
        launcher: Optional["StackLauncher"],
        dev_ptrs: Union[Sequence[int], "TensorTable"],
        host_ptrs: Optional[Sequence[int]],
        group_size: int,
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        num_host_blocks: int,
        mode: int,
        stream: StreamLike,
        path: Union[int, str, None],
        inline_groups: int,
    ) -> None:
        op = self._OP
        self._capi = capi
        self._group_size = int_arg(group_size, op, "group_size")
        self._inline_groups = int_arg(inline_groups, op, "inline_groups")
        if launcher is not None and (not isinstance(launcher, StackLauncher) or launcher.handle is None):
            raise SwapOpError(f"{op}: launcher must be None or an open StackLauncher, got {launcher!r}",
                              op, "launcher", None)
        self._launcher = launcher
        self._table = capi.table_args(op, dev_ptrs, num_dev_blocks, block_bytes, host_ptrs, num_host_blocks, mode,
                                       path)
        self._stream = ctypes.c_void_p(stream_handle(stream))

    def run(
        self,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        events: Union[None, Sequence[int], HandleArray] = None,
        progress: Optional["GroupProgress"] = None,
        sync: bool = False,
    ) -> None:
        """Enqueue one stack on the calling thread, group by group, and return once every
        group is enqueued (after the copies too with ``sync``).

        ``events[g]`` (a ``cudaEvent_t`` handle as an int, e.g. ``cupy.cuda.Event().ptr``; 0
        for none) is recorded on the stream right after group g's copies.  Everything is
        checked before the first copy; a CUDA failure in group g raises naming it (earlier
        groups stay enqueued, later ones are not).  The CPU build takes no events (pass None).
        ``progress`` (from :meth:`CApi.group_progress`) lets another thread wait until group
        g's event is recorded before it waits on it.  A call made with a launcher launches
        (:meth:`launch`) instead.

        Why: a layer-by-layer load issued from Python pays ctypes, argument checks and the GIL
        once per layer; here the GIL is released once for the whole stack (docs/ops.md,
        "Layer groups").
        """
        op, capi, t = self._RUN, self._capi, self._table
        if self._launcher is not None:
            raise SwapOpError(f"{op}: this call is bound to a launcher; launch() it, or make one with launcher=None",
                              op, "launcher", None)
        if progress is not None and (not isinstance(progress, GroupProgress) or progress.handle is None):
            raise SwapOpError(f"{op}: progress must be None or an open GroupProgress, got {progress!r}",
                              op, "progress", None)
        d_keep, d_ptr, d_n = id_buffer(dev_ids, op, "dev_ids")
        h_keep, h_ptr, h_n = id_buffer(host_ids, op, "host_ids")
        ev_arr, ev_n = handles_arg(events, op, "events")
        rc = capi.lib.fdkv_swap_layer_groups(
            op.encode(), t.dev_ptrs, t.num_blocks, t.block_bytes, t.count, t.host_ptrs, t.num_host_blocks,
            self._group_size, d_ptr, d_n, h_ptr, h_n, t.mode, self._stream, ev_arr, ev_n,
            None if progress is None else progress.handle, 1 if sync else 0, t.path,
        )
        capi.check(rc)  # (d_keep and h_keep held the id buffers through the call)

    def launch(
        self,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        progress: "GroupProgress",
        events: Union[None, Sequence[int], HandleArray] = None,
        waits: Union[Sequence[int], HandleArray] = (),
        start_event: int = 0,
        done_event: int = 0,
    ) -> None:
        """:meth:`run` without waiting for the copies to be enqueued.

        Everything is checked here (a bad argument raises and fails ``progress``; nothing is
        enqueued).  Then, in launch order on the stream: a wait on each event of ``waits``,
        ``start_event``, the groups with ``events[g]``, ``done_event`` (``cudaEvent_t``
        handles as ints, or a :class:`HandleArray` of them; 0 for none).  With an idle
        launcher this thread enqueues the fences and the first ``inline_groups`` groups
        itself, the launcher's thread the rest; a busy launcher queues the whole stack behind
        the ones it holds; a call made without a launcher enqueues everything here.
        ``progress`` advances per group and is closed (:meth:`GroupProgress.wait_closed`) once
        ``done_event`` is recorded; a CUDA failure fails it (:meth:`GroupProgress.error` names
        the group) and still records ``done_event``.  Ids and handles are copied before this
        returns; the events themselves must live until ``progress`` is closed (the launcher
        may enqueue a wait or a record later).

        Why: a load's first copy waited for a Python launcher thread (its wake-up, the GIL it
        shares with the forward pass, the argument conversion): 0.5-0.9 ms on an H100 host,
        where the copy itself took 0.3 (docs/ops.md, "Measured costs").
        """
        op, capi, t = self._LAUNCH, self._capi, self._table
        if not isinstance(progress, GroupProgress) or progress.handle is None:
            raise SwapOpError(f"{op}: progress must be an open GroupProgress (capi.group_progress()), got {progress!r}",
                              op, "progress", None)
        launcher = None
        if self._launcher is not None:
            launcher = self._launcher.handle
            if launcher is None:
                raise SwapOpError(f"{op}: the launcher is closed", op, "launcher", None)
        d_keep, d_ptr, d_n = id_buffer(dev_ids, op, "dev_ids")
        h_keep, h_ptr, h_n = id_buffer(host_ids, op, "host_ids")
        ev_arr, ev_n = handles_arg(events, op, "events")
        wait_arr, wait_n = handles_arg(waits, op, "waits")
        rc = capi.lib.fdkv_launch_layer_groups(
            launcher, op.encode(), t.dev_ptrs, t.num_blocks, t.block_bytes, t.count, t.host_ptrs,
            t.num_host_blocks, self._group_size, d_ptr, d_n, h_ptr, h_n, t.mode, self._stream, ev_arr, ev_n,
            progress.handle, wait_arr, wait_n, ptr_arg(start_event, op, "start_event"),
            ptr_arg(done_event, op, "done_event"), t.path, self._inline_groups,
        )
        capi.check(rc)  # (d_keep and h_keep held the id buffers through the call)


class GroupProgress:
    """How many groups of one :meth:`LayerStackCall.run` or :meth:`LayerStackCall.launch`
    call are enqueued (their copies and event), for a thread that must wait on group g's
    event only once it is recorded; whether the call is closed, and how it failed.

    Waits release the GIL (a ctypes call), so a launcher thread issuing the stack and a
    forward pass waiting layer by layer never contend for it.  One object per call.
    """

    def __init__(self, capi: "CApi") -> None:
        self._capi = capi
        out = ctypes.c_void_p()
        capi.check(capi.lib.fdkv_progress_create(ctypes.byref(out)))
        self.handle: Optional[int] = out.value

    def wait(self, at_least: int, timeout_s: float) -> int:
        """Groups enqueued once ``at_least`` are (or the timeout passed); -1 if the call failed."""
        if self.handle is None:
            raise ValueError("GroupProgress.wait: the progress object is closed")
        done = ctypes.c_int64(0)
        self._capi.check(self._capi.lib.fdkv_progress_wait(
            self.handle, int(at_least), max(0, int(timeout_s * 1e6)), ctypes.byref(done)))
        return int(done.value)

    def _open_handle(self, what: str) -> int:
        if self.handle is None:
            raise ValueError(f"GroupProgress.{what}: the progress object is closed")
        return self.handle

    def wait_closed(self, timeout_s: float) -> bool:
        """Whether every stream operation of the call is enqueued (or it failed and nothing
        more will be), waiting up to ``timeout_s`` for it."""
        closed = ctypes.c_int(0)
        self._capi.check(self._capi.lib.fdkv_progress_wait_closed(
            self._open_handle("wait_closed"), max(0, int(timeout_s * 1e6)), ctypes.byref(closed)))
        return bool(closed.value)

    def is_closed(self) -> bool:
        return self.state().closed

    def state(self) -> "ProgressState":
        """A snapshot: groups done, failed, closed, the ``PATH_*`` bits used, the failed group."""
        done, failed, closed, paths, group = (ctypes.c_int64(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0),
                                              ctypes.c_int64(-1))
        self._capi.check(self._capi.lib.fdkv_progress_state(
            self._open_handle("state"), ctypes.byref(done), ctypes.byref(failed), ctypes.byref(closed),
            ctypes.byref(paths), ctypes.byref(group)))
        return ProgressState(int(done.value), bool(failed.value), bool(closed.value), int(paths.value),
                             int(group.value))

    def error(self) -> str:
        """The call's failure message ("" if it has not failed)."""
        return (self._capi.lib.fdkv_progress_error(self._open_handle("error")) or b"").decode("utf-8", "replace")

    def abandon(self, error: str) -> None:
        """Fail and close the progress of a call that will not be launched (no-op once closed)."""
        self._capi.check(self._capi.lib.fdkv_progress_abandon(self._open_handle("abandon"), error.encode()))

    def close(self) -> None:
        if self.handle is not None:
            self._capi.lib.fdkv_progress_destroy(self.handle)
            self.handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class ProgressState(NamedTuple):
    """:meth:`GroupProgress.state`: groups enqueued, whether the call failed (at
    ``failed_group``, -1 before any group), whether it is closed, and its ``PATH_*`` bits."""

    done: int
    failed: bool
    closed: bool
    paths: int
    failed_group: int


class StackLauncher:
    """The C library's launcher thread of :meth:`LayerStackCall.launch`: it enqueues the
    stacks launched through it in launch order.  :meth:`close` enqueues what is still
    queued, then stops the thread."""

    def __init__(self, capi: "CApi") -> None:
        self._capi = capi
        out = ctypes.c_void_p()
        capi.check(capi.lib.fdkv_launcher_create(ctypes.byref(out)))
        self.handle: Optional[int] = out.value

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every stack launched so far is wholly enqueued, waiting up to ``timeout_s``."""
        if self.handle is None:
            return True
        idle = ctypes.c_int(0)
        self._capi.check(self._capi.lib.fdkv_launcher_wait_idle(self.handle, max(0, int(timeout_s * 1e6)),
                                                                 ctypes.byref(idle)))
        return bool(idle.value)

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self._capi.check(self._capi.lib.fdkv_launcher_destroy(handle))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


