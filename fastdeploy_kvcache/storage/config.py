"""Storage tier flags (``--kvcache-storage-*``) and the policies the scheduler follows.

Kept apart from :mod:`fastdeploy_kvcache.config` so the storage tier can be wired in by one
call (``add_storage_cli_args(parser)``) without touching the cache flags; the scheduler-side
integration reads :class:`StorageConfig` (see docs/storage.md, "Scheduler integration").
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Optional

from fastdeploy_kvcache.cli_flags import add_flag
from fastdeploy_kvcache.storage import BACKENDS, make_storage_backend
from fastdeploy_kvcache.storage.base import StorageBackend
from fastdeploy_kvcache.storage.file_backend import MAX_READ_THREADS
from fastdeploy_kvcache.storage.mooncake_backend import parse_size

logger = logging.getLogger(__name__)

__all__ = ["StorageConfig", "add_storage_cli_args", "PUT_POLICIES", "PREFETCH_POLICIES"]

PUT_POLICIES = ("write_through", "write_back")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")
FETCH_PLANS = ("auto", "on", "off")


@dataclass
class StorageConfig:
    """The storage tier's settings.  ``backend=None`` turns the tier off.

    Policies (carried out by the scheduler side):

    * ``put_policy``: when a block is put to storage: ``write_through`` when it is backed up
      to host, ``write_back`` when it is evicted from host.  (Not the cache's
      ``CacheConfig.write_policy``, FastDeploy's ``--write-policy``, which decides when a
      block is backed up from device to host.)
    * ``prefetch_policy``: ``best_effort`` schedules the request at once and uses whatever
      prefix has arrived; ``wait_complete`` holds the request until the prefetch finishes
      (or fails); ``timeout`` holds it at most :meth:`prefetch_timeout_s` seconds, which
      grows with the number of tokens being fetched.
    """

    backend: Optional[str] = None
    path: Optional[str] = None
    size: int = 0
    min_free: int = 1 << 30
    put_policy: str = "write_through"
    prefetch_policy: str = "timeout"
    prefetch_timeout_base_s: float = 0.05
    prefetch_timeout_per_ktoken_s: float = 0.01
    # Smallest prefix (in blocks) worth fetching from storage rather than recomputing.
    prefetch_min_blocks: int = 1
    # Longest a graceful stop spends writing the cached blocks the store lacks (0: skip).
    shutdown_flush_s: float = 20.0
    # Fetch or recompute, planned per request (core/fetch_plan.py): "on", "off" (every stored
    # block is fetched), or "auto": on when the model runs on a GPU (the engine resolves it),
    # where recomputing can beat a slow store; off on the CPU, where it never does.
    fetch_plan: str = "auto"
    # Most threads one batch read of the file backend runs on; 0: the machine's default
    # (storage.file_backend.default_read_threads: half the usable CPUs, 1 to 16).
    read_threads: int = 0
    # Tests and benchmarks only (no flag): wraps the backend make_backend builds, e.g.
    # storage.throttle.ThrottledBackend.at(bytes_per_s) for a store of a given read rate.
    # Servers started as subprocesses get the throttle from FDKV_STORAGE_THROTTLE_BYTES_PER_S
    # instead (make_backend applies it where no wrapper is given).
    backend_wrapper: Optional[Callable[[StorageBackend], StorageBackend]] = field(default=None, compare=False,
                                                                                  repr=False)

    def __post_init__(self) -> None:
        if self.backend is not None and self.backend not in BACKENDS:
            raise ValueError(f"--kvcache-storage-backend must be one of {BACKENDS}, got {self.backend!r}")
        if self.backend == "file" and not self.path:
            raise ValueError("--kvcache-storage-backend file needs --kvcache-storage-path (a directory)")
        self.size = parse_size(self.size)
        self.min_free = parse_size(self.min_free)
        if self.put_policy not in PUT_POLICIES:
            raise ValueError(
                f"--kvcache-storage-put-policy must be one of {PUT_POLICIES}, got {self.put_policy!r}"
            )
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"--kvcache-storage-prefetch-policy must be one of {PREFETCH_POLICIES}, got {self.prefetch_policy!r}"
            )
        if self.prefetch_timeout_base_s < 0 or self.prefetch_timeout_per_ktoken_s < 0:
            raise ValueError("prefetch timeouts must be >= 0")
        if not self.shutdown_flush_s >= 0:
            raise ValueError(f"--kvcache-storage-shutdown-flush must be >= 0 seconds, got {self.shutdown_flush_s!r}")
        if self.fetch_plan not in FETCH_PLANS:
            raise ValueError(f"--kvcache-storage-fetch-plan must be one of {FETCH_PLANS}, got {self.fetch_plan!r}")
        if isinstance(self.read_threads, bool) or not isinstance(self.read_threads, int) or not (
                0 <= self.read_threads <= MAX_READ_THREADS):
            raise ValueError(f"--kvcache-storage-read-threads must be an int from 0 (the machine's default) to "
                             f"{MAX_READ_THREADS}, got {self.read_threads!r}")
        if self.prefetch_min_blocks < 1:
            raise ValueError(f"prefetch_min_blocks must be >= 1, got {self.prefetch_min_blocks}")

    @property
    def enabled(self) -> bool:
        return self.backend is not None

    def prefetch_timeout_s(self, num_tokens: int) -> float:
        """How long the ``timeout`` policy waits for a prefetch of ``num_tokens`` tokens."""
        return self.prefetch_timeout_base_s + self.prefetch_timeout_per_ktoken_s * num_tokens / 1000.0

    def make_backend(self, **overrides: Any) -> StorageBackend:
        """Build the backend (``file``: path, size, floor; ``mooncake``: MOONCAKE_* env)."""
        if self.backend is None:
            raise ValueError("the storage tier is off (--kvcache-storage-backend not given)")
        if self.backend == "file":
            kwargs: dict[str, Any] = dict(path=self.path, capacity_bytes=self.size, min_free_bytes=self.min_free,
                                          read_threads=self.read_threads or None)
        else:
            kwargs = {}
        kwargs.update(overrides)
        backend = make_storage_backend(self.backend, **kwargs)
        wrapper = self.backend_wrapper
        if wrapper is None:
            from fastdeploy_kvcache import envs

            try:
                rate = envs.storage_throttle_bytes_per_s()
            except ValueError:
                backend.close()
                raise
            if rate > 0:
                from fastdeploy_kvcache.storage.throttle import ThrottledBackend

                logger.warning("storage reads held to %.3g bytes/s (FDKV_STORAGE_THROTTLE_BYTES_PER_S: a "
                               "benchmark and test knob)", rate)
                wrapper = ThrottledBackend.at(rate)
        return backend if wrapper is None else wrapper(backend)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "StorageConfig":
        names = {f.name for f in fields(cls)}
        prefix = "kvcache_storage_"
        kwargs = {k[len(prefix):]: v for k, v in vars(args).items() if k.startswith(prefix) and v is not None}
        return cls(**{k: v for k, v in kwargs.items() if k in names})


def add_storage_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--kvcache-storage-*`` flags (dest ``kvcache_storage_<field>``); a flag the parser
    defines already keeps its own meaning there (:func:`~fastdeploy_kvcache.cli_flags.add_flag`)."""
    g = parser.add_argument_group("KV cache storage tier (fastdeploy_kvcache.storage)")
    add_flag(g, "--kvcache-storage-backend", dest="kvcache_storage_backend", choices=BACKENDS, default=None,
             help="Third tier below host memory: file (a directory) or mooncake (MOONCAKE_* env). Off if unset.")
    add_flag(g, "--kvcache-storage-path", dest="kvcache_storage_path", default=None,
             help="Directory of the file backend.")
    add_flag(g, "--kvcache-storage-size", dest="kvcache_storage_size", default=None,
             help="Byte cap of the file backend (e.g. 200GB; 0: only the free-space floor). LRU eviction.")
    add_flag(g, "--kvcache-storage-min-free", dest="kvcache_storage_min_free", default=None,
             help="Free disk space the file backend never uses (default 1GB).")
    add_flag(g, "--kvcache-storage-put-policy", dest="kvcache_storage_put_policy",
             choices=PUT_POLICIES, default=None,
             help="write_through: store when backed up to host; write_back: when evicted from host.")
    add_flag(g, "--kvcache-storage-prefetch-policy", dest="kvcache_storage_prefetch_policy",
             choices=PREFETCH_POLICIES, default=None,
             help="best_effort: use what arrived; wait_complete: wait for all; timeout: wait up to "
                  "base + per-ktoken * tokens seconds.")
    add_flag(g, "--kvcache-storage-prefetch-timeout-base", dest="kvcache_storage_prefetch_timeout_base_s",
             type=float, default=None, help="timeout policy: seconds for any prefetch (default 0.05).")
    add_flag(g, "--kvcache-storage-prefetch-timeout-per-ktoken", dest="kvcache_storage_prefetch_timeout_per_ktoken_s",
             type=float, default=None, help="timeout policy: extra seconds per 1000 tokens (default 0.01).")
    add_flag(g, "--kvcache-storage-shutdown-flush", dest="kvcache_storage_shutdown_flush_s", type=float,
             default=None, metavar="S",
             help="On a graceful stop, spend at most S seconds (within --graceful-shutdown-timeout) writing every "
                  "cached block the store lacks (device-only blocks go through host first), so a restarted "
                  "server is warm (default 20; 0: write nothing more).")
    add_flag(g, "--kvcache-storage-fetch-plan", dest="kvcache_storage_fetch_plan", choices=FETCH_PLANS,
             default=None,
             help="Fetch or recompute a storage hit, planned per request from measured read, link and prefill "
                  "rates (docs/storage.md, 'Fetch or recompute'): on, off (fetch every stored block), or auto "
                  "(the default: on when the model runs on a GPU, off on the CPU).")
    add_flag(g, "--kvcache-storage-read-threads", dest="kvcache_storage_read_threads", type=int, default=None,
             metavar="N",
             help="file: most threads one batch read runs on (1 to 256; default 0: half the usable CPUs, 1 to 16). "
                  "Reads are spread over objects, so a cold or NVMe store has several in flight.")
    return parser
