"""The router's start-up and stop, as an operator reads them in its log.

A fleet is usually started all at once, so the router comes up while its workers are still
loading their models.  That is no fault: each such worker is "not up yet", said once, then
"up" when it first answers; no replay time-outs and no "down" warnings every poll.  The
router says when it serves (as a server says "serving on ..."), and prints no dependency
notice that does not apply (transformers' "PyTorch was not found").  A stop leaves no
socket file behind.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

from fastdeploy_kvcache.entrypoints.server_process import RouterProcess, ServerProcess, free_port
from shutdown_helpers import wait_until

from .conftest import BLOCK_SIZE, MODEL, WORKER_ARGS


def test_a_router_started_before_its_worker_waits_quietly_and_says_when_it_serves(tmp_path: Path) -> None:
    pub, replay = tmp_path / "w0-pub", tmp_path / "w0-replay"
    worker = ServerProcess([*WORKER_ARGS, "--kv-events-config", json.dumps(
        {"enable_kv_cache_events": True, "endpoint": f"ipc://{pub}", "replay_endpoint": f"ipc://{replay}"})],
        env={"ENABLE_V1_KVCACHE_MANAGER": "1"}, port=free_port())
    router = RouterProcess(["--model", MODEL, "--block-size", str(BLOCK_SIZE), "--health-interval", "0.3",
                            "--worker-urls", worker.base_url, "--worker-events", f"ipc://{pub},ipc://{replay}"])
    try:
        router.start()  # the worker is not even started: the router must come up anyway
        wait_until(lambda: "not up yet" in router.log_tail(), 30, "the router to notice the worker is not up")
        worker.start()
        wait_until(lambda: router.get_json("/router/state")["workers"][0]["healthy"], 60,
                   "the router to see the worker up")
        router.proc.send_signal(signal.SIGTERM)
        code = router.proc.wait(30)
        worker_code = worker.stop()
    finally:
        router.stop()
        worker.stop()
    log = router.log_tail(200)
    assert code == 0 and worker_code == 0, log
    assert f"router serving on http://127.0.0.1:{router.port} (1 worker)" in log, log
    assert log.count("is not up yet") == 1, log
    assert f"worker {worker.base_url} is up" in log, log
    for noise in ("timed out", "is down", "PyTorch was not found", "Traceback"):
        assert noise not in log, log
    assert not pub.exists() and not replay.exists(), sorted(p.name for p in tmp_path.iterdir())
