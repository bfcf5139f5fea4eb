"""A cap on request body size: 413 before the body is read, or as soon as it passes the cap.

Parsing JSON and validating it (FastAPI, pydantic) run on the event loop and hold the GIL
for time proportional to the body (about 0.1 s per MiB of token ids here), so no thread can
take that work off the loop; the cap bounds it instead.  A ``Content-Length`` over the cap
is answered at once, without reading a byte of the body; a body sent without one (chunked)
is counted as it arrives and refused when it passes the cap.
"""

from __future__ import annotations

import logging
from typing import Any, Awaitable, Callable

from starlette.exceptions import HTTPException

logger = logging.getLogger(__name__)

# Room for a prompt of about 500k tokens as text, or 250k as a JSON list of token ids.
DEFAULT_MAX_BODY_BYTES = 2 << 20

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyTooLarge(HTTPException):
    """413: raised from ``receive`` so the app's HTTP error handler shapes the answer."""

    def __init__(self, limit: int, size: int, declared: bool) -> None:
        how = "declares" if declared else "passed"
        super().__init__(413, f"request body too large: it {how} {size} bytes; this server takes at most "
                              f"{limit} (--max-request-body-bytes)")


class BodySizeLimit:
    """ASGI middleware: HTTP bodies larger than ``max_bytes`` get a 413 (0: no cap)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int,
                 on_reject: Callable[[BodyTooLarge, Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app
        self.max_bytes = int(max_bytes)
        self.on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self.max_bytes <= 0:
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            logger.warning("refused a %d-byte request body to %s (over --max-request-body-bytes %d)",
                           declared, scope.get("path"), self.max_bytes)
            await self.on_reject(BodyTooLarge(self.max_bytes, declared, True), scope, receive, send)
            return
        received = 0

        async def counted_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    logger.warning("refused a streamed request body to %s at %d bytes (over "
                                   "--max-request-body-bytes %d)", scope.get("path"), received, self.max_bytes)
                    raise BodyTooLarge(self.max_bytes, received, False)
            return message

        await self.app(scope, counted_receive, send)


def _content_length(scope: Scope) -> "int | None":
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the HTTP parser rejects a malformed one before we see it
    return None
