"""The router with API keys and tenant salting over two real workers that publish KV events.

The workers and the router share one keys file and ``--tenant-isolation salt``.  A prompt
computed on worker 1 under alice's salt shows in the router's view (built from the events)
under exactly the hashes the router computes for alice's requests, so the router sends
alice's next request there and predicts its reuse; bob's request and a request with its own
``cache_salt`` match nothing.  The router refuses a missing key itself, and a router without
keys forwards the client's ``Authorization`` header to the workers, which check it.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx
import pytest

from fastdeploy_kvcache.core.kv_events import event_block_hashes
from fastdeploy_kvcache.entrypoints.auth import MAX_CACHE_SALT_CHARS, tenant_cache_salt
from fastdeploy_kvcache.entrypoints.server_process import RouterProcess, ServerProcess

from .conftest import BLOCK_SIZE, MODEL, ROUTER_ARGS, WORKER_ARGS

KEYS = {"key-alice-1": "alice", "key-alice-2": "alice", "key-bob": "bob"}
DOC = [(7 * i + 3) % 490 + 10 for i in range(200)]  # 12 full blocks
FULL = 12 * BLOCK_SIZE


class TenantFleet:
    def __init__(self, d: Path, isolation: str = "salt") -> None:
        self.dir = d
        self.keys = d / "keys.json"
        self.keys.write_text(json.dumps(KEYS))
        self.auth = ["--api-keys-file", str(self.keys), "--tenant-isolation", isolation]
        self.workers = [self._worker(i) for i in range(2)]
        self.routers: list[RouterProcess] = []

    def events(self, i: int) -> str:
        return f"ipc://{self.dir}/w{i}-pub,ipc://{self.dir}/w{i}-replay"

    def _worker(self, i: int) -> ServerProcess:
        pub, replay = self.events(i).split(",")
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
        return ServerProcess([*WORKER_ARGS, *self.auth, "--kv-events-config", json.dumps(cfg)],
                             env={"ENABLE_V1_KVCACHE_MANAGER": "1"})

    def router(self, *flags: str) -> RouterProcess:
        r = RouterProcess([*ROUTER_ARGS, "--worker-urls", *[w.base_url for w in self.workers],
                           "--worker-events", *[self.events(i) for i in range(2)], *flags]).start()
        self.routers.append(r)
        return r


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TenantFleet]:
    f = TenantFleet(tmp_path_factory.mktemp("tenant-fleet"))
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda w: w.start(), f.workers))
        f.router(*f.auth)
        yield f
    finally:
        for r in f.routers:
            r.stop()
        for w in f.workers:
            w.stop()


def _auth(key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def post(url: str, key: Optional[str], prompt: list[int], salt: Optional[str] = None) -> httpx.Response:
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    if salt is not None:
        body["cache_salt"] = salt
    return httpx.post(url + "/v1/completions", json=body, headers=_auth(key), timeout=120.0)


def settled_view(router: RouterProcess, fleet: TenantFleet, timeout_s: float = 30.0) -> dict[str, Any]:
    """The router's state with hashes, once no event arrived for 0.5 s."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        r = httpx.get(router.base_url + "/router/state?hashes=1", headers=_auth("key-bob"), timeout=10.0)
        assert r.status_code == 200, r.text
        state = r.json()
        now = [(w["url"], (w.get("events_stats") or {}).get("last_seq")) for w in state["workers"]]
        if now == last:
            return state
        last = now
        time.sleep(0.5)
    raise AssertionError("router events did not settle")


def test_the_router_routes_a_salted_prefix_to_the_worker_that_holds_it(fleet: TenantFleet) -> None:
    router, w1 = fleet.routers[0], fleet.workers[1]
    # Worker 1 computes DOC for alice, directly (not through the router).
    r = post(w1.base_url, "key-alice-1", DOC)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    alice = set(event_block_hashes(DOC, BLOCK_SIZE, cache_salt=tenant_cache_salt("alice", None)))
    plain = set(event_block_hashes(DOC, BLOCK_SIZE))
    # The events carry the salted hashes: the worker's own list and the router's view agree.
    truth = httpx.get(w1.base_url + "/debug/kv_cache_blocks", headers=_auth("key-bob"), timeout=30.0).json()
    assert alice <= set(truth["mediums"]["GPU"]) and not plain & set(truth["mediums"]["GPU"])
    view = settled_view(router, fleet)["workers"][1]
    assert view["url"] == w1.base_url
    assert alice <= {int(h, 16) for h in view["hashes"]["device"]}

    # alice's other key, through the router: to worker 1, the reuse predicted and found.
    r = post(router.base_url, "key-alice-2", DOC + [7])
    assert r.status_code == 200, r.text
    assert r.headers["x-fdkv-worker"] == w1.base_url
    assert int(r.headers["x-fdkv-predicted-cached-tokens"]) == FULL
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["device"] == FULL
    # bob, and alice with a cache_salt of her own: no match predicted, none found.
    for key, salt in (("key-bob", None), ("key-alice-1", "own")):
        r = post(router.base_url, key, DOC + [8], salt)
        assert r.status_code == 200, r.text
        assert int(r.headers["x-fdkv-predicted-cached-tokens"]) == 0, (key, salt)
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, (key, salt)


def test_the_router_checks_keys_itself_and_a_router_without_keys_forwards_them(fleet: TenantFleet) -> None:
    router = fleet.routers[0]
    routed = _routed(router)
    for headers in ({}, _auth("nope")):
        for method, path in (("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                             ("GET", "/v1/models"), ("GET", "/router/state")):
            r = httpx.request(method, router.base_url + path, headers=headers, timeout=30.0,
                              json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, r.text)
            assert not r.json()["error"]["message"].startswith("worker")  # the router's own answer
    assert _routed(router) == routed  # no worker was asked
    assert httpx.get(router.base_url + "/v1/models", headers=_auth("key-bob")).json()["data"][0]["block_size"] \
        == BLOCK_SIZE
    for path in ("/health", "/metrics"):
        assert httpx.get(router.base_url + path, timeout=30.0).status_code == 200, path

    plain = fleet.router()  # no keys: the workers check what it forwards
    r = post(plain.base_url, "key-bob", [5, 6, 7])
    assert r.status_code == 200, r.text
    r = post(plain.base_url, None, [5, 6, 7])
    assert r.status_code == 401 and r.json()["error"]["message"].startswith("worker server: "), r.text


def test_a_bad_cache_salt_through_the_router_is_the_workers_400_naming_it(fleet: TenantFleet) -> None:
    router = fleet.routers[0]
    for salt, says in (("", "an empty one"), (5, "valid string"),
                       ("s" * (MAX_CACHE_SALT_CHARS + 1), f"at most {MAX_CACHE_SALT_CHARS} characters")):
        r = post(router.base_url, "key-bob", [5, 6, 7], salt)  # type: ignore[arg-type]
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == "cache_salt" and err["message"].startswith("worker server: cache_salt: ") \
            and says in err["message"], err
    r = post(router.base_url, "key-bob", [5, 6, 7], "s" * MAX_CACHE_SALT_CHARS)  # the longest: accepted
    assert r.status_code == 200, r.text


def _routed(router: RouterProcess) -> float:
    text = router.get_text("/metrics")
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("fdkv_router:requests_routed_total{"))


SYSTEM = "You answer questions about the quarterly report of the accounts team. " * 10


def _chat(url: str, key: str, user: str) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": 2, "temperature": 0,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]}
    return httpx.post(url + "/v1/chat/completions", json=body, headers=_auth(key), timeout=120.0)


def test_the_router_predicts_a_shared_system_prompt_under_salt_after_system(tmp_path: Path) -> None:
    """Workers and router with ``--tenant-isolation salt-after-system``: bob's chat with alice's
    system messages goes to the worker that computed them for alice, and the router predicts
    exactly the system part the worker then reuses (not alice's user part)."""
    f = TenantFleet(tmp_path, "salt-after-system")
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda w: w.start(), f.workers))
        router = f.router(*f.auth)
        w1 = f.workers[1]
        question = "What was the revenue in the third quarter, and why did it change? " * 3
        r = _chat(w1.base_url, "key-alice-1", question)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0, r.text
        settled_view(router, f)
        r = _chat(router.base_url, "key-bob", question)
        assert r.status_code == 200, r.text
        predicted = int(r.headers["x-fdkv-predicted-cached-tokens"])
        found = r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert r.headers["x-fdkv-worker"] == w1.base_url
        assert predicted == found and BLOCK_SIZE <= found < r.json()["usage"]["prompt_tokens"] - BLOCK_SIZE, \
            (predicted, found)
        r = _chat(router.base_url, "key-alice-2", question)  # alice's own: the whole prompt
        assert r.status_code == 200, r.text
        assert int(r.headers["x-fdkv-predicted-cached-tokens"]) > found
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > found
    finally:
        for r in f.routers:
            r.stop()
        for w in f.workers:
            w.stop()


def test_under_k_anonymity_the_router_sees_a_prefix_only_once_revealed(tmp_path: Path) -> None:
    """Workers and router with ``--tenant-isolation k-anonymity`` (k = 2): alice's private
    prefix is not in the events, so the router predicts nothing for bob (no header tells him
    it is cached anywhere); once bob computed it on the same worker it is revealed there,
    announced, and the router predicts and finds it."""
    f = TenantFleet(tmp_path, "k-anonymity")
    try:
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda w: w.start(), f.workers))
        router = f.router(*f.auth)
        w1 = f.workers[1]
        plain = set(event_block_hashes(DOC, BLOCK_SIZE))
        r = post(w1.base_url, "key-alice-1", DOC)
        assert r.status_code == 200 and r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        view = settled_view(router, f)["workers"][1]
        assert not plain & {int(h, 16) for h in view["hashes"]["device"]}, "a private block was announced"
        r = post(router.base_url, "key-bob", DOC + [8])
        assert r.status_code == 200, r.text
        assert int(r.headers["x-fdkv-predicted-cached-tokens"]) == 0
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert post(w1.base_url, "key-bob", DOC + [9]).status_code == 200  # bob on w1 too (if not yet)
        view = settled_view(router, f)["workers"][1]
        assert plain <= {int(h, 16) for h in view["hashes"]["device"]}, "the revealed prefix was not announced"
        r = post(router.base_url, "key-alice-2", DOC + [10])
        assert r.status_code == 200, r.text
        assert r.headers["x-fdkv-worker"] == w1.base_url
        assert int(r.headers["x-fdkv-predicted-cached-tokens"]) == FULL
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]["device"] == FULL
    finally:
        for r in f.routers:
            r.stop()
        for w in f.workers:
            w.stop()
