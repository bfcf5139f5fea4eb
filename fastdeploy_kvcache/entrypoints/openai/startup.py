"""The server's start-up checks: refuse a bad configuration in one line, bind before serving.

A configuration error (an unknown ``--model``, ``--device gpu`` on a CPU build of Paddle,
a value a flag or an environment variable does not take, a busy ``--port``) is found before the model loads, and ends
the process with one line naming the flag and exit status 2, as argparse does for its own
errors; no traceback, no usage block.  The listening socket is bound before the engine
starts, so the "serving on" line that ends start-up is true when it is logged.
"""

from __future__ import annotations

import argparse
import errno
import logging
import socket
import sys
from typing import Any, NoReturn

logger = logging.getLogger(__name__)

CONFIG_ERROR_EXIT = 2  # argparse's status for a usage error


class ConfigError(Exception):
    """A start-up setting that cannot work; ``str()`` is one line that names the flag."""


class OneLineErrorParser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line (``prog: error: ...``), exit status 2.

    argparse's default prints the whole usage block first: for this server, 25 lines in
    front of the one that says what is wrong.
    """

    def error(self, message: str) -> NoReturn:
        self.exit(CONFIG_ERROR_EXIT, f"{self.prog}: error: {message} (--help lists the flags)\n")


def flag_message(exc: BaseException) -> str:
    """``exc``'s message with its leading field name (``dtype: ...``) spelled as its flag."""
    from fastdeploy_kvcache.config import CLI_FLAGS
    from fastdeploy_kvcache.engine.args import EngineArgs

    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    field, sep, rest = text.partition(":")
    if not sep or not field.isidentifier():
        return text
    # CacheConfig's field names differ from their flags (dtype -> --kv-cache-dtype).
    flag = next((spec.flag for spec in CLI_FLAGS if spec.field == field), None)
    if flag is None and field in EngineArgs.__dataclass_fields__:
        flag = "--" + field.replace("_", "-")
    return f"{flag}:{rest}" if flag else text


def check_environment() -> None:
    """Parse every environment variable the package reads (``envs.ENV_VARS``); ConfigError
    naming the first bad one.  The engine reads them only once the model has loaded, where a
    bad value would end start-up in a traceback."""
    from fastdeploy_kvcache import envs

    for name in envs.ENV_VARS:
        try:
            envs.get(name)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None


def check_config(args: argparse.Namespace) -> Any:
    """The server's EngineArgs, after every check that needs no model: raises ConfigError.

    Checks the environment variables, the values (ranges, choices), that ``--model`` names
    something loadable, that ``--max-model-len`` fits its positions, and that ``--device`` is
    available.  Cheap next to loading the model, so a mistake costs seconds.
    """
    from fastdeploy_kvcache.engine.args import EngineArgs, check_max_model_len
    from fastdeploy_kvcache.engine.llm_engine import wants_gpu
    from fastdeploy_kvcache.engine.model_loader import model_positions
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import RANDOM_SHAPES

    check_environment()
    from fastdeploy_kvcache.entrypoints.auth import api_keys_from_args

    api_keys_from_args(args)  # a bad keys file: one line now, not a traceback in the lifespan
    engine_args = EngineArgs.from_cli_args(args)
    storage = engine_args.storage
    if storage is not None and storage.enabled and not engine_args.host_tier_enabled:
        raise ConfigError(f"--kvcache-storage-backend {storage.backend}: needs a host tier to stage blocks "
                          "through; give --swap-space (GiB)")
    if engine_args.model_impl != "transformers" and engine_args.model in RANDOM_SHAPES:
        raise ConfigError(f"--model {engine_args.model}: runs on --model-impl transformers only")
    # model_positions also checks that --model names something loadable.
    check_max_model_len(engine_args.max_model_len, model_positions(engine_args.model), engine_args.model)
    if engine_args.model_impl == "transformers":
        # torch's view of the GPU, not Paddle's: this path may run where Paddle is absent.
        from fastdeploy_kvcache.engine.transformers_runner.torch_runner import select_device

        select_device(engine_args.device)
    else:
        wants_gpu(engine_args.device)
    return engine_args


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` and listening; ConfigError naming the flag if not."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise ConfigError(f"--host {host}: cannot resolve it ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    try:
        # As uvicorn does: a restarted server may bind while old connections sit in TIME_WAIT.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            raise ConfigError(f"--port {port}: address {host}:{port} is already in use "
                              "(another server? pick a free port with --port)") from None
        if exc.errno == errno.EACCES:
            raise ConfigError(f"--port {port}: not allowed to listen on {host}:{port} ({exc.strerror})") from None
        raise ConfigError(f"--host {host} --port {port}: cannot listen there ({exc.strerror})") from None
    sock.set_inheritable(True)
    return sock


def prepare(prog: str, args: argparse.Namespace) -> socket.socket:
    """Check the configuration and bind the port; on an error, exit 2 with one line."""
    try:
        check_config(args)
        return listen_socket(args.host, args.port)
    except (ConfigError, ValueError) as exc:
        sys.stderr.write(f"{prog}: error: {flag_message(exc)}\n")
        sys.exit(CONFIG_ERROR_EXIT)
