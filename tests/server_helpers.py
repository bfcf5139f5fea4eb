"""Helpers shared by the tests that drive real servers (tests/entrypoints, tests/pd,
tests/storage_tier).

Starting and stopping the processes is the library's job
(``fastdeploy_kvcache.entrypoints.server_process``); what lives here is what only tests need.
"""

from __future__ import annotations

import json
import time
from typing import Any


def scrape(server: Any) -> dict[str, float]:
    """``/metrics`` as {'name{labels}': value} (labels sorted, as text)."""
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[str, float] = {}
    for family in text_string_to_metric_families(server.get_text("/metrics")):
        for s in family.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            samples[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return samples


def wait_storage_quiet(server: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Storage stats once nothing runs and no storage job, put or pin is left."""
    deadline = time.monotonic() + timeout_s
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        stats = server.engine_stats()
        tier = stats["storage"]["tier"]
        if (stats.get("num_requests_running") == 0 and stats.get("num_requests_waiting") == 0
                and stats["storage"]["pending_work"] == 0 and tier["jobs_in_flight"] == 0 and tier["puts_pending"] == 0 and tier["pinned_host_blocks"] == 0
                and tier["prefetch_host_blocks"] == 0):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"storage not quiet after {timeout_s} s: {json.dumps(stats, indent=1)[:3000]}")


# The small server the storage-tier and PD tests start: tiny-llama-random on the CPU, a device
# pool of 64 blocks of 16 tokens, a host tier of 0.05 GiB (hundreds of tiny-llama blocks).
MODEL = "tiny-llama-random"
BLOCK_SIZE = 16
BASE_ARGS = [
    "--model", MODEL, "--device", "cpu", "--block-size", str(BLOCK_SIZE), "--max-model-len", "1024",
    "--num-gpu-blocks-override", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
    "--swap-space", "0.05", "--write-policy", "write_through",
]


def prompt_ids(seed: int, n: int) -> list[int]:
    """A token-id prompt (fixed seed; ids inside tiny-llama-random's vocabulary of 503)."""
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(n)]


def file_store_args(directory: Any, *more: str) -> list[str]:
    """A file storage tier in ``directory`` that waits for its prefetches."""
    return ["--kvcache-storage-backend", "file", "--kvcache-storage-path", str(directory),
            "--kvcache-storage-min-free", "0", "--kvcache-storage-prefetch-policy", "wait_complete", *more]


def mooncake_store_args(*more: str) -> list[str]:
    """A Mooncake storage tier (MOONCAKE_* from the environment) that waits for its prefetches."""
    return ["--kvcache-storage-backend", "mooncake", "--kvcache-storage-prefetch-policy", "wait_complete", *more]
