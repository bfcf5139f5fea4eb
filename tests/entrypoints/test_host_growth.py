"""A real server whose host tier is still being pinned: it serves at once, host hits come
from the blocks that landed with the greedy tokens of recompute, and SIGTERM while the tier
grows exits 0.  Growth is slowed through its documented knobs (FDKV_HOST_GROW_CHUNK_MIB,
FDKV_HOST_GROW_PACE_S), not mocked."""

from __future__ import annotations

import signal
import time

import openai

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess
from server_helpers import BASE_ARGS, MODEL, prompt_ids, scrape
from shutdown_helpers import wait_until

# 1 MiB pieces of tiny-llama blocks, one every 2 s: the 0.05 GiB tier takes ~100 s to pin,
# far longer than the test's requests.
GROW_ENV = {"ENABLE_V1_KVCACHE_MANAGER": "1", "FDKV_HOST_GROW_CHUNK_MIB": "1", "FDKV_HOST_GROW_PACE_S": "2"}


def _host_blocks(server: ServerProcess) -> tuple[float, float]:
    m = scrape(server)
    return m["fastdeploy_kvcache:host_blocks_ready"], m["fastdeploy_kvcache:host_blocks_total"]


def _greedy(client: openai.OpenAI, prompt: list[int], n: int = 6):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                     extra_body={"ignore_eos": True})


def test_serves_host_hits_while_the_host_tier_grows_then_stops_cleanly() -> None:
    # write_back: host copies are made only when the device pool evicts, so the target's
    # blocks are the first (and only) to go to the few host blocks landed by then.
    server = ServerProcess([*BASE_ARGS, "--write-policy", "write_back"], env=GROW_ENV,
                           wait_for_host_tier=False).start()
    try:
        ready, total = _host_blocks(server)
        assert total > 0 and ready < total, (ready, total)
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        target = prompt_ids(1, 200)  # 12 full blocks of 16
        # Enough landed host blocks for the target's evicted blocks to land in.
        wait_until(lambda: _host_blocks(server)[0] >= 16, 60, "16 host blocks pinned")
        first = _greedy(client, target)
        # Others (13 blocks each) push the target out of the 64-block device pool.
        for seed in range(2, 7):
            _greedy(client, prompt_ids(seed, 200), 2)
        back = _greedy(client, target)
        by_tier = back.usage.model_dump()["prompt_tokens_details"]["cached_tokens_by_tier"]
        ready, total = _host_blocks(server)
        assert ready < total, "the tier completed before the test could use it while growing"
        assert by_tier["host"] > 0, back.usage
        assert back.choices[0].text == first.choices[0].text, "KV from a landed host block must equal recompute"
        m = scrape(server)
        assert m['fastdeploy_kvcache:blocks_used{tier="host"}'] <= ready
        # SIGTERM while the background pinning still runs: a clean, prompt exit.
        assert server.proc is not None
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(60)
        log = server.log_tail(400)
        assert code == 0, log
        assert time.monotonic() - started < 30, log
        assert "Traceback" not in log, log
        assert "host KV cache complete" not in log, log
    finally:
        server.stop()


def test_complete_host_tier_is_logged_with_size_and_seconds() -> None:
    env = dict(GROW_ENV, FDKV_HOST_GROW_CHUNK_MIB="8", FDKV_HOST_GROW_PACE_S="0")
    server = ServerProcess(BASE_ARGS, env=env, wait_for_host_tier=False).start()
    try:
        wait_until(lambda: _host_blocks(server)[0] == _host_blocks(server)[1], 60, "the host tier complete")
        wait_until(lambda: "host KV cache complete" in server.log_tail(400), 10, "the completion log line")
        line = next(x for x in server.log_tail(400).splitlines() if "host KV cache complete" in x)
        assert "GiB pinned in" in line and " s" in line, line
    finally:
        server.stop()


def test_a_started_server_process_has_its_host_tier_whole() -> None:
    """ServerProcess.start() waits for a host tier pinned in the background (the default with
    CUDA copies), so a benchmark's workload never meets a tier still empty; a caller timing
    "serving" opts out and sees it grow."""
    env = dict(GROW_ENV, FDKV_HOST_GROW_CHUNK_MIB="8", FDKV_HOST_GROW_PACE_S="0.5")  # ~7 pieces, ~3 s
    server = ServerProcess(BASE_ARGS, env=env).start()
    try:
        ready, total = _host_blocks(server)
        assert total > 0 and ready == total, (ready, total)
        assert server.host_tier_progress() == (ready, total)
    finally:
        server.stop()
    early = ServerProcess(BASE_ARGS, env=env, wait_for_host_tier=False).start()
    try:
        ready, total = _host_blocks(early)
        assert total > 0 and ready < total, (ready, total)
    finally:
        early.stop()
