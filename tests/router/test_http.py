"""http.FastPaths: the two proxy endpoints served in front of the FastAPI app.

Driven through the ASGI interface itself (uvicorn's side of it); the fleet tests drive the
same code through a real router process.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi.responses import Response

from fastdeploy_kvcache.entrypoints.auth import Caller
from fastdeploy_kvcache.entrypoints.router.http import FastPaths


def _call(asgi: Any, method: str, path: str, chunks: list[bytes]) -> list[dict[str, Any]]:
    """Send one request as ``chunks`` of body (a disconnect when none); the ASGI messages sent back."""
    inbox = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return inbox.pop(0) if inbox else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "headers": [], "query_string": b"",
             "http_version": "1.1", "scheme": "http", "server": ("127.0.0.1", 1), "client": ("127.0.0.1", 2)}
    asyncio.run(asgi(scope, receive, send))
    return sent


class _App:
    """Stands for the FastAPI app: answers 418 and records what reached it."""

    def __init__(self) -> None:
        self.paths: list[tuple[str, str]] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        self.paths.append((scope["method"], scope["path"]))
        await Response(b"app", status_code=418)(scope, receive, send)


def test_a_proxy_path_gets_the_whole_body_and_the_rest_goes_to_the_app() -> None:
    got: list[tuple[bytes, float, Caller]] = []

    async def handler(data: bytes, t0: float, caller: Caller) -> Response:
        got.append((data, t0, caller))
        return Response(b"forwarded", status_code=200)

    app = _App()
    asgi = FastPaths(app, {"/v1/completions": handler})
    sent = _call(asgi, "POST", "/v1/completions", [b'{"prompt":', b' "hi"}'])
    assert sent[0]["status"] == 200 and sent[1]["body"] == b"forwarded"
    assert got[0][0] == b'{"prompt": "hi"}' and got[0][1] > 0
    assert got[0][2] == Caller(None, None)  # no Authorization header, no key checked
    assert app.paths == []
    for method, path in (("GET", "/v1/completions"), ("POST", "/v1/other"), ("GET", "/health")):
        assert _call(asgi, method, path, [b""])[0]["status"] == 418
    assert app.paths == [("GET", "/v1/completions"), ("POST", "/v1/other"), ("GET", "/health")]


def test_an_unexpected_error_is_an_openai_shaped_500_and_a_gone_client_gets_nothing() -> None:
    calls = []

    async def broken(data: bytes, t0: float, caller: Caller) -> Response:
        calls.append(data)
        raise RuntimeError("boom")

    asgi = FastPaths(_App(), {"/v1/chat/completions": broken})
    sent = _call(asgi, "POST", "/v1/chat/completions", [b"{}"])
    assert sent[0]["status"] == 500
    err = json.loads(sent[1]["body"])["error"]
    assert err["message"] == "router: internal error: RuntimeError: boom" and err["type"] == "server_error"
    # A client that disconnects before its body arrives: the handler never runs, nothing is sent.
    assert _call(asgi, "POST", "/v1/chat/completions", []) == [] and calls == [b"{}"]
