"""Shared helpers of the PD tests: a prefill server, a decode server and the router, all real
processes on 127.0.0.1 (uvicorn, tiny-llama-random on the CPU), over a real store."""

from __future__ import annotations

import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from typing import Any, Optional, Sequence

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess, free_port, stop_child
from server_helpers import (  # noqa: F401 - re-exported for the PD tests
    BASE_ARGS,
    BLOCK_SIZE,
    MODEL,
    file_store_args,
    mooncake_store_args,
    prompt_ids,
    scrape,
)

ENV = {"ENABLE_V1_KVCACHE_MANAGER": "1", "FD_PD_TRANSFER_VIA_STORAGE": "1"}


def start_server(role: str, store_args: Sequence[str], env: Optional[dict[str, str]] = None,
                 extra: Sequence[str] = ()) -> ServerProcess:
    role_args = [] if role == "mixed" else ["--splitwise-role", role]
    return ServerProcess([*BASE_ARGS, *store_args, *role_args, *extra], env={**ENV, **(env or {})}).start()


def stop_cluster(servers: dict[str, Any]) -> None:
    """Stop what a PD cluster fixture started: the router first, so nothing forwards to a stopped server."""
    for name in ("router", "prefill", "decode", "mixed"):
        if name in servers:
            servers[name].stop()


class RouterProcess:
    """``python -m fastdeploy_kvcache.entrypoints.router`` in a child process."""

    def __init__(self, prefill_url: str, decode_url: str) -> None:
        self.port = free_port()
        self.prefill_url = prefill_url
        self.decode_url = decode_url
        self.proc: Optional[subprocess.Popen[bytes]] = None
        self._log = tempfile.NamedTemporaryFile(prefix="fdkv-router-", suffix=".log", delete=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 60.0) -> "RouterProcess":
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fastdeploy_kvcache.entrypoints.router", "--prefill-url", self.prefill_url,
             "--decode-url", self.decode_url, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"router exited with {self.proc.returncode}: {open(self._log.name).read()}")
            try:
                urllib.request.urlopen(self.base_url + "/health", timeout=2.0).close()
                return self
            except urllib.error.HTTPError:
                return self  # it answers (a 503 only says a server is down)
            except (urllib.error.URLError, OSError):
                time.sleep(0.1)
        self.stop()
        raise TimeoutError("router not up")

    def stop(self) -> None:
        if self.proc is not None:
            stop_child(self.proc, signal.SIGTERM, 10, 10)

    def __enter__(self) -> "RouterProcess":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def completion(base_url: str, prompt: Any, max_tokens: int = 12, stream: bool = False, chat: bool = False,
               **extra: Any) -> dict[str, Any]:
    """A greedy request; returns {"status", "text", "finish_reason", "usage", "json"/"events"}."""
    import httpx

    body: dict[str, Any] = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **extra}
    if chat:
        body["messages"] = prompt
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    if stream:
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
        texts: list[str] = []
        finish = None
        usage = None
        events: list[Any] = []
        with httpx.stream("POST", base_url + path, json=body, timeout=120.0) as resp:
            if resp.status_code != 200:
                resp.read()
                return {"status": resp.status_code, "json": resp.json()}
            for line in resp.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                import json

                ev = json.loads(line[6:])
                events.append(ev)
                if "error" in ev:
                    continue
                if ev.get("usage"):
                    usage = ev["usage"]
                for ch in ev.get("choices", []):
                    texts.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
                    finish = ch.get("finish_reason") or finish
        return {"status": 200, "text": "".join(texts), "finish_reason": finish, "usage": usage, "events": events}
    resp = httpx.post(base_url + path, json=body, timeout=120.0)
    out = resp.json()
    if resp.status_code != 200:
        return {"status": resp.status_code, "json": out}
    ch = out["choices"][0]
    text = ch["message"]["content"] if chat else ch["text"]
    return {"status": 200, "text": text, "finish_reason": ch["finish_reason"], "usage": out["usage"], "json": out}


def recomputed(server: Any) -> float:
    """The decode server's fastdeploy:pd_recomputed_token_num, read from its /metrics."""
    return scrape(server)["fastdeploy:pd_recomputed_token_num_total"]
