"""A storage hit through the server (real uvicorn on 127.0.0.1, ``openai`` client, a real
directory): on an idle engine its fetch is read on the engine thread, and the engine's
per-request timings say where its time to first token went."""

from __future__ import annotations

from pathlib import Path

from skip_helpers import needs_server_modules

from .helpers import BLOCK_SIZE, MODEL, assert_no_leak, file_store_args, prompt_ids, start_server, wait_storage_quiet

pytestmark = needs_server_modules()

P = prompt_ids(11, 200)  # 12 full blocks
Q = prompt_ids(12, 200)


def _complete(server: object, prompt: list[int]) -> tuple[str, dict[str, int]]:
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)  # type: ignore[attr-defined]
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    details = out.usage.prompt_tokens_details.model_dump()  # type: ignore[union-attr]
    return out.choices[0].text, details["cached_tokens_by_tier"]


def test_a_lone_storage_hit_is_read_on_the_engine_thread_and_timed(tmp_path: Path) -> None:
    store = tmp_path / "kv"
    first = start_server(file_store_args(store))
    try:
        cold = {name: _complete(first, p)[0] for name, p in (("P", P), ("Q", Q))}
        wait_storage_quiet(first)
        timing = first.engine_stats()["request_timings"][-1]
        assert timing["fetch"] is None and timing["cached_tokens"]["storage"] == 0  # computed, nothing fetched
        assert 0 <= timing["queued_s"] <= timing["ttft_s"]
        assert timing["first_step"]["tokens"] > 0 and timing["first_step"]["forward_s"] > 0
    finally:
        first.stop()

    second = start_server(file_store_args(store))
    try:
        for name, prompt in (("P", P), ("Q", Q)):
            wait_storage_quiet(second)  # idle: nothing runs, nothing waits
            text, tiers = _complete(second, prompt)
            assert text == cold[name], "storage-tier KV must give the same greedy output as recompute"
            assert tiers["storage"] == 12 * BLOCK_SIZE, tiers
            timing = second.engine_stats()["request_timings"][-1]
            fetch = timing["fetch"]
            assert fetch is not None and fetch["blocks"] == 12 and fetch["bytes"] > 0, timing
            assert fetch["on_arrival"] and not fetch["shared"]
            # Planned, read, in the tree, admitted, first token: in that order.
            assert 0 <= fetch["started_s"] <= fetch["landed_s"] <= fetch["in_tree_s"] <= timing["queued_s"], timing
            assert timing["admit_after_fetch_s"] >= 0 and timing["queued_s"] <= timing["ttft_s"]
            assert fetch["job_s"] > 0 and timing["cached_tokens"]["storage"] == 12 * BLOCK_SIZE
        stats = assert_no_leak(second)["storage"]["tier"]
        # Each hit arrived at an idle engine: read inline, no job left for the transfer thread.
        assert stats["prefetch_jobs_inline"] == 2 and stats["prefetch_jobs"] == 2, stats
        assert stats["prefetch_blocks_inserted"] == 24
    finally:
        second.stop()
