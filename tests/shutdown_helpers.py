"""What the graceful-shutdown tests of the servers (tests/entrypoints) and of the router
(tests/router) share: a streamed completion read on its own thread, and waiting for a
listening socket to refuse connections."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any, Optional

import openai

from server_helpers import MODEL


class Stream(threading.Thread):
    """One streamed completion read to its end by the official client, on its own thread."""

    def __init__(self, server: Any, prompt: list[int], max_tokens: int) -> None:
        super().__init__(daemon=True)
        self.client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0,
                                    timeout=120.0)
        self.prompt, self.max_tokens = prompt, max_tokens
        self.chunks = 0
        self.finish_reason: Optional[str] = None
        self.completion_tokens: Optional[int] = None
        self.error: Optional[BaseException] = None
        self.ended_at: Optional[float] = None

    def run(self) -> None:
        try:
            stream = self.client.completions.create(
                model=MODEL, prompt=self.prompt, max_tokens=self.max_tokens, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
            for chunk in stream:
                self.chunks += 1
                for choice in chunk.choices:
                    if choice.finish_reason is not None:
                        self.finish_reason = choice.finish_reason
                if chunk.usage is not None:
                    self.completion_tokens = chunk.usage.completion_tokens
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.ended_at = time.monotonic()


def refused(port: int) -> bool:
    """True when nothing accepts a connection on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1.0):
            return False
    except OSError:
        return True


def wait_until(cond: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
