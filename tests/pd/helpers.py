"""Shared helpers of the PD tests: a prefill server, a decode server and the router, all real
processes on 127.0.0.1 (uvicorn, tiny-llama-random on the CPU), over a real store."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from fastdeploy_kvcache.entrypoints.server_process import RouterProcess as _RouterProcess
from fastdeploy_kvcache.entrypoints.server_process import ServerProcess
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


def RouterProcess(prefill_url: str, decode_url: str) -> _RouterProcess:
    """The router in PD mode over the two servers (not started)."""
    return _RouterProcess(["--prefill-url", prefill_url, "--decode-url", decode_url])


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
