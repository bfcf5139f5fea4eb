"""Work in flight is shared, through a real server (uvicorn on 127.0.0.1, tiny-llama-random on
the CPU, the ``openai`` client): a cold burst computes its shared prefix once, a queued
request's storage prefetch starts on arrival, and an aborted request leaves nothing behind.

Every check compares greedy text with a server that recomputes everything
(ENABLE_V1_KVCACHE_MANAGER=0), asserts on the counter that shows the case happened, and
ends with no device block owned and no host block held by a prefetch.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess
from server_helpers import file_store_args, prompt_ids, scrape, wait_storage_quiet

MODEL = "tiny-llama-random"
BS = 16
# The leader prefills in 48-token chunks: followers that arrive meanwhile are held in the
# pass of its last chunk, for the blocks that chunk completes.
def _args(max_num_seqs: int = 8) -> list[str]:
    return ["--model", MODEL, "--device", "cpu", "--block-size", str(BS), "--max-model-len", "2048",
            "--num-gpu-blocks-override", "256", "--max-num-seqs", str(max_num_seqs),
            "--max-num-batched-tokens", "48", "--swap-space", "0.05", "--write-policy", "write_through"]


ARGS = _args()
PREFIX = prompt_ids(7, 59 * BS)  # 59 full blocks: its end is not at a chunk boundary
ABORTED = 'fastdeploy:request_success_total{finish_reason="abort"}'


def _start(args: list[str], v1: bool = True) -> ServerProcess:
    return ServerProcess(args, env={"ENABLE_V1_KVCACHE_MANAGER": "1" if v1 else "0"}).start()


@pytest.fixture(scope="module")
def recompute() -> Iterator[ServerProcess]:
    server = _start(ARGS, v1=False)
    try:
        yield server
    finally:
        server.stop()


def _client(server: ServerProcess) -> Any:
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def _complete(server: ServerProcess, prompt: list[int], max_tokens: int = 8) -> tuple[str, int]:
    out = _client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                             extra_body={"ignore_eos": True})
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


@contextmanager
def _open_request(server: ServerProcess, prompt: list[int], max_tokens: int = 8) -> Iterator[socket.socket]:
    """A completion request sent on a raw connection that the test closes when it wants
    (the server aborts a request whose client disconnected)."""
    body = json.dumps({"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    host, port = server.base_url.split("//")[1].split(":")
    sock = socket.create_connection((host, int(port)), timeout=10)
    try:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: " + host.encode() + b"\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        yield sock
    finally:
        sock.close()


def _wait_for(what: str, check: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting until {what}")
        time.sleep(0.01)


def _quiet(server: ServerProcess, timeout_s: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        stats = server.engine_stats()
        cache = stats["cache"]
        if stats["num_requests_running"] == 0 and stats["num_requests_waiting"] == 0 \
                and cache["device_blocks_owned"] == 0:
            assert cache["device_blocks_free"] + cache["device_blocks_cached"] == cache["device_blocks_total"]
            return stats
        time.sleep(0.05)
    raise AssertionError(f"server not quiet after {timeout_s} s: {stats}")


def test_cold_burst_computes_its_prefix_once(recompute: ServerProcess) -> None:
    prompts = [PREFIX + prompt_ids(100 + i, 5) for i in range(4)]
    want = [_complete(recompute, p)[0] for p in prompts]
    server = _start(ARGS)
    try:
        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(lambda p: _complete(server, p), prompts))
        assert [text for text, _ in got] == want, "shared prefill must give the tokens of recompute"
        cached = sorted(c for _, c in got)
        assert cached[0] == 0 and cached[1:] == [len(PREFIX)] * 3, cached  # N-1 of N reused it
        m = scrape(server)
        assert m["fastdeploy_kvcache:prefix_share_held_requests_total"] >= 1
        assert m["fastdeploy_kvcache:prefix_share_reused_tokens_total"] >= len(PREFIX)
        stats = _quiet(server)
        assert stats["prefix_sharing"]["held_now"] == 0
        assert stats["engine"]["prompt_tokens_computed"] == len(PREFIX) + 4 * 5
    finally:
        server.stop()


def test_an_aborted_follower_frees_what_it_held(recompute: ServerProcess) -> None:
    """A follower whose client leaves while it waits for the leader: aborted, nothing left
    behind; the leader still gives the recompute text."""
    leader_prompt = PREFIX + prompt_ids(200, 5)
    server = _start(ARGS)
    try:
        before = scrape(server).get(ABORTED, 0.0)
        with cf.ThreadPoolExecutor(1) as pool:
            leader = pool.submit(_complete, server, leader_prompt, 64)
            _wait_for("the leader runs", lambda: server.engine_stats()["num_requests_running"] == 1)
            # NOTE: a follower long enough to be still in flight when its client leaves: the
            # engine's stats snapshot may be up to 50 ms old while requests run, so the test
            # can see the hold only after it ended, and a short follower would finish first.
            with _open_request(server, PREFIX + prompt_ids(201, 5), max_tokens=1024):
                _wait_for("the follower is held",
                          lambda: server.engine_stats()["prefix_sharing"]["held_requests"] >= 1)
            text, cached = leader.result()
        assert text == _complete(recompute, leader_prompt, 64)[0] and cached == 0
        _wait_for("the follower is aborted", lambda: scrape(server).get(ABORTED, 0.0) > before)
        stats = _quiet(server)
        assert stats["prefix_sharing"]["held_now"] == 0
    finally:
        server.stop()


def test_queued_request_prefetches_on_arrival_and_an_aborted_one_frees_its_prefetch(
        tmp_path: Path, recompute: ServerProcess) -> None:
    """One request slot: while a long request runs, a queued request's blocks come from the
    store into host memory; another queued request is aborted before it ran and its prefetch
    leaves no host block behind.  The first is then served from storage, same text."""
    store = tmp_path / "kv"
    p1, p2 = prompt_ids(300, 20 * BS + 3), prompt_ids(301, 20 * BS + 3)
    want = _complete(recompute, p1)[0]
    first = _start(ARGS + file_store_args(store))
    try:
        assert _complete(first, p1)[0] == want
        _complete(first, p2)
        wait_storage_quiet(first)
    finally:
        first.stop()
    second = _start(_args(max_num_seqs=1) + file_store_args(store))
    try:
        before = scrape(second).get(ABORTED, 0.0)
        with cf.ThreadPoolExecutor(2) as pool:
            blocker = pool.submit(_complete, second, prompt_ids(302, 40), 600)
            _wait_for("the blocker runs", lambda: second.engine_stats()["num_requests_running"] == 1)
            queued = pool.submit(_complete, second, p1)
            with _open_request(second, p2):
                _wait_for("both queued requests prefetch",
                          lambda: second.engine_stats()["storage"]["tier"]["arrival_prefetch_jobs"] == 2)
                stats = second.engine_stats()
                assert stats["num_requests_waiting"] == 2, "the blocker finished too early"
            text, cached = queued.result()
            blocker.result()
        assert text == want and cached == 20 * BS
        _wait_for("the queued request is aborted", lambda: scrape(second).get(ABORTED, 0.0) > before)
        stats = wait_storage_quiet(second)
        tier = stats["storage"]["tier"]
        # Both prefetches were done before the abort: the aborted one's blocks are host cache
        # now (evictable, counted cached), not held by anything.
        assert tier["prefetch_host_blocks"] == 0 and tier["prefetch_blocks_inserted"] == 40, tier
        assert stats["cache"]["device_blocks_owned"] == 0
        assert stats["storage"]["tier"]["storage_hit_tokens"] == 20 * BS
    finally:
        second.stop()
