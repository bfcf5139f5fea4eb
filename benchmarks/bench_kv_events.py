"""What KV cache events cost the scheduler (CPU only; no Paddle, no model).

The workload is bench_scheduler's (multi-turn conversations over shared system prompts,
block size 64, device and host pools too small for them: evictions, backups and host hits
every step), run in three modes, interleaved, each ``--repeats`` times:

* ``off``        no recorder (the tree's hooks test one attribute): the baseline;
* ``recorder``   the recorder on the tree, drained once per step into a ``KVEventBatch``
                 and encoded with msgspec in the scheduler's thread (an upper bound of the
                 engine thread's share: the server encodes on the publisher thread);
* ``publisher``  the recorder plus the real ZMQ publisher on 127.0.0.1 (its thread encodes
                 and sends, competing for the GIL as in the server), one subscriber reading
                 in another process.

Reported from the same run: the median CPU time of the process per mode (all its threads;
less sensitive than wall time to other processes on a shared machine) and its ratio to
``off``, the wall time, the
mean and p99 of ``request_finish`` and ``allocate_device_blocks`` (where blocks enter and
leave the tiers), events and batches per run, payload bytes, and dropped batches; then the
median ``request_finish`` of 250 new blocks with and without the recorder (per block cost).

Usage: python benchmarks/bench_kv_events.py [--requests 2000] [--repeats 3] [--quick]
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import subprocess
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

import bench_scheduler as bs  # noqa: E402
from tqdm import tqdm  # noqa: E402

from fastdeploy_kvcache.core.cache_manager import CacheManager  # noqa: E402
from fastdeploy_kvcache.core.kv_event_recorder import KVEventRecorder  # noqa: E402
from fastdeploy_kvcache.core.kv_events import encode_batch  # noqa: E402

MODES = ("off", "recorder", "publisher")


class Counters:
    def __init__(self) -> None:
        self.batches = 0
        self.events = 0
        self.bytes = 0


def manager_class(mode: str, counters: Counters, publisher: Optional[Any]) -> type:
    """A CacheManager that records events and flushes them once per step (the step's
    ``issue_pending_backup_to_batch_request`` call, which the workload makes once a step)."""
    if mode == "off":
        return CacheManager

    class EventsCacheManager(CacheManager):
        def __init__(self, config: Any) -> None:
            super().__init__(config)
            self.tree.events = KVEventRecorder(self.block_size)

        def issue_pending_backup_to_batch_request(self):  # type: ignore[override]
            batch = self.tree.events.drain()
            if batch is not None:
                counters.batches += 1
                counters.events += len(batch.events)
                if publisher is None:
                    counters.bytes += len(encode_batch(batch))
                elif not publisher.publish(batch):
                    self.tree.events.request_resync()
            return super().issue_pending_backup_to_batch_request()

    return EventsCacheManager


_READER = """
import sys, zmq
ctx = zmq.Context()
sub = ctx.socket(zmq.SUB)
sub.setsockopt_string(zmq.SUBSCRIBE, "kv")
sub.connect(sys.argv[1])
print("ready", flush=True)
while True:
    sub.recv_multipart()
"""


def start_publisher() -> tuple[Any, subprocess.Popen]:
    """The publisher on 127.0.0.1 and a subscriber in its own process (its CPU is not ours)."""
    from fastdeploy_kvcache.engine.kv_events_config import KVEventsConfig
    from fastdeploy_kvcache.engine.kv_events_publisher import ZmqEventPublisher
    from fastdeploy_kvcache.entrypoints.server_process import free_port

    cfg = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"tcp://127.0.0.1:{free_port()}", topic="kv")
    pub = ZmqEventPublisher(cfg)
    reader = subprocess.Popen([sys.executable, "-c", _READER, cfg.endpoint], stdout=subprocess.PIPE, text=True)
    assert reader.stdout is not None and reader.stdout.readline().strip() == "ready"
    return pub, reader


def run(args: argparse.Namespace, mode: str, log: logging.Logger) -> dict[str, float]:
    counters = Counters()
    publisher = reader = None
    if mode == "publisher":
        publisher, reader = start_publisher()
    saved = bs.CacheManager
    bs.CacheManager = manager_class(mode, counters, publisher)  # type: ignore[misc]
    try:
        cpu0 = time.process_time()  # every thread of the process: the publisher's too
        t, _stats, elapsed = bs.run_workload(args, args.policy, log)
        cpu = time.process_time() - cpu0
    finally:
        bs.CacheManager = saved  # type: ignore[misc]
        if publisher is not None:
            dropped = publisher.stats()["dropped_batches"]
            publisher.shutdown()
            reader.kill()
            reader.wait()
    finish_mean, finish_p99 = bs.mean_p99_us(t.finish)
    alloc_mean, alloc_p99 = bs.mean_p99_us(t.alloc)
    return {
        "wall_s": elapsed, "cpu_s": cpu, "finish_mean": finish_mean, "finish_p99": finish_p99, "alloc_mean": alloc_mean,
        "alloc_p99": alloc_p99, "batches": counters.batches, "events": counters.events, "bytes": counters.bytes,
        "dropped": dropped if publisher is not None else 0,
    }


def finish_cost(events: bool, requests: int = 40, blocks: int = 250) -> float:
    """Median microseconds of ``request_finish`` inserting ``blocks`` new blocks of 64 tokens."""
    import random

    from fastdeploy_kvcache.config import CacheConfig
    from fastdeploy_kvcache.core.request import Request

    mgr = CacheManager(CacheConfig(block_size=64, num_gpu_blocks=requests * blocks, num_host_blocks=0,
                                   write_policy="write_through"))
    if events:
        mgr.tree.events = KVEventRecorder(64)
    rng = random.Random(0)
    times = []
    for i in range(requests):
        req = Request(f"r{i}", [rng.randrange(32000) for _ in range(blocks * 64)])
        mgr.match_prefix(req)
        mgr.allocate_device_blocks(req, blocks)
        req.num_computed_tokens = blocks * 64
        start = time.perf_counter_ns()
        mgr.request_finish(req)
        times.append(time.perf_counter_ns() - start)
        if events:
            mgr.tree.events.drain()
    return statistics.median(times) / 1000.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--conversations", type=int, default=128)
    parser.add_argument("--system-prompts", type=int, default=8)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--device-blocks", type=int, default=20_000)
    parser.add_argument("--host-blocks", type=int, default=60_000)
    parser.add_argument("--policy", default="write_through")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of the three modes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true", help="smoke run: 300 requests, smaller pools, 1 repeat")
    args = parser.parse_args()
    if args.quick:
        args.requests, args.conversations, args.system_prompts = 300, 32, 4
        args.device_blocks, args.host_blocks, args.repeats = 6_000, 18_000, 1
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(message)s")
    log = logging.getLogger("bench_kv_events")
    results: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
    with tqdm(total=args.repeats * len(MODES), desc="bench_kv_events", unit="run") as bar:
        for _ in range(args.repeats):
            for mode in MODES:  # interleaved: a shared machine's drift hits every mode alike
                bar.set_postfix_str(mode)
                results[mode].append(run(args, mode, log))
                bar.update()
    base = statistics.median(r["cpu_s"] for r in results["off"])
    print(f"\nKV cache events on the scheduler: {args.requests} requests, policy {args.policy}, block 64, "
          f"{args.device_blocks} device / {args.host_blocks} host blocks, {args.repeats} repeats "
          f"(median CPU seconds of the process, all threads; per-call columns from the median run)\n")
    print("| mode | CPU s | / off | wall s | finish mean / p99 us | alloc mean / p99 us | batches | events | "
          "payload KiB | dropped |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for mode in MODES:
        runs = sorted(results[mode], key=lambda r: r["cpu_s"])
        r = runs[len(runs) // 2]
        print(f"| {mode} | {r['cpu_s']:.2f} | {r['cpu_s'] / base:.3f} | {r['wall_s']:.2f} | {r['finish_mean']:.1f} / "
              f"{r['finish_p99']:.1f} | {r['alloc_mean']:.1f} / {r['alloc_p99']:.1f} | {int(r['batches'])} | "
              f"{int(r['events'])} | {r['bytes'] / 1024:.0f} | {int(r['dropped'])} |")
    print(f"\nbaseline (off) median CPU: {base:.2f} s; CPU s of each run: "
          + ", ".join(f"{m} {[round(r['cpu_s'], 2) for r in results[m]]}" for m in MODES))
    off, on = [], []
    for _ in range(3):
        off.append(finish_cost(False))
        on.append(finish_cost(True))
    print(f"request_finish of 250 new blocks (median of 40, 3 interleaved runs): off {statistics.median(off):.0f} us, "
          f"recorder {statistics.median(on):.0f} us, ratio {statistics.median(on) / statistics.median(off):.2f}, "
          f"{(statistics.median(on) - statistics.median(off)) / 250:.2f} us per block")


if __name__ == "__main__":
    main()
