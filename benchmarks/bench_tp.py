"""Per-rank swap bandwidth and load/compute overlap under tensor parallelism.

One process per rank (``fastdeploy_kvcache.worker.tp.TPCoordinator``), each with its own
CacheController on its own GPU holding its head shard.  For every figure, each rank runs it
alone (the other ranks idle), then all ranks run it at once, started together; each rank's
figure is reported as the ratio ``all ranks at once / that rank alone``.  A ratio near 1.0
says the ranks do not slow each other down (separate PCIe links, NUMA-local pinned memory);
well below 1.0 says they share a link or a socket.

Figures (per rank, through the worker's transfer manager, scattered block ids, every layer):

* ``d2h`` / ``h2d``: swap bandwidth in GB/s, timed by the copy streams' events (the
  controller's stats) and by the wall clock;
* ``overlap`` (CuPy only): a layer-by-layer load under a forward pass of spin kernels
  (``--spin-us`` per layer): the load's GB/s, and the step time over the compute-only step.

    python benchmarks/bench_tp.py --ranks 2 [--backend cupy] [--quick] [--out DIR]

Needs ``--ranks`` GPUs for the CuPy backend (``bash build.sh gpu`` first: nvidia-h200-x2 for
two ranks); ``--backend cpu`` runs the same code on host memory (a smoke run, not a figure of
any GPU).  Writes ``bench_tp.json`` and ``bench_tp.md`` under ``--out`` (default ``$OUT`` or
``build/bench``).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastdeploy_kvcache.config import CacheConfig  # noqa: E402
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, TransferKind  # noqa: E402

GB = 1e9


class BenchHook:
    """Rank-side half of the benchmark (built in each rank process by the coordinator)."""

    def __init__(self, ctrl: Any, rank: int, tp_size: int) -> None:
        self.ctrl = ctrl
        self.rank = rank
        self.rng = random.Random(1000 + rank)  # fixed seeds, one stream of ids per rank

    def _ids(self, blocks: int) -> tuple[list[int], list[int]]:
        dev = self.rng.sample(range(self.ctrl.num_gpu_blocks), blocks)
        host = self.rng.sample(range(self.ctrl.num_host_blocks), blocks)
        return dev, host

    @staticmethod
    def _sleep_until(start_at: Optional[float]) -> None:
        if start_at is not None:
            time.sleep(max(0.0, start_at - time.time()))

    def _stats(self, direction: str) -> tuple[float, float]:
        stats = self.ctrl.get_stats()[direction]
        return stats["bytes"], stats["seconds"]

    def swap(self, direction: str, blocks: int, iters: int, warmup: int, start_at: Optional[float]) -> dict:
        """``iters`` tasks of ``blocks`` scattered blocks, one at a time, in ``direction``."""
        def one() -> None:
            dev, host = self._ids(blocks)
            if direction == "d2h":
                meta = CacheSwapMetadata(dev, host, CacheLevel.DEVICE, CacheLevel.HOST, kind=TransferKind.BACKUP)
                self.ctrl.submit_swap_tasks(meta, None)
            else:
                counter = self.ctrl.submit_swap_tasks(None, CacheSwapMetadata(host, dev))
                counter.wait_all()
            done = self.ctrl.collect_finished(wait=True)
            if not all(m.success for m in done):
                raise RuntimeError(f"rank {self.rank}: copy failed: {[m.error_message for m in done]}")

        for _ in range(warmup):
            one()
        self._sleep_until(start_at)
        bytes0, secs0 = self._stats(direction)
        t0 = time.perf_counter()
        for _ in range(iters):
            one()
        wall = time.perf_counter() - t0
        nbytes, secs = (a - b for a, b in zip(self._stats(direction), (bytes0, secs0)))
        return {"rank": self.rank, "device": self.ctrl.device_id, "GBps_events": nbytes / secs / GB if secs else 0.0,
                "GBps_wall": nbytes / wall / GB, "bytes": nbytes}

    def overlap(self, blocks: int, iters: int, warmup: int, spin_us: float, start_at: Optional[float]) -> dict:
        """Step time of a spin-kernel forward with and without a layer-wise load (CuPy)."""
        import cupy

        dev = cupy.cuda.Device(self.ctrl.device_id)
        with dev:
            spin = cupy.RawKernel(
                r'''extern "C" __global__ void spin(long long cycles) {
                    long long start = clock64(); while (clock64() - start < cycles) {}
                }''', "spin")
            cycles = cupy.int64(int(spin_us * 1e-6 * dev.attributes["ClockRate"] * 1e3))
            stream = cupy.cuda.Stream(non_blocking=True)

            def step(load: bool) -> float:
                with stream:
                    counter = None
                    if load:
                        d, h = self._ids(blocks)
                        counter = self.ctrl.submit_swap_tasks(None, CacheSwapMetadata(h, d))
                    t0 = time.perf_counter()
                    for layer in range(self.ctrl.num_layers):
                        if counter is not None:
                            counter.wait_for_layer(layer)
                        spin((1,), (1,), (cycles,))
                    stream.synchronize()
                    elapsed = time.perf_counter() - t0
                done = self.ctrl.collect_finished(wait=True)
                if not all(m.success for m in done):
                    raise RuntimeError(f"rank {self.rank}: load failed")
                return elapsed

            for _ in range(warmup):
                step(False)
                step(True)
            self._sleep_until(start_at)
            bytes0, secs0 = self._stats("h2d")
            plain = [step(False) for _ in range(iters)]
            loaded = [step(True) for _ in range(iters)]
            nbytes, secs = (a - b for a, b in zip(self._stats("h2d"), (bytes0, secs0)))
        return {"rank": self.rank, "device": self.ctrl.device_id, "load_GBps": nbytes / secs / GB if secs else 0.0,
                "step_ms": statistics.median(loaded) * 1e3, "compute_ms": statistics.median(plain) * 1e3,
                "step_over_compute": statistics.median(loaded) / statistics.median(plain)}


def _ratios(alone: list[dict], together: list[dict], key: str) -> list[float]:
    return [t[key] / a[key] if a[key] else float("nan") for a, t in zip(alone, together)]


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2, help="tensor-parallel ranks, one process and one GPU each")
    p.add_argument("--devices", default="", help="comma list of device ids (default 0..ranks-1)")
    p.add_argument("--backend", default="auto", choices=["auto", "cupy", "cpu"])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--heads", type=int, default=8, help="KV heads of the whole model (split over the ranks)")
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--blocks", type=int, default=64, help="blocks per copy task")
    p.add_argument("--pool-blocks", type=int, default=512, help="device and host blocks per rank")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--spin-us", type=float, default=200.0, help="compute per layer in the overlap figure")
    p.add_argument("--quick", action="store_true", help="smaller shape and fewer iterations (smoke run)")
    p.add_argument("--out", default=os.environ.get("OUT") or "build/bench")
    args = p.parse_args(argv)
    if args.backend == "cpu" and not args.quick:
        print("bench_tp: --backend cpu runs the --quick shape (host memory stands in for each GPU)")
        args.quick = True
    if args.quick:
        args.layers, args.iters, args.warmup, args.pool_blocks, args.blocks = 4, 5, 1, 64, 16
        args.head_dim, args.block_size = 64, 16

    from fastdeploy_kvcache.worker.tp import TPCoordinator

    # "auto" is the GPU run (CuPy); the cpu backend only when asked for (a smoke run).
    backend = "cupy" if args.backend == "auto" else args.backend
    devices = [int(d) for d in args.devices.split(",")] if args.devices else list(range(args.ranks))
    if backend == "cupy":
        try:
            import cupy

            have = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # noqa: BLE001 - no CuPy, no driver
            print(f"bench_tp: needs CuPy and {len(devices)} GPUs ({type(exc).__name__}: {exc}); "
                  f"--backend cpu runs a smoke run on host memory.")
            return 0
        if have < len(devices) or max(devices) >= have:
            print(f"bench_tp: needs {len(devices)} GPUs (devices {devices}); {have} visible. Run it on a machine "
                  f"with that many (nvidia-h200-x2 for --ranks 2), or --backend cpu for a smoke run.")
            return 0
    cfg = CacheConfig(
        num_layers=args.layers, num_kv_heads=args.heads, head_dim=args.head_dim, block_size=args.block_size,
        dtype="bfloat16", num_gpu_blocks=args.pool_blocks, num_host_blocks=args.pool_blocks,
        tensor_parallel_size=args.ranks,
    )
    rows: list[dict[str, Any]] = []
    t_start = time.time()
    with TPCoordinator(cfg, devices=devices, backend=backend, hook=BenchHook, async_launch=backend == "cupy",
                       timeout_s=600.0) as coord:
        info = coord.rank_info
        ranks = list(range(args.ranks))
        cases: list[tuple[str, str, tuple, list[str]]] = [
            ("d2h", "swap", ("d2h", args.blocks, args.iters, args.warmup), ["GBps_events", "GBps_wall"]),
            ("h2d", "swap", ("h2d", args.blocks, args.iters, args.warmup), ["GBps_events", "GBps_wall"]),
        ]
        if backend == "cupy":
            cases.append(("overlap", "overlap", (args.blocks, args.iters, args.warmup, args.spin_us),
                          ["load_GBps", "step_over_compute"]))
        for name, method, call_args, keys in cases:
            alone = [coord.call(method, *call_args, None, ranks=[r])[0] for r in ranks]
            together = coord.call(method, *call_args, time.time() + 1.0)
            for key in keys:
                for r, (a, t, ratio) in enumerate(zip(alone, together, _ratios(alone, together, key))):
                    rows.append({"figure": name, "metric": key, "rank": r, "device": devices[r],
                                 "alone": a[key], "all_ranks": t[key], "ratio": ratio})
    report = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "backend": backend, "ranks": args.ranks, "devices": devices, "rank_info": info,
        "shape": {"layers": args.layers, "heads_total": args.heads, "heads_per_rank": args.heads // args.ranks,
                  "head_dim": args.head_dim, "block_size": args.block_size, "dtype": "bfloat16",
                  "block_bytes_per_rank_all_layers": cfg.bytes_per_block // args.ranks},
        "blocks_per_task": args.blocks, "iters": args.iters, "spin_us": args.spin_us, "rows": rows,
        "seconds": time.time() - t_start,
    }
    lines = [f"# bench_tp: {args.ranks} ranks on {backend} (devices {devices})", "",
             "Each rank's figure with every rank running it at once, over the same figure with that rank alone.", "",
             "| figure | metric | rank | device | alone | all ranks | ratio |", "|---|---|---|---|---|---|---|"]
    for row in rows:
        lines.append(f"| {row['figure']} | {row['metric']} | {row['rank']} | {row['device']} | {row['alone']:.3f} | "
                     f"{row['all_ranks']:.3f} | {row['ratio']:.3f} |")
    md = "\n".join(lines)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_tp.json").write_text(json.dumps(report, indent=1))
    (out / "bench_tp.md").write_text(md + "\n")
    print(f"{md}\n\nwrote {out / 'bench_tp.json'} and {out / 'bench_tp.md'} in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
