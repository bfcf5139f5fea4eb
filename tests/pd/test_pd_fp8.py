"""PD with block_wise_fp8 KV through a shared directory: the hand-off carries the 8-bit bytes
and their scales, full blocks and the partial last one.  Real processes on 127.0.0.1
(tiny-llama-random, CPU): a prefill server, a decode server and the router, against a mixed
server with the same fp8 cache (the output of recomputing with fp8 KV).  A decode server of
another KV dtype never reads the fp8 hand-off: it recomputes, with the text of its own dtype."""

from __future__ import annotations

from typing import Any, Iterator

import pytest

from .helpers import RouterProcess, completion, file_store_args, prompt_ids, recomputed, start_server, stop_cluster
from skip_helpers import needs_server_modules

pytestmark = needs_server_modules()

FP8 = ["--quantization", '{"kv_cache_quant_type": "block_wise_fp8"}']
PROMPTS = {n: prompt_ids(300 + n, n) for n in (45, 100)}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    store = tmp_path_factory.mktemp("pdfp8")
    servers: dict[str, Any] = {}
    try:
        servers["mixed"] = start_server("mixed", [], extra=FP8)
        servers["prefill"] = start_server("prefill", file_store_args(store), extra=FP8)
        servers["decode"] = start_server("decode", file_store_args(store), extra=FP8)
        servers["router"] = RouterProcess(servers["prefill"].base_url, servers["decode"].base_url).start()
        yield {**servers, "store": store}
    finally:
        stop_cluster(servers)


def test_fp8_hand_off_gives_the_mixed_servers_tokens_and_recomputes_nothing(cluster: dict[str, Any]) -> None:
    for n, prompt in PROMPTS.items():
        via = completion(cluster["router"].base_url, prompt)
        ref = completion(cluster["mixed"].base_url, prompt)
        assert via["status"] == ref["status"] == 200, (via, ref)
        assert via["text"] == ref["text"], n
        tiers = via["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]
        assert sum(tiers.values()) == n, (n, tiers)
    assert recomputed(cluster["decode"]) == 0
    assert cluster["decode"].engine_stats()["pd"]["decode_partial_loaded"] >= 2


def test_a_decode_server_of_another_kv_dtype_recomputes(cluster: dict[str, Any]) -> None:
    store = cluster["store"]
    servers: dict[str, Any] = {}
    try:
        servers["mixed"] = start_server("mixed", [])
        servers["decode"] = start_server("decode", file_store_args(store))
        servers["router"] = RouterProcess(cluster["prefill"].base_url, servers["decode"].base_url).start()
        prompt = PROMPTS[45]
        via = completion(servers["router"].base_url, prompt)
        ref = completion(servers["mixed"].base_url, prompt)
        assert via["status"] == 200 and via["text"] == ref["text"]
        assert recomputed(servers["decode"]) >= 45
    finally:
        stop_cluster(servers)
