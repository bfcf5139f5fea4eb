"""Huge and malformed prompts: answered with a clear 4xx, without stalling other clients.

A real server (conftest's ``server`` fixture: tiny-llama-random, ``--max-model-len 4096``,
the default ``--max-request-body-bytes``).  While a huge prompt is in flight, a second
client keeps timing ``GET /health``: a server that tokenizes on its event loop, or parses a
body of any size, freezes it for seconds (10 MiB: about 30 s on this project's 2-core
machine; ``benchmarks/bench_huge_prompt.py`` measures it).
"""

from __future__ import annotations

import json
import threading
import time
from typing import Any, Iterator

import httpx
import pytest

from conftest import BLOCK_SIZE, MAX_MODEL_LEN, MODEL
from fastdeploy_kvcache.entrypoints.openai.body_limit import DEFAULT_MAX_BODY_BYTES

# A /health answer slower than this while a huge prompt is handled means the loop stalled.
# (Idle, it takes milliseconds; the stall it guards against lasts seconds.)
STALL_S = 1.0


class HealthProber(threading.Thread):
    """Times ``GET /health`` back to back until stopped."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.stop_event = threading.Event()
        self.latencies: list[float] = []

    def run(self) -> None:
        with httpx.Client(base_url=self.base_url, timeout=120.0) as client:
            while not self.stop_event.is_set():
                t = time.perf_counter()
                client.get("/health").raise_for_status()
                self.latencies.append(time.perf_counter() - t)
                time.sleep(0.01)


def _while_probing(server: Any, send: Any) -> tuple[httpx.Response, list[float]]:
    prober = HealthProber(server.base_url)
    prober.start()
    while not prober.latencies:  # the prober is connected and warm
        time.sleep(0.01)
    resp = send()
    time.sleep(0.1)  # a probe queued behind the huge request ends after it
    prober.stop_event.set()
    prober.join(120)
    return resp, prober.latencies


def _text(n_bytes: int) -> str:
    unit = "cache block device host storage tier prefix radix tree "
    return (unit * (n_bytes // len(unit) + 1))[:n_bytes]


def _post(server: Any, path: str, content: Any, **headers: str) -> httpx.Response:
    return httpx.post(server.base_url + path, content=content, timeout=300.0,
                      headers={"content-type": "application/json", **headers})


def test_body_over_the_limit_is_413_before_it_is_read_and_health_does_not_stall(server: Any) -> None:
    body = json.dumps({"model": MODEL, "prompt": _text(10 << 20), "max_tokens": 4}).encode()
    resp, latencies = _while_probing(server, lambda: _post(server, "/v1/completions", body))
    assert max(latencies) < STALL_S, f"/health took up to {max(latencies):.2f} s during the huge request"
    assert resp.status_code == 413, resp.text[:500]
    err = resp.json()["error"]
    assert "--max-request-body-bytes" in err["message"] and str(DEFAULT_MAX_BODY_BYTES) in err["message"], err
    assert httpx.get(server.base_url + "/health", timeout=10).status_code == 200


def test_body_without_a_length_is_cut_off_at_the_limit(server: Any) -> None:
    """A chunked body declares no size: it is counted as it arrives."""
    data = json.dumps({"model": MODEL, "prompt": _text(DEFAULT_MAX_BODY_BYTES + (1 << 20))}).encode()

    def chunks() -> Iterator[bytes]:
        for i in range(0, len(data), 64 << 10):
            yield data[i:i + (64 << 10)]

    try:
        resp = _post(server, "/v1/completions", chunks())
    except httpx.TransportError as exc:  # pragma: no cover - the server answered mid-upload
        pytest.fail(f"the server should answer 413, not drop the connection: {exc!r}")
    assert resp.status_code == 413, resp.text[:500]
    assert "--max-request-body-bytes" in resp.json()["error"]["message"]


def test_text_prompt_that_cannot_fit_is_400_before_tokenizing_and_health_does_not_stall(server: Any) -> None:
    """Under the body cap, but far past the context: refused from its size alone."""
    body = json.dumps({"model": MODEL, "prompt": _text(DEFAULT_MAX_BODY_BYTES - 4096), "max_tokens": 4}).encode()
    t = time.perf_counter()
    resp, latencies = _while_probing(server, lambda: _post(server, "/v1/completions", body))
    took = time.perf_counter() - t
    assert max(latencies) < STALL_S, (f"/health took up to {max(latencies):.2f} s while a {len(body)}-byte prompt "
                                      f"was refused (in {took:.2f} s)")
    assert resp.status_code == 400, resp.text[:500]
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    assert "bytes of text" in err["message"] and str(MAX_MODEL_LEN) in err["message"], err


def test_chat_messages_that_cannot_fit_are_400_before_templating(server: Any) -> None:
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": _text(1 << 20)}]}).encode()
    resp = _post(server, "/v1/chat/completions", body)
    assert resp.status_code == 400, resp.text[:500]
    err = resp.json()["error"]
    assert err["code"] == "context_length_exceeded" and "bytes of message text" in err["message"], err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": MODEL, "prompt": "ab\ud800cd", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", "x\udfff"], "max_tokens": 2}, "prompt[1]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi \ud83d"}]},
     "messages[0].content"),
], ids=["completion", "completion list", "chat"])
def test_lone_surrogate_is_400_without_a_traceback(server: Any, path: str, body: Any, param: str) -> None:
    """JSON can carry "\\ud800" alone; it is no text, and the answer says so (no 500)."""
    with open(server.log_path, "rb") as f:
        log_before = len(f.read())
    resp = _post(server, path, json.dumps(body).encode())  # ensure_ascii: the surrogate goes as \\ud800
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and "surrogate" in err["message"], err
    time.sleep(0.2)
    with open(server.log_path, "rb") as f:
        new_log = f.read()[log_before:].decode(errors="replace")
    assert "Traceback" not in new_log and "ERROR" not in new_log, new_log


# ---------------------------------------------------------------------- malformed bodies
def _error(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text[:500]
    return resp.json()["error"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": "a\ud800"}, "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "stop": ["ok", "\udc00b"]}, "stop[1]"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stop": "\ud800"},
     "stop"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "user": "u\ud800"}, "user"),
    ("/v1/completions", {"model": "x\ud800", "prompt": "hi"}, "model"),
    ("/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
     "messages[0].content[0].text"),
], ids=["stop", "stop list", "chat stop", "user", "model", "content part"])
def test_lone_surrogate_in_any_text_field_is_400(server: Any, path: str, body: Any, param: str) -> None:
    """Every text field is held to the same rule as the prompt (raw HTTP: the `openai` client
    cannot encode a lone surrogate)."""
    err = _error(_post(server, path, json.dumps(body).encode()))
    assert err["param"] == param and "lone UTF-16 surrogate" in err["message"], err


@pytest.mark.parametrize("field,value", [
    ("stream", "yes"), ("stream", 1), ("echo", "false"), ("ignore_eos", "true"),
    ("max_tokens", True), ("max_tokens", 2.0), ("n", True), ("seed", "7"), ("top_k", False),
    ("stop_token_ids", [True]), ("prompt", [1, True]), ("stream_options", {"include_usage": 1}),
    ("temperature", True), ("temperature", "0.5"),
])
def test_booleans_and_integers_have_strict_types(server: Any, field: str, value: Any) -> None:
    """A JSON string is not a boolean and a boolean is not an integer: 400 naming the field."""
    body = {"model": MODEL, "prompt": "hi", "max_tokens": 2, field: value}
    err = _error(_post(server, "/v1/completions", json.dumps(body).encode()))
    assert err["param"] is not None and err["param"].startswith(field) and field in err["message"], err


def test_strict_types_through_the_openai_client(server: Any) -> None:
    import openai

    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="hi", max_tokens=True)  # type: ignore[arg-type]
    assert info.value.body["param"] == "max_tokens", info.value.body
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"ignore_eos": "yes"})
    assert info.value.body["param"] == "ignore_eos", info.value.body
    ok = client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 2


def test_prompt_plus_max_tokens_past_the_device_pool_is_context_length_exceeded(server: Any) -> None:
    """Inside --max-model-len but more blocks than the device pool has: the same code as an
    over-long prompt, so a client can tell "too long" from "malformed"."""
    import openai


    pool_tokens = 128 * BLOCK_SIZE  # conftest's NUM_GPU_BLOCKS
    assert pool_tokens + 100 < MAX_MODEL_LEN
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60.0)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt=list(range(10, 110)), max_tokens=pool_tokens)
    err = info.value.body
    assert err["code"] == "context_length_exceeded" and err["param"] == "prompt", err
    assert "device KV pool" in err["message"], err


def test_invalid_utf8_body_is_400_naming_the_byte(server: Any) -> None:
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "caf\xe9 au lait"}'
    at = body.index(b"\xe9")
    err = _error(_post(server, "/v1/completions", body))
    assert f"invalid UTF-8 at byte {at}" in err["message"], err


def test_deeply_nested_body_is_400_naming_the_limit(server: Any) -> None:
    from fastdeploy_kvcache.entrypoints.openai.json_body import MAX_JSON_DEPTH

    deep = b"[" * 200_000 + b"]" * 200_000  # past the parser's recursion limit
    body = b'{"model": "' + MODEL.encode() + b'", "prompt": "hi", "extra": ' + deep + b"}"
    err = _error(_post(server, "/v1/completions", body))
    assert f"nesting deeper than {MAX_JSON_DEPTH} levels" in err["message"], err
    # Brackets inside strings do not count, and nesting up to the limit is accepted.
    ok = {"model": MODEL, "prompt": "[[[[" * 100, "max_tokens": 1,
          "extra": json.loads("[" * (MAX_JSON_DEPTH - 1) + "]" * (MAX_JSON_DEPTH - 1))}
    assert _post(server, "/v1/completions", json.dumps(ok).encode()).status_code == 200


def test_token_ids_are_checked_against_one_vocabulary(server: Any) -> None:
    """The prompt and stop_token_ids name the same range: the model's embedding rows (512 for
    tiny-llama-random, whose tokenizer has 503 tokens), in the same words."""
    messages = []
    for body in ({"model": MODEL, "prompt": [5, 512], "max_tokens": 1},
                 {"model": MODEL, "prompt": [5], "max_tokens": 1, "stop_token_ids": [512]}):
        messages.append(_error(_post(server, "/v1/completions", json.dumps(body).encode()))["message"])
    assert messages[0].startswith("prompt: token id 512 at position 1 is out of range [0, 512)"), messages
    assert messages[1].startswith("stop_token_ids: token id 512 at position 0 is out of range [0, 512)"), messages
    # An id the model has but the tokenizer lacks is a valid prompt token.
    resp = _post(server, "/v1/completions", json.dumps({"model": MODEL, "prompt": [5, 505], "max_tokens": 1}).encode())
    assert resp.status_code == 200, resp.text
