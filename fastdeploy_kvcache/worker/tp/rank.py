"""The process of one tensor-parallel rank: a CacheController on its own device, driven by messages.

Each rank runs :func:`rank_main` in a process of its own (``multiprocessing`` with *spawn*:
CUDA does not survive ``fork``).  It builds its :class:`CacheController` for its device and
head shard, allocates the device and pinned host caches there (the host cache on that GPU's
NUMA node), then serves the coordinator's messages until told to close or until the
coordinator's end of the pipe goes away.

The messages are tuples, ``(op, ...)``; every reply is ``("ok", value)`` or
``("error", text)``.  A failure inside one message is reported and the rank keeps serving:
only the coordinator decides that the group is broken.

The rank runs the engine's per-rank work through a *hook*, a picklable factory
``hook(controller, rank, tp_size)`` built once in the rank process.  The hook may define:

* ``prepare(batch, payload)``: before the step's copies are submitted;
* ``forward(batch, counter, payload)``: the rank's forward pass, which calls
  ``counter.wait_for_layer(i)`` before layer ``i`` reads the cache; its return value comes
  back to the coordinator;
* any other method, reached through the coordinator's ``call``.
"""

from __future__ import annotations

import logging
import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.metadata import CacheSwapMetadata

logger = logging.getLogger(__name__)

#: Factory of a rank's hook: (controller, rank, tp_size) -> hook object.
HookFactory = Callable[[Any, int, int], Any]


@dataclass
class RankSpec:
    """Everything a rank process needs to build its controller (pickled to the process)."""

    rank: int
    tp_size: int
    device_id: int
    config: CacheConfig  # the rank's shard (shard.shard_config)
    backend: str = "cpu"
    threaded: bool = True
    async_launch: Optional[bool] = None
    d2h_copy_path: Optional[str] = None
    hook: Optional[HookFactory] = None
    log_level: Optional[int] = None
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class StepReply:
    """What a rank says after a step: the hook's result and the copies it has finished."""

    rank: int
    outcome: Any
    finished: list[CacheSwapMetadata]


def rank_main(conn: Any, spec: RankSpec) -> None:
    """Entry point of a rank process (the target of ``multiprocessing.Process``)."""
    import os

    os.environ.update(spec.env)
    if spec.log_level is not None:
        logging.basicConfig(level=spec.log_level, format=f"[rank {spec.rank}] %(levelname)s %(name)s: %(message)s")
    try:
        host = _RankHost(spec)
    except BaseException as exc:  # noqa: BLE001 - reported to the coordinator, then exit
        _send(conn, ("error", f"rank {spec.rank} (device {spec.device_id}) failed to start: {_format(exc)}"))
        return
    _send(conn, ("ok", host.info()))
    try:
        host.serve(conn)
    finally:
        host.shutdown()


def _format(exc: BaseException) -> str:
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def _send(conn: Any, message: Any) -> bool:
    try:
        conn.send(message)
        return True
    except (BrokenPipeError, EOFError, OSError):
        return False  # the coordinator is gone: nobody to tell


class _RankHost:
    """The controller of one rank and the loop that carries out the coordinator's messages."""

    def __init__(self, spec: RankSpec) -> None:
        from fastdeploy_kvcache.worker.cache_controller import CacheController

        self.spec = spec
        self.ctrl = CacheController(
            spec.config, local_rank=spec.rank, device_id=spec.device_id, backend=spec.backend,
            threaded=spec.threaded, async_launch=spec.async_launch, d2h_copy_path=spec.d2h_copy_path,
        )
        try:
            self.ctrl.initialize_kv_cache()
            self.ctrl.initialize_host_cache()
            self.hook = spec.hook(self.ctrl, spec.rank, spec.tp_size) if spec.hook is not None else None
        except BaseException:
            self.ctrl.close()
            raise
        self._closed = False

    def info(self) -> dict[str, Any]:
        return {
            "rank": self.spec.rank,
            "device_id": self.spec.device_id,
            "backend": self.ctrl.backend.name,
            "num_kv_heads": self.spec.config.num_kv_heads,
            "bytes_per_block": self.spec.config.bytes_per_block,
            "numa_node": self.ctrl.numa_node,
            "pid": __import__("os").getpid(),
        }

    def serve(self, conn: Any) -> None:
        while not self._closed:
            try:
                message = conn.recv()
            except (EOFError, OSError):
                logger.warning("rank %d: the coordinator went away; closing", self.spec.rank)
                return
            try:
                reply: Any = ("ok", self.handle(message))
            except BaseException as exc:  # noqa: BLE001 - reported, the rank keeps serving
                reply = ("error", f"rank {self.spec.rank}: {_format(exc)}")
            if not _send(conn, reply):
                return

    def handle(self, message: tuple) -> Any:
        op = message[0]
        if op == "step":
            _, batch_bytes, payload, wait = message
            return self.step(pickle.loads(batch_bytes), payload, wait)
        if op == "collect":
            _, wait, timeout_s = message
            return self.ctrl.collect_finished(wait=wait, timeout_s=timeout_s)
        if op == "call":
            _, name, args, kwargs = message
            if name == "stats":
                return self.ctrl.get_stats()
            if self.hook is None or name.startswith("_") or not hasattr(self.hook, name):
                raise AttributeError(f"the rank's hook has no method {name!r}")
            return getattr(self.hook, name)(*args, **kwargs)
        if op == "close":
            return self.close()
        raise ValueError(f"unknown message {op!r}")

    def step(self, batch: Any, payload: Any, wait: bool) -> StepReply:
        prepare = getattr(self.hook, "prepare", None)
        if prepare is not None:
            prepare(batch, payload)
        counter = self.ctrl.submit_swap_tasks(batch.cache_evict_metadata, batch.cache_swap_metadata)
        outcome = None
        forward = getattr(self.hook, "forward", None)
        if forward is not None:
            outcome = forward(batch, counter, payload)
        return StepReply(self.spec.rank, outcome, self.ctrl.collect_finished(wait=wait))

    def close(self) -> Union[list[CacheSwapMetadata], None]:
        """Drain, free and close; returns what finished during the drain."""
        self._closed = True
        finished = self.ctrl.free_cache()
        self.ctrl.close()
        return finished

    def shutdown(self) -> None:
        if not self.ctrl.closed:
            try:
                self.ctrl.close()
            except Exception:  # noqa: BLE001 - the process is ending
                logger.warning("rank %d: close failed", self.spec.rank, exc_info=True)
