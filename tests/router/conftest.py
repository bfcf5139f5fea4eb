"""A real fleet for the router tests: three api_server processes (tiny-llama-random, CPU) that
publish KV cache events on ipc:// sockets (local only), and the router in front of them."""

from __future__ import annotations

import importlib.util
import json
import os
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import pytest

from fastdeploy_kvcache.entrypoints.server_process import RouterProcess, ServerProcess

_missing = [m for m in ("fastapi", "uvicorn", "openai", "paddleformers", "zmq", "msgspec")
            if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"needs {', '.join(_missing)} (installed by `bash build.sh`)", allow_module_level=True)

MODEL = "tiny-llama-random"
BLOCK_SIZE = 16
NUM_WORKERS = 3
# A device pool of 64 blocks (1024 tokens) and a host tier of hundreds: a few 300-token
# prompts push a document off the device while its host copy (write_through) stays.
WORKER_ARGS = [
    "--model", MODEL, "--device", "cpu", "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024",
    "--num-gpu-blocks-override", "64", "--max-num-seqs", "8", "--max-num-batched-tokens", "512",
    "--swap-space", "0.05", "--write-policy", "write_through",
]
ROUTER_ARGS = ["--model", MODEL, "--block-size", str(BLOCK_SIZE), "--health-interval", "0.3",
               "--health-failures", "2", "--log-level", "warning"]


@dataclass
class Fleet:
    sock_dir: str
    workers: list[ServerProcess] = field(default_factory=list)
    router: Optional[RouterProcess] = None

    def events_spec(self, i: int) -> str:
        return f"ipc://{self.sock_dir}/w{i}-pub,ipc://{self.sock_dir}/w{i}-replay"

    def worker(self, i: int, port: Optional[int] = None) -> ServerProcess:
        pub, replay = self.events_spec(i).split(",")
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
               "topic": "kv-events"}
        return ServerProcess([*WORKER_ARGS, "--kv-events-config", json.dumps(cfg)],
                             env={"ENABLE_V1_KVCACHE_MANAGER": "1"}, port=port)

    def start_router(self, *flags: str) -> RouterProcess:
        args = [*ROUTER_ARGS, "--worker-urls", *[w.base_url for w in self.workers],
                "--worker-events", *[self.events_spec(i) for i in range(len(self.workers))], *flags]
        return RouterProcess(args).start()

    def state(self, router: Optional[RouterProcess] = None, hashes: bool = False) -> dict[str, Any]:
        return (router or self.router).get_json("/router/state" + ("?hashes=1" if hashes else ""))  # type: ignore[union-attr]

    def settle(self, router: Optional[RouterProcess] = None, timeout_s: float = 30.0) -> dict[str, Any]:
        """The router's state once every worker is idle and no event arrived for 0.5 s."""
        deadline = time.monotonic() + timeout_s
        for w in self.workers:
            while True:
                if w.proc is None or w.proc.poll() is not None:
                    break
                s = w.engine_stats()
                if s.get("num_requests_running") == 0 and s.get("num_requests_waiting") == 0 and \
                        s.get("cache", {}).get("num_copies_in_flight", 0) == 0:
                    break
                if time.monotonic() > deadline:
                    raise AssertionError(f"worker {w.base_url} not idle: {s}")
                time.sleep(0.05)
        last = None
        while time.monotonic() < deadline:
            now = [(w["url"], (w.get("events_stats") or {}).get("last_seq")) for w in self.state(router)["workers"]]
            if now == last:
                return self.state(router, hashes=True)
            last = now
            time.sleep(0.5)
        raise AssertionError("router events did not settle")


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    with tempfile.TemporaryDirectory(prefix="fdkv-fleet-") as d:
        f = Fleet(d)
        try:
            for i in range(NUM_WORKERS):
                f.workers.append(f.worker(i))
            with ThreadPoolExecutor(NUM_WORKERS) as pool:  # model loading overlaps
                list(pool.map(lambda w: w.start(), f.workers))
            f.router = f.start_router()
            yield f
        finally:
            if f.router is not None:
                f.router.stop()
            for w in f.workers:
                w.stop()
            for name in os.listdir(d):
                os.unlink(os.path.join(d, name))
