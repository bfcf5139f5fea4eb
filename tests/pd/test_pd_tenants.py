"""Prefill/decode hand-off with API keys and tenant salting: a prefill server, a decode server
and the PD router, all with one keys file and ``--tenant-isolation salt``, over a file store.

The router forwards the client's key to both servers, so both salt the prompt by its tenant:
the decode server finds every block of the hand-off (the partial one too) under the salted
keys, and another tenant's request reuses none of them.
"""

from __future__ import annotations

import json
from typing import Any, Iterator

import httpx
import pytest

from fastdeploy_kvcache.entrypoints.server_process import RouterProcess
from skip_helpers import needs_server_modules

from .helpers import BLOCK_SIZE, MODEL, file_store_args, prompt_ids, recomputed, start_server, stop_cluster

pytestmark = needs_server_modules()

KEYS = {"key-alice-1": "alice", "key-alice-2": "alice", "key-bob": "bob"}
PROMPT = prompt_ids(7, 45)  # 2 full blocks + a partial one of 13 tokens


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    d = tmp_path_factory.mktemp("pd-tenants")
    (d / "keys.json").write_text(json.dumps(KEYS))
    auth = ["--api-keys-file", str(d / "keys.json"), "--tenant-isolation", "salt"]
    servers: dict[str, Any] = {}
    try:
        servers["prefill"] = start_server("prefill", file_store_args(d / "kv"), extra=auth)
        servers["decode"] = start_server("decode", file_store_args(d / "kv"), extra=auth)
        servers["router"] = RouterProcess(["--prefill-url", servers["prefill"].base_url, "--decode-url",
                                           servers["decode"].base_url, *auth]).start()
        yield servers
    finally:
        stop_cluster(servers)


def post(url: str, key: str | None, max_tokens: int = 6) -> httpx.Response:
    return httpx.post(url + "/v1/completions", timeout=120.0, headers={"Authorization": f"Bearer {key}"} if key else {},
                      json={"model": MODEL, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True})


def tiers(r: httpx.Response) -> dict[str, int]:
    assert r.status_code == 200, r.text
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]


def test_a_salted_hand_off_is_found_whole_by_its_tenant_only(cluster: dict[str, Any]) -> None:
    router, prefill, decode = cluster["router"], cluster["prefill"], cluster["decode"]
    for key in (None, "nope"):
        r = post(router.base_url, key)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", r.text
    # alice through the router: the decode server loads every prompt token from the store.
    via = post(router.base_url, "key-alice-1")
    assert sum(tiers(via).values()) == len(PROMPT), tiers(via)
    assert recomputed(decode) == 0
    pd = decode.engine_stats()["pd"]
    assert pd["decode_partial_loaded"] == 1 and pd["decode_partial_failed"] == 0, pd
    # On the prefill server alice's blocks are salted by her tenant: her other key reuses them,
    # bob does not.
    assert tiers(post(prefill.base_url, "key-alice-2", max_tokens=1))["device"] == 2 * BLOCK_SIZE
    assert sum(tiers(post(prefill.base_url, "key-bob", max_tokens=1)).values()) == 0
    # bob through the router: his own hand-off, found whole, the same text.
    bob = post(router.base_url, "key-bob")
    assert sum(tiers(bob).values()) == len(PROMPT) and bob.json()["choices"][0]["text"] == \
        via.json()["choices"][0]["text"]
    assert recomputed(decode) == 0
