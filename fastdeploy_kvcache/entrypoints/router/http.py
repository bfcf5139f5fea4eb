"""What both router modes share: the app shell, OpenAI-shaped errors, relays of a server's errors."""

from __future__ import annotations

import json
import logging
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

logger = logging.getLogger(__name__)


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
        logger.exception("unhandled error in the router")
        return error_response(500, f"router: internal error: {type(exc).__name__}: {exc}")

    return app
