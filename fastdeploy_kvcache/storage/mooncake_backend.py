"""The ``mooncake`` storage backend: Mooncake Store through ``MooncakeDistributedStore``.

Configuration follows FastDeploy's: ``MOONCAKE_MASTER_SERVER_ADDR`` (required),
``MOONCAKE_METADATA_SERVER`` (default ``P2PHANDSHAKE``), ``MOONCAKE_PROTOCOL`` (default
``tcp``), ``MOONCAKE_LOCAL_HOSTNAME`` and ``MOONCAKE_GLOBAL_SEGMENT_SIZE``; constructor
arguments override them.  Two more are ours: ``MOONCAKE_MASTER_METRICS_ADDR`` (the master's
``--metrics_host:--metrics_port``, polled at ``/health``; default the master's host, port
9003, Mooncake's default) and ``MOONCAKE_LOCAL_BUFFER_SIZE``.

Never blocking the caller (the measured behaviour is in docs/storage.md, "`mooncake`"):

* **Set-up** runs on a background thread.  It polls the master's ``/health`` first (a dead
  master would block ``setup()`` for ~90 s), then calls ``setup()`` with
  ``MC_STORE_CLIENT_SETUP_RETRIES`` bounded (default 1 here: ~4.5 s).  Until it succeeds
  the tier is off: ``health().available`` is False and every call raises
  ``StorageError("unreachable")`` at once.  It retries with backoff, forever, in the
  background.
* **Every call is bounded.**  Calls run on a small pool and the caller waits at most
  ``call_timeout_s``.  With the master dead, Mooncake's own RPCs fail after ~4.3 s (exists
  at once).  If our limit passes first the call raises ``StorageError("timeout")`` whose
  ``pending`` attribute is a future of the real call: the caller's buffers stay in use
  until it is done (a late ``get_into`` still writes them).
* **A circuit breaker** (:mod:`.breaker`) turns the tier off after ``failure_threshold``
  consecutive failed calls, and a background probe (``/health``, then one
  ``batch_is_exist``) turns it back on.  A restarted master comes back empty: every key is
  a miss, which the scheduler handles like any miss.
* **Lost objects are announced.**  ``health().generation`` goes up when the breaker closes
  again after an outage, and when the master's request counters (its ``/metrics``, read
  every ``restart_check_s``) go down: a master restarted between two calls, which comes
  back empty.  The scheduler then forgets which blocks it stored, so they are written again
  when next computed.  (A marker object would also catch a departed holder, but a full
  store evicts it, which reads as a restart.)

Results: ``-704`` is a miss, ``-200`` (store full) a soft ``Status.FULL`` (eviction runs in
the background; never "stored"), ``-600`` ``Status.INVALID`` (buffer smaller than the
object), ``-800``/``-900`` ``Status.UNREACHABLE``.  A key missing after a positive existence
check is a plain miss.

``batch_put_from`` skips keys already stored: Mooncake's ``put`` keeps the old value, and a
key names its bytes (the chained hash), so the old value is the same block.  Pass
``overwrite=True`` to use ``upsert`` where a key's bytes may change.

Where the bytes live: in the memory segment of one client process (``global_segment_size``).
A server that should find its KV again after a restart needs a *holder*: a process that only
holds memory, e.g. ``mooncake_client`` (see docs/storage.md), with the server itself at
``global_segment_size=0``.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable, Optional, Sequence, Union

from fastdeploy_kvcache.storage.base import Status, StorageBackend, StorageError, StorageHealth, validate_batch
from fastdeploy_kvcache.storage.breaker import BREAKER_STATE_VALUE, CLOSED, CircuitBreaker
from fastdeploy_kvcache.storage.buffers import BufferRegistry
from fastdeploy_kvcache.storage.executor import BoundedExecutor
from fastdeploy_kvcache.storage.stats import StorageStats

logger = logging.getLogger(__name__)

__all__ = ["MooncakeBackend", "MooncakeConfig", "parse_size", "mooncake_available", "MOONCAKE_CODES"]

# Mooncake error codes as its calls return them (docs/storage.md, "`mooncake`") -> per-key Status.
MOONCAKE_CODES = {
    -704: Status.MISSING,  # object not found
    -706: Status.MISSING,  # leased (remove) - never returned for data calls here
    -200: Status.FULL,  # no space: soft failure
    -600: Status.INVALID,  # invalid argument / buffer too small
    -800: Status.UNREACHABLE,  # transfer failed (the holder of the segment is gone)
    -900: Status.UNREACHABLE,  # RPC to the master failed
}
_UNREACHABLE_CODES = frozenset({-800, -900})

ENV_DEFAULTS = {
    "MOONCAKE_MASTER_SERVER_ADDR": "",
    "MOONCAKE_METADATA_SERVER": "P2PHANDSHAKE",
    "MOONCAKE_PROTOCOL": "tcp",
    "MOONCAKE_LOCAL_HOSTNAME": "",
    "MOONCAKE_GLOBAL_SEGMENT_SIZE": "1GB",
    "MOONCAKE_LOCAL_BUFFER_SIZE": "16MB",
    "MOONCAKE_RDMA_DEVICES": "",
    "MOONCAKE_MASTER_METRICS_ADDR": "",
}
"""Environment variables the backend reads (constructor arguments override each)."""

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?B)?\s*$", re.IGNORECASE)


def parse_size(value: Union[int, str]) -> int:
    """Bytes of ``"1GB"``, ``"512MiB"``, ``"4096"`` or an int (K/M/G/T are powers of 1024)."""
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must be >= 0, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"cannot parse size {value!r}: expected e.g. 4096, 512MB or 1GB")
    number, unit = float(match.group(1)), match.group(2).upper()
    return int(number * (1 << (10 * " KMGT".index(unit or " "))))


def mooncake_available() -> Optional[str]:
    """None if ``mooncake.store`` imports, else why not (for skips and logs)."""
    try:
        from mooncake.store import MooncakeDistributedStore  # noqa: F401
    except Exception as exc:  # ImportError, or OSError for a missing libibverbs.so.1
        return f"{type(exc).__name__}: {exc}"
    return None


def _route_ip(host: str) -> str:
    """The local address that reaches ``host`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


class MooncakeConfig:
    """Resolved set-up parameters: constructor arguments, then MOONCAKE_* env, then defaults."""

    def __init__(
        self,
        master_server_addr: Optional[str] = None,
        metadata_server: Optional[str] = None,
        protocol: Optional[str] = None,
        local_hostname: Optional[str] = None,
        global_segment_size: Union[int, str, None] = None,
        local_buffer_size: Union[int, str, None] = None,
        rdma_devices: Optional[str] = None,
        master_metrics_addr: Optional[str] = None,
    ) -> None:
        def pick(arg: Any, env: str) -> Any:
            return arg if arg is not None else os.environ.get(env, ENV_DEFAULTS[env])

        self.master_server_addr: str = pick(master_server_addr, "MOONCAKE_MASTER_SERVER_ADDR")
        if not self.master_server_addr or ":" not in self.master_server_addr:
            raise ValueError(
                "the mooncake backend needs the master's host:port: set MOONCAKE_MASTER_SERVER_ADDR "
                f"or pass master_server_addr (got {self.master_server_addr!r})"
            )
        master_host = self.master_server_addr.rsplit(":", 1)[0]
        self.metadata_server: str = pick(metadata_server, "MOONCAKE_METADATA_SERVER")
        self.protocol: str = pick(protocol, "MOONCAKE_PROTOCOL")
        # NOTE: "127.0.0.1", not "localhost" (docs/storage.md, "`mooncake`"); a remote master gets the address
        # that routes to it, so other machines can reach this client's segment.
        self.local_hostname: str = pick(local_hostname, "MOONCAKE_LOCAL_HOSTNAME") or (
            "127.0.0.1" if master_host in ("127.0.0.1", "localhost") else _route_ip(master_host)
        )
        self.global_segment_size = parse_size(pick(global_segment_size, "MOONCAKE_GLOBAL_SEGMENT_SIZE"))
        self.local_buffer_size = parse_size(pick(local_buffer_size, "MOONCAKE_LOCAL_BUFFER_SIZE"))
        self.rdma_devices: str = pick(rdma_devices, "MOONCAKE_RDMA_DEVICES")
        self.master_metrics_addr: str = pick(master_metrics_addr, "MOONCAKE_MASTER_METRICS_ADDR") or f"{master_host}:9003"

    def as_dict(self) -> dict[str, Any]:
        return dict(vars(self))


class MooncakeBackend(StorageBackend):
    """Mooncake Store as the storage tier.  Construction returns at once; see the module doc.

    Args:
        config: where the store is and how this client joins it (:class:`MooncakeConfig`;
            None: ``MooncakeConfig()``, every field from its MOONCAKE_* variable).
    Keyword-only args:
        call_timeout_s: the longest a caller waits for one data call (get, put, delete).
        exists_timeout_s: the longest ``batch_exists`` waits: the scheduler calls it inline
            (a dead master answers it at once; a hung one would not).
        failure_threshold: consecutive failed calls that open the breaker.
        reset_timeout_s: first wait before the breaker's probe (doubles up to 30 s).
        setup_retries: ``MC_STORE_CLIENT_SETUP_RETRIES`` for one ``setup()`` attempt.
        overwrite: use ``upsert`` for puts (replace existing values).
        max_pending: batches queued for the writer / reader thread before "busy".
        call_threads: threads that run store calls (bounds concurrent stuck calls).
        restart_check_s: how often the monitor reads the master's request counters (a drop
            means a restarted master and bumps ``health().generation``).
        store_factory: builds the client (tests of set-up failures pass a real but
            differently configured class; default ``MooncakeDistributedStore``).
    """

    name = "mooncake"

    def __init__(
        self,
        config: Optional[MooncakeConfig] = None,
        *,
        call_timeout_s: float = 8.0,
        exists_timeout_s: float = 1.0,
        failure_threshold: int = 3,
        reset_timeout_s: float = 1.0,
        setup_retries: int = 1,
        overwrite: bool = False,
        max_pending: int = 64,
        call_threads: int = 4,
        restart_check_s: float = 1.0,
        store_factory: Optional[Callable[[], Any]] = None,
    ) -> None:
        if config is not None and not isinstance(config, MooncakeConfig):
            raise TypeError(f"config must be a MooncakeConfig or None, got {type(config).__name__}")
        self.config = config if config is not None else MooncakeConfig()
        reason = mooncake_available() if store_factory is None else None
        if reason is not None:
            raise StorageError(
                "unreachable",
                f"mooncake is not installed ({reason}); run `bash build.sh` (installs libibverbs1 "
                "and mooncake-transfer-engine-non-cuda)",
            )
        self.call_timeout_s = call_timeout_s
        self.exists_timeout_s = exists_timeout_s
        self.setup_retries = setup_retries
        self.overwrite = overwrite
        self._store_factory = store_factory
        self._store: Any = None
        self._lock = threading.Lock()
        self._buffers = BufferRegistry()
        self._stats = StorageStats()
        self.breaker = CircuitBreaker("mooncake", failure_threshold, reset_timeout_s)
        self.breaker.force_open()  # off until set-up succeeds
        self._setup_attempts = 0
        self._generation = 0
        self.restart_check_s = restart_check_s
        self._master_requests: Optional[int] = None  # the master's request counters, last read
        self._next_restart_check = 0.0
        self._last_error = "not set up yet"
        self._closed = threading.Event()
        self._connected = threading.Event()
        self._calls = ThreadPoolExecutor(max_workers=call_threads, thread_name_prefix="fdkv-mooncake-call")
        self._writer = BoundedExecutor("fdkv-mooncake-writer", max_pending)
        self._reader = BoundedExecutor("fdkv-mooncake-reader", max_pending)
        self._monitor = threading.Thread(target=self._monitor_loop, name="fdkv-mooncake-monitor", daemon=True)
        self._monitor.start()

    # ------------------------------------------------------------------ set-up and probing
    def _master_healthy(self, timeout_s: float = 0.5) -> bool:
        url = f"http://{self.config.master_metrics_addr}/health"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                body = resp.read(4096)
                return resp.status == 200 and b'"service_ready":false' not in body.replace(b" ", b"")
        except (OSError, urllib.error.URLError, ValueError):
            return False

    def _try_setup(self) -> bool:
        """One bounded attempt; True once the client is set up and buffers are registered."""
        self._setup_attempts += 1
        if not self._master_healthy():
            self._last_error = f"master /health at {self.config.master_metrics_addr} not ready"
            return False
        # NOTE: the client reads this at setup(); without it a master that dies between the
        # health poll and setup() would block this thread ~90 s (20 retries).
        os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", str(self.setup_retries))
        if self._store_factory is not None:
            store = self._store_factory()
        else:
            from mooncake.store import MooncakeDistributedStore

            store = MooncakeDistributedStore()
        c = self.config
        start = time.perf_counter()
        rc = store.setup(
            c.local_hostname, c.metadata_server, c.global_segment_size, c.local_buffer_size,
            c.protocol, c.rdma_devices, c.master_server_addr,
        )
        if rc != 0:
            self._last_error = f"setup() returned {rc}"
            logger.warning("mooncake setup failed (%s); the storage tier stays off and retries", rc)
            try:
                store.close()
            except Exception:  # noqa: BLE001 - best effort on a half set-up client
                pass
            return False
        # Under the lock: a register_buffer() racing with set-up either lands in the regions
        # registered here or sees the new store and registers itself; never neither.
        with self._lock:
            for ptr, nbytes in self._buffers.regions():
                rc = store.register_buffer(ptr, nbytes)
                if rc != 0:
                    self._last_error = f"register_buffer({ptr:#x}, {nbytes}) returned {rc}"
                    logger.error("mooncake %s; the storage tier stays off", self._last_error)
                    store.close()
                    return False
            self._store = store
        self._connected.set()
        logger.info(
            "mooncake store set up in %.2fs (master %s, %s, segment %d MiB)",
            time.perf_counter() - start, c.master_server_addr, c.protocol, c.global_segment_size >> 20,
        )
        return True

    def _probe(self) -> bool:
        """Is the master back?  /health, then one existence call through the client."""
        if not self._master_healthy():
            return False
        try:
            future = self._calls.submit(self._store.batch_is_exist, ["fdkv-probe"])
            result = future.result(timeout=self.call_timeout_s)
        except Exception as exc:  # noqa: BLE001 - a failed probe just keeps the tier off
            self._last_error = f"probe failed: {exc}"
            return False
        return bool(result) and result[0] in (0, 1)

    def _monitor_loop(self) -> None:
        """Background: set up (with backoff), then probe whenever the breaker is open."""
        delay = 0.2
        while not self._closed.is_set():
            try:
                if self._store is None:
                    if self._try_setup():
                        self.breaker.record_success()
                        delay = 0.2
                        continue
                    delay = min(delay * 2, 5.0)
                elif self.breaker.state != CLOSED and self.breaker.allow():
                    if self._probe():
                        self.breaker.record_success()
                        self._master_requests = None  # a new master's counters start over
                        self._lost_objects("the store is reachable again after an outage")
                    else:
                        self.breaker.record_failure()
                    delay = 0.2
                else:
                    if self.breaker.state == CLOSED and time.monotonic() >= self._next_restart_check:
                        self._check_master_restart()
                    delay = 0.2
            except Exception as exc:  # noqa: BLE001 - the monitor must never die silently
                self._last_error = f"monitor: {type(exc).__name__}: {exc}"
                logger.exception("mooncake monitor error; retrying")
                delay = min(delay * 2, 5.0)
            self._closed.wait(delay)

    @property
    def raw_store(self) -> Any:
        """Mooncake's own client (None until connected), for a benchmark's baseline: calls
        on it bypass this backend's timeouts, breaker and statistics."""
        return self._store

    @property
    def generation(self) -> int:
        return self._generation

    def _lost_objects(self, why: str) -> None:
        self._generation += 1
        logger.warning("mooncake store may have lost objects (%s): what was stored will be written again", why)

    def _master_request_count(self, timeout_s: float = 0.5) -> Optional[int]:
        """The sum of the master's ``master_*_requests_total`` counters (None: unreadable)."""
        url = f"http://{self.config.master_metrics_addr}/metrics"
        try:
            with urllib.request.urlopen(url, timeout=timeout_s) as resp:
                body = resp.read(1 << 20).decode("utf-8", "replace")
        except (OSError, urllib.error.URLError, ValueError):
            return None
        total, seen = 0, False
        for line in body.splitlines():
            if line.startswith("master_") and "_requests_total" in line.split(" ", 1)[0]:
                try:
                    total += int(float(line.rsplit(" ", 1)[1]))
                    seen = True
                except (IndexError, ValueError):
                    continue
        return total if seen else None

    def _check_master_restart(self) -> None:
        """A restarted master starts its counters from 0: a drop means everything is gone.

        NOTE: this client's calls raise them between two reads, so a read lower than the
        last is a new master (a restart the breaker never saw: no call ran meanwhile)."""
        self._next_restart_check = time.monotonic() + self.restart_check_s
        count = self._master_request_count()
        if count is None:
            return
        last, self._master_requests = self._master_requests, count
        if last is not None and count < last:
            self._lost_objects(f"the master's request counters went from {last} to {count}: it restarted")

    def wait_ready(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` for the tier to be on (tests and tools; never the scheduler)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._store is not None and self.breaker.state == CLOSED:
                return True
            time.sleep(0.05)
        return self._store is not None and self.breaker.state == CLOSED

    # ------------------------------------------------------------------ bounded calls
    def _call(self, op: str, fn: Callable[..., Any], *args: Any, timeout_s: Optional[float] = None) -> Any:
        """Run one store call with the breaker and the time limit.  Raises StorageError."""
        limit = self.call_timeout_s if timeout_s is None else timeout_s
        if self._closed.is_set():
            raise StorageError("unreachable", f"{op}: the mooncake backend is closed")
        store = self._store
        if store is None or not self.breaker.allow():
            self._stats.record_error("unreachable")
            raise StorageError(
                "unreachable", f"{op}: mooncake tier is off (breaker {self.breaker.state}; {self._last_error})"
            )
        future = self._calls.submit(fn, *args)
        try:
            return future.result(timeout=limit)
        except FutureTimeout:
            self.breaker.record_failure()
            self._stats.record_error("timeout")
            err = StorageError("timeout", f"{op}: no answer from mooncake in {limit}s")
            err.pending = future  # type: ignore[attr-defined]
            raise err from None
        except Exception as exc:  # noqa: BLE001 - the binding raises on odd failures
            self.breaker.record_failure()
            self._stats.record_error("io")
            raise StorageError("io", f"{op}: {type(exc).__name__}: {exc}") from exc

    def _settle(self, op: str, codes: Sequence[int]) -> None:
        """Feed the breaker: a batch where every key was unreachable is one failure."""
        if codes and all(c in _UNREACHABLE_CODES for c in codes):
            self.breaker.record_failure()
            self._stats.record_error("unreachable")
            raise StorageError("unreachable", f"{op}: mooncake unreachable (codes {sorted(set(codes))})")
        self.breaker.record_success()

    # ------------------------------------------------------------------ memory
    def register_buffer(self, ptr: int, nbytes: int) -> None:
        """Register host memory for zero-copy transfers (now, or at set-up if not connected)."""
        with self._lock:
            self._buffers.add(ptr, nbytes)
            store = self._store
            if store is not None:
                rc = store.register_buffer(ptr, nbytes)
                if rc != 0:
                    self._buffers.remove(ptr)
                    raise StorageError("io", f"mooncake register_buffer({ptr:#x}, {nbytes}) returned {rc}")

    def unregister_buffer(self, ptr: int) -> None:
        with self._lock:
            self._buffers.remove(ptr)
            store = self._store
            if store is not None:
                rc = store.unregister_buffer(ptr)
                if rc != 0:
                    logger.warning("mooncake unregister_buffer(%#x) returned %d", ptr, rc)

    # ------------------------------------------------------------------ data
    def batch_exists(self, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        self._stats.add("exists_calls")
        codes = self._call("batch_exists", self._store_method("batch_is_exist"), list(keys),
                           timeout_s=self.exists_timeout_s)
        if codes and codes[0] < 0:
            # NOTE: an RPC failure comes back per key (-1 or -900) at once, not after 4.3 s.
            self.breaker.record_failure()
            self._stats.record_error("unreachable")
            raise StorageError("unreachable", "batch_exists: mooncake master unreachable")
        self.breaker.record_success()
        count = 0
        for code in codes:
            if code != 1:
                break
            count += 1
        return count

    def batch_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        keys, ptrs, sizes = self._check("batch_get_into", keys, ptrs, sizes)
        start = time.perf_counter()
        codes = self._call("batch_get_into", self._store_method("batch_get_into"), keys, ptrs, sizes)
        self._settle("batch_get_into", codes)
        results = [int(c) if c >= 0 else int(MOONCAKE_CODES.get(int(c), Status.IO)) for c in codes]
        self._stats.record_reads(results, time.perf_counter() - start)
        return results

    def batch_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> list[int]:
        keys, ptrs, sizes = self._check("batch_put_from", keys, ptrs, sizes)
        method = "batch_upsert_from" if self.overwrite else "batch_put_from"
        start = time.perf_counter()
        codes = self._call("batch_put_from", self._store_method(method), keys, ptrs, sizes)
        self._settle("batch_put_from", codes)
        results = [int(Status.OK) if c == 0 else int(MOONCAKE_CODES.get(int(c), Status.IO)) for c in codes]
        self._stats.record_writes(results, sizes, time.perf_counter() - start)
        return results

    def submit_put_from(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> "Future[list[int]]":
        keys, ptrs, sizes = self._check("submit_put_from", keys, ptrs, sizes)
        return self._writer.submit(self.batch_put_from, keys, ptrs, sizes)

    def submit_get_into(self, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]) -> "Future[list[int]]":
        keys, ptrs, sizes = self._check("submit_get_into", keys, ptrs, sizes)
        return self._reader.submit(self.batch_get_into, keys, ptrs, sizes)

    def delete(self, keys: Sequence[str]) -> int:
        """Remove now, leases or not (``force``: a get leases a key for 10 s)."""
        if not keys:
            return 0
        codes = self._call("delete", self._store_method("batch_remove"), list(keys), True)
        self._settle("delete", codes)
        removed = sum(1 for c in codes if c == 0)
        self._stats.add("deleted", removed)
        return removed

    def _store_method(self, name: str) -> Callable[..., Any]:
        store = self._store
        if store is None:
            raise StorageError("unreachable", f"{name}: mooncake tier is off ({self._last_error})")
        return getattr(store, name)

    def _check(
        self, op: str, keys: Sequence[str], ptrs: Sequence[int], sizes: Sequence[int]
    ) -> tuple[list[str], list[int], list[int]]:
        keys, ptrs, sizes = validate_batch(op, keys, ptrs, sizes)
        self._buffers.check(op, ptrs, sizes)
        return keys, ptrs, sizes

    # ------------------------------------------------------------------ state
    def health(self) -> StorageHealth:
        state = self.breaker.state
        available = self._store is not None and state == CLOSED and not self._closed.is_set()
        return StorageHealth(
            available=available, backend=self.name, breaker=state,
            consecutive_failures=self.breaker.consecutive_failures,
            detail="ok" if available else self._last_error,
            extra={"setup_attempts": self._setup_attempts, "master": self.config.master_server_addr},
            generation=self._generation,
        )

    def stats(self) -> dict[str, Any]:
        snap = self._stats.snapshot()
        state = self.breaker.state
        snap.update(
            backend=self.name, breaker_state=state, breaker_state_value=BREAKER_STATE_VALUE[state],
            breaker_opens=self.breaker.opens, connected=self._store is not None,
            setup_attempts=self._setup_attempts, pending_writes=self._writer.pending(),
            generation=self._generation,
        )
        return snap

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._writer.close(timeout_s=self.call_timeout_s * 2)
        self._reader.close(timeout_s=self.call_timeout_s * 2)
        self._closed.set()
        self._monitor.join(timeout=self.call_timeout_s + 5)
        self._calls.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            for ptr, _ in self._buffers.regions():
                try:
                    store.unregister_buffer(ptr)
                except Exception:  # noqa: BLE001 - shutting down
                    pass
            # Mooncake's own close takes about a second (its client threads): say so, so that
            # a stop is not silent meanwhile.
            logger.info("closing the Mooncake client")
            t0 = time.monotonic()
            try:
                store.close()
            except Exception as exc:  # noqa: BLE001
                logger.warning("mooncake close: %s", exc)
            logger.info("Mooncake client closed in %.2f s", time.monotonic() - t0)
        self.breaker.force_open()

