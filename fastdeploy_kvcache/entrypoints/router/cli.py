"""The router's flags and ``main``: fleet mode (``--worker-urls``) or PD mode (``--prefill-url``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any, Optional, Sequence
from urllib.parse import urlsplit

from fastdeploy_kvcache.entrypoints.openai.shutdown import DEFAULT_GRACE_S

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8190
PROG = "python -m fastdeploy_kvcache.entrypoints.router"


def make_arg_parser() -> argparse.ArgumentParser:
    from fastdeploy_kvcache.entrypoints.router.policy import POLICIES
    from fastdeploy_kvcache.entrypoints.router.view import TierWeights

    w = TierWeights()
    p = argparse.ArgumentParser(
        prog=PROG,
        description="OpenAI-compatible router over N servers (--worker-urls; cache-aware from the servers' KV "
                    "cache events) or over a prefill and a decode server (--prefill-url/--decode-url). "
                    "Guide: docs/fleet.md.")
    g = p.add_argument_group("fleet mode")
    g.add_argument("--worker-urls", nargs="+", metavar="URL", help="Base URLs of the servers, e.g. http://10.0.0.1:8188.")
    g.add_argument("--worker-events", nargs="+", metavar="PUB[,REPLAY]",
                   help="Per worker, in --worker-urls order: the ZMQ endpoint of its KV events (the endpoint of its "
                        "--kv-events-config) and, after a comma, its replay endpoint; a '*' host means the worker "
                        "URL's host (tcp://*:5557,tcp://*:5558); 'none' for a worker without events. Without this "
                        "flag no events are read and cache_aware predicts from the requests it routed only.")
    g.add_argument("--events-topic", default="", help="ZMQ topic to subscribe to (default: every topic).")
    g.add_argument("--model", default="smollm2-135m-instruct",
                   help="The workers' --model, for its tokenizer (no weights are loaded): a registered name, a "
                        "checkpoint directory or a .gguf file (default: smollm2-135m-instruct).")
    g.add_argument("--policy", choices=POLICIES, default="cache_aware", help="Routing policy (default cache_aware).")
    g.add_argument("--device-weight", type=float, default=w.device,
                   help=f"Worth of a reused block on the worker's device tier (default {w.device}).")
    g.add_argument("--host-weight", type=float, default=w.host,
                   help=f"Worth of a reused block on the worker's host tier (default {w.host}).")
    g.add_argument("--storage-weight", type=float, default=w.storage,
                   help=f"Worth of a reused block in storage (default {w.storage}).")
    g.add_argument("--balance-abs-threshold", type=int, default=4,
                   help="Load is imbalanced when the busiest worker has more than this many requests in flight "
                        "above the idlest one ... (default 4)")
    g.add_argument("--balance-rel-threshold", type=float, default=1.5,
                   help="... and more than this many times as many; then cache_aware sends to the least-loaded "
                        "worker (default 1.5).")
    g.add_argument("--shared-storage", action=argparse.BooleanOptionalAction, default=True,
                   help="The workers share one store: a block one worker stored counts as a storage block for "
                        "every worker (default on).")
    g.add_argument("--block-size", type=int, default=None,
                   help="The workers' --block-size. By default each worker's is read from its /v1/models; "
                        "given, a worker that reports another one is refused (down, with one log line).")
    g.add_argument("--pending-ttl", type=float, default=10.0,
                   help="Seconds a routed request's blocks count as the worker's before its events confirm them.")
    g.add_argument("--health-interval", type=float, default=2.0, help="Seconds between health checks (default 2).")
    g.add_argument("--health-timeout", type=float, default=5.0, help="Seconds a health check may take (default 5).")
    g.add_argument("--health-failures", type=int, default=2,
                   help="Failed checks in a row that mark a worker down (a refused connection marks it at once).")
    g = p.add_argument_group("PD mode")
    g.add_argument("--prefill-url", help="Base URL of the --splitwise-role prefill server.")
    g.add_argument("--decode-url", help="Base URL of the --splitwise-role decode server.")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"Address to listen on (default {DEFAULT_HOST}).")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"Port to listen on (default {DEFAULT_PORT}).")
    p.add_argument("--timeout", type=float, default=600.0, help="Seconds a call to a server may take.")
    p.add_argument("--graceful-shutdown-timeout", type=float, default=DEFAULT_GRACE_S, metavar="SECONDS",
                   help="On SIGTERM or SIGINT: new connections are refused, requests in flight may finish for 3/4 "
                        "of this; streams still running then end with an error event and [DONE] (a second signal "
                        f"ends them at once); the process exits 0 (default: {DEFAULT_GRACE_S:g}).")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    from fastdeploy_kvcache.entrypoints.auth import add_auth_cli_args

    # The workers' own: given, the router checks keys itself (401 before any worker is asked)
    # and hashes with the tenants' salts as the workers do.  The client's Authorization header
    # is forwarded either way.
    add_auth_cli_args(p)
    return p


def _check_url(flag: str, url: str) -> None:
    if not url.startswith(("http://", "https://")):
        raise SystemExit(f"{flag}: must start with http:// or https://, got {url!r}")


def parse_worker_events(specs: Optional[Sequence[str]], worker_urls: Sequence[str]) -> list:
    """``--worker-events`` as one :class:`EventEndpoints` (or None) per worker."""
    from fastdeploy_kvcache.entrypoints.router.fleet import EventEndpoints

    if not specs:
        return [None] * len(worker_urls)
    if len(specs) != len(worker_urls):
        raise SystemExit(f"--worker-events: {len(specs)} given for {len(worker_urls)} --worker-urls; give one per "
                         "worker ('none' for a worker without events)")
    out = []
    for spec, url in zip(specs, worker_urls):
        if spec.lower() == "none":
            out.append(None)
            continue
        parts = spec.split(",")
        if len(parts) > 2 or not all(x.startswith(("tcp://", "ipc://")) for x in parts):
            raise SystemExit(f"--worker-events: {spec!r} is not PUB[,REPLAY] with tcp:// or ipc:// endpoints")
        host = urlsplit(url).hostname or "127.0.0.1"
        parts = [x.replace("://*:", f"://{host}:") for x in parts]
        out.append(EventEndpoints(parts[0], parts[1] if len(parts) == 2 else None))
    return out


def build_app_from_args(args: argparse.Namespace):  # -> FastAPI
    from fastdeploy_kvcache.entrypoints.auth import api_keys_from_args

    try:
        keys = api_keys_from_args(args)
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    app = _build_app(args, keys)
    app.state.api_keys = keys
    return app


def _build_app(args: argparse.Namespace, keys: Any):  # -> FastAPI
    if not 0 <= args.graceful_shutdown_timeout < float("inf"):
        raise SystemExit(f"--graceful-shutdown-timeout: must be a finite number >= 0, got "
                         f"{args.graceful_shutdown_timeout}")
    if args.prefill_url or args.decode_url:
        if args.worker_urls:
            raise SystemExit("--worker-urls and --prefill-url/--decode-url are two modes; give one")
        if not (args.prefill_url and args.decode_url):
            raise SystemExit("PD mode needs both --prefill-url and --decode-url")
        _check_url("--prefill-url", args.prefill_url)
        _check_url("--decode-url", args.decode_url)
        from fastdeploy_kvcache.entrypoints.router.pd import build_pd_app

        return build_pd_app(args.prefill_url, args.decode_url, args.timeout)
    if not args.worker_urls:
        raise SystemExit("give --worker-urls (fleet mode) or --prefill-url and --decode-url (PD mode)")
    for url in args.worker_urls:
        _check_url("--worker-urls", url)
    if args.block_size is not None and args.block_size <= 0:
        raise SystemExit(f"--block-size: must be > 0, got {args.block_size}")
    if args.health_failures < 1 or args.health_interval <= 0:
        raise SystemExit("--health-failures must be >= 1 and --health-interval > 0")
    from fastdeploy_kvcache.entrypoints.router.fleet import FleetConfig, FleetRouter, build_fleet_app
    from fastdeploy_kvcache.entrypoints.router.policy import make_policy
    from fastdeploy_kvcache.entrypoints.router.prompt import SegmentEncoder, load_tokenizer
    from fastdeploy_kvcache.entrypoints.router.view import TierWeights

    events = parse_worker_events(args.worker_events, args.worker_urls)
    try:
        weights = TierWeights(args.device_weight, args.host_weight, args.storage_weight)
        policy = make_policy(args.policy, weights, args.balance_abs_threshold, args.balance_rel_threshold,
                             args.shared_storage)
        tokenizer = SegmentEncoder(load_tokenizer(args.model))
    except (ValueError, FileNotFoundError) as exc:
        raise SystemExit(str(exc)) from exc
    config = FleetConfig(policy=policy, tokenizer=tokenizer, block_size=args.block_size,
                         events_topic=args.events_topic, shared_storage=args.shared_storage,
                         health_interval_s=args.health_interval,
                         health_timeout_s=args.health_timeout, health_failures=args.health_failures,
                         pending_ttl_s=args.pending_ttl, timeout_s=args.timeout,
                         tenant_isolation=getattr(args, "tenant_isolation", "none"),
                         worker_api_key=keys.any_key() if keys is not None else None)
    return build_fleet_app(FleetRouter(args.worker_urls, events, config))


def _fastest(module: str) -> str:
    """uvicorn's ``loop``/``http`` choice: ``module`` when it imports (uvloop, httptools: about
    a fifth less of the router's CPU time per request than asyncio's loop and h11), else its default."""
    import importlib

    try:
        importlib.import_module(module)
    except ImportError:
        return "auto"
    return module


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Serve until SIGTERM or SIGINT, then drain (the servers' graceful shutdown) and exit 0."""
    import uvicorn
    from uvicorn.config import STARTUP_FAILURE

    from fastdeploy_kvcache.entrypoints.openai.shutdown import GracefulServer, ShutdownPlan, exit_process

    args = make_arg_parser().parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = build_app_from_args(args)
    plan = ShutdownPlan(args.graceful_shutdown_timeout)
    plan.on_abort(app.state.router.streams.end_all)  # either mode
    from fastdeploy_kvcache.entrypoints.router.http import FastPaths

    asgi = FastPaths(app, app.state.fast_paths) if getattr(app.state, "fast_paths", None) else app
    if app.state.api_keys is not None:
        from fastdeploy_kvcache.entrypoints.auth import ApiKeyGuard

        asgi = ApiKeyGuard(asgi, app.state.api_keys)
    config = uvicorn.Config(asgi, host=args.host, port=args.port, log_level="warning", access_log=False,
                            loop=_fastest("uvloop"), http=_fastest("httptools"))
    n = len(args.worker_urls or ())
    mode = "prefill/decode" if args.prefill_url else f"{n} worker{'' if n == 1 else 's'}"
    server = GracefulServer(config, plan, then="the router stops",
                            on_serving=lambda: logger.info("router serving on http://%s:%s (%s)",
                                                           args.host, args.port, mode))
    server.run()
    if not server.started:
        sys.exit(STARTUP_FAILURE)  # a busy port, ...: uvicorn.run's status
    exit_process(0)  # everything is closed: skip the interpreter's teardown
