"""A client that leaves a streamed request early costs the fleet nothing: a real router in
front of a real server, clients on raw sockets that hang up right after sending.

The router's in-flight count of the worker (what ``least_requests`` and the balance
fallback read) must come back to zero, and the worker must abort the requests (the router
closes its upstream connection), also when the client is gone before the stream's first
byte, where the relay generator never starts.
"""

from __future__ import annotations

import json
import socket
from typing import Iterator

import httpx
import pytest

from fastdeploy_kvcache.entrypoints.server_process import RouterProcess, ServerProcess
from server_helpers import BASE_ARGS, MODEL, prompt_ids
from shutdown_helpers import wait_until


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[ServerProcess, RouterProcess]]:
    with ServerProcess(BASE_ARGS, env={"ENABLE_V1_KVCACHE_MANAGER": "1"}) as worker:
        router = RouterProcess(["--worker-urls", worker.base_url, "--model", MODEL, "--block-size", "16",
                                "--policy", "least_requests"]).start()
        try:
            yield worker, router
        finally:
            router.stop()


def _in_flight(router: RouterProcess) -> int:
    state = httpx.get(f"{router.base_url}/router/state", timeout=10).json()
    return sum(w["in_flight"] for w in state["workers"])


def _hang_up_after_sending(port: int, body: dict, read_first: bool) -> None:
    data = json.dumps(body).encode()
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
        if read_first:
            sock.recv(1)  # the response has started: the relay is running
        sock.shutdown(socket.SHUT_RDWR)


@pytest.mark.parametrize("read_first", [False, True], ids=["before-the-first-byte", "mid-stream"])
def test_a_client_that_hangs_up_leaves_no_request_in_flight(fleet: tuple[ServerProcess, RouterProcess],
                                                            read_first: bool) -> None:
    worker, router = fleet
    for i in range(6):
        body = {"model": MODEL, "prompt": prompt_ids(900 + i, 200), "max_tokens": 400, "stream": True,
                "temperature": 0.0}
        _hang_up_after_sending(router.port, body, read_first)
    wait_until(lambda: _in_flight(router) == 0, 60, "the router's in-flight count to drop back to 0")
    wait_until(lambda: worker.engine_stats()["num_requests_running"] == 0, 60,
               "the worker to abort the abandoned requests")
    # The router still serves.
    out = httpx.post(f"{router.base_url}/v1/completions", timeout=120,
                     json={"model": MODEL, "prompt": prompt_ids(7, 20), "max_tokens": 4, "temperature": 0.0})
    assert out.status_code == 200, out.text
    assert _in_flight(router) == 0
