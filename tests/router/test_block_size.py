"""The router hashes prompts with the workers' block size, read from the workers themselves.

A real worker (``--block-size 16``) and real routers: one started without ``--block-size``
learns 16 from the worker's ``/v1/models`` before any request or event; one started with
another size refuses the worker, says why, and answers 503 rather than route with wrong hashes.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterator

import httpx
import pytest

from fastdeploy_kvcache.entrypoints.server_process import RouterProcess, ServerProcess
from server_helpers import BASE_ARGS, BLOCK_SIZE, MODEL


@pytest.fixture(scope="module")
def worker() -> Iterator[ServerProcess]:
    with ServerProcess(BASE_ARGS, env={"ENABLE_V1_KVCACHE_MANAGER": "1"}) as server:
        yield server


def _router(worker: ServerProcess, *flags: str) -> RouterProcess:
    return RouterProcess(["--worker-urls", worker.base_url, "--model", MODEL, "--health-interval", "0.2",
                          "--log-level", "info", *flags]).start()


def _until(check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = check()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_the_worker_announces_its_block_size(worker: ServerProcess) -> None:
    card = worker.get_json("/v1/models")["data"][0]
    assert card["block_size"] == BLOCK_SIZE


def test_a_router_without_block_size_uses_the_workers(worker: ServerProcess) -> None:
    router = _router(worker)
    try:
        state = _until(lambda: [w for w in router.get_json("/router/state")["workers"] if w["block_size"]],
                       "the router to read the worker's block size")
        assert state[0]["block_size"] == BLOCK_SIZE and state[0]["healthy"] and state[0]["refused"] is None
        resp = httpx.post(router.base_url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": list(range(10, 60)), "max_tokens": 1})
        assert resp.status_code == 200, resp.text
    finally:
        router.stop()


def test_a_router_with_another_block_size_refuses_the_worker_clearly(worker: ServerProcess) -> None:
    router = _router(worker, "--block-size", "64")
    try:
        state = _until(lambda: [w for w in router.get_json("/router/state")["workers"] if w["refused"]],
                       "the router to refuse the worker")
        assert "--block-size 16" in state[0]["refused"] and "--block-size 64" in state[0]["refused"], state
        assert not state[0]["healthy"]
        resp = httpx.post(router.base_url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": list(range(10, 60)), "max_tokens": 1})
        assert resp.status_code == 503, resp.text
        time.sleep(0.5)  # more probes: the worker stays refused, and the log says why once
        assert not router.get_json("/router/state")["workers"][0]["healthy"]
        assert router.log_tail(200).count("refused: it runs --block-size 16") == 1, router.log_tail(200)
    finally:
        router.stop()
