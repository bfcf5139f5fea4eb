"""Child processes and ports: the two helpers every layer that starts a child needs (the
API server's launcher, the PD router, the local Mooncake master and holder).

It sits at the bottom of the import order (docs/architecture.md, "Import layers"), beside
``config`` and ``envs``, so storage code can start a child without importing the
entrypoints.
"""

from __future__ import annotations

import logging
import signal
import socket
import subprocess
from typing import Optional

logger = logging.getLogger(__name__)

__all__ = ["free_port", "stop_child"]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def stop_child(proc: "subprocess.Popen[bytes]", sig: int = signal.SIGTERM, wait_s: float = 10.0,
               kill_wait_s: float = 10.0) -> Optional[int]:
    """Send ``sig`` to a child still running, wait ``wait_s``, then SIGKILL it; its exit code.

    One place for the graceful-then-forced stop that the API server, the PD router and the
    local Mooncake processes all need, so none of them can leak a child that ignores ``sig``.
    Returns ``None`` when the child had already exited.
    """
    if proc.poll() is not None:
        return None
    proc.send_signal(sig)
    try:
        return proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        logger.warning("child %d did not stop in %.0f s; killing it", proc.pid, wait_s)
        proc.kill()
        return proc.wait(kill_wait_s)
