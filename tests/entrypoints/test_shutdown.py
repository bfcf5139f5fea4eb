"""Graceful shutdown: a real server process, a real signal, streams in flight, a file store.

systemd, Kubernetes and docker stop a service with SIGTERM; a person at a terminal sends
SIGINT.  Both must do the same, whatever the server's dependencies did to the signal
handlers (``import paddleformers`` resets SIGTERM to the default action): stop accepting,
let the in-flight requests finish (or end them cleanly once the grace period is spent),
shut the engine down so the storage tier writes what it owes, and exit 0.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import signal
import time
from pathlib import Path
from typing import Any, Callable, Optional

import pytest

from fastdeploy_kvcache.entrypoints.openai.shutdown import ENGINE_MIN_S, REQUEST_SHARE, ShutdownPlan, SignalGuard
from fastdeploy_kvcache.entrypoints.server_process import ServerProcess
from server_helpers import BASE_ARGS, file_store_args, prompt_ids
from shutdown_helpers import Stream, refused, wait_until
from storage_tier.helpers import block_hashes, object_file

SIGNALS = [pytest.param(signal.SIGTERM, id="SIGTERM"), pytest.param(signal.SIGINT, id="SIGINT")]


def _clean_exit(server: ServerProcess, streams: list[Stream], code: Optional[int], what: str) -> str:
    """The server's log, once every stream has ended; it exited 0, no stream was cut, no traceback."""
    log = server.log_tail(400)
    for s in streams:
        s.join(30)
    assert code == 0, f"exit code {code} after {what}:\n{log}"
    for s in streams:
        assert s.error is None, f"a stream in flight was cut instead of ended: {s.error!r}\n{log}"
    assert "Traceback" not in log, log
    return log


def _start(store: Path, *extra: str) -> ServerProcess:
    # Two sequences at a time: of six streams, four wait in the engine's queue when the
    # signal comes, so their prompts are computed (and owed to the store) after it.
    return ServerProcess([*BASE_ARGS, *file_store_args(store), "--max-num-seqs", "2", *extra],
                         env={"ENABLE_V1_KVCACHE_MANAGER": "1"}).start()


@pytest.mark.parametrize("sig", SIGNALS)
def test_signal_under_load_finishes_streams_writes_the_store_and_exits_0(tmp_path: Path, sig: int) -> None:
    store = tmp_path / "kv"
    server = _start(store, "--graceful-shutdown-timeout", "120")
    prompts = [prompt_ids(100 + i, 200) for i in range(6)]  # 12 full blocks each
    streams = [Stream(server, p, max_tokens=48) for p in prompts]
    try:
        for s in streams:
            s.start()
        wait_until(lambda: any(s.chunks for s in streams) and server.engine_stats()["num_requests_waiting"] >= 2,
                    120, "a first streamed token while at least two streams wait in the engine's queue")
        signalled = time.monotonic()
        server.proc.send_signal(sig)
        # Stop accepting: the listening socket closes while the streams still run.
        wait_until(lambda: refused(server.port), 10, "the listening socket to close")
        refused_at = time.monotonic()
        code = server.proc.wait(180)
    finally:
        server.stop()
    _clean_exit(server, streams, code, signal.Signals(sig).name)
    for s in streams:
        assert s.finish_reason == "length" and s.completion_tokens == 48, (s.finish_reason, s.completion_tokens)
    assert refused_at < max(s.ended_at for s in streams), "new connections must be refused while draining"
    assert refused_at - signalled < 5
    # The queued requests' prompts were computed after the signal; the engine's shutdown
    # let the storage tier finish their puts, so every full block is in the store.
    for p in prompts:
        for h in block_hashes(p):
            object_file(store, h)


@pytest.mark.parametrize("grace,second_signal", [(4.0, None), (120.0, signal.SIGINT)],
                         ids=["grace period spent", "second signal"])
def test_unfinished_streams_end_cleanly_and_the_server_exits_0(tmp_path: Path, grace: float,
                                                                second_signal: Optional[int]) -> None:
    """Past 3/4 of the grace period, or on a second signal, running streams are ended."""
    server = _start(tmp_path / "kv", "--graceful-shutdown-timeout", str(grace))
    # Far more tokens than the grace period leaves time for: each stream must be ended.
    streams = [Stream(server, prompt_ids(200 + i, 40), max_tokens=900) for i in range(2)]
    try:
        for s in streams:
            s.start()
        wait_until(lambda: all(s.chunks for s in streams), 120, "both streams to start")
        signalled = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        if second_signal is not None:
            time.sleep(0.5)
            server.proc.send_signal(second_signal)
        code = server.proc.wait(60)
        took = time.monotonic() - signalled
    finally:
        server.stop()
    log = _clean_exit(server, streams, code, "SIGTERM")
    # The streams ended with a last chunk and [DONE], not a cut connection.
    for s in streams:
        assert s.finish_reason == "abort", s.finish_reason
        assert s.completion_tokens is not None and s.completion_tokens < 900
    limit = 10.0 if second_signal is not None else grace + 10
    assert took < limit, f"shutdown took {took:.1f} s (grace period {grace} s, second signal {second_signal})"
    why = "SIGINT again" if second_signal is not None else "grace period spent"
    assert f"{why}: ending 2 in-flight request(s)" in log, log


def test_plan_splits_the_grace_period_between_requests_and_engine() -> None:
    now = [100.0]
    plan = ShutdownPlan(20.0, clock=lambda: now[0])
    assert plan.begin("SIGTERM") and not plan.begin("SIGINT") and plan.reason == "SIGTERM"
    assert plan.abort_at == 100.0 + REQUEST_SHARE * 20.0 and plan.deadline == 120.0
    now[0] = 105.0  # requests done early: the engine gets everything that is left
    assert plan.engine_budget() == 15.0
    now[0] = 125.0  # past the deadline: the engine still gets its minimum
    assert plan.engine_budget() == ENGINE_MIN_S
    with pytest.raises(ValueError, match="graceful-shutdown-timeout"):
        ShutdownPlan(-1.0)


def test_guard_undoes_paddles_reset_of_sigterm() -> None:
    """paddle.disable_signal_handler() resets SIGTERM in C; Python's getsignal does not see it."""
    paddle = pytest.importorskip("paddle", reason="needs paddle (installed by `bash build.sh`)")
    got: list[int] = []
    guard = SignalGuard(lambda sig, frame: got.append(sig))
    previous = guard.install()
    try:
        paddle.disable_signal_handler()
        guard.check()
        signal.raise_signal(signal.SIGTERM)  # the default action would end pytest here
        assert got == [signal.SIGTERM]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
    libc.signal.restype = ctypes.c_void_p
    return libc


def _guard_log(replace: Callable[[], None], caplog: pytest.LogCaptureFixture) -> str:
    """What the guard logs after ``replace`` swapped out the SIGTERM handler it installed."""
    got: list[int] = []
    guard = SignalGuard(lambda sig, frame: got.append(sig))
    previous = guard.install()
    try:
        with caplog.at_level(logging.DEBUG, logger="fastdeploy_kvcache.entrypoints.openai.shutdown"):
            replace()
            guard.check()
        signal.raise_signal(signal.SIGTERM)  # ours again: recorded, not the replacement's action
        assert got == [signal.SIGTERM]
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    lines = [r.getMessage() for r in caplog.records if "SIGTERM's handler was replaced" in r.getMessage()]
    assert len(lines) == 1, caplog.text
    assert "paddleformers" not in lines[0]  # nothing here imported it
    return lines[0]


def _a_python_handler(sig: int, frame: Any) -> None:
    """Stands for a library's own handler."""


@pytest.mark.parametrize("how, named", [
    ("c-default", "the default action (SIG_DFL), set from C"),
    ("c-ignore", "ignore (SIG_IGN), set from C"),
    ("c-function", "a C handler in libc.so"),  # a function of libc's stands for a library's handler
    ("python", f"Python's {__name__}._a_python_handler"),
])
def test_guard_names_what_replaced_the_handler(how: str, named: str, caplog: pytest.LogCaptureFixture) -> None:
    def replace() -> None:
        libc = _libc()
        if how == "c-default":
            libc.signal(signal.SIGTERM, 0)
        elif how == "c-ignore":
            libc.signal(signal.SIGTERM, 1)
        elif how == "c-function":
            # Never run: the guard puts its handler back before the signal is raised.
            libc.signal(signal.SIGTERM, ctypes.cast(libc.abort, ctypes.c_void_p).value)
        else:
            signal.signal(signal.SIGTERM, _a_python_handler)

    line = _guard_log(replace, caplog)
    assert named in line, line
    if how == "c-function":
        assert "(abort)" in line, line


@pytest.mark.parametrize("argv", [["--graceful-shutdown-timeout", "-1"], ["--graceful-shutdown-timeout", "inf"],
                                  ["--max-request-body-bytes", "-5"], ["--max-request-body-bytes", "2MiB"]])
def test_bad_limits_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from fastdeploy_kvcache.entrypoints.openai.api_server import make_arg_parser

    with pytest.raises(SystemExit) as info:
        make_arg_parser().parse_args(argv)
    assert info.value.code == 2 and argv[0] in capsys.readouterr().err
