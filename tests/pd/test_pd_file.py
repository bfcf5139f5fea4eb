"""PD through a shared directory (file backend): a prefill server, a decode server and the
router, real processes on 127.0.0.1 (tiny-llama-random, CPU).  Every output through the
router is compared token for token (greedy text, finish reason, usage counts) with a mixed
server's, on prompts whose last block is partial; the decode server must recompute nothing
(its /metrics), and the faults (store gone, prefill dead, corrupt partial block) must give
the same text with the recomputed tokens counted."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from .helpers import (
    BLOCK_SIZE,
    MODEL,
    RouterProcess,
    completion,
    file_store_args,
    prompt_ids,
    recomputed,
    scrape,
    start_server,
    stop_cluster,
)
from server_helpers import wait_storage_quiet
from skip_helpers import needs_server_modules

pytestmark = needs_server_modules()

# Lengths not a multiple of the block size (16), plus one shorter than a block and one exact.
LENGTHS = (45, 55, 5, 100)
PROMPTS = {n: prompt_ids(100 + n, n) for n in LENGTHS}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    store = tmp_path_factory.mktemp("pdstore")
    servers: dict[str, Any] = {"store": store}
    try:
        servers["mixed"] = start_server("mixed", [])
        servers["prefill"] = start_server("prefill", file_store_args(store))
        servers["decode"] = start_server("decode", file_store_args(store), extra=["--enable-output-caching"])
        servers["router"] = RouterProcess(servers["prefill"].base_url, servers["decode"].base_url).start()
        yield servers
    finally:
        stop_cluster(servers)


def same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a["status"] == 200 and b["status"] == 200, (a, b)
    assert a["text"] == b["text"], "PD output differs from the mixed server's"
    assert a["finish_reason"] == b["finish_reason"]
    for k in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert a["usage"][k] == b["usage"][k], (k, a["usage"], b["usage"])


def test_router_output_is_token_identical_and_nothing_is_recomputed(cluster: dict[str, Any]) -> None:
    router, mixed, decode = cluster["router"], cluster["mixed"], cluster["decode"]
    for n, prompt in PROMPTS.items():
        for stream in (False, True):
            via = completion(router.base_url, prompt, stream=stream)
            ref = completion(mixed.base_url, prompt, stream=stream)
            same(via, ref)
            tiers = via["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
            if not stream or n % BLOCK_SIZE:
                # Every prompt token came from the store: full blocks and the partial one.
                assert tiers["storage"] + tiers["device"] + tiers["host"] == n, (n, tiers)
    # Chat, streamed and not (the chat template's prompt is not a multiple of 16 here).
    messages = [{"role": "user", "content": "Tell me about key-value caches, briefly."}]
    for stream in (False, True):
        same(completion(router.base_url, messages, chat=True, stream=stream),
             completion(mixed.base_url, messages, chat=True, stream=stream))
    # Seeded sampling continues the same random stream on the decode side.
    seeded = dict(temperature=0.9, seed=1234)
    same(completion(router.base_url, PROMPTS[45], **seeded), completion(mixed.base_url, PROMPTS[45], **seeded))
    assert recomputed(decode) == 0
    pd = decode.engine_stats()["pd"]
    assert pd["decode_partial_loaded"] >= 3 and pd["decode_partial_failed"] == 0, pd
    metrics = scrape(cluster["prefill"])
    assert metrics['fastdeploy:pd_write_block_num_total{result="ok"}'] > 0
    assert metrics['fastdeploy:pd_write_block_num_total{result="failed"}'] == 0
    # The prefill server's own write-through backups skip what the hand-off stored.
    assert cluster["prefill"].engine_stats()["storage"]["tier"]["put_skipped_stored"] > 0
    # No block leaked on either side once everything settled.
    for name in ("prefill", "decode"):
        wait_storage_quiet(cluster[name])
        cache = cluster[name].engine_stats()["cache"]
        assert cache["device_blocks_owned"] == 0, (name, cache)
        assert cache["device_blocks_free"] + cache["device_blocks_cached"] == cache["device_blocks_total"], cache


def test_max_tokens_one_and_eos_finish_on_the_prefill_token(cluster: dict[str, Any]) -> None:
    router, mixed = cluster["router"], cluster["mixed"]
    same(completion(router.base_url, PROMPTS[55], max_tokens=1), completion(mixed.base_url, PROMPTS[55], max_tokens=1))
    # The prefill's token as a stop token: the decode server finishes at once, like mixed.
    first = httpx.post(cluster["prefill"].base_url + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": PROMPTS[55], "max_tokens": 1, "temperature": 0})
    t0 = first.json()["kv_transfer_params"]["prefill_token_ids"][0]
    a = completion(router.base_url, PROMPTS[55], stop_token_ids=[t0])
    b = completion(mixed.base_url, PROMPTS[55], stop_token_ids=[t0])
    same(a, b)
    assert a["finish_reason"] == "stop" and a["usage"]["completion_tokens"] == 1


def test_errors_reach_the_client_in_openai_shape(cluster: dict[str, Any]) -> None:
    router = cluster["router"]
    # A bad request is the server's own 400, with its field, named by role, through the router.
    out = completion(router.base_url, [1, 2, 10**6])
    assert out["status"] == 400 and out["json"]["error"]["message"].startswith("prefill server: prompt")
    assert out["json"]["error"]["param"] == "prompt"
    out = completion(router.base_url, PROMPTS[45], max_tokens=-3)  # the prefill call asks for 1 token
    assert out["status"] == 400 and out["json"]["error"]["message"].startswith("decode server: max_tokens")
    out = completion(router.base_url, PROMPTS[45], n=2)
    assert out["status"] == 400 and out["json"]["error"]["param"] == "n"
    bad = httpx.post(router.base_url + "/v1/completions", content=b"{not json", timeout=30)
    assert bad.status_code == 400 and "error" in bad.json()
    # A decode server refuses a malformed hand-off with a 400 naming the field.
    r = httpx.post(cluster["decode"].base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": PROMPTS[45], "kv_transfer_params": {"prefill_token_ids": "x"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "kv_transfer_params"
    # A mixed server takes no hand-off.
    r = httpx.post(cluster["mixed"].base_url + "/v1/completions", timeout=30,
                   json={"model": MODEL, "prompt": PROMPTS[45], "kv_transfer_params": {"prefill_token_ids": [1]}})
    assert r.status_code == 400 and "decode" in r.json()["error"]["message"]
    assert httpx.get(router.base_url + "/health", timeout=30).status_code == 200
    models = httpx.get(router.base_url + "/v1/models", timeout=30)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == MODEL
    # A decode server that is not there: a 502 naming it, after the prefill call succeeded.
    from fastdeploy_kvcache.entrypoints.server_process import free_port

    with RouterProcess(cluster["prefill"].base_url, f"http://127.0.0.1:{free_port()}") as lonely:
        for stream in (False, True):
            out = completion(lonely.base_url, PROMPTS[45], stream=stream)
            assert out["status"] == 502, out
            assert out["json"]["error"]["message"].startswith("decode server:")
            assert out["json"]["error"]["code"] == "upstream_unavailable"
        h = httpx.get(lonely.base_url + "/health", timeout=30)
        assert h.status_code == 503 and "decode server" in h.json()["error"]["message"]


def _prefill(server: Any, prompt: list[int]) -> dict[str, Any]:
    r = httpx.post(server.base_url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def _decode(server: Any, prompt: list[int], kv: dict[str, Any], max_tokens: int = 12) -> dict[str, Any]:
    return completion(server.base_url, prompt, max_tokens=max_tokens, kv_transfer_params=kv)


def test_store_gone_between_prefill_and_decode_recomputes_with_the_same_output(cluster: dict[str, Any]) -> None:
    prompt = prompt_ids(7, 61)
    decode, store = cluster["decode"], cluster["store"]
    kv = _prefill(cluster["prefill"], prompt)
    wait_storage_quiet(cluster["prefill"])  # its tier's own write-through puts must not land after the move
    before = recomputed(decode)
    moved = store.parent / (store.name + "-away")
    shutil.move(str(store), str(moved))  # the store is gone (a directory the servers cannot read)
    store.mkdir()
    try:
        out = _decode(decode, prompt, kv)
    finally:
        # The decode server backs up what it recomputed into the stand-in directory; its
        # writes (temp file, then rename) must be done before the directory is removed.
        wait_storage_quiet(decode)
        shutil.rmtree(store)
        shutil.move(str(moved), str(store))
    same(out, completion(cluster["mixed"].base_url, prompt))
    assert recomputed(decode) - before == len(prompt)


def test_corrupt_partial_block_is_recomputed_and_counted(cluster: dict[str, Any]) -> None:
    prompt = prompt_ids(8, 3 * BLOCK_SIZE + 9)
    decode, store = cluster["decode"], cluster["store"]
    kv = _prefill(cluster["prefill"], prompt)
    [partial] = list(Path(store).glob("*partial=9.kv"))
    raw = bytearray(partial.read_bytes())
    raw[-10] ^= 0xFF
    partial.write_bytes(bytes(raw))
    before, failed = recomputed(decode), decode.engine_stats()["pd"]["decode_partial_failed"]
    out = _decode(decode, prompt, kv)
    same(out, completion(cluster["mixed"].base_url, prompt))
    assert recomputed(decode) - before == 9  # exactly the partial block's tokens
    assert decode.engine_stats()["pd"]["decode_partial_failed"] == failed + 1
    assert not partial.exists()  # the file backend deletes a corrupt object


def test_decoded_blocks_reach_the_store_for_the_next_turn(cluster: dict[str, Any]) -> None:
    """--enable-output-caching: the decode server writes its decoded blocks back under the
    keys a next turn (prompt + answer + more) looks up."""
    import time

    from fastdeploy_kvcache.core.hashing import storage_key
    from fastdeploy_kvcache.core.request import Request

    prompt = prompt_ids(9, 40)  # 2 full blocks + 8 tokens
    prefill, decode, router, store = cluster["prefill"], cluster["decode"], cluster["router"], cluster["store"]
    # The greedy answer's token ids (a prefill server reports its ids); then empty the store,
    # so whatever holds decoded tokens afterwards was written by the decode server.
    r = httpx.post(prefill.base_url + "/v1/completions", timeout=60,
                   json={"model": MODEL, "prompt": prompt, "max_tokens": 20, "temperature": 0, "ignore_eos": True})
    answer = r.json()["kv_transfer_params"]["prefill_token_ids"]
    assert len(answer) == 20
    wait_storage_quiet(prefill)
    for f in Path(store).glob("*.kv"):
        f.unlink()
    puts = decode.engine_stats()["storage"]["tier"]["put_blocks_ok"]
    same(completion(router.base_url, prompt, max_tokens=20), completion(cluster["mixed"].base_url, prompt, max_tokens=20))
    # Block 2 (tokens 32..47) holds the prompt's last 8 tokens and 8 decoded ones: only the
    # decode server computed it (the prefill server computed tokens 0..39 for this turn).
    block2 = storage_key(Request("t", prompt + answer).block_hashes(BLOCK_SIZE)[2])
    deadline = time.monotonic() + 60
    while not list(Path(store).glob(f"*={block2}.kv")) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert list(Path(store).glob(f"*={block2}.kv")), "the decoded block is not in the store"
    # The file appears (rename) before the put's result reaches the decode server's tier.
    while decode.engine_stats()["storage"]["tier"]["put_blocks_ok"] <= puts and time.monotonic() < deadline:
        time.sleep(0.05)
    assert decode.engine_stats()["storage"]["tier"]["put_blocks_ok"] > puts
    turn2 = prompt + answer[:19] + prompt_ids(10, 13)
    same(completion(router.base_url, turn2), completion(cluster["mixed"].base_url, turn2))


def test_prefill_dies_after_writing_and_decode_still_serves(cluster: dict[str, Any]) -> None:
    """Runs last in this module: it stops the prefill server."""
    prompt = prompt_ids(11, 77)
    prefill, decode, router = cluster["prefill"], cluster["decode"], cluster["router"]
    kv = _prefill(prefill, prompt)
    prefill.proc.kill()
    prefill.proc.wait(30)
    before = recomputed(decode)
    same(_decode(decode, prompt, kv), completion(cluster["mixed"].base_url, prompt))
    assert recomputed(decode) == before
    # The router says which server is gone.
    h = httpx.get(router.base_url + "/health", timeout=30)
    assert h.status_code == 503 and "prefill server" in h.json()["error"]["message"]
    out = completion(router.base_url, prompt)
    assert out["status"] == 502 and "prefill server" in out["json"]["error"]["message"]
