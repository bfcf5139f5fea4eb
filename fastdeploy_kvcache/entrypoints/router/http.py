"""What both router modes share: the app shell, OpenAI-shaped errors, relays of a server's errors."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from fastdeploy_kvcache.entrypoints.auth import Caller

logger = logging.getLogger(__name__)

# Keep-alive connections to a server are dropped after this many idle seconds: below
# uvicorn's own keep-alive (5 s), so the router never sends on a connection the server
# is closing.
KEEPALIVE_S = 4.0
UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError)
"""What a call to a server raises when it is unreachable, breaks or times out."""


def forward_headers(caller: Caller, base: Optional[dict[str, str]] = None) -> Optional[dict[str, str]]:
    """``base`` plus the caller's ``Authorization`` header, which the servers check too."""
    if caller.authorization is None:
        return base
    return {**(base or {}), "Authorization": caller.authorization}


def upstream_session(timeout_s: float, connect_s: float, limit: int) -> aiohttp.ClientSession:
    """The router's HTTP client to its servers (either mode), made on the running loop.

    aiohttp rather than httpx: its client side of a call costs about a quarter of httpx's
    (a C HTTP parser, no anyio layers), and httpx was the largest part of the router's
    added latency.  Bytes are relayed as they came: no Accept-Encoding is sent (so a
    server never compresses) and nothing is decompressed.  ``timeout_s`` bounds each read.
    """
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit, limit_per_host=0, keepalive_timeout=KEEPALIVE_S),
        auto_decompress=False, skip_auto_headers=("Accept-Encoding",), cookie_jar=aiohttp.DummyCookieJar(),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=connect_s, sock_read=timeout_s))


def error_body(message: str, type_: str = "server_error", param: Optional[str] = None,
               code: Optional[str] = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "server_error", param: Optional[str] = None,
                   code: Optional[str] = None, headers: Optional[dict[str, str]] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def relay_error(role: str, status: int, body: bytes,
                headers: Optional[dict[str, str]] = None) -> JSONResponse:
    """A server's non-200 answer, kept (status and OpenAI body) when it is OpenAI-shaped, else
    wrapped; the message is prefixed with ``role`` so the client knows which server said it."""
    try:
        data = json.loads(body)
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict) and "message" in data["error"]:
        err = dict(data["error"])
        err["message"] = f"{role} server: {err['message']}"
        return JSONResponse({"error": err}, status_code=status, headers=headers)
    text = body.decode("utf-8", "replace")[:500]
    return error_response(status if status >= 400 else 502,
                          f"{role} server answered HTTP {status}: {text}", headers=headers)


class OpenStreams:
    """The servers' streams the router is relaying, so that its shutdown can end them.

    ``end_all`` (the shutdown's grace period is spent, or a second signal came) closes each
    connection to a server (which aborts the request there); the relay sees its read fail
    with ``ending`` set and ends the client's stream with :data:`SHUTTING_DOWN_EVENT`.
    """

    def __init__(self) -> None:
        self._open: set[aiohttp.ClientResponse] = set()
        self.ending = False

    def add(self, resp: aiohttp.ClientResponse) -> None:
        self._open.add(resp)

    def discard(self, resp: aiohttp.ClientResponse) -> None:
        self._open.discard(resp)

    def end_all(self) -> int:
        """Close every stream still open; how many (a ShutdownPlan abort hook)."""
        self.ending = True
        streams, self._open = list(self._open), set()
        for resp in streams:
            resp.close()
        return len(streams)


SHUTTING_DOWN_EVENT = ("data: " + json.dumps(error_body(
    "router: shutting down; the stream was ended at the end of its grace period", code="shutting_down"))
    + "\n\ndata: [DONE]\n\n").encode()
"""What a client's stream gets last when the router's shutdown ends it."""


def internal_error(exc: BaseException) -> JSONResponse:
    """The OpenAI-shaped 500 for an exception no handler expected (logged with its trace)."""
    logger.error("unhandled error in the router", exc_info=exc)
    return error_response(500, f"router: internal error: {type(exc).__name__}: {exc}")


ProxyHandler = Callable[[bytes, float, Caller], Awaitable[Response]]
"""A proxy endpoint: (the request body, its arrival ``perf_counter()``, who sent it) -> the response."""


async def error_body_of(resp: aiohttp.ClientResponse) -> bytes:
    """The body of an upstream's non-200 answer to a streamed request (b"" where it broke
    while read), the response closed either way (its connection is not reused)."""
    try:
        return await resp.read()
    except UPSTREAM_ERRORS:
        return b""
    finally:
        resp.close()


def stream_end(streams: "OpenStreams", resp: aiohttp.ClientResponse,
               then: Optional[Callable[[], None]] = None) -> Callable[[], None]:
    """The once-only end of a relayed upstream stream: forget it, run ``then`` (e.g. drop a
    worker's in-flight count), and read it to the end so the connection goes back to the
    pool, or, where the client left early, close it, which tells the worker to abort."""
    ended = False

    def end() -> None:
        nonlocal ended
        if ended:
            return
        ended = True
        streams.discard(resp)
        if then is not None:
            then()
        resp.release() if resp.content.at_eof() else resp.close()

    return end


class RelayResponse(StreamingResponse):
    """A relayed stream whose ``on_end`` runs once however the response ends.

    Why not the relay generator's own ``finally``: a client that leaves before the first byte
    is sent ends the response before the generator ever starts, and an unstarted generator
    runs no ``finally``; the worker's in-flight count would then never drop, and the upstream
    connection would stay open (so the worker would not abort the request).  ``on_end`` must
    be idempotent: the generator's ``finally`` calls it too.
    """

    def __init__(self, content: AsyncIterator[bytes], on_end: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, media_type="text/event-stream", **kwargs)
        self.on_end = on_end

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_end()


class FastPaths:
    """ASGI in front of an app: ``POST`` to one of ``paths`` goes straight to its handler.

    Why: FastAPI's middleware and routing cost about a tenth of a millisecond per request,
    which the router would add to every forwarded request; the proxy endpoints need none
    of it (no validation, no dependencies).  Everything else (``/health``, ``/metrics``,
    the lifespan) goes to ``app``.  An exception a handler did not expect is answered with
    an OpenAI-shaped 500, as the app's own handler does.
    """

    def __init__(self, app: Any, paths: dict[str, ProxyHandler]) -> None:
        self.app = app
        self.paths = paths

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        handler = self.paths.get(scope["path"]) if scope["type"] == "http" and scope["method"] == "POST" else None
        if handler is None:
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        chunks = []
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body: nobody to answer
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        try:
            response = await handler(b"".join(chunks), t0, Caller.of_scope(scope))
        except Exception as exc:  # noqa: BLE001 - one request never ends the process
            response = internal_error(exc)
        await response(scope, receive, send)


def router_app(title: str, start: Callable[[], Awaitable[None]], close: Callable[[], Awaitable[None]]) -> FastAPI:
    """A FastAPI app that runs ``start``/``close`` around its life and answers any unhandled
    exception with an OpenAI-shaped 500 naming it (the process never dies of one request)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await start()
        try:
            yield
        finally:
            await close()

    app = FastAPI(title=title, lifespan=lifespan)

    @app.exception_handler(Exception)
    async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        return internal_error(exc)

    return app
