"""OpenAI-compatible HTTP server over the reference engine (FastAPI + uvicorn).

Run it with ``python -m fastdeploy_kvcache.entrypoints.openai.api_server [flags]`` or
``fastdeploy-kvcache serve [flags]`` (the same flags; ``--help`` lists them).  The
engine reads ``ENABLE_V1_KVCACHE_MANAGER`` (1: tiered cache manager; 0: plain block
allocator, no reuse between requests).

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both with
``stream``), ``GET /v1/models``, ``GET /health`` (``?verbose=1`` adds the engine's
stats: used by tests and operators to check that no block leaked), ``GET /metrics``,
``GET /debug/kv_cache_blocks`` (the cache's blocks per tier as KV cache events name them:
docs/fleet.md).

With ``--api-key`` or ``--api-keys-file`` the ``/v1`` routes and ``/debug`` need
``Authorization: Bearer <key>`` (401 otherwise; ``entrypoints/auth.py``); ``/health`` and
``/metrics`` stay open.

Every error, FastAPI's own request validation included, is returned in OpenAI's shape
``{"error": {"message", "type", "param", "code"}}``; a malformed request is a 400, never a
422, and never reaches the engine.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import sys
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, NoReturn, Optional, Sequence

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from fastapi.routing import APIRoute
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from fastdeploy_kvcache.cli_flags import add_flag
from fastdeploy_kvcache.entrypoints.auth import ApiKeyGuard, add_auth_cli_args, api_keys_from_args
from fastdeploy_kvcache.entrypoints.openai.body_limit import DEFAULT_MAX_BODY_BYTES, BodySizeLimit, BodyTooLarge
from fastdeploy_kvcache.entrypoints.openai.engine_client import AsyncEngineClient
from fastdeploy_kvcache.entrypoints.openai.json_body import parse_json_body
from fastdeploy_kvcache.entrypoints.openai.metrics import ServerMetrics
from fastdeploy_kvcache.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from fastdeploy_kvcache.entrypoints.openai.serving import ClientDisconnected, OpenAIServing, RequestError
from fastdeploy_kvcache.entrypoints.openai.shutdown import (DEFAULT_GRACE_S, GracefulServer, ShutdownPlan, exit_process,
                                                            run_bounded)
from fastdeploy_kvcache.entrypoints.openai.startup import OneLineErrorParser, prepare

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8188
STARTUP_FAILURE_EXIT = 3  # uvicorn's status when the application fails to start
# Bodies larger than this are parsed off the event loop (the 2 MiB default takes ~20 ms).
_PARSE_OFF_LOOP_BYTES = 256 << 10


# ---------------------------------------------------------------------- flags
def _at_least_zero(kind: type) -> Any:
    """argparse ``type=``: a finite number >= 0 (anything else is a usage error, not a traceback)."""
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        if not (value >= 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def add_server_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Server flags (``--host``, ``--port``, ...) plus the engine's and the cache's flags.

    Like the engine's, it tolerates a parser that already defines some of these flags
    (FastDeploy's parser defines ``--host``/``--port``): those are left as they are.
    """
    from fastdeploy_kvcache.engine.args import add_engine_cli_args  # engine side: lazy

    group = parser.add_argument_group("HTTP server")

    def add(flag: str, **kwargs: Any) -> None:
        add_flag(group, flag, **kwargs)

    add("--host", default=DEFAULT_HOST, help=f"Address to listen on (default: {DEFAULT_HOST}).")
    add("--port", type=int, default=DEFAULT_PORT, help=f"TCP port to listen on (default: {DEFAULT_PORT}).")
    add("--served-model-name", dest="served_model_name", nargs="+", default=None,
        help="Model name(s) clients must send in `model` (default: the engine's model name).")
    add("--uvicorn-log-level", dest="uvicorn_log_level", default="warning",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
        help="uvicorn's log level; `info` logs every HTTP request (default: warning).")
    add("--log-level", dest="log_level", default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="Log level of fastdeploy_kvcache's own loggers (default: info).")
    add("--graceful-shutdown-timeout", dest="graceful_shutdown_timeout", type=_at_least_zero(float),
        default=DEFAULT_GRACE_S,
        metavar="SECONDS",
        help="On SIGTERM or SIGINT: new connections are refused, in-flight requests may finish for 3/4 of "
             "this, those still running are then aborted (streams end cleanly), and the engine's shutdown "
             "(pending storage writes) gets the rest; the process exits 0. Give the process manager more "
             f"than this before it kills (default: {DEFAULT_GRACE_S:g}).")
    add("--max-request-body-bytes", dest="max_request_body_bytes", type=_at_least_zero(int),
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="BYTES",
        help="Larger request bodies get HTTP 413, before they are read when they declare their length, "
             "else as soon as they pass it; 0: no limit (default: "
             f"{DEFAULT_MAX_BODY_BYTES}, {DEFAULT_MAX_BODY_BYTES >> 20} MiB).")
    add_auth_cli_args(parser)
    add_engine_cli_args(parser)
    return parser


def make_arg_parser(prog: Optional[str] = None) -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog=prog,
        description="OpenAI-compatible server over fastdeploy_kvcache's reference engine. "
                    "ENABLE_V1_KVCACHE_MANAGER=1 turns on the tiered KV-cache manager "
                    "(device prefix cache, plus a host tier when --swap-space > 0).",
    )
    return add_server_cli_args(parser)


# ---------------------------------------------------------------------- errors
def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


def _validation_message(exc: RequestValidationError) -> tuple[str, Optional[str]]:
    """One readable line per pydantic error, and the first error's field as ``param``."""
    parts, first_param = [], None
    for err in exc.errors():
        loc = [str(x) for x in err.get("loc", ()) if x != "body"]
        field = ".".join(loc)
        if err.get("type") == "json_invalid":
            parts.append(f"malformed JSON body: {err.get('ctx', {}).get('error', err.get('msg'))}")
            continue
        if first_param is None and field:
            first_param = field
        parts.append(f"{field or 'body'}: {err.get('msg')}")
    return "; ".join(parts) or "invalid request body", first_param


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def _on_validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        # Without a JSON Content-Type FastAPI does not parse the body, and pydantic's complaint
        # ("Input should be a valid dictionary") does not say why.
        content_type = request.headers.get("content-type")
        mime = (content_type or "").split(";")[0].strip().lower()
        if request.method == "POST" and not (mime == "application/json" or
                                             (mime.startswith("application/") and mime.endswith("+json"))):
            got = f"'{content_type}'" if content_type else "none"
            return error_response(400, f"Content-Type: must be application/json, got {got}", param="Content-Type")
        message, param = _validation_message(exc)
        return error_response(400, message, param=param)

    @app.exception_handler(RequestError)
    async def _on_request_error(_: Request, exc: RequestError) -> JSONResponse:
        return error_response(exc.status, exc.message, type_=exc.type, param=exc.param, code=exc.code)

    @app.exception_handler(ClientDisconnected)
    async def _on_disconnect(_: Request, exc: ClientDisconnected) -> Response:
        return Response(status_code=499)  # nobody reads it; nginx's "client closed request"

    @app.exception_handler(StarletteHTTPException)
    async def _on_http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), type_=kind, param=getattr(exc, "param", None))

    @app.exception_handler(Exception)
    async def _on_unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error while serving a request")
        return error_response(500, f"internal server error: {type(exc).__name__}: {exc}", type_="server_error")


def _json_safe(value: Any) -> Any:
    """Engine stats as JSON (enums and other objects become strings; NaN becomes None)."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set)):
        return [_json_safe(v) for v in value]
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return str(value)


# ---------------------------------------------------------------------- app
class _CheckedJSONRequest(Request):
    """A request whose JSON body is parsed by :func:`parse_json_body` (a 400 that names what
    is wrong with a body that is not UTF-8, nests too deep or holds a lone surrogate)."""

    async def json(self) -> Any:
        if not hasattr(self, "_json"):
            body = await self.body()
            if len(body) > _PARSE_OFF_LOOP_BYTES:
                self._json = await asyncio.to_thread(parse_json_body, body)
            else:
                self._json = parse_json_body(body)
        return self._json


class _CheckedJSONRoute(APIRoute):
    """The endpoints' route: FastAPI parses the body through :class:`_CheckedJSONRequest`."""

    def get_route_handler(self) -> Any:
        handler = super().get_route_handler()

        async def checked(request: Request) -> Response:
            return await handler(_CheckedJSONRequest(request.scope, request.receive))

        return checked


def _reply(result: Any, stream: Optional[bool]) -> Response:
    """A streamed request's server-sent events, or the whole response as JSON."""
    if stream:
        return StreamingResponse(result, media_type="text/event-stream")
    return JSONResponse(result.model_dump())


def build_app(args: argparse.Namespace) -> FastAPI:
    """The FastAPI app; the engine is built and started in its lifespan, stopped at exit."""
    state: dict[str, Any] = {}
    plan = ShutdownPlan(getattr(args, "graceful_shutdown_timeout", DEFAULT_GRACE_S))

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        from fastdeploy_kvcache.engine.args import EngineArgs
        from fastdeploy_kvcache.engine.llm_engine import LLMEngine

        engine_args = EngineArgs.from_cli_args(args)
        # Model loading takes seconds; off the loop so uvicorn's own tasks keep running.
        engine = await asyncio.to_thread(LLMEngine, engine_args)
        client = AsyncEngineClient(engine)
        names = list(args.served_model_name or [engine.model_name])
        metrics = ServerMetrics(names[0], client.get_stats)
        state.update(client=client, metrics=metrics, names=names,
                     serving=OpenAIServing(client, metrics, names, tenant_isolation=isolation))
        plan.on_abort(client.end_inflight)
        client.start()
        logger.info("serving %s on http://%s:%s (max_model_len=%d)", ", ".join(names), args.host, args.port,
                    engine.max_model_len)
        try:
            yield
        finally:
            state["serving"].close()
            budget = plan.engine_budget()
            logger.info("shutting down the engine (within %.1f s)", budget)
            if await run_bounded(client.shutdown, budget, "engine shutdown"):
                logger.info("engine shut down")

    keys = api_keys_from_args(args)
    isolation = getattr(args, "tenant_isolation", "none")
    app = FastAPI(title="fastdeploy_kvcache OpenAI-compatible server", lifespan=lifespan)
    app.router.route_class = _CheckedJSONRoute
    app.state.shutdown_plan = plan
    _install_error_handlers(app)

    async def reject_body(exc: BodyTooLarge, scope: Any, receive: Any, send: Any) -> None:
        await error_response(exc.status_code, str(exc.detail))(scope, receive, send)

    app.add_middleware(BodySizeLimit, on_reject=reject_body,
                       max_bytes=getattr(args, "max_request_body_bytes", DEFAULT_MAX_BODY_BYTES))
    if keys is not None:
        # Added last, so it runs first: a request without a key is refused before its body is read.
        app.add_middleware(ApiKeyGuard, keys=keys)
        logger.info("API keys required on /v1 (%d key(s), %d tenant(s)); tenant isolation: %s",
                    len(keys), len(keys.tenants), isolation)

    def serving() -> OpenAIServing:
        return state["serving"]

    @app.get("/health")
    async def health(verbose: bool = False) -> Any:
        """Liveness, and the storage tier's state when there is one; ``?verbose=1`` adds
        ``engine.get_stats()`` (block counts per tier, ...)."""
        out: dict[str, Any] = {"status": "ok"}
        storage = await asyncio.to_thread(state["client"].storage_health)  # a statvfs may block
        if storage is not None:
            out["storage"] = _json_safe(storage)
        if not verbose:
            return out
        stats = await asyncio.to_thread(state["client"].get_stats)
        return {**out, "model": state["names"][0], "engine": _json_safe(stats)}

    @app.get("/debug/kv_cache_blocks")
    async def kv_cache_blocks() -> Any:
        """Per medium, the block hashes the cache holds, as KV cache events name them."""
        return await asyncio.to_thread(state["client"].kv_cache_blocks)

    @app.get("/v1/models")
    async def models() -> ModelList:
        client = state["client"]
        return ModelList(data=[ModelCard(id=name, max_model_len=client.max_model_len, block_size=client.block_size)
                               for name in state["names"]])

    @app.get("/metrics")
    async def metrics() -> Response:
        body = await asyncio.to_thread(state["metrics"].render)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Any:
        return _reply(await serving().create_completion(body, raw), body.stream)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Any:
        return _reply(await serving().create_chat_completion(body, raw), body.stream)

    return app


def run_server(args: argparse.Namespace, prog: str = "fastdeploy-kvcache serve") -> NoReturn:
    """Serve until SIGTERM or SIGINT, then shut down gracefully and exit 0 (:func:`exit_process`).

    See :mod:`.shutdown` for what a signal does, and why the handlers need guarding. A
    configuration error or a busy port ends the process first, with one line naming the flag
    and exit status 2 (``startup.py``).
    """
    import uvicorn

    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    sock = prepare(prog, args)
    args.port = sock.getsockname()[1]  # --port 0: the port the kernel picked, for the log
    app = build_app(args)
    server = GracefulServer(uvicorn.Config(app, log_level=args.uvicorn_log_level), app.state.shutdown_plan)
    server.run(sockets=[sock])
    if not server.started:
        sys.exit(STARTUP_FAILURE_EXIT)  # the lifespan failed (uvicorn.run's status for it)
    exit_process(0)  # everything is closed: skip the interpreter's teardown (shutdown.py)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = make_arg_parser(prog="python -m fastdeploy_kvcache.entrypoints.openai.api_server")
    run_server(parser.parse_args(argv), parser.prog)


if __name__ == "__main__":
    main(sys.argv[1:])
