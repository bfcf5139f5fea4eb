"""Start a Mooncake master and a holder on 127.0.0.1: for one-machine setups, tests, benchmarks.

``python -m fastdeploy_kvcache.storage.mooncake_local --segment 4GB`` runs both in the
foreground and prints the environment a server needs (``MOONCAKE_MASTER_SERVER_ADDR`` ...).
Every port is passed explicitly: the master's defaults bind 0.0.0.0 (docs/storage.md, "One machine").

The *holder* is ``mooncake_client``: a process that only contributes memory (its
``--global_segment_size``) to the store.  Keys placed in its segment outlive the processes
that wrote them, so a restarted server finds its KV again.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Optional, Union

from fastdeploy_kvcache.processes import free_port, stop_child

logger = logging.getLogger(__name__)

__all__ = ["find_binary", "free_port", "MooncakeMaster", "MooncakeHolder", "LocalMooncake"]


def find_binary(name: str) -> Optional[str]:
    """``mooncake_master`` / ``mooncake_client``: next to this Python first (the venv), then PATH."""
    local = Path(sys.executable).parent / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    return shutil.which(name)


def _log_file(log_dir: Optional[Union[str, Path]], name: str):  # type: ignore[no-untyped-def]
    if log_dir is None:
        return subprocess.DEVNULL
    Path(log_dir).mkdir(parents=True, exist_ok=True)
    return open(Path(log_dir) / f"{name}.log", "ab")


class MooncakeMaster:
    """``mooncake_master`` on loopback with fixed ports (restartable on the same ports)."""

    def __init__(
        self,
        rpc_port: Optional[int] = None,
        metrics_port: Optional[int] = None,
        log_dir: Optional[Union[str, Path]] = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        binary = find_binary("mooncake_master")
        if binary is None:
            raise FileNotFoundError("mooncake_master not installed: run `bash build.sh` (or `bash build.sh serve`)")
        self.binary = binary
        self.rpc_port = rpc_port or free_port()
        self.metrics_port = metrics_port or free_port()
        self.log_dir = log_dir
        self.extra_args = extra_args
        self.proc: Optional[subprocess.Popen] = None

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metrics_addr(self) -> str:
        return f"127.0.0.1:{self.metrics_port}"

    def start(self, wait_s: float = 10.0) -> "MooncakeMaster":
        out = _log_file(self.log_dir, "mooncake_master")
        self.proc = subprocess.Popen(
            [self.binary, "--rpc_address=127.0.0.1", f"--rpc_port={self.rpc_port}",
             "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}", "--logtostderr=1",
             *self.extra_args],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode} (ports {self.rpc_port}, {self.metrics_port})")
            if self.ready():
                return self
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"mooncake_master not ready in {wait_s}s")

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self.metrics_addr}/health", timeout=0.5) as resp:
                return resp.status == 200 and b"service_ready" in resp.read()
        except OSError:
            return False

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            stop_child(self.proc, sig, 10, 5)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the master hangs (calls stall instead of failing) - a fault for tests.

        Returns once the kernel reports the process stopped: the signal is delivered
        asynchronously, and a call sent in that window would still be answered.
        """
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)
        stat = f"/proc/{self.proc.pid}/stat"
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                with open(stat) as f:
                    state = f.read().rsplit(")", 1)[1].split()[0]
            except OSError:
                return  # no /proc (or the process is gone): nothing more to wait for
            if state in ("T", "t"):
                return
            time.sleep(0.001)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


class MooncakeHolder:
    """``mooncake_client``: holds ``segment`` bytes of the store; writers can use segment 0."""

    def __init__(self, master: MooncakeMaster, segment: str = "256MB", log_dir: Optional[Union[str, Path]] = None) -> None:
        binary = find_binary("mooncake_client")
        if binary is None:
            raise FileNotFoundError("mooncake_client not installed: run `bash build.sh` (or `bash build.sh serve`)")
        self.binary = binary
        self.master = master
        self.segment = segment
        self.port = free_port()
        self.log_dir = log_dir
        self.proc: Optional[subprocess.Popen] = None

    def start(self, settle_s: float = 1.0) -> "MooncakeHolder":
        out = _log_file(self.log_dir, "mooncake_client")
        self.proc = subprocess.Popen(
            [self.binary, f"--global_segment_size={self.segment}", f"--master_server_address={self.master.addr}",
             "--metadata_server=P2PHANDSHAKE", "--host=127.0.0.1", f"--port={self.port}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
        )
        # NOTE: the client prints nothing we can wait on portably; its segment is mounted well
        # within a second on these machines (a put before that fails with -200, softly).
        time.sleep(settle_s)
        if self.proc.poll() is not None:
            raise RuntimeError(f"mooncake_client exited with {self.proc.returncode}")
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, signal.SIGTERM, 10, 5)
        self.proc = None


class LocalMooncake:
    """A master plus one holder on loopback (context manager)."""

    def __init__(self, segment: str = "256MB", log_dir: Optional[Union[str, Path]] = None) -> None:
        self.master = MooncakeMaster(log_dir=log_dir)
        self.holder = MooncakeHolder(self.master, segment, log_dir)

    def start(self) -> "LocalMooncake":
        self.master.start()
        try:
            self.holder.start()
        except BaseException:
            self.master.stop()
            raise
        return self

    def env(self) -> dict[str, str]:
        """What a server (or MooncakeBackend) needs to use this store, with segment 0."""
        return {
            "MOONCAKE_MASTER_SERVER_ADDR": self.master.addr,
            "MOONCAKE_MASTER_METRICS_ADDR": self.master.metrics_addr,
            "MOONCAKE_METADATA_SERVER": "P2PHANDSHAKE",
            "MOONCAKE_PROTOCOL": "tcp",
            "MOONCAKE_LOCAL_HOSTNAME": "127.0.0.1",
            "MOONCAKE_GLOBAL_SEGMENT_SIZE": "0",
        }

    def stop(self) -> None:
        self.holder.stop()
        self.master.stop()

    def __enter__(self) -> "LocalMooncake":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description="Run a Mooncake master and a holder on 127.0.0.1.")
    parser.add_argument("--segment", default="1GB", help="memory the holder contributes (default 1GB)")
    parser.add_argument("--log-dir", default=None, help="write mooncake_master.log / mooncake_client.log here")
    args = parser.parse_args(argv)
    # NOTE: handlers, not a blocked signal mask: children inherit the mask, and a master
    # started with SIGTERM blocked would ignore our stop().
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        local = LocalMooncake(args.segment, args.log_dir).start()
    except (FileNotFoundError, RuntimeError, TimeoutError) as exc:  # not installed, or a child died
        sys.stderr.write(f"mooncake_local: {exc}\n")
        return 2
    for k, v in local.env().items():
        sys.stdout.write(f"export {k}={v}\n")
    sys.stdout.flush()
    try:
        while not stop.wait(0.5):
            pass
    finally:
        local.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
