"""Shared helpers of the storage-tier tests: real servers (uvicorn, tiny-llama-random, CPU)
with a storage backend, and the keys/files of a prompt's blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from fastdeploy_kvcache.core.hashing import storage_key
from fastdeploy_kvcache.core.request import Request
from fastdeploy_kvcache.entrypoints.server_process import ServerProcess
from server_helpers import (  # noqa: F401 - re-exported for the storage-tier tests
    BASE_ARGS,
    BLOCK_SIZE,
    MODEL,
    file_store_args,
    prompt_ids,
    scrape,
    wait_storage_quiet,
)

def start_server(storage_args: Sequence[str], env: Optional[dict[str, str]] = None,
                 extra: Sequence[str] = ()) -> ServerProcess:
    return ServerProcess([*BASE_ARGS, *storage_args, *extra],
                         env={"ENABLE_V1_KVCACHE_MANAGER": "1", **(env or {})}).start()


def complete(server: ServerProcess, prompt: list[int], max_tokens: int = 8) -> tuple[str, dict[str, int]]:
    """Greedy completion: (text, cached_tokens_by_tier)."""
    import httpx

    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120.0)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    tiers = out["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
    return out["choices"][0]["text"], tiers


def storage_stats(server: ServerProcess) -> dict[str, Any]:
    return server.engine_stats()["storage"]


def assert_no_leak(server: ServerProcess) -> dict[str, Any]:
    """No device block owned by a request; every host block free or cached; no pin left."""
    stats = wait_storage_quiet(server)
    cache = stats["cache"]
    assert cache["device_blocks_owned"] == 0, cache
    assert cache["device_blocks_free"] + cache["device_blocks_cached"] == cache["device_blocks_total"], cache
    return stats


def block_hashes(prompt: list[int]) -> list[int]:
    return Request("h", list(prompt)).block_hashes(BLOCK_SIZE)


def object_file(directory: Path, block_hash: int) -> Path:
    """The file backend's object of a block (its key's namespace is the server's)."""
    found = list(directory.glob(f"*={storage_key(block_hash)}.kv"))
    assert len(found) == 1, f"{len(found)} objects for block {block_hash:#x} in {directory}"
    return found[0]
