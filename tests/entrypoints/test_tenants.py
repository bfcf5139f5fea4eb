"""API keys, ``cache_salt`` and tenant salting through a real server (uvicorn on 127.0.0.1,
tiny-llama-random on the CPU, the official ``openai`` client where it can say it).

One server with a keys file (two tenants, three keys), ``FDKV_API_KEY`` for a key without a
tenant, ``--tenant-isolation salt``, a host tier (write_through) and a file store; a second
pair of servers shares a store across a restart.  Every reuse claim is read from the
response's ``usage.prompt_tokens_details.cached_tokens_by_tier``, and where a tier should
hold a salted block, from ``/debug/kv_cache_blocks`` (the hashes KV events carry).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx
import openai
import pytest

from fastdeploy_kvcache.core.kv_events import event_block_hashes
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.core.hashing import storage_key
from fastdeploy_kvcache.entrypoints.auth import MAX_CACHE_SALT_CHARS, tenant_cache_salt
from fastdeploy_kvcache.entrypoints.server_process import ServerProcess
from server_helpers import BASE_ARGS, BLOCK_SIZE, MODEL, file_store_args, prompt_ids, wait_storage_quiet

KEYS = {"key-alice-1": "alice", "key-alice-2": "alice", "key-bob": "bob"}
ROOT_KEY = "key-root"  # FDKV_API_KEY: a key without a tenant
P = prompt_ids(11, 200)  # 12 full blocks + 8 tokens
FULL = 12 * BLOCK_SIZE


def _keys_file(directory: Path) -> Path:
    path = directory / "keys.txt"
    path.write_text("# key tenant\n" + "".join(f"{k} {t}\n" for k, t in KEYS.items()) + "\n")
    return path


def _start(store: Path, keys: Path) -> ServerProcess:
    return ServerProcess([*BASE_ARGS, *file_store_args(store), "--api-keys-file", str(keys),
                          "--tenant-isolation", "salt"],
                         env={"ENABLE_V1_KVCACHE_MANAGER": "1", "FDKV_API_KEY": ROOT_KEY}).start()


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    d = tmp_path_factory.mktemp("tenants")
    srv = _start(d / "kv", _keys_file(d))
    try:
        yield srv
    finally:
        assert srv.stop() in (0, None), srv.log_tail()


def _auth(key: Optional[str]) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def complete(server: ServerProcess, key: str, prompt: list[int], salt: Any = None,
             max_tokens: int = 6) -> tuple[str, dict[str, int]]:
    """Greedy completion as ``key``: (text, cached tokens by tier)."""
    body: dict[str, Any] = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                            "ignore_eos": True}
    if salt is not None:
        body["cache_salt"] = salt
    r = httpx.post(server.base_url + "/v1/completions", json=body, headers=_auth(key), timeout=120.0)
    assert r.status_code == 200, r.text
    out = r.json()
    return out["choices"][0]["text"], out["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]


def blocks(server: ServerProcess) -> dict[str, set[int]]:
    r = httpx.get(server.base_url + "/debug/kv_cache_blocks", headers=_auth(ROOT_KEY), timeout=30.0)
    assert r.status_code == 200, r.text
    return {m: set(h) for m, h in r.json()["mediums"].items()}


def salted(prompt: list[int], salt: Optional[str]) -> set[int]:
    return set(event_block_hashes(prompt, BLOCK_SIZE, cache_salt=salt))


# ---------------------------------------------------------------------- keys
ROUTES = [
    ("GET", "/v1/models", None),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 2, "stream": True}),
    ("GET", "/debug/kv_cache_blocks", None),
]


def test_every_v1_route_needs_a_key_and_health_and_metrics_do_not(server: ServerProcess) -> None:
    url = server.base_url
    finished_before = _finished(server)
    for method, path, body in ROUTES:
        for headers in ({}, _auth("wrong-key"), _auth("key-alice-1x"), {"Authorization": "Basic key-bob"},
                        {"Authorization": "Bearer"}):
            r = httpx.request(method, url + path, json=body, headers=headers, timeout=30.0)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json()["error"]["code"] == "invalid_api_key", r.text
            assert r.headers["www-authenticate"] == "Bearer"
    # Nothing refused reached the engine.
    assert _finished(server) == finished_before
    for key in (*KEYS, ROOT_KEY):
        for method, path, body in ROUTES:
            r = httpx.request(method, url + path, json=body, headers=_auth(key), timeout=60.0)
            assert r.status_code == 200, (path, key, r.text)
    assert _finished(server) == finished_before + 3 * (len(KEYS) + 1)
    for path in ("/health", "/health?verbose=1", "/metrics"):
        assert httpx.get(url + path, timeout=30.0).status_code == 200, path
    # The official client: a wrong key is its AuthenticationError, a right one answers.
    bad = openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    good = openai.OpenAI(base_url=url + "/v1", api_key="key-bob", max_retries=0, timeout=60.0)
    assert good.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=2).usage.completion_tokens == 2


def _finished(server: ServerProcess) -> float:
    from server_helpers import scrape

    return sum(v for k, v in scrape(server).items() if k.startswith("fastdeploy:request_success_total"))


@pytest.mark.parametrize("salt,why", [("", "an empty one"), (5, "valid string"), (["a"], "valid string"),
                                      (True, "valid string"),
                                      ("s" * (MAX_CACHE_SALT_CHARS + 1),
                                       f"at most {MAX_CACHE_SALT_CHARS} characters, got {MAX_CACHE_SALT_CHARS + 1}")])
def test_a_bad_cache_salt_is_a_400_naming_the_field(server: ServerProcess, salt: Any, why: str) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=ROOT_KEY, max_retries=0, timeout=60.0)
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"cache_salt": salt})
    assert exc.value.body["param"] == "cache_salt" and why in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                       extra_body={"cache_salt": salt})
    assert exc.value.body["param"] == "cache_salt" and why in exc.value.body["message"]


def test_the_longest_cache_salt_is_a_namespace_of_its_own(server: ServerProcess) -> None:
    longest = "s" * MAX_CACHE_SALT_CHARS
    q = prompt_ids(14, 200)
    text, tiers = complete(server, ROOT_KEY, q, longest)
    assert sum(tiers.values()) == 0, tiers
    assert salted(q, tenant_cache_salt(None, longest)) <= blocks(server)["GPU"]
    again, tiers = complete(server, ROOT_KEY, q, longest)
    assert again == text and tiers["device"] == FULL, tiers
    again, tiers = complete(server, ROOT_KEY, q, longest[:-1])  # one character less: another salt
    assert again == text and sum(tiers.values()) == 0, tiers


# ---------------------------------------------------------------------- salts, device and host
def test_salts_share_no_block_on_device_or_host_and_each_salt_reuses_its_own(server: ServerProcess) -> None:
    # The root key has no tenant: its requests are salted "tenant:0::<cache_salt>".
    salt = {s: tenant_cache_salt(None, s) for s in ("a", "b", "c", None)}
    text, tiers = complete(server, ROOT_KEY, P, "a")
    assert sum(tiers.values()) == 0, tiers
    for other in ("b", None):
        again, tiers = complete(server, ROOT_KEY, P, other)
        assert sum(tiers.values()) == 0, (other, tiers)  # P is on the device, under another salt
        assert again == text  # the salt changes what is shared, never what is computed
    on = blocks(server)
    for s in ("a", "b", None):
        assert salted(P, salt[s]) <= on["GPU"], s
    assert not salted(P, None) & on["GPU"]  # no unsalted block: this server salts every request
    again, tiers = complete(server, ROOT_KEY, P, "a")
    assert again == text and tiers == {"device": FULL, "host": 0, "storage": 0}, tiers

    # Push P off the device (64 blocks): its three salted copies stay on the host (write_through).
    for seed in range(7):
        complete(server, ROOT_KEY, prompt_ids(100 + seed, 200), max_tokens=1)
    wait_storage_quiet(server)
    on = blocks(server)
    for s in ("a", "b", None):
        assert salted(P, salt[s]) <= on["CPU"] and not salted(P, salt[s]) & on["GPU"], s
    again, tiers = complete(server, ROOT_KEY, P, "c")
    assert again == text and sum(tiers.values()) == 0, tiers  # a new salt finds none of them
    again, tiers = complete(server, ROOT_KEY, P, "b")
    assert again == text and tiers == {"device": 0, "host": FULL, "storage": 0}, tiers


def test_tenant_salting_separates_tenants_and_shares_within_one(server: ServerProcess) -> None:
    q = prompt_ids(12, 200)
    text, tiers = complete(server, "key-alice-1", q)
    assert sum(tiers.values()) == 0, tiers
    assert salted(q, tenant_cache_salt("alice", None)) <= blocks(server)["GPU"]
    again, tiers = complete(server, "key-alice-2", q)  # the same tenant with its other key
    assert again == text and tiers["device"] == FULL, tiers
    # Another tenant, the tenant-less key, and forged salts that spell alice's: nothing shared.
    for key, forged in (("key-bob", None), (ROOT_KEY, None), ("key-bob", tenant_cache_salt("alice", None)),
                        (ROOT_KEY, tenant_cache_salt("alice", None)), ("key-alice-1", "x")):
        again, tiers = complete(server, key, q, forged)
        assert again == text and sum(tiers.values()) == 0, (key, forged, tiers)
    again, tiers = complete(server, "key-alice-1", q, "x")  # alice's own salted namespace is hers
    assert tiers["device"] == FULL, tiers


# ---------------------------------------------------------------------- storage, across a restart
def test_a_shared_file_store_serves_a_salt_only_to_that_salt_across_a_restart(tmp_path: Path) -> None:
    store, keys = tmp_path / "kv", _keys_file(tmp_path)
    q = prompt_ids(13, 200)
    first = _start(store, keys)
    try:
        text, _ = complete(first, "key-alice-1", q)
        complete(first, ROOT_KEY, q, "s")
        wait_storage_quiet(first)
    finally:
        assert first.stop() in (0, None), first.log_tail()
    # Storage keys derive from the salted hashes: alice's and "s"'s objects are there, no
    # unsalted one.
    names = {p.name for p in store.rglob("*.kv")}
    for salt in (tenant_cache_salt("alice", None), tenant_cache_salt(None, "s")):
        for h in Request("k", q, cache_salt=salt).block_hashes(BLOCK_SIZE):
            assert any(n.endswith(f"={storage_key(h)}.kv") for n in names), salt
    for h in Request("k", q).block_hashes(BLOCK_SIZE):
        assert not any(storage_key(h) in n for n in names)

    second = _start(store, keys)
    try:
        for key, salt in (("key-bob", None), (ROOT_KEY, None), (ROOT_KEY, "t")):
            again, tiers = complete(second, key, q, salt)
            assert again == text and sum(tiers.values()) == 0, (key, salt, tiers)
        again, tiers = complete(second, "key-alice-2", q)
        assert again == text and tiers == {"device": 0, "host": 0, "storage": FULL}, tiers
        again, tiers = complete(second, ROOT_KEY, q, "s")
        assert again == text and tiers == {"device": 0, "host": 0, "storage": FULL}, tiers
    finally:
        assert second.stop() in (0, None), second.log_tail()


# ---------------------------------------------------------------------- start-up
@pytest.mark.parametrize("content,says", [
    ("k1 alice\nk2\n", "line 2: expected '<key> <tenant>', got 1 field(s)"),
    ('{"k1": "alice", "k1": "bob"}', "not valid JSON (the name 'k1' appears twice in one object)"),
    ('{"k1": "alice"', "not valid JSON (Expecting ',' delimiter: line 1 column 15 (char 14))"),
    (None, "cannot read it (No such file or directory)"),
])
def test_a_bad_keys_file_ends_start_up_with_one_line(tmp_path: Path, content: Optional[str], says: str) -> None:
    import subprocess
    import sys

    path = tmp_path / "keys"
    if content is not None:
        path.write_text(content)
    proc = subprocess.run([sys.executable, "-m", ServerProcess.MODULE, *BASE_ARGS, "--api-keys-file", str(path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(f"error: --api-keys-file {path}: {says}"), proc.stderr


def test_an_empty_api_key_ends_start_up_with_one_line() -> None:
    """``--api-key ''`` is refused, not read as "no key": the server would start open."""
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", ServerProcess.MODULE, *BASE_ARGS, "--api-key", ""],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith("error: --api-key: the key must be a non-empty string, got ''"), \
        proc.stderr
