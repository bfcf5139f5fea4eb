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

from conftest import MAX_MODEL_LEN, MODEL
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
    ("/v1/completions", {"model": MODEL, "prompt": ["fine", "x\udfff"], "max_tokens": 2}, "prompt"),
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
