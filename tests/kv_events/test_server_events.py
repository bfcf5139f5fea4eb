"""KV cache events from a real server: uvicorn on 127.0.0.1, tiny-llama-random on the CPU,
a write-through host tier and a file storage tier in a real directory, driven by the
``openai`` client.

The subscriber (tests/kv_events/subscriber.py) is written from docs/fleet.md with plain
msgpack.  After the workload it must hold, per medium, exactly the blocks the server's
cache holds (``GET /debug/kv_cache_blocks``), having filled its gaps from the replay
socket; and a prompt's blocks carry the hashes ``event_block_hashes`` computes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from skip_helpers import SERVER_MODULES, needs_modules, needs_mooncake

pytestmark = needs_modules(*SERVER_MODULES, "openai", "zmq", "msgpack", "msgspec")

from fastdeploy_kvcache.core.kv_events import event_block_hashes  # noqa: E402
from fastdeploy_kvcache.entrypoints.server_process import ServerProcess, free_port  # noqa: E402
from server_helpers import (  # noqa: E402
    BASE_ARGS,
    BLOCK_SIZE,
    MODEL,
    file_store_args,
    mooncake_store_args,
    prompt_ids,
    scrape,
    wait_storage_quiet,
)

from .subscriber import Subscriber, rebuild  # noqa: E402

TOPIC = "kv-events"
DOCS = [prompt_ids(100 + i, 150) for i in range(8)]  # 9 full blocks each: more than the 64-block device pool


def client(server: ServerProcess):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def ask(server: ServerProcess, prompt: list[int], max_tokens: int = 8) -> None:
    out = client(server).completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
    assert out.choices[0].finish_reason in ("length", "stop")


def events_config(pub: str, replay: str) -> str:
    return json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub,
                       "replay_endpoint": replay, "topic": TOPIC})


def fill_gaps(sub: Subscriber, next_seq: int) -> list[int]:
    """Replay every seq below ``next_seq`` the subscriber lacks; the seqs it had to ask for."""
    missing = [s for s in range(next_seq) if s not in sub.batches]
    if missing:
        got = {seq for seq, _ in sub.replay(missing[0])}
        assert set(missing) <= got, f"replay lacks {sorted(set(missing) - got)}"
    return missing


def settled_view(server: ServerProcess, sub: Subscriber) -> dict:
    """The server's tiers once no copy or put is pending, with every batch up to then received."""
    wait_storage_quiet(server)
    view = server.get_json("/debug/kv_cache_blocks")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not all(s in sub.batches for s in range(view["next_seq"])):
        sub.recv(0.1)
    return view


def test_events_rebuild_every_tier_with_replay_after_a_gap(tmp_path: Path) -> None:
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = ServerProcess([*BASE_ARGS, *file_store_args(tmp_path / "kv"), "--kv-events-config", events_config(pub, replay)],
                           env={"ENABLE_V1_KVCACHE_MANAGER": "1"}).start()
    sub = Subscriber(pub, TOPIC, replay)
    try:
        # Round 1: eight documents over a 64-block device pool (evictions), backed up to host
        # (write_through) and stored in the directory.
        for doc in DOCS:
            ask(server, doc)
        view = settled_view(server, sub)
        assert view["block_size"] == BLOCK_SIZE
        # Whatever the subscriber missed while it joined (PUB drops before the SUB is
        # connected) comes from the replay socket.
        replays = int(bool(fill_gaps(sub, view["next_seq"])))
        mediums = {m: set(h) for m, h in view["mediums"].items() if h}
        assert set(mediums) == {"GPU", "CPU", "DISK"}, mediums.keys()
        assert rebuild(sub.batches) == mediums
        removed = {m for b in sub.batches.values() for ev in b[1] if ev[0] == "BlockRemoved" for m in [ev[2]]}
        assert "GPU" in removed, "the workload was meant to evict device blocks"

        # The reference hashes: a document's full blocks, and the tokens the events carry.
        doc = DOCS[0]
        want = event_block_hashes(doc, BLOCK_SIZE)
        assert set(want) <= mediums["CPU"] and set(want) <= mediums["DISK"]
        tokens: dict[int, list[int]] = {}
        for b in sub.batches.values():
            for ev in b[1]:
                if ev[0] == "BlockStored" and ev[3]:
                    for i, h in enumerate(ev[1]):
                        tokens[h] = ev[3][i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]
        assert [tokens[h] for h in want] == [doc[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE] for i in range(len(want))]

        # A gap: the subscriber goes away, round 2 runs, a new one comes back and replays.
        sub.close()
        had = dict(sub.batches)
        for doc in DOCS[:3]:
            ask(server, doc + prompt_ids(7, 40))  # a returning conversation: host hits, new blocks
        sub = Subscriber(pub, TOPIC, replay)
        sub.batches.update(had)
        view = settled_view(server, sub)
        asked = fill_gaps(sub, view["next_seq"])
        assert asked, "round 2 published while no subscriber was connected: there must be a gap"
        replays += 1
        assert rebuild(sub.batches) == {m: set(h) for m, h in view["mediums"].items() if h}

        # /metrics reads the engine's stats snapshot, refreshed every step and every 0.5 s idle.
        deadline = time.monotonic() + 10
        while True:
            metrics = scrape(server)
            if metrics["fastdeploy_kvcache:kv_events_replay_requests_total"] >= replays or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert metrics["fastdeploy_kvcache:kv_events_replay_requests_total"] == replays
        assert metrics["fastdeploy_kvcache:kv_events_published_batches_total"] == view["next_seq"]
        assert metrics["fastdeploy_kvcache:kv_events_dropped_batches_total"] == 0
    finally:
        sub.close()
        server.stop()


@needs_mooncake()
def test_a_mooncake_store_is_announced_as_mooncake(tmp_path: Path) -> None:
    from fastdeploy_kvcache.storage.mooncake_local import LocalMooncake

    local = LocalMooncake(segment="256MB", log_dir=tmp_path / "logs").start()
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    server = sub = None
    try:
        server = ServerProcess([*BASE_ARGS, *mooncake_store_args(), "--kv-events-config", events_config(pub, replay)],
                               env={"ENABLE_V1_KVCACHE_MANAGER": "1", **local.env()}).start()
        sub = Subscriber(pub, TOPIC, replay)
        for doc in DOCS[:3]:
            ask(server, doc)
        view = settled_view(server, sub)
        fill_gaps(sub, view["next_seq"])
        mediums = {m: set(h) for m, h in view["mediums"].items() if h}
        assert set(mediums) == {"GPU", "CPU", "MOONCAKE"}, mediums.keys()
        assert set(event_block_hashes(DOCS[0], BLOCK_SIZE)) <= mediums["MOONCAKE"]
        assert rebuild(sub.batches) == mediums
    finally:
        if sub is not None:
            sub.close()
        if server is not None:
            server.stop()
        local.stop()


def test_malformed_flag_fails_start_up_in_one_line() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "fastdeploy_kvcache.entrypoints.openai.api_server", "--model", MODEL,
         "--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": 5557}'],
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert ("error: argument --kv-events-config: endpoint: must be a ZMQ address such as "
            "'tcp://*:5557', got 5557") in last, proc.stderr


def test_events_need_the_tiered_cache_manager() -> None:
    server = ServerProcess(["--model", MODEL, "--device", "cpu", "--kv-events-config",
                            events_config(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")],
                           env={"ENABLE_V1_KVCACHE_MANAGER": "0"}, startup_timeout_s=120)
    try:
        with pytest.raises(RuntimeError, match="KV cache events describe the tiered cache; set ENABLE_V1_KVCACHE_MANAGER=1"):
            server.start()
    finally:
        server.stop()


def test_a_stopped_server_leaves_no_ipc_socket_files(tmp_path: Path) -> None:
    """SIGTERM: the server stops cleanly, its event sockets' files are gone, and the stop
    ends with its own last log line (the process leaves right after it)."""
    pub, replay = tmp_path / "events", tmp_path / "replay"
    server = ServerProcess([*BASE_ARGS, "--kv-events-config", events_config(f"ipc://{pub}", f"ipc://{replay}")],
                           env={"ENABLE_V1_KVCACHE_MANAGER": "1"}, startup_timeout_s=180)
    try:
        server.start()
        assert pub.is_socket() and replay.is_socket()
        ask(server, prompt_ids(7, 40))
        code = server.stop()
    finally:
        server.stop()
    log = server.log_tail(40)
    assert code == 0, log
    assert "Traceback" not in log, log
    assert log.strip().splitlines()[-1].endswith("engine shut down"), log
    assert not pub.exists() and not replay.exists(), sorted(p.name for p in tmp_path.iterdir())
