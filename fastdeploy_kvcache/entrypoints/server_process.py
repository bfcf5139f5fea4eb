"""Start the API server in a child process and wait until it answers (tests, benchmarks).

The tests and ``benchmarks/bench_serving.py`` drive a real uvicorn server over TCP, as a
client would; this is the one place that knows how to start one on a free port, wait
for ``/health``, and stop it (SIGTERM, so the lifespan shuts the engine down).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence

from fastdeploy_kvcache.processes import free_port, stop_child

logger = logging.getLogger(__name__)

__all__ = ["ServerProcess", "free_port", "stop_child", "rss_bytes"]


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (Linux ``/proc/<pid>/statm``).

    The soak benchmark and the memory regression test read a server's growth with it.
    """
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ServerProcess:
    """``python -m fastdeploy_kvcache.entrypoints.openai.api_server`` in a child process.

    (``MODULE`` names the program; :class:`RouterProcess` runs the router the same way.)

    Args:
        args: extra server flags (``--model``, ``--swap-space``, ...).
        env: environment overrides, e.g. ``{"ENABLE_V1_KVCACHE_MANAGER": "1"}``.
        startup_timeout_s: how long model loading may take before start() fails.
        wait_for_host_tier: start() also waits until the host tier is pinned whole
            (``/metrics``: ``host_blocks_ready`` = ``host_blocks_total``).  With CUDA copies
            the server pins it in the background by default, so a workload started at
            "serving" would meet an empty host tier; False for a caller that times "serving".
    """

    MODULE = "fastdeploy_kvcache.entrypoints.openai.api_server"

    def __init__(self, args: Sequence[str] = (), env: Optional[dict[str, str]] = None,
                 host: str = "127.0.0.1", port: Optional[int] = None, startup_timeout_s: float = 300.0,
                 python: str = sys.executable, wait_for_host_tier: bool = True) -> None:
        self.host = host
        self.port = port or free_port(host)
        self.args = list(args)
        self.env = dict(os.environ, **(env or {}))
        self.startup_timeout_s = startup_timeout_s
        self.python = python
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._log = tempfile.NamedTemporaryFile(prefix="fdkv-server-", suffix=".log", delete=False)
        self.up_when_unhealthy = False
        self.wait_for_host_tier = wait_for_host_tier

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def log_path(self) -> str:
        return self._log.name

    def log_tail(self, n: int = 60) -> str:
        try:
            with open(self._log.name, "r", errors="replace") as f:
                return "".join(f.readlines()[-n:])
        except OSError:
            return ""

    def start(self) -> "ServerProcess":
        cmd = [self.python, "-m", self.MODULE,
               "--host", self.host, "--port", str(self.port), *self.args]
        logger.info("starting %s", " ".join(cmd))
        self.proc = subprocess.Popen(cmd, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} during start-up:\n"
                                   f"{self.log_tail()}")
            try:
                self.get_json("/health", timeout=2.0)
                if self.wait_for_host_tier:
                    self._await_host_tier(deadline)
                return self
            except urllib.error.HTTPError:
                if self.up_when_unhealthy:
                    return self
                time.sleep(0.2)
            except (urllib.error.URLError, ConnectionError, OSError):
                time.sleep(0.2)
        self.stop()
        raise TimeoutError(f"server not up after {self.startup_timeout_s} s:\n{self.log_tail()}")

    def host_tier_progress(self) -> tuple[float, float]:
        """``(host_blocks_ready, host_blocks_total)`` from ``/metrics`` (0, 0 without a host tier
        or without the metrics)."""
        found = {}
        for line in self.get_text("/metrics", timeout=5.0).splitlines():
            for name in ("host_blocks_ready", "host_blocks_total"):
                if line.startswith(f"fastdeploy_kvcache:{name} "):
                    found[name] = float(line.split()[1])
        return found.get("host_blocks_ready", 0.0), found.get("host_blocks_total", 0.0)

    def _await_host_tier(self, deadline: float) -> None:
        while True:
            try:
                ready, total = self.host_tier_progress()
            except urllib.error.HTTPError:
                return  # no /metrics: nothing to wait for
            if ready >= total:
                return
            if time.monotonic() >= deadline or (self.proc is not None and self.proc.poll() is not None):
                raise TimeoutError(f"host tier {ready:.0f} of {total:.0f} blocks pinned when the start-up time ran "
                                   f"out:\n{self.log_tail()}")
            time.sleep(0.05)

    def get_json(self, path: str, timeout: float = 10.0) -> Any:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as resp:
            return json.loads(resp.read())

    def get_text(self, path: str, timeout: float = 10.0) -> str:
        with urllib.request.urlopen(self.base_url + path, timeout=timeout) as resp:
            return resp.read().decode()

    def engine_stats(self) -> dict[str, Any]:
        """``GET /health?verbose=1``'s engine stats (block counts per tier, requests, copies)."""
        return self.get_json("/health?verbose=1")["engine"]

    def stop(self, timeout_s: float = 30.0) -> Optional[int]:
        """SIGTERM (the server's graceful shutdown, which stops the engine), then SIGKILL.

        A clean stop exits 0 (see ``entrypoints/openai/shutdown.py``).
        """
        if self.proc is None or self.proc.poll() is not None:
            return None if self.proc is None else self.proc.returncode
        return stop_child(self.proc, signal.SIGTERM, timeout_s, 10)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


class RouterProcess(ServerProcess):
    """``python -m fastdeploy_kvcache.entrypoints.router`` in a child process (either mode).

    It counts as started once it answers ``/health`` at all: a 503 there only says that no
    server behind it is healthy, which some tests want.
    """

    MODULE = "fastdeploy_kvcache.entrypoints.router"

    def __init__(self, args: Sequence[str] = (), **kwargs: Any) -> None:
        kwargs.setdefault("startup_timeout_s", 120.0)
        kwargs.setdefault("wait_for_host_tier", False)  # a router has no host tier
        super().__init__(args, **kwargs)
        self.up_when_unhealthy = True
