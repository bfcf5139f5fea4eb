"""The router over a real fleet (tests/router/conftest.py): three workers publishing KV events.

In file order (the last test kills a worker):

* the router's answers are token-identical to one server's under greedy decoding, for
  completions (text and token ids) and chat, streamed or not, and errors pass through;
* cache_aware sends a returning conversation to the worker holding its prefix, and its
  prediction never exceeds what the worker reports;
* under load imbalance it spreads a burst sharing one prefix over several workers;
* the router's view of each worker matches the worker: block counts per tier equal the
  worker's own, and a document pushed off the device shows as host-only in the view and
  is served from the host by the worker;
* a restarted router rebuilds the same view from the workers' replay sockets;
* a worker killed mid-run fails only the requests in flight on it; the router keeps
  serving, and takes the worker back once it is restarted.
"""

from __future__ import annotations

import json
import random
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import httpx
import pytest

from fastdeploy_kvcache.core.kv_events import event_block_hashes
from fastdeploy_kvcache.entrypoints.router.prompt import load_tokenizer

from .conftest import BLOCK_SIZE, MODEL, Fleet

WORDS = ("the quick brown fox jumps over lazy dog paris is capital of france berlin germany tiered cache keeps "
         "blocks on device host and storage radix tree finds longest prefix hello world how are you today").split()


def text(seed: int, n_words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def post(base_url: str, body: dict[str, Any], chat: bool = False, timeout: float = 120.0) -> dict[str, Any]:
    """One request; {"status", "worker", "predicted", "reason"?, "text", "usage", "json"}."""
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body = {"model": MODEL, "temperature": 0, **body}
    out: dict[str, Any] = {}
    if body.get("stream"):
        texts, usage, errors = [], None, []
        with httpx.stream("POST", base_url + path, json=body, timeout=timeout) as resp:
            out.update(status=resp.status_code, worker=resp.headers.get("x-fdkv-worker"),
                       predicted=resp.headers.get("x-fdkv-predicted-cached-tokens"))
            if resp.status_code != 200:
                resp.read()
                return {**out, "json": resp.json()}
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if "error" in ev:
                    errors.append(ev["error"])
                    continue
                usage = ev.get("usage") or usage
                for ch in ev.get("choices", []):
                    texts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
        return {**out, "text": "".join(texts), "usage": usage, "errors": errors}
    resp = httpx.post(base_url + path, json=body, timeout=timeout)
    out.update(status=resp.status_code, worker=resp.headers.get("x-fdkv-worker"),
               predicted=resp.headers.get("x-fdkv-predicted-cached-tokens"), json=resp.json())
    if resp.status_code == 200:
        ch = out["json"]["choices"][0]
        out.update(text=ch["message"]["content"] if chat else ch["text"], usage=out["json"]["usage"])
    return out


def cached(r: dict[str, Any], tier: Optional[str] = None) -> int:
    d = r["usage"]["prompt_tokens_details"]
    return int(d["cached_tokens"] if tier is None else d["cached_tokens_by_tier"][tier])


def by_url(fleet: Fleet, url: str) -> Any:
    return next(w for w in fleet.workers if w.base_url == url)


# ---------------------------------------------------------------------- identity
def test_router_is_token_identical_to_one_server(fleet: Fleet) -> None:
    router, single = fleet.router.base_url, fleet.workers[0].base_url  # type: ignore[union-attr]
    cases: list[tuple[dict[str, Any], bool]] = [
        ({"prompt": text(1, 60), "max_tokens": 12, "ignore_eos": True}, False),
        ({"prompt": ids(2, 90), "max_tokens": 12, "ignore_eos": True}, False),
        ({"prompt": text(3, 40), "max_tokens": 12, "ignore_eos": True, "stream": True,
          "stream_options": {"include_usage": True}}, False),
        ({"messages": [{"role": "system", "content": text(4, 30)}, {"role": "user", "content": text(5, 20)}],
          "max_tokens": 12, "ignore_eos": True}, True),
        ({"messages": [{"role": "user", "content": text(6, 50)}], "max_tokens": 12, "ignore_eos": True,
          "stream": True}, True),
    ]
    for body, chat in cases:
        via, direct = post(router, body, chat), post(single, body, chat)
        assert via["status"] == direct["status"] == 200, (via, direct)
        assert via["text"] == direct["text"] and via["text"], body
        if body.get("stream") and not body.get("stream_options"):
            # The router asked for the usage chunk (to read cached_tokens) and hid it again.
            assert via["usage"] is None and direct["usage"] is None
        else:
            assert via["usage"]["completion_tokens"] == direct["usage"]["completion_tokens"] == 12
    # A worker's 400 reaches the client as it is.
    bad = post(router, {"prompt": "hi", "max_tokens": 0})
    assert bad["status"] == 400 and "max_tokens" in bad["json"]["error"]["message"]
    bad = post(router, {"prompt": "hi", "max_tokens": 2, "model": "nope"})
    assert bad["status"] == 400 and bad["json"]["error"]["code"] == "model_not_found"


# ---------------------------------------------------------------------- cache_aware
def test_cache_aware_returns_a_conversation_to_its_worker(fleet: Fleet) -> None:
    router = fleet.router.base_url  # type: ignore[union-attr]
    docs = [text(100 + k, 120) for k in range(3)]
    first = [post(router, {"messages": [{"role": "user", "content": d}], "max_tokens": 8, "ignore_eos": True}, True)
             for d in docs]
    assert all(r["status"] == 200 for r in first)
    for rnd in range(2):
        for d, r1 in zip(docs, first):
            msgs = [{"role": "user", "content": d}, {"role": "assistant", "content": r1["text"]},
                    {"role": "user", "content": text(200 + rnd, 10)}]
            r = post(router, {"messages": msgs, "max_tokens": 8, "ignore_eos": True}, True)
            assert r["status"] == 200
            assert r["worker"] == r1["worker"], "a returning conversation left the worker holding its prefix"
            doc_blocks = len(load_tokenizer(MODEL).apply_chat_template(msgs[:1], add_generation_prompt=False)) // BLOCK_SIZE
            assert int(r["predicted"]) >= doc_blocks * BLOCK_SIZE
            # The view holds only what the worker announced: it never predicts more than is reused.
            assert int(r["predicted"]) <= cached(r)
    metrics = fleet.router.get_text("/metrics")  # type: ignore[union-attr]
    assert 'fdkv_router:requests_routed_total{reason="cache"' in metrics


def test_cache_aware_spreads_under_imbalance(fleet: Fleet) -> None:
    """A burst sharing one cached prefix: with tight balance thresholds it spreads; the
    prefix-holding worker still gets the requests while load is level."""
    tight = fleet.start_router("--balance-abs-threshold", "1", "--balance-rel-threshold", "1.0")
    try:
        doc = ids(300, 160)
        warm = post(tight.base_url, {"prompt": doc + ids(301, 4), "max_tokens": 2})
        assert warm["status"] == 200
        burst = [doc + ids(310 + k, 4) for k in range(6)]
        with ThreadPoolExecutor(6) as pool:
            rs = list(pool.map(lambda p: post(tight.base_url, {"prompt": p, "max_tokens": 48, "ignore_eos": True}),
                               burst))
        assert all(r["status"] == 200 for r in rs)
        workers = {r["worker"] for r in rs}
        assert len(workers) >= 2, f"a burst of 6 on one prefix stayed on {workers}"
        assert warm["worker"] in workers
        m = tight.get_text("/metrics")
        assert 'reason="balance"' in m
    finally:
        tight.stop()


# ---------------------------------------------------------------------- the view
TIER_MEDIUMS = {"device": ("GPU",), "host": ("CPU",), "storage": ("DISK", "MOONCAKE")}


def test_router_view_matches_each_worker_on_the_right_tier(fleet: Fleet) -> None:
    w0 = fleet.workers[0]
    doc = ids(400, 200)  # 12 full blocks
    assert post(w0.base_url, {"prompt": doc, "max_tokens": 1})["status"] == 200
    for k in range(4):  # 4 x 300 tokens through a 64-block device pool: doc leaves the device
        assert post(w0.base_url, {"prompt": ids(410 + k, 300), "max_tokens": 1})["status"] == 200
    state = fleet.settle()
    for w, view in zip(fleet.workers, state["workers"]):
        truth = w.get_json("/debug/kv_cache_blocks")
        assert view["events_stats"]["last_seq"] == truth["next_seq"] - 1
        assert view["block_size"] == truth["block_size"] == BLOCK_SIZE
        for tier, mediums in TIER_MEDIUMS.items():
            held = {int(h) for m in mediums for h in truth["mediums"].get(m, [])}
            believed = {int(h, 16) for h in view["hashes"][tier]}
            assert believed == held, f"{view['url']} {tier}: {len(believed - held)} believed but not held, " \
                                     f"{len(held - believed)} held but not believed"
        assert view["events_stats"]["missed"] == 0
    dev0 = {int(h, 16) for h in state["workers"][0]["hashes"]["device"]}
    host0 = {int(h, 16) for h in state["workers"][0]["hashes"]["host"]}
    doc_h = set(event_block_hashes(doc, BLOCK_SIZE))
    assert len(doc_h) == 12 and not doc_h & dev0 and doc_h <= host0, "the document should be host-only"
    last = ids(413, 300)
    assert set(event_block_hashes(last, BLOCK_SIZE)) <= dev0
    # The worker serves them from those tiers: the document from the host, the filler from the device.
    r = post(w0.base_url, {"prompt": doc + [7], "max_tokens": 1})
    assert cached(r, "host") == 12 * BLOCK_SIZE and cached(r, "device") == 0
    r = post(w0.base_url, {"prompt": last + [7], "max_tokens": 1})
    assert cached(r, "device") == len(last) // BLOCK_SIZE * BLOCK_SIZE


def test_a_restarted_router_rebuilds_the_view_from_replay(fleet: Fleet) -> None:
    before = fleet.settle()
    fresh = fleet.start_router()
    try:
        after = fleet.settle(fresh)
    finally:
        fresh.stop()
    # Nothing was published after the fresh router connected: the view came from replay.
    for a, b in zip(before["workers"], after["workers"]):
        assert a["hashes"] == b["hashes"] and a["blocks"] == b["blocks"]
        assert b["events_stats"]["replays"] >= 1 and b["events_stats"]["missed"] == 0


# ---------------------------------------------------------------------- failures
def test_a_killed_worker_fails_only_its_in_flight_requests(fleet: Fleet) -> None:
    rr = fleet.start_router("--policy", "round_robin")
    victim = fleet.workers[2]
    try:
        results: list[dict[str, Any]] = []
        lock = threading.Lock()

        def one(k: int) -> None:
            r = post(rr.base_url, {"prompt": ids(500 + k, 40), "max_tokens": 64, "ignore_eos": True,
                                   "stream": k % 2 == 0})
            with lock:
                results.append(r)

        threads = [threading.Thread(target=one, args=(k,)) for k in range(9)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while rr.get_json("/router/state")["workers"][2]["in_flight"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        victim.proc.send_signal(signal.SIGKILL)  # type: ignore[union-attr]
        victim.proc.wait(10)  # type: ignore[union-attr]
        for t in threads:
            t.join(120)
        failed = [r for r in results if r["status"] != 200 or r.get("errors")]
        assert failed, "a request in flight on the killed worker should have failed"
        assert all(r["worker"] == victim.base_url for r in failed), failed
        assert all(r["status"] == 200 and not r.get("errors") for r in results if r["worker"] != victim.base_url)
        # The router keeps serving on the others, and says the victim is down.
        after = [post(rr.base_url, {"prompt": ids(600 + k, 30), "max_tokens": 4}) for k in range(6)]
        assert all(r["status"] == 200 and r["worker"] != victim.base_url for r in after)
        assert rr.get_json("/health")["down"] == [victim.base_url]
        # Restarted on the same port and sockets, it is taken back.
        fleet.workers[2] = revived = fleet.worker(2, port=victim.port).start()
        deadline = time.monotonic() + 30
        while revived.base_url not in rr.get_json("/health")["healthy"]:
            assert time.monotonic() < deadline, "the restarted worker was not taken back"
            time.sleep(0.1)
        back = [post(rr.base_url, {"prompt": ids(700 + k, 30), "max_tokens": 4}) for k in range(6)]
        assert all(r["status"] == 200 for r in back)
        assert revived.base_url in {r["worker"] for r in back}
    finally:
        rr.stop()


def test_no_healthy_worker_is_a_503(fleet: Fleet) -> None:
    for w in fleet.workers:
        w.stop()
    deadline = time.monotonic() + 30
    while True:
        r = post(fleet.router.base_url, {"prompt": "hello", "max_tokens": 2})  # type: ignore[union-attr]
        if r["status"] == 503:
            break
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert r["json"]["error"]["code"] == "no_healthy_worker"
