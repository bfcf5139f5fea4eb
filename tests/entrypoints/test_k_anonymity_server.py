"""k-anonymous sharing and the per-range salt through real servers (uvicorn on 127.0.0.1,
tiny-llama-random on the CPU, the official ``openai`` client).

``--tenant-isolation k-anonymity --k-anonymity-k 3`` with five tenants, a host tier
(write_through) and a file store: a prompt is reused by a new tenant only after three
distinct tenants computed it, on the device and on the host tier; the store holds revealed
blocks only, and a restarted server serves them (and nothing private) from it.
``--tenant-isolation salt-after-system``: a chat's system messages are shared across
tenants, the rest is not.  Every reuse claim is read from the response's
``usage.prompt_tokens_details`` (``cached_tokens`` and ``cached_tokens_by_tier``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from fastdeploy_kvcache.core.hashing import storage_key
from fastdeploy_kvcache.core.kv_events import event_block_hashes
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.entrypoints.server_process import ServerProcess
from server_helpers import BASE_ARGS, BLOCK_SIZE, MODEL, file_store_args, prompt_ids, wait_storage_quiet

K = 3
TENANTS = [f"t{i}" for i in range(5)]
FILLER = "filler"
P_LEN = 200  # 12 full blocks + 8 tokens
FULL = (P_LEN // BLOCK_SIZE) * BLOCK_SIZE
NONE = {"device": 0, "host": 0, "storage": 0}


def _keys_file(directory: Path) -> Path:
    path = directory / "keys.txt"
    path.write_text("".join(f"key-{t} {t}\n" for t in (*TENANTS, FILLER)))
    return path


def _start(keys: Path, *more: str, store: Path | None = None) -> ServerProcess:
    args = [*BASE_ARGS, "--api-keys-file", str(keys), *more]
    if store is not None:
        args += file_store_args(store)
    return ServerProcess(args, env={"ENABLE_V1_KVCACHE_MANAGER": "1"}).start()


def _client(server: ServerProcess, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=f"key-{tenant}", max_retries=0, timeout=120.0)


def complete(server: ServerProcess, tenant: str, prompt: list[int], max_tokens: int = 4) -> tuple[str, dict[str, int]]:
    """Greedy completion as ``tenant``: (text, cached tokens by tier)."""
    out = _client(server, tenant).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens,
                                                     temperature=0, extra_body={"ignore_eos": True})
    details = out.usage.prompt_tokens_details
    tiers = out.model_dump()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    assert details.cached_tokens == sum(tiers.values()), out.usage
    return out.choices[0].text, tiers


def event_hashes(prompt: list[int]) -> set[int]:
    return set(event_block_hashes(prompt, BLOCK_SIZE))


def debug_blocks(server: ServerProcess, tenant: str) -> dict[str, set[int]]:
    r = httpx.get(server.base_url + "/debug/kv_cache_blocks", headers={"Authorization": f"Bearer key-{tenant}"},
                  timeout=30.0)
    assert r.status_code == 200, r.text
    return {m: set(h) for m, h in r.json()["mediums"].items()}


def push_off_device(server: ServerProcess) -> None:
    """Fill the 64-block device pool with other prompts: cached blocks go to the host tier."""
    for seed in range(7):
        complete(server, FILLER, prompt_ids(900 + seed, P_LEN), max_tokens=1)
    wait_storage_quiet(server)


@pytest.fixture(scope="module")
def kanon_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kanon")


@pytest.fixture(scope="module")
def server(kanon_dir: Path) -> Iterator[ServerProcess]:
    srv = _start(_keys_file(kanon_dir), "--tenant-isolation", "k-anonymity", "--k-anonymity-k", str(K),
                 store=kanon_dir / "kv")
    try:
        yield srv
    finally:
        assert srv.stop() in (0, None), srv.log_tail()


def test_a_prefix_is_revealed_on_the_device_exactly_by_the_kth_tenant(server: ServerProcess) -> None:
    q = prompt_ids(31, P_LEN)
    text, tiers = complete(server, "t0", q)
    assert tiers == NONE, tiers
    # Private: the block list (what KV events announce) does not show it to anyone.
    assert not event_hashes(q) & debug_blocks(server, "t3")["GPU"]
    again, tiers = complete(server, "t0", q)  # a tenant always sees what it computed
    assert again == text and tiers["device"] == FULL, tiers
    # t1 and t2 compute it as a miss: with t0 they are k distinct tenants only after t2.
    for t in ("t1", "t2"):
        again, tiers = complete(server, t, q)
        assert again == text and tiers == NONE, (t, tiers)
    again, tiers = complete(server, "t3", q)
    assert again == text and tiers["device"] == FULL, tiers
    assert event_hashes(q) <= debug_blocks(server, "t3")["GPU"]  # revealed: announced
    stats = server.engine_stats()["cache"]["k_anonymity"]
    assert stats["k"] == K and stats["revealed_blocks"] >= FULL // BLOCK_SIZE, stats


def test_a_private_prefix_on_the_host_is_a_miss_for_others_until_revealed(server: ServerProcess) -> None:
    q = prompt_ids(32, P_LEN)
    text, _ = complete(server, "t0", q)
    push_off_device(server)
    again, tiers = complete(server, "t0", q)  # its own copy, on the host
    assert again == text and tiers == {"device": 0, "host": FULL, "storage": 0}, tiers
    push_off_device(server)
    for t in ("t1", "t2"):  # the host copy (and the store) is a miss for them
        again, tiers = complete(server, t, q)
        assert again == text and tiers == NONE, (t, tiers)
        push_off_device(server)
    again, tiers = complete(server, "t4", q)
    assert again == text and tiers == {"device": 0, "host": FULL, "storage": 0}, tiers


def test_the_store_holds_revealed_blocks_only_and_serves_them_after_a_restart(server: ServerProcess,
                                                                            kanon_dir: Path) -> None:
    revealed, private = prompt_ids(33, P_LEN), prompt_ids(34, P_LEN)
    text, _ = complete(server, "t0", revealed)
    for t in ("t1", "t2"):
        complete(server, t, revealed)
    private_text, _ = complete(server, "t0", private)
    wait_storage_quiet(server)
    stats = server.engine_stats()["storage"]["tier"]
    assert stats["put_skipped_private"] > 0, stats

    def stored() -> set[str]:
        return {p.name for p in (kanon_dir / "kv").rglob("*.kv")}

    def on_store(prompt: list[int], names: set[str]) -> list[bool]:
        return [any(storage_key(h) in n for n in names) for h in Request("k", prompt).block_hashes(BLOCK_SIZE)]

    # Revealed by t2 after t0's host copy was made: written then, not only by the shutdown flush.
    assert all(on_store(revealed, stored())), "a revealed block is not in the store"
    assert server.stop() in (0, None), server.log_tail()  # the shutdown flush
    assert not any(on_store(private, stored())), "a private block reached the shared store"

    second = _start(_keys_file(kanon_dir), "--tenant-isolation", "k-anonymity", "--k-anonymity-k", str(K),
                    store=kanon_dir / "kv")
    try:
        again, tiers = complete(second, "t4", revealed)
        assert again == text and tiers == {"device": 0, "host": 0, "storage": FULL}, tiers
        again, tiers = complete(second, "t0", private)  # not stored: recomputed, even by its tenant
        assert again == private_text and tiers == NONE, tiers
    finally:
        assert second.stop() in (0, None), second.log_tail()


# ---------------------------------------------------------------------- per-range salt
SYSTEM = "You are a careful assistant for the accounts team. " * 12


def _chat(server: ServerProcess, tenant: str, user: str) -> tuple[str, int]:
    out = _client(server, tenant).chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}],
        max_tokens=4, temperature=0)
    return out.choices[0].message.content or "", out.usage.prompt_tokens_details.cached_tokens


@pytest.fixture(scope="module")
def per_range(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    srv = _start(_keys_file(tmp_path_factory.mktemp("per_range")), "--tenant-isolation", "salt-after-system")
    try:
        yield srv
    finally:
        assert srv.stop() in (0, None), srv.log_tail()


def test_the_system_prompt_is_shared_across_tenants_and_the_rest_is_not(per_range: ServerProcess) -> None:
    secret = "My account number is 4411-2290-7731 and my balance is private. " * 4
    text, cached = _chat(per_range, "t0", secret)
    assert cached == 0
    # Another tenant with another question: the system messages' whole blocks are shared.
    _, system_cached = _chat(per_range, "t1", "What is the weather like today? " * 4)
    assert system_cached >= BLOCK_SIZE and system_cached % BLOCK_SIZE == 0, system_cached
    # A third tenant sends t0's secret: only the system part is found, not t0's messages.
    again, cached = _chat(per_range, "t2", secret)
    assert again == text and cached == system_cached, (cached, system_cached)
    # t0 itself finds all of it.
    again, cached = _chat(per_range, "t0", secret)
    assert again == text and cached > system_cached, (cached, system_cached)
    # A completion has no system part: salted from its first block, nothing shared.
    q = prompt_ids(35, P_LEN)
    complete(per_range, "t0", q)
    assert complete(per_range, "t1", q)[1] == NONE
    assert complete(per_range, "t0", q)[1]["device"] == FULL


@pytest.mark.parametrize("k", ["1", "0", "x"])
def test_a_bad_k_is_a_usage_error(tmp_path: Path, k: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", ServerProcess.MODULE, *BASE_ARGS, "--api-keys-file",
                           str(_keys_file(tmp_path)), "--tenant-isolation", "k-anonymity", "--k-anonymity-k", k],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "--k-anonymity-k" in proc.stderr and "expected an integer >= 2" in proc.stderr, proc.stderr


def test_k_anonymity_with_a_pd_role_ends_start_up_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", ServerProcess.MODULE, *BASE_ARGS, "--api-keys-file",
                           str(_keys_file(tmp_path)), "--tenant-isolation", "k-anonymity", "--splitwise-role",
                           "prefill", *file_store_args(tmp_path / "kv")],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "not with --splitwise-role prefill/decode" in lines[0], proc.stderr


def test_k_without_k_anonymity_ends_start_up_with_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", ServerProcess.MODULE, *BASE_ARGS, "--api-keys-file",
                           str(_keys_file(tmp_path)), "--tenant-isolation", "salt", "--k-anonymity-k", "3"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].endswith(
        "--k-anonymity-k: only with --tenant-isolation k-anonymity (got salt)"), proc.stderr
