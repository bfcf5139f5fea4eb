"""The router's PD mode: one prefill server, one decode server.

``python -m fastdeploy_kvcache.entrypoints.router --prefill-url URL --decode-url URL --host H --port P``

For each ``POST /v1/completions`` or ``/v1/chat/completions`` (streamed or not):

1. the request goes to the prefill server with ``max_tokens=1`` and ``stream=false``; that
   server computes the prompt, writes its KV to the store (full blocks and the partial last
   block) and only then answers, with its token ids in ``kv_transfer_params``;
2. the original request goes to the decode server with
   ``"kv_transfer_params": {"prefill_token_ids": [...], "request_key": ..., "num_prompt_tokens": ...}``;
   the decode server loads the KV, emits the prefill's token first and decodes the rest;
3. the decode server's answer (its SSE stream, or its JSON) goes back to the client as is,
   so the client sees one ordinary OpenAI response.

Errors: a server's own OpenAI-style error (400 for a bad request, ...) reaches the client
with its status; an unreachable or broken server becomes a 502 whose message names the
server (``prefill`` or ``decode``) and what went wrong.  ``GET /health`` is 200 only when
both servers answer their own ``/health``.

Only ``n = 1`` is routed (a hand-off carries one prompt's first token).  The client's
``Authorization`` header goes to both servers; its ``cache_salt`` is in the body both get, so
both hash (and key) the prompt's blocks the same way.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, AsyncIterator, Optional

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from fastdeploy_kvcache.entrypoints.auth import Caller
from fastdeploy_kvcache.entrypoints.router.http import (SHUTTING_DOWN_EVENT, UPSTREAM_ERRORS, OpenStreams,
                                                         RelayResponse, error_body, error_body_of, error_response,
                                                         forward_headers, relay_error, router_app, stream_end,
                                                         upstream_session)

logger = logging.getLogger(__name__)

__all__ = ["build_pd_app"]

HEADER_PREFILL_S = "x-fdkv-pd-prefill-seconds"
"""Response header: seconds the prefill call took (prompt compute + KV write), for benchmarks."""


class UpstreamError(Exception):
    """A server could not be reached or answered nonsense: a 502 naming it."""

    def __init__(self, role: str, message: str, status: int = 502) -> None:
        super().__init__(f"{role} server: {message}")
        self.role = role
        self.message = f"{role} server: {message}"
        self.status = status


class PDRouter:
    """The router's state: one HTTP client (:func:`.http.upstream_session`), the two servers' URLs."""

    def __init__(self, prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> None:
        self.prefill_url = prefill_url.rstrip("/")
        self.decode_url = decode_url.rstrip("/")
        self.timeout_s = timeout_s
        self.client: Optional[aiohttp.ClientSession] = None
        self.streams = OpenStreams()  # ended by the shutdown (cli.main registers streams.end_all)

    async def start(self) -> None:
        self.client = upstream_session(self.timeout_s, connect_s=10.0, limit=256)

    async def close(self) -> None:
        if self.client is not None:
            await self.client.close()

    async def _post_json(self, url: str, body: dict[str, Any],
                         headers: Optional[dict[str, str]] = None) -> tuple[int, bytes]:
        """(status, body) of a non-streamed POST; ``UPSTREAM_ERRORS`` when the call fails."""
        assert self.client is not None
        async with self.client.post(url, json=body, headers=headers) as resp:
            return resp.status, await resp.read()

    # ------------------------------------------------------------------ the two calls
    async def prefill(self, path: str, body: dict[str, Any],
                      auth: Optional[dict[str, str]] = None) -> tuple[Optional[dict[str, Any]], Optional[Response]]:
        """(kv_transfer_params, None) on success, else (None, the error response for the client)."""
        assert self.client is not None
        pbody = dict(body)
        pbody.pop("max_completion_tokens", None)
        pbody.pop("stream_options", None)
        pbody["max_tokens"] = 1
        pbody["stream"] = False
        try:
            status, content = await self._post_json(self.prefill_url + path, pbody, auth)
        except UPSTREAM_ERRORS as exc:
            raise UpstreamError("prefill", f"{self.prefill_url} unreachable ({type(exc).__name__}: {exc})") from exc
        if status != 200:
            return None, relay_error("prefill", status, content)
        try:
            data = json.loads(content)
        except ValueError as exc:
            text = content.decode("utf-8", "replace")[:200]
            raise UpstreamError("prefill", f"answered with a body that is not JSON: {text!r}") from exc
        kv = data.get("kv_transfer_params") if isinstance(data, dict) else None
        if not isinstance(kv, dict) or not kv.get("prefill_token_ids"):
            raise UpstreamError("prefill", f"{self.prefill_url} returned no kv_transfer_params.prefill_token_ids: "
                                "is it started with --splitwise-role prefill?")
        return kv, None

    async def route(self, path: str, raw: Request) -> Response:
        try:
            body = await raw.json()
        except ValueError:
            return error_response(400, "malformed JSON body", type_="invalid_request_error")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object", type_="invalid_request_error")
        if body.get("n") not in (None, 1):
            return error_response(400, f"n: the PD router serves n=1 only, got {body.get('n')!r}",
                                  type_="invalid_request_error", param="n")
        if body.get("kv_transfer_params") is not None:
            return error_response(400, "kv_transfer_params: set by the router, not by clients",
                                  type_="invalid_request_error", param="kv_transfer_params")
        t0 = time.perf_counter()
        auth = forward_headers(Caller.of_scope(raw.scope))  # both servers check the client's key
        try:
            kv, err = await self.prefill(path, body, auth)
        except UpstreamError as exc:
            logger.warning("%s", exc.message)
            return error_response(exc.status, exc.message, code="upstream_unavailable")
        if err is not None:
            return err
        prefill_s = time.perf_counter() - t0
        dbody = dict(body)
        dbody["kv_transfer_params"] = kv
        headers = {HEADER_PREFILL_S: f"{prefill_s:.6f}"}
        if body.get("stream"):
            return await self._decode_stream(path, dbody, headers, auth)
        return await self._decode_json(path, dbody, headers, auth)

    async def _decode_json(self, path: str, body: dict[str, Any], headers: dict[str, str],
                           auth: Optional[dict[str, str]] = None) -> Response:
        assert self.client is not None
        try:
            status, content = await self._post_json(self.decode_url + path, body, auth)
        except UPSTREAM_ERRORS as exc:
            msg = f"decode server: {self.decode_url} unreachable ({type(exc).__name__}: {exc})"
            logger.warning("%s", msg)
            return error_response(502, msg, code="upstream_unavailable")
        if status != 200:
            return relay_error("decode", status, content)
        return Response(content, status_code=200, media_type="application/json", headers=headers)

    async def _decode_stream(self, path: str, body: dict[str, Any], headers: dict[str, str],
                             auth: Optional[dict[str, str]] = None) -> Response:
        assert self.client is not None
        try:
            resp = await self.client.post(self.decode_url + path, json=body, headers=auth)
        except UPSTREAM_ERRORS as exc:
            msg = f"decode server: {self.decode_url} unreachable ({type(exc).__name__}: {exc})"
            logger.warning("%s", msg)
            return error_response(502, msg, code="upstream_unavailable")
        if resp.status != 200:
            return relay_error("decode", resp.status, await error_body_of(resp))

        self.streams.add(resp)
        end = stream_end(self.streams, resp)

        async def relay() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.content.iter_any():
                    yield chunk
            except UPSTREAM_ERRORS as exc:
                if self.streams.ending:
                    yield SHUTTING_DOWN_EVENT
                    return
                # The stream broke mid-way: tell the client in the stream's own error shape.
                msg = f"decode server: the stream broke ({type(exc).__name__}: {exc})"
                logger.warning("%s", msg)
                yield f"data: {json.dumps(error_body(msg))}\n\n".encode()
            finally:
                end()

        return RelayResponse(relay(), end, headers=headers)

    async def health(self) -> Response:
        assert self.client is not None

        async def probe(url: str) -> Optional[str]:
            try:
                async with self.client.get(url + "/health",  # type: ignore[union-attr]
                                           timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                    await r.read()
                    status = r.status
            except UPSTREAM_ERRORS as exc:
                return f"unreachable ({type(exc).__name__})"
            return None if status == 200 else f"HTTP {status}"

        p, d = await asyncio.gather(probe(self.prefill_url), probe(self.decode_url))
        if p is None and d is None:
            return JSONResponse({"status": "ok", "prefill": self.prefill_url, "decode": self.decode_url})
        parts = [f"{role} server {url}: {why}" for role, url, why in
                 (("prefill", self.prefill_url, p), ("decode", self.decode_url, d)) if why]
        return error_response(503, "; ".join(parts), code="upstream_unavailable")


def build_pd_app(prefill_url: str, decode_url: str, timeout_s: float = 600.0) -> FastAPI:
    router = PDRouter(prefill_url, decode_url, timeout_s)

    app = router_app("fastdeploy_kvcache PD router", router.start, router.close)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        return await router.health()

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        assert router.client is not None
        try:
            async with router.client.get(router.decode_url + "/v1/models",
                                         headers=forward_headers(Caller.of_scope(raw.scope))) as resp:
                return Response(await resp.read(), status_code=resp.status, media_type="application/json")
        except UPSTREAM_ERRORS as exc:
            return error_response(502, f"decode server: {router.decode_url} unreachable ({type(exc).__name__})",
                                  code="upstream_unavailable")

    @app.post("/v1/completions")
    async def completions(raw: Request) -> Response:
        return await router.route("/v1/completions", raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(raw: Request) -> Response:
        return await router.route("/v1/chat/completions", raw)

    return app
