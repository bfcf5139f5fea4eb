"""A backend that wraps a real one and makes chosen copies fail or stall (tests only).

Why a wrapper: the fault has to come from below the transfer manager, so that a test of the
recovery code runs the very launch path serving runs (the Python loop per layer, or one
native call per layer stack) and only the copy itself misbehaves.

Install it on a live worker with :meth:`TransferManager.wrap_backend`::

    faults = ctrl.transfer_manager.wrap_backend(FaultInjectingBackend)
    faults.rule = lambda call: ...            # raise: the copy fails; block: it stalls
    faults.fail_task(meta, layer=1)           # or: the copy of ``meta`` fails at layer 1
    faults.rule = None                        # copies pass through again

A rule sees each copy call as a :class:`CopyCall` before the call reaches the real backend.
What a fault fails depends on the path, as a real failure would:

- a device->host call moves every layer at once (``layer`` -1): the whole task fails;
- a load launched layer by layer sees one call per layer: layers before the failing one
  complete, the failing layer and the rest do not;
- a load launched as one native layer stack (``has_layer_groups`` backends): the rule is
  asked once per layer of the stack before the native call, and a fault at any layer fails
  the whole call before anything is enqueued.  A rule that blocks there blocks the thread
  that launches the stack.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from fastdeploy_kvcache.core.metadata import CacheSwapMetadata, CopyDirection
from fastdeploy_kvcache.worker.backends.base import Backend


@dataclass(frozen=True)
class CopyCall:
    """One copy call as a fault rule sees it."""

    direction: CopyDirection
    layer: int  # -1: one call over every layer (device->host copies)
    device_ids: tuple[int, ...]
    host_ids: tuple[int, ...]

    def carries(self, meta: CacheSwapMetadata) -> bool:
        """True when this call moves the copies of ``meta`` (same direction and ids)."""
        if meta.direction is not self.direction:
            return False
        device, host = (
            (meta.src_block_ids, meta.dst_block_ids)
            if self.direction is CopyDirection.DEVICE_TO_HOST
            else (meta.dst_block_ids, meta.src_block_ids)
        )
        return self.device_ids == tuple(device) and self.host_ids == tuple(host)


#: Called before each copy call reaches the real backend; raising fails the call.
FaultRule = Callable[[CopyCall], None]


def _ints(ids: Any) -> tuple[int, ...]:
    return tuple(int(i) for i in ids)


class FaultInjectingBackend:
    """Delegates everything to ``inner``; copy calls pass :attr:`rule` first.

    Registered as a virtual :class:`Backend`, so it goes wherever a backend does.  Only the
    copy entry points are its own: ``swap_blocks`` and ``prepare_layer_stack`` (and
    ``describe_arrays``, which it watches to tell which layer a per-layer call moves).
    """

    def __init__(self, inner: Backend, rule: Optional[FaultRule] = None) -> None:
        self.inner = inner
        self.rule = rule
        self._lock = threading.Lock()
        self._tasks: dict[CopyCall, tuple[CacheSwapMetadata, int]] = {}
        # ids of every layer's arrays in layer order (the last all-layer table described)
        self._all_arrays: list[int] = []
        self._kept: list[Any] = []  # described tables, kept alive so their arrays' ids stay unique

    def __getattr__(self, name: str) -> Any:
        # Only called for names this class lacks: everything but the copy entry points.
        return getattr(self.__dict__["inner"], name)

    # ------------------------------------------------------------------ rules
    def fail_task(self, meta: CacheSwapMetadata, layer: int = -1) -> None:
        """Make the copy of ``meta`` fail at ``layer`` (-1: a device->host copy), once.

        The task is recognised by its direction and block ids; the fault is used up when it
        fires.  Works beside :attr:`rule` (both are asked)."""
        with self._lock:
            self._tasks[self._key(meta)] = (meta, int(layer))

    @staticmethod
    def _key(meta: CacheSwapMetadata) -> CopyCall:
        direction = meta.direction
        device, host = (
            (meta.src_block_ids, meta.dst_block_ids)
            if direction is CopyDirection.DEVICE_TO_HOST
            else (meta.dst_block_ids, meta.src_block_ids)
        )
        return CopyCall(direction, -1, _ints(device), _ints(host))

    def _check(self, call: CopyCall) -> None:
        key = CopyCall(call.direction, -1, call.device_ids, call.host_ids)
        with self._lock:
            armed = self._tasks.get(key)
            if armed is not None and armed[1] == call.layer:
                del self._tasks[key]
            else:
                armed = None
        if armed is not None:
            raise RuntimeError(f"injected failure of task {armed[0].task_id} at layer {call.layer}")
        rule = self.rule
        if rule is not None:
            rule(call)

    # ------------------------------------------------------------------ copies
    def describe_arrays(self, arrays: Sequence[Any], host_ptrs: Optional[Sequence[int]] = None) -> Sequence[Any]:
        ids = [id(a) for a in arrays]
        with self._lock:
            if not set(ids) <= set(self._all_arrays):
                self._all_arrays = ids  # a new layout: its all-layer table comes first
            table = self.inner.describe_arrays(arrays, host_ptrs)
            self._kept.append((list(arrays), table))
        return table

    def _layer_of(self, device_arrays: Sequence[Any]) -> int:
        ids = [id(a) for a in device_arrays]
        all_ids = self._all_arrays
        if not ids or len(ids) >= len(all_ids) or ids[0] not in all_ids:
            return -1
        return all_ids.index(ids[0]) // len(ids)

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
        call = CopyCall(CopyDirection(direction), self._layer_of(device_arrays), _ints(device_ids), _ints(host_ids))
        self._check(call)
        self.inner.swap_blocks(device_arrays, host_ptrs, num_host_blocks, device_ids, host_ids, direction, stream,
                               path=path)

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
    ) -> "_FaultyLayerStack":
        stack = self.inner.prepare_layer_stack(launcher, device_arrays, host_ptrs, group_size, num_host_blocks,
                                               direction, stream, path=path)
        return _FaultyLayerStack(self, stack, CopyDirection(direction), len(device_arrays) // group_size)


class _FaultyLayerStack:
    """A prepared native layer stack whose launch asks the rule once per layer first."""

    def __init__(self, owner: FaultInjectingBackend, stack: Any, direction: CopyDirection, num_layers: int) -> None:
        self._owner = owner
        self._stack = stack
        self._direction = direction
        self._num_layers = num_layers

    def launch(self, device_ids: Any, host_ids: Any, handles: Any, waits: Sequence[Any]) -> None:
        dev, host = _ints(device_ids), _ints(host_ids)
        for layer in range(self._num_layers):
            self._owner._check(CopyCall(self._direction, layer, dev, host))
        self._stack.launch(device_ids, host_ids, handles, waits)


Backend.register(FaultInjectingBackend)
