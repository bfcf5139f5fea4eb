"""PD through Mooncake Store: a real ``mooncake_master`` and a holder (``mooncake_client``), a
prefill server, a decode server and the router, all on 127.0.0.1 (tiny-llama-random, CPU).

Outputs through the router are token-identical to a mixed server's on prompts whose last
block is partial, and the decode server recomputes nothing (its /metrics).  Faults, in this
order on one cluster: the prefill server dies after writing (the holder keeps the bytes: the
decode server still serves from the store), then the store goes down between a prefill and
its decode (the decode server recomputes; same output)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from fastdeploy_kvcache.storage.mooncake_local import LocalMooncake
from skip_helpers import needs_mooncake, needs_server_modules

from .helpers import (
    BLOCK_SIZE,
    MODEL,
    RouterProcess,
    completion,
    mooncake_store_args,
    prompt_ids,
    recomputed,
    start_server,
    stop_cluster,
)

pytestmark = [needs_server_modules(), needs_mooncake()]

LENGTHS = (45, 55, 5, 100)
PROMPTS = {n: prompt_ids(200 + n, n) for n in LENGTHS}


def wait_available(server: Any, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.engine_stats()["storage"]["available"]:
            return
        time.sleep(0.2)
    raise AssertionError("mooncake set-up did not finish")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    logs: Path = tmp_path_factory.mktemp("mclogs")
    local = LocalMooncake(segment="256MB", log_dir=logs).start()
    env = {**local.env(), "MC_STORE_CLIENT_SETUP_RETRIES": "1"}
    servers: dict[str, Any] = {"mooncake": local}
    try:
        servers["mixed"] = start_server("mixed", [])
        servers["prefill"] = start_server("prefill", mooncake_store_args(), env=env)
        servers["decode"] = start_server("decode", mooncake_store_args(), env=env)
        wait_available(servers["prefill"])
        wait_available(servers["decode"])
        servers["router"] = RouterProcess(servers["prefill"].base_url, servers["decode"].base_url).start()
        yield servers
    finally:
        stop_cluster(servers)
        local.stop()


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["status"] == 200 and b["status"] == 200, (a, b)
    assert a["text"] == b["text"], "PD output differs from the mixed server's"
    assert a["finish_reason"] == b["finish_reason"]
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"]


def test_router_output_is_token_identical_and_nothing_is_recomputed(cluster: dict[str, Any]) -> None:
    router, mixed, decode = cluster["router"], cluster["mixed"], cluster["decode"]
    for n, prompt in PROMPTS.items():
        for stream in (False, True):
            via = completion(router.base_url, prompt, stream=stream)
            same(via, completion(mixed.base_url, prompt, stream=stream))
            tiers = via["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
            assert sum(tiers.values()) == n, (n, tiers)
    messages = [{"role": "user", "content": "What does a decode server load?"}]
    for stream in (False, True):
        same(completion(router.base_url, messages, chat=True, stream=stream),
             completion(mixed.base_url, messages, chat=True, stream=stream))
    assert recomputed(decode) == 0
    pd = decode.engine_stats()["pd"]
    assert pd["decode_partial_loaded"] >= 3 and pd["decode_partial_failed"] == 0, pd


def _prefill(server: Any, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def test_prefill_dies_after_writing_and_decode_still_serves(cluster: dict[str, Any]) -> None:
    prompt = prompt_ids(31, 3 * BLOCK_SIZE + 5)
    prefill, decode = cluster["prefill"], cluster["decode"]
    kv = _prefill(prefill, prompt)
    prefill.proc.kill()  # its writes live in the holder's segment, not in its own
    prefill.proc.wait(30)
    before = recomputed(decode)
    out = completion(decode.base_url, prompt, kv_transfer_params=kv)
    same(out, completion(cluster["mixed"].base_url, prompt))
    assert recomputed(decode) == before
    h = httpx.get(cluster["router"].base_url + "/health", timeout=30)
    assert h.status_code == 503 and "prefill server" in h.json()["error"]["message"]


def test_store_down_between_prefill_and_decode_recomputes_with_the_same_output(cluster: dict[str, Any]) -> None:
    """Runs after the prefill server died: a fresh prefill server writes, then the master stops."""
    local = cluster["mooncake"]
    prefill = start_server("prefill", mooncake_store_args(),
                           env={**local.env(), "MC_STORE_CLIENT_SETUP_RETRIES": "1"})
    try:
        wait_available(prefill)
        prompt = prompt_ids(32, 2 * BLOCK_SIZE + 11)
        kv = _prefill(prefill, prompt)
        assert prefill.engine_stats()["pd"]["prefill_write_blocks_ok"] == 3
        short = prompt_ids(33, 5)  # a partial block only: the decode side tries to read it
        kv_short = _prefill(prefill, short)
    finally:
        prefill.stop()
    decode = cluster["decode"]
    before = recomputed(decode)
    local.master.stop()  # the store is down: the decode server's calls fail (at once or bounded)
    out = completion(decode.base_url, prompt, kv_transfer_params=kv)
    same(out, completion(cluster["mixed"].base_url, prompt))
    assert recomputed(decode) - before == len(prompt)
    failed = decode.engine_stats()["pd"]["decode_partial_failed"]
    out = completion(decode.base_url, short, kv_transfer_params=kv_short)
    same(out, completion(cluster["mixed"].base_url, short))
    assert recomputed(decode) - before == len(prompt) + len(short)
    assert decode.engine_stats()["pd"]["decode_partial_failed"] == failed + 1
