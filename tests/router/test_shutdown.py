"""The router stops like the servers do: a real router and a real server, a real SIGTERM.

Stop accepting (the listening socket closes at once), let the streams in flight through it
finish, end those still running when 3/4 of ``--graceful-shutdown-timeout`` is spent (an
error event and ``data: [DONE]``, not a cut connection), and exit 0.
"""

from __future__ import annotations

import signal
import time
from typing import Iterator

import openai
import pytest

from fastdeploy_kvcache.entrypoints.server_process import RouterProcess, ServerProcess
from server_helpers import BASE_ARGS, MODEL, prompt_ids
from shutdown_helpers import Stream, refused, wait_until


@pytest.fixture(scope="module")
def worker() -> Iterator[ServerProcess]:
    with ServerProcess(BASE_ARGS, env={"ENABLE_V1_KVCACHE_MANAGER": "1"}) as server:
        yield server


def _router(worker: ServerProcess, grace_s: float) -> RouterProcess:
    return RouterProcess(["--worker-urls", worker.base_url, "--model", MODEL, "--block-size", "16",
                          "--graceful-shutdown-timeout", str(grace_s), "--log-level", "info"]).start()


def test_sigterm_drains_the_streams_in_flight_refuses_new_connections_and_exits_0(worker: ServerProcess) -> None:
    router = _router(worker, 60.0)
    streams = [Stream(router, prompt_ids(300 + i, 40), max_tokens=120) for i in range(2)]
    try:
        for s in streams:
            s.start()
        wait_until(lambda: all(s.chunks for s in streams), 120, "both streams to start through the router")
        router.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        wait_until(lambda: refused(router.port), 10, "the router's listening socket to close")
        refused_at = time.monotonic()
        code = router.proc.wait(60)  # type: ignore[union-attr]
    finally:
        router.stop()
    log = router.log_tail(200)
    for s in streams:
        s.join(30)
        assert s.error is None, f"a stream through the router was cut: {s.error!r}\n{log}"
        assert s.finish_reason == "length" and s.completion_tokens == 120, (s.finish_reason, s.completion_tokens)
    assert refused_at < max(s.ended_at for s in streams), "new connections must be refused while draining"  # type: ignore[type-var]
    assert code == 0, f"router exit code {code} after SIGTERM:\n{log}"
    assert "SIGTERM: refusing new connections" in log and "Traceback" not in log, log
    # The worker is untouched: it still answers, and nothing is left running on it.
    wait_until(lambda: worker.engine_stats()["num_requests_running"] == 0, 30, "the worker to go idle")


def test_streams_still_running_when_the_grace_period_is_spent_end_with_an_error_event(worker: ServerProcess) -> None:
    grace = 2.0
    router = _router(worker, grace)
    stream = Stream(router, prompt_ids(400, 40), max_tokens=900)  # far longer than the grace period
    try:
        stream.start()
        wait_until(lambda: stream.chunks > 0, 120, "the stream to start through the router")
        signalled = time.monotonic()
        router.proc.send_signal(signal.SIGTERM)  # type: ignore[union-attr]
        code = router.proc.wait(60)  # type: ignore[union-attr]
        took = time.monotonic() - signalled
    finally:
        router.stop()
    stream.join(30)
    log = router.log_tail(200)
    assert code == 0, f"router exit code {code} after SIGTERM:\n{log}"
    assert took < grace + 10, f"shutdown took {took:.1f} s with a grace period of {grace} s"
    # The client got the router's error event (the official client raises it), not a cut connection.
    assert isinstance(stream.error, openai.APIError) and "shutting down" in str(stream.error), repr(stream.error)
    assert stream.completion_tokens is None and stream.chunks < 900
    assert "grace period spent: ending 1 in-flight request(s)" in log, log
    # The router closed its connection to the worker, so the worker aborted the request.
    wait_until(lambda: worker.engine_stats()["num_requests_running"] == 0, 30, "the worker to abort the request")
