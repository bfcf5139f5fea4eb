"""The router's fleet mode: N interchangeable workers, a routing policy, health checks.

Per ``POST /v1/completions`` or ``/v1/chat/completions``: the body is read once, the prompt
turned into token ids and chained block hashes (:mod:`.prompt`, the same hashing as the
workers' radix trees), a policy (:mod:`.policy`) picks a healthy worker, and the request is
forwarded unchanged, with the client's ``Authorization`` header; the worker's answer (JSON or
its SSE stream) goes back as it came.  The request's ``cache_salt`` (and, with
``--tenant-isolation salt``, its tenant's salt: :mod:`..auth`) enters the prompt's hashes as
it enters the worker's, so the router predicts salted prefixes exactly.

* **Errors.**  A worker's own error (a 400 for a bad request, ...) reaches the client with
  its status and body.  No healthy worker: 503.  A worker that refuses the connection is
  marked down and the request goes to another one (nothing was sent yet); a worker that
  dies while answering fails that request only (502, or an error event in the stream).
* **Health.**  Every ``health_interval_s`` each worker's ``/health`` is asked; after
  ``health_failures`` failures in a row it is down (no requests, its view emptied, since a
  restarted worker starts with an empty cache); one success brings it back.  A worker gets
  requests from its first successful check on; until then it is still starting ("not up
  yet", said once), not down.
* **Usage.**  Each response's ``usage.prompt_tokens_details.cached_tokens`` is read (for a
  stream the router asks for the usage chunk, and drops it again when the client did not
  ask for it), so ``/metrics`` sets the predicted reuse against the reported one.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.core.kv_events import event_block_hashes
from fastdeploy_kvcache.entrypoints.auth import Caller, check_cache_salt, tenant_cache_salt
from fastdeploy_kvcache.entrypoints.router.events import EventSubscriber
from fastdeploy_kvcache.entrypoints.router.http import (SHUTTING_DOWN_EVENT, UPSTREAM_ERRORS, OpenStreams,
                                                         RelayResponse, error_body, error_body_of, error_response,
                                                         forward_headers, relay_error, router_app, stream_end,
                                                         upstream_session)
from fastdeploy_kvcache.entrypoints.router.metrics import RouterMetrics
from fastdeploy_kvcache.entrypoints.router.policy import Candidate, Policy
from fastdeploy_kvcache.entrypoints.router.prompt import prompt_token_ids
from fastdeploy_kvcache.entrypoints.router.view import DEVICE, HOST, STORAGE, TIER_NAMES, TierWeights, WorkerView

logger = logging.getLogger(__name__)

HEADER_WORKER = "x-fdkv-worker"
"""Response header: the worker that served the request."""
HEADER_OVERHEAD_S = "x-fdkv-router-overhead-seconds"
"""Response header: the router's own seconds before forwarding (parse, tokenize, hash, choose)."""
HEADER_PREDICTED = "x-fdkv-predicted-cached-tokens"
"""Response header: prompt tokens the router expected the chosen worker to reuse."""

_USAGE_MARK = b'"usage":{'
_COUNT_ONLY = TierWeights()  # any weights: only the matched block count is used


@dataclass
class EventEndpoints:
    """Where a worker publishes its KV cache events (``replay`` optional)."""

    pub: str
    replay: Optional[str] = None


@dataclass
class Worker:
    url: str
    events: Optional[EventEndpoints]
    view: WorkerView = field(default_factory=WorkerView)
    subscriber: Optional[EventSubscriber] = None
    healthy: bool = False  # until its first /health answer: no request goes to a worker still starting
    up_once: bool = False  # answered /health at least once: until then a failure is "waiting", not "down"
    waiting_logged: bool = False
    failures: int = 0
    in_flight: int = 0
    pending: dict[int, float] = field(default_factory=dict)
    # Why the router refuses this worker for good (its block size is not the one configured).
    refused: Optional[str] = None


@dataclass
class FleetConfig:
    policy: Policy
    tokenizer: Any
    # The workers' --block-size when the operator names it (a worker reporting another one is
    # refused); None: each worker's own, from its /v1/models.
    block_size: Optional[int] = None
    events_topic: str = ""
    shared_storage: bool = True
    health_interval_s: float = 2.0
    health_timeout_s: float = 5.0
    health_failures: int = 2
    pending_ttl_s: float = 10.0
    timeout_s: float = 600.0
    # The workers' --tenant-isolation: "salt" hashes each prompt with its tenant's salt.
    tenant_isolation: str = "none"
    # A key for the router's own calls to the workers' /v1 routes (None: the workers take none).
    worker_api_key: Optional[str] = None


_JSON_HEADERS = {"content-type": "application/json"}
# How long the router's start waits for the first health checks (a worker still loading its
# model keeps its check open up to the health timeout; the router does not wait for that).
FIRST_PROBE_WAIT_S = 1.0


def _usage_of(content: bytes) -> Any:
    """A JSON answer's ``usage`` object, or None."""
    try:
        return json.loads(content).get("usage")
    except (ValueError, AttributeError):
        return None


_ASK_USAGE = b'{"stream_options":{"include_usage":true},'


def _with_usage(body: dict[str, Any], data: bytes) -> bytes:
    """The request ``data`` (whose parse is ``body``, with ``stream`` set) asking for the usage chunk.

    Without ``stream_options`` the key is put in front of the client's bytes, which are
    otherwise forwarded untouched (the object is not empty: it has ``stream``); with it,
    or in an encoding other than UTF-8 without a BOM, the body is encoded again.
    """
    stripped = data.lstrip()
    if "stream_options" not in body and stripped[:1] == b"{":
        return _ASK_USAGE + stripped[1:]
    body = dict(body)
    body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    return json.dumps(body).encode()


class _Prompt:
    """A request's token ids and, per block size asked for, its event block hashes (cached).

    ``cache_salt`` is the salt the worker will hash the prompt with (the request's own, and
    its tenant's under ``--tenant-isolation salt``), so the hashes are the worker's events'.
    """

    __slots__ = ("ids", "cache_salt", "_hashes")

    def __init__(self, ids: Optional[list[int]], cache_salt: Optional[str] = None) -> None:
        self.ids = ids
        self.cache_salt = cache_salt
        self._hashes: dict[int, list[int]] = {}

    def hashes(self, block_size: int) -> Optional[list[int]]:
        if self.ids is None:
            return None
        got = self._hashes.get(block_size)
        if got is None:
            got = self._hashes[block_size] = event_block_hashes(self.ids, block_size, cache_salt=self.cache_salt)
        return got


class FleetRouter:
    def __init__(self, worker_urls: Sequence[str], events: Sequence[Optional[EventEndpoints]],
                 config: FleetConfig) -> None:
        if len(events) != len(worker_urls):
            raise ValueError("one events entry per worker URL")
        self.workers = [Worker(u.rstrip("/"), e) for u, e in zip(worker_urls, events)]
        self.config = config
        self.metrics = RouterMetrics(lambda: self.workers)
        self.client: Optional[aiohttp.ClientSession] = None
        self._health_task: Optional[asyncio.Task[None]] = None
        self.streams = OpenStreams()  # ended by the shutdown (cli.main registers streams.end_all)

    # ------------------------------------------------------------------ lifecycle
    async def start(self) -> None:
        self.client = upstream_session(self.config.timeout_s, connect_s=5.0, limit=512)
        for w in self.workers:
            if w.events is not None:
                w.subscriber = EventSubscriber(w.url, w.view, w.events.pub, w.events.replay, self.config.events_topic)
                w.subscriber.start()
        # The first health checks, before the router serves: workers already up are healthy
        # from its first request on; one still starting is "not up yet" (logged once) and gets
        # requests once it answers.
        first = [asyncio.ensure_future(self._probe(w)) for w in self.workers]
        await asyncio.wait(first, timeout=min(FIRST_PROBE_WAIT_S, self.config.health_timeout_s))
        self._health_task = asyncio.ensure_future(self._health_loop(first))

    async def close(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        for w in self.workers:
            if w.subscriber is not None:
                await w.subscriber.stop()
        if self.client is not None:
            await self.client.close()

    # ------------------------------------------------------------------ health
    def _mark_down(self, w: Worker, why: str) -> None:
        if not w.up_once and w.refused is None:
            if not w.waiting_logged:  # still starting (loading its model): once, not every poll
                logger.info("worker %s is not up yet (%s); waiting for it", w.url, why)
                w.waiting_logged = True
        elif w.healthy and w.up_once:
            logger.warning("worker %s is down (%s); routing around it", w.url, why)
        w.healthy = False
        w.pending.clear()
        if w.subscriber is not None:
            w.subscriber.reset()  # a worker that comes back has an empty cache
        else:
            w.view.clear()

    async def _probe(self, w: Worker) -> None:
        assert self.client is not None
        refused = False
        try:
            async with self.client.get(w.url + "/health",
                                       timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as r:
                await r.read()
                ok, why = r.status == 200, f"HTTP {r.status}"
        except UPSTREAM_ERRORS as exc:
            ok, why, refused = False, type(exc).__name__, isinstance(exc, aiohttp.ClientConnectorError)
        if ok and w.view.block_size is None and w.refused is None:
            ok, why = await self._learn_block_size(w)
        if w.refused is not None:
            self._mark_down(w, "its block size is not the router's")
            return
        if ok:
            if not w.up_once:
                logger.info("worker %s is up", w.url)
            elif not w.healthy:
                logger.info("worker %s is back", w.url)
            w.healthy, w.failures, w.up_once = True, 0, True
            return
        w.failures += 1
        if w.failures >= self.config.health_failures or refused or not w.up_once:
            self._mark_down(w, why)

    async def _learn_block_size(self, w: Worker) -> tuple[bool, str]:
        """Read the worker's block size from its ``/v1/models`` (the server's cache config);
        refuse the worker for good when it is not the configured one."""
        assert self.client is not None
        key = self.config.worker_api_key
        try:
            async with self.client.get(w.url + "/v1/models", headers={"Authorization": f"Bearer {key}"} if key else None,
                                       timeout=aiohttp.ClientTimeout(total=self.config.health_timeout_s)) as r:
                cards = (await r.json(content_type=None)).get("data") or [{}]
        except (*UPSTREAM_ERRORS, ValueError, AttributeError) as exc:
            return False, f"/v1/models: {type(exc).__name__}"
        size = cards[0].get("block_size") if isinstance(cards[0], dict) else None
        if not isinstance(size, int) or size <= 0:
            return True, ""  # a server that does not say: its events will
        expected = self.config.block_size
        if expected is not None and size != expected:
            w.refused = (f"it runs --block-size {size}, the router was started with --block-size {expected}; "
                         f"restart the router without --block-size or with {size}")
            logger.error("worker %s refused: %s", w.url, w.refused)
            return False, w.refused
        w.view.store((), None, size)
        return True, ""

    async def _health_loop(self, first: Sequence["asyncio.Future[None]"] = ()) -> None:
        await asyncio.gather(*first, return_exceptions=True)
        while True:
            await asyncio.sleep(self.config.health_interval_s)
            await asyncio.gather(*(self._probe(w) for w in self.workers), return_exceptions=True)
            now = time.monotonic()
            for w in self.workers:
                if len(w.pending) > 4096:
                    w.pending = {h: t for h, t in w.pending.items() if t > now}

    # ------------------------------------------------------------------ routing
    def _block_size_of(self, view: WorkerView) -> int:
        """The worker's own (from /v1/models or its events), else the configured or the servers' default."""
        return view.block_size or self.config.block_size or CacheConfig.block_size

    def choose(self, prompt: _Prompt, exclude: set[int]) -> Optional[tuple[int, str, int]]:
        """(worker index, reason, predicted cached tokens), or None when no worker is healthy."""
        now = time.monotonic()
        cands = [Candidate(i, w.in_flight, w.view, w.pending) for i, w in enumerate(self.workers)
                 if w.healthy and i not in exclude]
        if not cands:
            return None
        d = self.config.policy.choose(cands, lambda v: prompt.hashes(self._block_size_of(v)), now)
        w = self.workers[d.index]
        predicted = 0
        if prompt.ids:
            bs = self._block_size_of(w.view)
            match = d.match
            if not match.blocks:  # the policy did not look (round_robin, ...): what the view says
                shared = [o.view for o in self.workers if o is not w] if self.config.shared_storage else ()
                match = w.view.match(prompt.hashes(bs) or (), _COUNT_ONLY, shared)
            predicted = min(match.confirmed, (len(prompt.ids) - 1) // bs) * bs
            expiry = now + self.config.pending_ttl_s
            hashes = prompt.hashes(bs) or ()
            pending = w.pending
            for h in hashes:
                pending[h] = expiry
        return d.index, d.reason, predicted

    def _salt_of(self, body: dict[str, Any], caller: Caller) -> tuple[bool, Optional[str]]:
        """``(valid, salt)``: the salt the worker hashes this request with; not valid when its
        ``cache_salt`` is bad (the worker answers with its 400)."""
        try:
            salt = check_cache_salt(body.get("cache_salt"))
        except ValueError:
            return False, None
        if self.config.tenant_isolation == "salt":
            salt = tenant_cache_salt(caller.tenant, salt)
        return True, salt

    async def route(self, path: str, data: bytes, t0: float, caller: Caller = Caller()) -> Response:
        """Forward one request (its body ``data``, arrived at ``perf_counter()`` ``t0``, sent by
        ``caller``, whose ``Authorization`` header goes along) to a worker."""
        try:
            body = json.loads(data)
        except ValueError:
            body = None
        if not isinstance(body, dict):
            body = None  # the worker answers with its own 400
        ids, salt = None, None
        if body is not None:
            valid, salt = self._salt_of(body, caller)
            if valid:
                ids = prompt_token_ids(self.config.tokenizer, path, body)
        prompt = _Prompt(ids, salt)
        send_headers = forward_headers(caller, _JSON_HEADERS)
        stream = bool(body and body.get("stream"))
        wants_usage = bool(body and isinstance(body.get("stream_options"), dict)
                           and body["stream_options"].get("include_usage"))
        if stream and not wants_usage and body is not None:
            data = _with_usage(body, data)
        tried: set[int] = set()
        while True:
            choice = self.choose(prompt, tried)
            if choice is None:
                self.metrics.no_worker.inc()
                reason = "no healthy worker" if not tried else "every healthy worker refused the connection"
                return error_response(503, f"router: {reason} ({len(self.workers)} configured)",
                                      code="no_healthy_worker")
            index, reason, predicted = choice
            w = self.workers[index]
            tried.add(index)
            overhead = time.perf_counter() - t0
            headers = {HEADER_WORKER: w.url, HEADER_OVERHEAD_S: f"{overhead:.6f}", HEADER_PREDICTED: str(predicted)}
            w.in_flight += 1
            try:
                if stream:
                    resp = await self._forward_stream(w, path, data, headers, predicted, not wants_usage,
                                                      send_headers)
                else:
                    resp = await self._forward_json(w, path, data, headers, predicted, send_headers)
            except aiohttp.ClientConnectorError as exc:
                w.in_flight -= 1
                self._mark_down(w, f"connection refused: {exc}")
                self.metrics.routed.labels(worker=w.url, reason="refused").inc()
                continue
            self.metrics.overhead.observe(overhead)
            self.metrics.routed.labels(worker=w.url, reason=reason).inc()
            return resp

    def _record_usage(self, w: Worker, usage: Any, predicted: int) -> None:
        if not isinstance(usage, dict):
            return
        details = usage.get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(cached, int):
            self.metrics.predicted.labels(worker=w.url).inc(predicted)
            self.metrics.reported.labels(worker=w.url).inc(cached)
        if isinstance(usage.get("prompt_tokens"), int):
            self.metrics.prompt_tokens.labels(worker=w.url).inc(usage["prompt_tokens"])

    async def _send(self, w: Worker, path: str, data: bytes, headers: dict[str, str],
                    send_headers: Optional[dict[str, str]]) -> tuple[Optional[aiohttp.ClientResponse],
                                                                    Optional[Response]]:
        """(the worker's response, None), or (None, a 502 for the client) when the call failed.

        A refused connection is raised as is (nothing was sent: route() tries another
        worker); any other failure ends the request here, so its in-flight count is dropped.
        """
        assert self.client is not None
        try:
            return await self.client.post(w.url + path, data=data, headers=send_headers or _JSON_HEADERS), None
        except aiohttp.ClientConnectorError:
            raise
        except BaseException as exc:
            w.in_flight -= 1
            if not isinstance(exc, UPSTREAM_ERRORS):
                raise
            self.metrics.failed.labels(worker=w.url).inc()
            msg = f"worker {w.url} failed ({type(exc).__name__}: {exc})"
            logger.warning("%s", msg)
            return None, error_response(502, msg, code="upstream_unavailable", headers=headers)

    async def _forward_json(self, w: Worker, path: str, data: bytes, headers: dict[str, str],
                            predicted: int, send_headers: Optional[dict[str, str]] = None) -> Response:
        resp, failed = await self._send(w, path, data, headers, send_headers)
        if resp is None:
            return failed  # type: ignore[return-value]
        try:
            content = await resp.read()
        except UPSTREAM_ERRORS as exc:
            resp.close()
            self.metrics.failed.labels(worker=w.url).inc()
            msg = f"worker {w.url} failed while answering ({type(exc).__name__}: {exc})"
            logger.warning("%s", msg)
            return error_response(502, msg, code="upstream_unavailable", headers=headers)
        except BaseException:  # cancelled (the client left): the connection is not reusable
            resp.close()
            raise
        finally:
            w.in_flight -= 1
        if resp.status != 200:
            return relay_error("worker", resp.status, content, headers)
        self._record_usage(w, _usage_of(content), predicted)
        return Response(content, status_code=200, media_type="application/json", headers=headers)

    async def _forward_stream(self, w: Worker, path: str, data: bytes, headers: dict[str, str],
                              predicted: int, drop_usage: bool,
                              send_headers: Optional[dict[str, str]] = None) -> Response:
        resp, failed = await self._send(w, path, data, headers, send_headers)
        if resp is None:
            return failed  # type: ignore[return-value]
        if resp.status != 200:
            try:
                content = await error_body_of(resp)
            finally:
                w.in_flight -= 1
            return relay_error("worker", resp.status, content, headers)

        self.streams.add(resp)

        def worker_done() -> None:
            w.in_flight -= 1

        end = stream_end(self.streams, resp, worker_done)

        async def relay() -> AsyncIterator[bytes]:
            buf = b""
            try:
                async for chunk in resp.content.iter_any():
                    # Whole server-sent events only, so that a usage chunk split over two
                    # reads is still read (and dropped when the client did not ask for it).
                    buf += chunk
                    if b"\n\n" not in buf:
                        continue
                    *events, buf = buf.split(b"\n\n")
                    out = []
                    for ev in events:
                        if _USAGE_MARK in ev and ev.startswith(b"data: "):
                            try:
                                payload = json.loads(ev[6:])
                            except ValueError:
                                payload = None
                            if isinstance(payload, dict):
                                self._record_usage(w, payload.get("usage"), predicted)
                                if drop_usage and not payload.get("choices"):
                                    continue
                        out.append(ev + b"\n\n")
                    if out:
                        yield b"".join(out)
                if buf:
                    yield buf
            except UPSTREAM_ERRORS as exc:
                if self.streams.ending:
                    yield SHUTTING_DOWN_EVENT
                    return
                self.metrics.failed.labels(worker=w.url).inc()
                msg = f"worker {w.url}: the stream broke ({type(exc).__name__}: {exc})"
                logger.warning("%s", msg)
                yield f"data: {json.dumps(error_body(msg))}\n\n".encode()
            finally:
                end()

        return RelayResponse(relay(), end, headers=headers)

    # ------------------------------------------------------------------ introspection
    def state(self, with_hashes: bool = False) -> dict[str, Any]:
        out = []
        for w in self.workers:
            entry: dict[str, Any] = {
                "url": w.url, "healthy": w.healthy, "refused": w.refused, "in_flight": w.in_flight,
                "block_size": w.view.block_size,
                "blocks": {TIER_NAMES[b]: w.view.count(b) for b in (DEVICE, HOST, STORAGE)},
                "events": None if w.events is None else {"endpoint": w.events.pub, "replay_endpoint": w.events.replay},
            }
            if w.subscriber is not None:
                entry["events_stats"] = dict(vars(w.subscriber.stats), last_seq=w.subscriber.last_seq)
            if with_hashes:
                entry["hashes"] = {TIER_NAMES[b]: [format(h, "x") for h in w.view.hashes_on(b)]
                                   for b in (DEVICE, HOST, STORAGE)}
            out.append(entry)
        return {"policy": self.config.policy.name, "workers": out}


def build_fleet_app(router: FleetRouter) -> FastAPI:
    app = router_app("fastdeploy_kvcache router", router.start, router.close)
    app.state.router = router

    @app.get("/health")
    async def health() -> Response:
        up = [w.url for w in router.workers if w.healthy]
        down = [w.url for w in router.workers if not w.healthy]
        if not up:
            return error_response(503, f"router: no healthy worker (down: {', '.join(down)})",
                                  code="no_healthy_worker")
        return JSONResponse({"status": "ok", "healthy": up, "down": down})

    @app.get("/router/state")
    async def state(hashes: bool = False) -> Response:
        return JSONResponse(router.state(with_hashes=hashes))

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(raw: Request) -> Response:
        assert router.client is not None
        for w in router.workers:
            if not w.healthy:
                continue
            try:
                async with router.client.get(w.url + "/v1/models",
                                             headers=forward_headers(Caller.of_scope(raw.scope))) as resp:
                    return Response(await resp.read(), status_code=resp.status, media_type="application/json")
            except UPSTREAM_ERRORS:
                continue
        return error_response(503, "router: no healthy worker", code="no_healthy_worker")

    # The two proxy endpoints take the body as bytes: it is forwarded as it came, so
    # FastAPI's request parsing would only add time.  ``cli.main`` serves them in front of
    # the app (http.FastPaths); the routes below answer when the app is used on its own.
    app.state.fast_paths = {
        "/v1/completions": lambda data, t0, caller: router.route("/v1/completions", data, t0, caller),
        "/v1/chat/completions": lambda data, t0, caller: router.route("/v1/chat/completions", data, t0, caller),
    }
    for path, handler in app.state.fast_paths.items():
        async def endpoint(raw: Request, handler: Any = handler) -> Response:
            t0 = time.perf_counter()
            return await handler(await raw.body(), t0, Caller.of_scope(raw.scope))

        app.add_route(path, endpoint, methods=["POST"])

    return app
