"""The OpenAI-compatible server through a real uvicorn server and the official client.

Everything goes over TCP on 127.0.0.1 to a child process running tiny-llama-random on
the CPU (fixtures in conftest.py).  Block accounting is read from ``GET /health?verbose=1``
(the engine's stats): after every test that could leak, no device block may stay owned.
"""

from __future__ import annotations

import json
import random
import threading
import time
from typing import Any

import httpx
import openai
import pytest

from conftest import BLOCK_SIZE, MAX_MODEL_LEN, MODEL
from server_helpers import scrape

WORDS = ("cache block device host storage tier prefix radix tree layer stream copy event token "
         "prompt engine server request batch model attention key value swap evict load").split()


def text_of(seed: int, n_words: int) -> str:
    """Deterministic filler text (random.Random with a fixed int seed, never hash())."""
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n_words))


def client_for(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def wait_quiet(server: Any, timeout_s: float = 30.0) -> dict[str, Any]:
    """Engine stats once nothing runs or waits and no device block is owned by a request."""
    deadline = time.monotonic() + timeout_s
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        stats = server.engine_stats()
        if (stats.get("num_requests_running") == 0 and stats.get("num_requests_waiting") == 0
                and device_blocks(stats)["owned"] == 0):
            return stats
        time.sleep(0.05)
    raise AssertionError(f"engine not quiet after {timeout_s} s: {json.dumps(stats, indent=1)[:3000]}")


def _find(stats: dict[str, Any], key: str) -> Any:
    if key in stats:
        return stats[key]
    for value in stats.values():
        if isinstance(value, dict):
            found = _find(value, key)
            if found is not None:
                return found
    return None


def device_blocks(stats: dict[str, Any]) -> dict[str, int]:
    total = _find(stats, "device_blocks_total")
    free = _find(stats, "device_blocks_free")
    cached = _find(stats, "device_blocks_cached") or 0
    owned = _find(stats, "device_blocks_owned")
    assert total is not None and free is not None and owned is not None, f"engine stats lack block counts: {stats}"
    return {"total": int(total), "free": int(free), "cached": int(cached), "owned": int(owned)}


def assert_no_leak(server: Any) -> None:
    blocks = device_blocks(wait_quiet(server))
    assert blocks["owned"] == 0, blocks
    assert blocks["free"] + blocks["cached"] == blocks["total"], blocks


# ---------------------------------------------------------------------- basics
def test_health_and_models(server: Any) -> None:
    assert server.get_json("/health") == {"status": "ok"}
    models = client_for(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


def test_completion(server: Any) -> None:
    client = client_for(server)
    out = client.completions.create(model=MODEL, prompt=text_of(1, 30), max_tokens=8, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert out.object == "text_completion"
    assert len(out.choices) == 1 and out.choices[0].finish_reason == "length"
    assert isinstance(out.choices[0].text, str) and out.choices[0].text
    assert out.usage.completion_tokens == 8
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 8


def test_completion_token_ids_and_n(server: Any) -> None:
    client = client_for(server)
    out = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9, 10], max_tokens=4, n=3,
                                    temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.prompt_tokens == 6 and out.usage.completion_tokens == 12  # the prompt counts once, as in OpenAI
    again = client.completions.create(model=MODEL, prompt=[5, 6, 7, 8, 9, 10], max_tokens=4, n=3,
                                      temperature=0.8, seed=7, extra_body={"ignore_eos": True})
    assert [c.text for c in again.choices] == [c.text for c in out.choices], "a seeded request must reproduce"


def test_chat(server: Any) -> None:
    client = client_for(server)
    out = client.chat.completions.create(
        model=MODEL, max_tokens=6, temperature=0, extra_body={"ignore_eos": True},
        messages=[{"role": "system", "content": text_of(2, 20)}, {"role": "user", "content": "hello"}])
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 6


def test_completion_stream_matches_non_stream(server: Any) -> None:
    client = client_for(server)
    prompt = text_of(3, 40)
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == full.choices[0].text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_stream(server: Any) -> None:
    client = client_for(server)
    messages = [{"role": "user", "content": text_of(4, 30)}]
    full = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == "length"


def test_raw_sse_framing(server: Any) -> None:
    """Every event is ``data: <json>\\n\\n`` and the stream ends with ``data: [DONE]``."""
    body = {"model": MODEL, "prompt": "cache block", "max_tokens": 3, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = resp.read().decode()
    events = [e for e in raw.split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events), raw
    assert events[-1] == "data: [DONE]"
    for e in events[:-1]:
        json.loads(e[len("data: "):])


# ---------------------------------------------------------------------- cache reuse
def test_cached_tokens_on_repeated_prefix(server: Any) -> None:
    client = client_for(server)
    prefix = text_of(10, 120)
    first = client.completions.create(model=MODEL, prompt=prefix + " first", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    second = client.completions.create(model=MODEL, prompt=prefix + " second", max_tokens=4, temperature=0,
                                       extra_body={"ignore_eos": True})
    d2 = second.usage.prompt_tokens_details
    assert first.usage.prompt_tokens > 3 * BLOCK_SIZE
    assert d2.cached_tokens >= 2 * BLOCK_SIZE, second.usage
    assert d2.cached_tokens % BLOCK_SIZE == 0
    by_tier = second.usage.model_dump()["prompt_tokens_details"]["cached_tokens_by_tier"]
    assert sum(by_tier.values()) == d2.cached_tokens
    assert by_tier["device"] > 0
    # The same prompt again reuses the same KV: the greedy output cannot change.
    again = client.completions.create(model=MODEL, prompt=prefix + " first", max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_host_tier_hit(server: Any) -> None:
    """A prompt whose device blocks were evicted by others comes back from the host tier."""
    client = client_for(server)
    target = text_of(20, 100)
    first = client.completions.create(model=MODEL, prompt=target, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True})
    # Others (about 21 blocks each) push it out of the device pool (128 blocks of 16).
    for seed in range(21, 31):
        client.completions.create(model=MODEL, prompt=text_of(seed, 100), max_tokens=2, temperature=0,
                                  extra_body={"ignore_eos": True})
    back = client.completions.create(model=MODEL, prompt=target, max_tokens=4, temperature=0,
                                     extra_body={"ignore_eos": True})
    by_tier = back.usage.model_dump()["prompt_tokens_details"]["cached_tokens_by_tier"]
    assert by_tier["host"] > 0, back.usage
    assert back.choices[0].text == first.choices[0].text, "host-tier KV must give the same greedy output"
    assert_no_leak(server)


def test_switch_off_reports_no_cached_tokens(baseline_server: Any) -> None:
    client = client_for(baseline_server)
    prompt = text_of(10, 120)
    outs = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"ignore_eos": True}) for _ in range(2)]
    assert [o.usage.prompt_tokens_details.cached_tokens for o in outs] == [0, 0]
    assert outs[0].choices[0].text == outs[1].choices[0].text
    metrics = scrape(baseline_server)
    assert metrics["fastdeploy:prefix_cache_token_num_total"] == 0
    assert_no_leak(baseline_server)


def test_same_output_with_and_without_reuse(server: Any, baseline_server: Any) -> None:
    prompt = text_of(10, 120) + " third"
    on = client_for(server).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                               extra_body={"ignore_eos": True})
    off = client_for(baseline_server).completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                                         extra_body={"ignore_eos": True})
    assert on.usage.prompt_tokens_details.cached_tokens > 0
    assert off.usage.prompt_tokens_details.cached_tokens == 0
    assert on.choices[0].text == off.choices[0].text


# ---------------------------------------------------------------------- concurrency
def test_16_concurrent_clients_8_requests_each(server: Any) -> None:
    errors: list[BaseException] = []
    results: dict[tuple[int, int], tuple[str, str, int]] = {}
    shared = text_of(30, 60)

    def worker(c: int) -> None:
        client = client_for(server)
        try:
            for r in range(8):
                prompt = f"{shared} client {c % 4} round {r}"
                if r % 2:
                    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                                    extra_body={"ignore_eos": True})
                    results[(c, r)] = (prompt, out.choices[0].text, out.usage.completion_tokens)
                else:
                    chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True})
                    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
                    results[(c, r)] = (prompt, text, 5)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors[:3]
    assert len(results) == 16 * 8
    assert all(n == 5 for _, _, n in results.values())
    # Clients c and c+4 send the same prompts (greedy): batching and reuse must not change output.
    by_prompt: dict[str, set[str]] = {}
    for prompt, text, _ in results.values():
        by_prompt.setdefault(prompt, set()).add(text)
    assert all(len(texts) == 1 for texts in by_prompt.values()), by_prompt
    assert_no_leak(server)


# ---------------------------------------------------------------------- bad input
LONG = " ".join(["cache"] * (MAX_MODEL_LEN * 2))

BAD_COMPLETIONS: list[tuple[str, Any, str]] = [
    ("unknown model", {"model": "nope", "prompt": "hi"}, "model"),
    ("max_tokens 0", {"model": MODEL, "prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens < 0", {"model": MODEL, "prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("prompt too long", {"model": MODEL, "prompt": LONG}, "prompt"),
    ("prompt + max_tokens too long", {"model": MODEL, "prompt": "hi", "max_tokens": MAX_MODEL_LEN}, "max_tokens"),
    ("temperature < 0", {"model": MODEL, "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("top_p 0", {"model": MODEL, "prompt": "hi", "top_p": 0}, "top_p"),
    ("top_p > 1", {"model": MODEL, "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("top_k 0", {"model": MODEL, "prompt": "hi", "top_k": 0}, "top_k"),
    ("top_k < -1", {"model": MODEL, "prompt": "hi", "top_k": -2}, "top_k"),
    ("n 0", {"model": MODEL, "prompt": "hi", "n": 0}, "n"),
    ("n over the documented cap", {"model": MODEL, "prompt": "hi", "n": 65}, "n"),
    ("empty prompt", {"model": MODEL, "prompt": ""}, "prompt"),
    ("token id out of range", {"model": MODEL, "prompt": [1, 2, 10 ** 9]}, "prompt"),
    ("negative seed", {"model": MODEL, "prompt": "hi", "seed": -1}, "seed"),
    ("unsupported penalty", {"model": MODEL, "prompt": "hi", "presence_penalty": 0.5}, "presence_penalty"),
    ("missing prompt", {"model": MODEL}, "prompt"),
    ("wrong type", {"model": MODEL, "prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("not an object", [1, 2, 3], ""),
]

BAD_CHAT: list[tuple[str, Any, str]] = [
    ("no messages", {"model": MODEL, "messages": []}, "messages"),
    ("bad role", {"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("chat max_tokens 0", {"model": MODEL, "max_tokens": 0, "messages": [{"role": "user", "content": "hi"}]},
     "max_tokens"),
    ("chat unknown model", {"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}, "model"),
    ("chat too long", {"model": MODEL, "messages": [{"role": "user", "content": LONG}]}, "messages"),
]


def _assert_openai_error(resp: httpx.Response, param: str) -> None:
    assert resp.status_code == 400, (resp.status_code, resp.text)
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["message"]
    if param:
        assert err["param"] is not None and err["param"].startswith(param), err
        assert param in err["message"], err


@pytest.mark.parametrize("name,body,param", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_request_is_400(server: Any, name: str, body: Any, param: str) -> None:
    resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=30)
    _assert_openai_error(resp, param)


@pytest.mark.parametrize("name,body,param", BAD_CHAT, ids=[c[0] for c in BAD_CHAT])
def test_bad_chat_request_is_400(server: Any, name: str, body: Any, param: str) -> None:
    resp = httpx.post(server.base_url + "/v1/chat/completions", json=body, timeout=30)
    _assert_openai_error(resp, param)


def test_malformed_json_is_400(server: Any) -> None:
    resp = httpx.post(server.base_url + "/v1/completions", content=b'{"model": "x", "prompt": ',
                      headers={"content-type": "application/json"}, timeout=30)
    _assert_openai_error(resp, "")
    assert "JSON" in resp.json()["error"]["message"]


def test_openai_client_raises_bad_request_and_server_keeps_serving(server: Any) -> None:
    client = client_for(server)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=0)
    assert "max_tokens" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2
    assert_no_leak(server)


# ---------------------------------------------------------------------- disconnects
ABORTED = 'fastdeploy:request_success_total{finish_reason="abort"}'
# A generation long enough (1600 tokens, seconds on the CPU) that the client leaves first.
LONG_GENERATION = 1600


def wait_aborted(server: Any, before: float) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if scrape(server).get(ABORTED, 0.0) > before:
            return
        time.sleep(0.05)
    raise AssertionError("no aborted request was recorded after the client disconnected")


def test_disconnect_mid_stream_aborts_and_frees_blocks(server: Any) -> None:
    before = scrape(server).get(ABORTED, 0.0)
    body = {"model": MODEL, "prompt": text_of(40, 100), "max_tokens": LONG_GENERATION, "stream": True,
            "ignore_eos": True, "temperature": 0}
    with httpx.stream("POST", server.base_url + "/v1/completions", json=body, timeout=60) as resp:
        assert resp.status_code == 200
        events: list[str] = []
        running: dict[str, Any] = {}
        for line in resp.iter_lines():
            if line.startswith("data: "):
                events.append(line)
            if len(events) >= 3:
                # Read the stats before leaving the loop: closing the line iterator closes
                # httpx's connection, which is the disconnect this test makes.
                running = server.engine_stats()
                break
        assert device_blocks(running)["owned"] > 0, (
            f"the streamed request should hold blocks while it runs; events {events}, stats {running}")
    # The connection is closed: the server aborts the request and its blocks are freed.
    wait_aborted(server, before)
    assert_no_leak(server)


def test_disconnect_non_stream_aborts(server: Any) -> None:
    before = scrape(server).get(ABORTED, 0.0)
    body = {"model": MODEL, "prompt": text_of(41, 100), "max_tokens": LONG_GENERATION,
            "ignore_eos": True, "temperature": 0}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
    wait_aborted(server, before)
    assert_no_leak(server)


# ---------------------------------------------------------------------- metrics
def test_metrics(server: Any) -> None:
    client = client_for(server)
    prefix = text_of(50, 100)
    for suffix in ("a", "b"):
        client.completions.create(model=MODEL, prompt=f"{prefix} {suffix}", max_tokens=2,
                                  extra_body={"ignore_eos": True})
    m = scrape(server)
    for name in ("fastdeploy:prefix_cache_token_num_total", "fastdeploy:prefix_gpu_cache_token_num_total",
                 "fastdeploy:prefix_cpu_cache_token_num_total", "fastdeploy:hit_token_rate",
                 "fastdeploy:gpu_cache_usage_perc", "fastdeploy:num_requests_running",
                 "fastdeploy:num_requests_waiting", "fastdeploy:time_to_first_token_seconds_count",
                 'fastdeploy_kvcache:blocks_free{tier="device"}', 'fastdeploy_kvcache:blocks_used{tier="device"}',
                 'fastdeploy_kvcache:blocks_free{tier="host"}', 'fastdeploy_kvcache:swap_bytes_total{direction="d2h"}',
                 'fastdeploy_kvcache:swap_bytes_total{direction="h2d"}',
                 'fastdeploy_kvcache:swap_seconds_total{direction="h2d"}', "fastdeploy_kvcache:failed_loads_total"):
        assert name in m, f"{name} missing from /metrics: {sorted(m)}"
    assert m["fastdeploy:prefix_cache_token_num_total"] >= 2 * BLOCK_SIZE
    assert m["fastdeploy:prefix_gpu_cache_token_num_total"] > 0
    assert (m["fastdeploy:prefix_gpu_cache_token_num_total"] + m["fastdeploy:prefix_cpu_cache_token_num_total"]
            + m["fastdeploy:prefix_ssd_cache_token_num_total"]) == m["fastdeploy:prefix_cache_token_num_total"]
    assert 0.0 < m["fastdeploy:hit_token_rate"] <= 1.0
    assert 0.0 < m["fastdeploy:gpu_cache_usage_perc"] <= 1.0  # cached blocks count as used
    assert m["fastdeploy:time_to_first_token_seconds_count"] >= 2
    assert m['fastdeploy_kvcache:swap_bytes_total{direction="d2h"}'] > 0  # write_through backs blocks up
    assert m["fastdeploy_kvcache:failed_loads_total"] == 0
    stats = wait_quiet(server)
    m = scrape(server)
    assert m["fastdeploy:num_requests_running"] == 0
    assert m['fastdeploy_kvcache:blocks_free{tier="device"}'] == device_blocks(stats)["free"]


# ---------------------------------------------------------------------- CLI
def test_help_lists_every_flag() -> None:
    import subprocess
    import sys

    for cmd in ([sys.executable, "-m", "fastdeploy_kvcache.entrypoints.openai.api_server", "--help"],
                [sys.executable, "-m", "fastdeploy_kvcache.entrypoints.cli", "serve", "--help"]):
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout
        for flag in ("--model", "--host", "--port", "--max-model-len", "--max-num-seqs", "--max-num-batched-tokens",
                     "--block-size", "--num-gpu-blocks-override", "--kv-cache-dtype", "--swap-space",
                     "--write-policy", "--write-through-threshold", "--enable-prefix-caching",
                     "--no-enable-prefix-caching", "--enable-output-caching", "--quantization"):
            assert flag in out, f"{flag} missing from {' '.join(cmd[2:])} --help"


def test_last_no_block_leaked(server: Any) -> None:
    """Runs last in this module: after everything above, every device block is free or cached."""
    assert_no_leak(server)


def test_server_flags_add_to_a_parser_that_has_some() -> None:
    """FastDeploy's parser already defines --host, --port and --swap-space: no conflict."""
    import argparse

    from fastdeploy_kvcache.entrypoints.openai.api_server import add_server_cli_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--host", default="0.0.0.0")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--swap-space", type=float, default=4.0)
    add_server_cli_args(parser)
    ns = parser.parse_args(["--model", "tiny-llama-random", "--swap-space", "1"])
    assert (ns.host, ns.port, ns.swap_space, ns.model) == ("0.0.0.0", 9000, 1.0, "tiny-llama-random")


def test_default_max_tokens_fits_context_and_device_pool() -> None:
    """Without max_tokens, chat may use the rest of the context, capped by one request's share of the pool."""
    from fastdeploy_kvcache.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
    from fastdeploy_kvcache.entrypoints.openai.serving import build_sampling_params

    chat = ChatCompletionRequest(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    assert build_sampling_params(chat, 100, 4096, "messages", 2048).max_tokens == 1948
    assert build_sampling_params(chat, 100, 1024, "messages", 2048).max_tokens == 924
    assert build_sampling_params(chat, 100, 1024, "messages").max_tokens == 924
    # No room left in the pool: 1 token, which the engine then refuses (context_length_exceeded).
    assert build_sampling_params(chat, 2048, 4096, "messages", 2048).max_tokens == 1
    # Completions keep OpenAI's default of 16.
    assert build_sampling_params(CompletionRequest(model=MODEL, prompt="x"), 10, 4096, "prompt", 2048).max_tokens == 16


def test_console_script_serve_help() -> None:
    """`fastdeploy-kvcache serve --help` (the [project.scripts] entry) has the server's flags."""
    import os
    import shutil
    import subprocess
    import sys

    script = shutil.which("fastdeploy-kvcache", path=os.path.dirname(sys.executable))
    if script is None:
        pytest.skip("the console script is not installed in this venv: `bash build.sh` (pip install -e .) installs it")
    out = subprocess.run([script, "serve", "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert "usage: fastdeploy-kvcache serve" in out
    for flag in ("--host", "--port", "--model", "--swap-space", "--write-policy"):
        assert flag in out


def test_completion_list_of_prompts(server: Any) -> None:
    client = client_for(server)
    out = client.completions.create(model=MODEL, prompt=["cache block", "host tier device"], max_tokens=3,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    single = [client.completions.create(model=MODEL, prompt=p, max_tokens=3, temperature=0,
                                        extra_body={"ignore_eos": True}) for p in ("cache block", "host tier device")]
    assert [c.text for c in out.choices] == [s.choices[0].text for s in single]
    assert out.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in single)
    assert out.usage.completion_tokens == 6
