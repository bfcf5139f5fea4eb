"""Bandwidth of the KV swap ops on a GPU (CuPy memory + the CUDA C ABI).

64 layers, random block ids, block sizes 4 KiB .. 2 MiB; per-layer calls (one per layer),
layer-group calls (one ``LayerStackCall.run`` per stack with an event recorded after each
layer: how the worker's layer-by-layer load issues it), all-layers calls (one per step), and
the worker's own pairing (``--apis worker``: loads as layer stacks, evictions and backups as
one all-layer call on the worker's device-to-host path, ``--d2h-copy-path``); host to
device, device to host, and both at once on two streams; scattered and fully
consecutive ids; every copy path (auto, kernel at several grid sizes, DMA batch).

Every figure is reported as a ratio to limits measured in the same run: one contiguous
1 GiB pinned ``cudaMemcpyAsync`` per direction, and both directions at once on two
streams.  The all-layer and layer-group calls take the tensors as a ``TensorTable`` (the
worker's way).  A case is timed from the call by default (its host preamble included);
``--host-ahead`` times the copies alone.

    python benchmarks/bench_swap.py [--quick] [--out DIR]

Writes ``bench_swap.json`` and ``bench_swap.md`` under ``--out`` (default ``$OUT`` or
``build/bench``).  Exits 0 with a message when no GPU / CuPy / CUDA library is present.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import json
import math
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastdeploy_kvcache import ops  # noqa: E402
from fastdeploy_kvcache.worker.transfer_manager import TransferManager  # noqa: E402

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
_PATH_BITS = ((ops.PATH_MEMCPY, "memcpy"), (ops.PATH_KERNEL, "kernel"), (ops.PATH_DMA, "dma"),
              (ops.PATH_CPU, "cpu"), (ops.PATH_STAGED, "staged"))


def path_name(bits: int) -> str:
    """``last_path()`` bits as words: "kernel+staged", "dma rows", "-" for none."""
    names = [name + (" rows" if bit == ops.PATH_DMA and bits & ops.PATH_DMA_ROWS else "")
             for bit, name in _PATH_BITS if bits & bit]
    return "+".join(names) or "-"
COPY_PATH = {"auto": 0, "kernel": 1, "dma": 2, "staged": 3}
# Id patterns (device ids, host ids): "scattered" both random; "host_runs" random device ids
# and one run of consecutive host ids (what the block allocator hands out for one request);
# "host_runs8" random device ids and host runs of 8 blocks at random places; "consecutive"
# both sides consecutive (one merged run).
ID_PATTERNS = ("scattered", "host_runs", "host_runs8", "consecutive")
# Call shapes (Row.api).  "worker": loads as layer stacks, device-to-host as one all-layer
# call on --d2h-copy-path, the pairing the worker makes (not in the default matrix); its
# device-to-host call keeps that path whatever --paths asks (the row's path is the load's).
APIS = ("all_layers", "per_layer", "layer_groups", "worker")
KERNEL_CHUNK, KERNEL_WARPS_PER_CTA, TMA_CHUNK = 8192, 16, 16384  # mirror swap_cuda.cu (CTA counts)


@dataclass
class Row:
    block_bytes: int
    ids: str            # one of ID_PATTERNS
    api: str            # all_layers | per_layer | layer_groups | worker
    path: str           # requested: auto | kernel | dma
    grid: int           # kernel grid cap for this row
    kernel: int         # kernel variant (copy_kernel option)
    slice: int          # bytes per cudaMemcpyBatchAsync call (dma_slice_bytes option)
    tables: int         # kernel_tables option (0 device copy, 1 read from pinned memory)
    direction: str      # h2d | d2h | both
    chunk: int = 0      # staging_chunk_bytes option (staged path)
    used: str = ""      # path(s) the op reported
    ctas: int = 0       # CTAs (= SMs at most) the kernel launched; 0 for DMA / memcpy
    gbps: float = 0.0
    ratio: float = 0.0  # to the one-direction (or bidirectional) limit of this run
    ms: float = 0.0
    nbytes: int = 0
    host_us: float = 0.0  # host time of one measured unit's submission (median), no sync


@dataclass
class Report:
    device: str
    sms: int
    date: str
    layers: int
    call_bytes: int
    host_ahead: bool = False  # the matrix timed with the host ahead of the GPU (--host-ahead)
    reference: dict = field(default_factory=dict)
    rows: list = field(default_factory=list)   # best pass of each case, ratio to the best limit
    raw: list = field(default_factory=list)    # every pass


def parse_size(text: str) -> int:
    text = text.strip().upper()
    for suffix, mult in (("KIB", KiB), ("K", KiB), ("MIB", MiB), ("M", MiB), ("GIB", GiB), ("G", GiB)):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * mult)
    return int(text)


# The GPU spin ahead of each timed case with --host-ahead: longer than any call's host preamble.
HOST_AHEAD_MS = 3.0


class Timer:
    """Times work enqueued on several streams between two events on the first one.

    ``lead_ms`` > 0 holds the first stream in a GPU spin that long before the start event,
    so the host enqueues the work while the GPU waits: the time is then the copies' own,
    without the call's host preamble before its first copy (``--host-ahead``).
    """

    _SPIN = r"""
    extern "C" __global__ void fdkv_bench_spin(unsigned long long ns) {
      unsigned long long t0, t;
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
      t = t0;
      while (t - t0 < ns) {
        __nanosleep(1000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      }
    }"""

    def __init__(self, cp, streams, lead_ms: float = 0.0):
        self.cp = cp
        self.streams = streams
        self.lead_ns = int(lead_ms * 1e6)
        self._spin = cp.RawKernel(self._SPIN, "fdkv_bench_spin") if self.lead_ns > 0 else None

    def run(self, issue: Callable[[], None], warmup: int, iters: int) -> float:
        cp = self.cp
        main = self.streams[0]
        times = []
        for i in range(warmup + iters):
            if self._spin is not None:
                with main:
                    self._spin((1,), (1,), (cp.uint64(self.lead_ns),))
            start = cp.cuda.Event()
            start.record(main)
            for s in self.streams[1:]:
                s.wait_event(start)
            issue()
            for s in self.streams[1:]:
                main.wait_event(s.record())
            end = cp.cuda.Event()
            end.record(main)
            end.synchronize()
            if i >= warmup:
                times.append(cp.cuda.get_elapsed_time(start, end))
        return statistics.median(times)


def measure_reference(cp, capi, nbytes: int, warmup: int, iters: int) -> dict:
    """Contiguous pinned cudaMemcpyAsync: each direction alone, then both on two streams."""
    rt = cp.cuda.runtime
    dev_a = cp.empty(nbytes, dtype=cp.uint8)
    dev_b = cp.empty(nbytes, dtype=cp.uint8)
    dev_a[:] = 1
    dev_b[:] = 2
    host_a = capi.host_alloc(nbytes)
    host_b = capi.host_alloc(nbytes)
    s1, s2 = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    try:
        t1 = Timer(cp, [s1])
        h2d = t1.run(lambda: rt.memcpyAsync(dev_a.data.ptr, host_a, nbytes, rt.memcpyHostToDevice, s1.ptr), warmup, iters)
        d2h = t1.run(lambda: rt.memcpyAsync(host_a, dev_a.data.ptr, nbytes, rt.memcpyDeviceToHost, s1.ptr), warmup, iters)
        t2 = Timer(cp, [s1, s2])

        def both() -> None:
            rt.memcpyAsync(dev_a.data.ptr, host_a, nbytes, rt.memcpyHostToDevice, s1.ptr)
            rt.memcpyAsync(host_b, dev_b.data.ptr, nbytes, rt.memcpyDeviceToHost, s2.ptr)

        bidir = t2.run(both, warmup, iters)
    finally:
        cp.cuda.runtime.deviceSynchronize()
        capi.host_free(host_a)
        capi.host_free(host_b)
    del dev_a, dev_b
    return {
        "bytes": nbytes,
        "h2d_gbps": nbytes / (h2d * 1e-3) / 1e9,
        "d2h_gbps": nbytes / (d2h * 1e-3) / 1e9,
        "both_gbps": 2 * nbytes / (bidir * 1e-3) / 1e9,
    }


class SizeBench:
    """Buffers for one block size: L device layers and L pinned host layers, each a pool of
    blocks; two disjoint id sets so the two directions of a 'both' case never overlap."""

    def __init__(self, cp, capi, layers: int, block_bytes: int, call_bytes: int, seed: int,
                 d2h_copy_path: str = TransferManager.DEFAULT_D2H_COPY_PATH):
        self.cp, self.capi, self.layers, self.bb = cp, capi, layers, block_bytes
        self.d2h_copy_path = d2h_copy_path
        self.n = max(1, call_bytes // (layers * block_bytes))
        self.pool = max(4 * self.n, self.n * 2 + 8)
        self.dev = cp.random.randint(0, 256, (layers, self.pool, block_bytes), dtype=cp.uint8)
        self.host_ptr = capi.host_alloc(layers * self.pool * block_bytes)
        self.host = np.ctypeslib.as_array(
            (ctypes.c_uint8 * (layers * self.pool * block_bytes)).from_address(self.host_ptr)
        ).reshape(layers, self.pool, block_bytes)
        # Fill host memory from random device data (fast) rather than numpy's generator.
        cp.cuda.runtime.memcpy(self.host_ptr, self.dev.data.ptr, self.host.nbytes, cp.cuda.runtime.memcpyDeviceToHost)
        self.dev_ptrs = [int(self.dev[l].data.ptr) for l in range(layers)]
        # One event per layer for the layer_groups api (the load's per-layer fences).
        self.events = [cp.cuda.Event(disable_timing=True) for _ in range(layers)]
        self.host_ptrs = [self.host_ptr + l * self.pool * block_bytes for l in range(layers)]
        # The addresses, block counts and sizes converted once, as the worker passes them
        # (its layout is fixed): the one-call shapes then time the library, not a per-call
        # conversion of 64 pointers.
        self.table = ops.TensorTable(self.dev_ptrs, self.pool, block_bytes, self.host_ptrs)
        rng = np.random.default_rng(seed)
        dp, hp = rng.permutation(self.pool), rng.permutation(self.pool)
        n = self.n
        run = min(8, n)
        bases = rng.permutation(self.pool // run) * run  # random starts of aligned runs of `run` blocks
        runs = np.concatenate([np.arange(b, b + run) for b in bases])[: 2 * n]
        self.ids = {
            "scattered": ((dp[:n], hp[:n]), (dp[n:2 * n], hp[n:2 * n])),
            "host_runs": ((dp[:n], np.arange(n)), (dp[n:2 * n], np.arange(n) + 2 * n)),
            "host_runs8": ((dp[:n], runs[:n]), (dp[n:2 * n], runs[n:2 * n])),
            "consecutive": ((np.arange(n), np.arange(n) + n), (np.arange(n) + 2 * n, np.arange(n) + 3 * n)),
        }
        if 4 * n > self.pool:  # keep the consecutive sets inside the pool
            self.ids["consecutive"] = ((np.arange(n), np.arange(n)), (np.arange(n) + n, np.arange(n) + n))

    def close(self) -> None:
        self.cp.cuda.runtime.deviceSynchronize()
        self.capi.host_free(self.host_ptr)
        del self.dev

    def issue(self, api: str, direction: str, ids: str, s_h2d, s_d2h) -> Callable[[], int]:
        """Return a callable that enqueues one measured unit and returns the path mask."""
        capi, L = self.capi, self.layers
        (d_a, h_a), (d_b, h_b) = self.ids[ids]
        jobs = []  # (mode, dev ids, host ids, stream)
        if direction in ("h2d", "both"):
            jobs.append((ops.CopyDirection.HOST_TO_DEVICE, d_a, h_a, s_h2d))
        if direction in ("d2h", "both"):
            jobs.append((ops.CopyDirection.DEVICE_TO_HOST, d_b if direction == "both" else d_a, h_b if direction == "both" else h_a, s_d2h))

        if api == "all_layers":
            def run() -> int:
                used = 0
                for mode, d, h, s in jobs:
                    capi.swap_all_layers(self.table, None, 0, 0, self.pool, d, h, mode, stream=s.ptr)
                    used |= capi.last_path()
                return used
        elif api in ("layer_groups", "worker"):
            events = ops.HandleArray([e.ptr for e in self.events])  # converted once, as the worker's are
            # The worker never issues a device-to-host stack: its evictions and backups are one
            # all-layer call each, on its own device-to-host path (TransferManager).
            d2h_path = ops.copy_path_code(self.d2h_copy_path) if api == "worker" else None

            def run() -> int:
                used = 0
                for mode, d, h, s in jobs:  # one call per direction; an event behind each layer
                    if mode == ops.CopyDirection.DEVICE_TO_HOST and d2h_path is not None:
                        capi.swap_all_layers(self.table, None, 0, 0, self.pool, d, h, mode, stream=s.ptr,
                                             path=d2h_path)
                    else:
                        capi.layer_stack_call(None, self.table, None, 1, 0, 0, self.pool, mode, stream=s.ptr).run(
                            d, h, events=events if mode == ops.CopyDirection.HOST_TO_DEVICE else None)
                    used |= capi.last_path()
                return used
        else:
            def run() -> int:
                used = 0
                for l in range(L):  # layer by layer, interleaving the directions
                    for mode, d, h, s in jobs:
                        capi.swap_per_layer(self.dev_ptrs[l], self.pool, self.bb, self.host_ptrs[l], self.pool, d, h,
                                            mode, stream=s.ptr)
                        used |= capi.last_path()
                return used
        return run

    def check(self, ids: str) -> None:
        """Spot check of correctness after a D2H: host blocks equal device blocks."""
        (d_a, h_a), _ = self.ids[ids]
        got = self.host[:8, h_a[:2]]
        want = self.cp.asnumpy(self.dev[:8, self.cp.asarray(d_a[:2])])
        if not np.array_equal(got, want):
            raise AssertionError(f"bench_swap: data mismatch at block size {self.bb} ({ids})")


def kernel_ctas(api: str, n: int, layers: int, bb: int, grid: int, variant: int) -> int:
    """CTAs the launcher starts (one CTA per SM at these sizes): mirrors swap_cuda.cu."""
    chunk, per_cta = (TMA_CHUNK, 1) if variant == 3 and bb % 16 == 0 else (KERNEL_CHUNK, KERNEL_WARPS_PER_CTA)
    items = n * math.ceil(bb / chunk) * (layers if api == "all_layers" else 1)
    return min(grid, math.ceil(items / per_cta))


def run(args: argparse.Namespace) -> Optional[Report]:
    try:
        import cupy as cp
    except ImportError:
        print("bench_swap: skipped (needs CuPy and a CUDA GPU)")
        return None
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            raise RuntimeError("no device")
    except Exception:
        print("bench_swap: skipped (no CUDA GPU visible)")
        return None
    try:
        capi = ops.load_capi(variant="cuda")
    except ops.OpsNotBuiltError:
        print("bench_swap: skipped (needs build/libfdkv_capi.so from `bash build.sh gpu`)")
        return None

    capi.set_options(args.option)
    props = cp.cuda.runtime.getDeviceProperties(0)
    name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
    report = Report(device=name, sms=int(props["multiProcessorCount"]), date=_dt.date.today().isoformat(),
                    layers=args.layers, call_bytes=args.call_bytes, host_ahead=args.host_ahead)
    # NOTE: the PCIe link's speed drifts between measurements (other traffic on the host),
    # by up to ~30% for seconds at a time.  So the whole matrix is measured in `rounds`
    # passes, each case keeps its best pass, and the limit is the best of all reference
    # runs (one before each pass and one at the end): the ratios compare best with best.
    refs: list[dict] = []

    def reference(tag: str) -> None:
        r = measure_reference(cp, capi, args.ref_bytes, args.warmup, args.iters)
        r["when"] = tag
        refs.append(r)
        print(f"reference ({tag}, contiguous pinned cudaMemcpyAsync, {args.ref_bytes / GiB:.2f} GiB): "
              f"H2D {r['h2d_gbps']:.1f} GB/s, D2H {r['d2h_gbps']:.1f} GB/s, both {r['both_gbps']:.1f} GB/s",
              flush=True)

    print(f"device: {name}, {report.sms} SMs", flush=True)

    option_names = ("copy_path", "copy_grid", "copy_kernel", "dma_slice_bytes", "kernel_tables", "staging_chunk_bytes")
    saved = {k: capi.get_option(k) for k in option_names}
    base_kernel, base_slice, base_tables = saved["copy_kernel"], saved["dma_slice_bytes"], saved["kernel_tables"]
    base_chunk = saved["staging_chunk_bytes"]
    s_h2d, s_d2h = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    # (path, grid, kernel variant, dma slice, kernel tables, staging chunk, scope)  scope
    # "full" runs the whole matrix; sweeps run scattered ids (chunk sweep: host runs),
    # all-layers (the table sweep: per-layer too).
    configs = [(p, args.grid, base_kernel, base_slice, base_tables, base_chunk, "full") for p in args.paths]
    configs += [("kernel", g, base_kernel, base_slice, base_tables, base_chunk, "sweep") for g in args.grid_sweep
                if g != args.grid]
    configs += [("kernel", args.grid, v, base_slice, base_tables, base_chunk, "sweep") for v in args.kernel_variants
                if v != base_kernel]
    configs += [("dma", args.grid, base_kernel, sl, base_tables, base_chunk, "sweep") for sl in args.dma_slices
                if sl != base_slice]
    configs += [("staged", args.grid, base_kernel, base_slice, base_tables, c, "chunk") for c in args.staging_chunks
                if c != base_chunk]
    if args.tables_sweep:
        configs += [("kernel", args.grid, base_kernel, base_slice, 1 - base_tables, base_chunk, "per_layer")]
    raw: list[Row] = []
    try:
        for rnd in range(args.rounds):
            reference(f"before pass {rnd + 1}")
            for bb in args.sizes:
                bench = SizeBench(cp, capi, args.layers, bb, args.call_bytes, seed=bb, d2h_copy_path=args.d2h_copy_path)
                for path, grid, variant, dslice, tables, chunk, scope in configs:
                    if scope in ("sweep", "per_layer") and path == "kernel" and bb >= args.kernel_max_bytes:
                        continue  # kernel sweeps only where auto picks the kernel
                    capi.set_option("copy_path", COPY_PATH[path])
                    capi.set_option("copy_grid", grid)
                    capi.set_option("copy_kernel", variant)
                    capi.set_option("dma_slice_bytes", dslice)
                    capi.set_option("kernel_tables", tables)
                    capi.set_option("staging_chunk_bytes", chunk)
                    id_set = args.ids if scope == "full" else (("host_runs",) if scope == "chunk" else ("scattered",))
                    for ids in id_set:
                        for api in args.apis if scope in ("full", "per_layer") else ("all_layers",):
                            for direction in ("h2d", "d2h", "both"):
                                issue = bench.issue(api, direction, ids, s_h2d, s_d2h)
                                streams = [s_h2d, s_d2h] if direction == "both" else [s_h2d if direction == "h2d" else s_d2h]
                                used = issue()
                                cp.cuda.runtime.deviceSynchronize()
                                if direction == "d2h":
                                    bench.check(ids)
                                ms = Timer(cp, streams, HOST_AHEAD_MS if args.host_ahead else 0.0).run(
                                    issue, args.warmup, args.iters)
                                host_s = []
                                for _ in range(5):  # host submit time, device idle before each
                                    cp.cuda.runtime.deviceSynchronize()
                                    t0 = time.perf_counter()
                                    issue()
                                    host_s.append(time.perf_counter() - t0)
                                cp.cuda.runtime.deviceSynchronize()
                                nbytes = bench.n * bb * args.layers * (2 if direction == "both" else 1)
                                gbps = nbytes / (ms * 1e-3) / 1e9
                                ctas = 0
                                if used & ops.PATH_KERNEL:
                                    ctas = kernel_ctas(api, bench.n, args.layers, bb, grid, variant)
                                row = Row(bb, ids, api, path, grid, variant, dslice, tables, direction, chunk,
                                          path_name(used), ctas, gbps, 0.0, ms, nbytes,
                                          statistics.median(host_s) * 1e6)
                                raw.append(row)
                                print(f"pass {rnd + 1} {bb // KiB:>5} KiB {ids:<11} {api:<10} {path:<6} grid={grid:<3} "
                                      f"k={variant} slice={dslice // MiB:<3}M chunk={chunk // MiB}M {direction:<4} "
                                      f"used={row.used:<13} ctas={row.ctas:<3} {gbps:7.1f} GB/s "
                                      f"host={row.host_us:8.0f} us", flush=True)
                bench.close()
    finally:
        for k, v in saved.items():
            capi.set_option(k, v)
    reference("end")
    limits = {d: max(r[f"{d}_gbps"] for r in refs) for d in ("h2d", "d2h", "both")}
    report.reference = {"bytes": args.ref_bytes, **{f"{d}_gbps": v for d, v in limits.items()}, "runs": refs,
                        "rounds": args.rounds}
    best: dict[tuple, Row] = {}
    for row in raw:
        key = (row.block_bytes, row.ids, row.api, row.path, row.grid, row.kernel, row.slice, row.tables,
               row.chunk, row.direction)
        if key not in best or row.gbps > best[key].gbps:
            best[key] = row
    for row in best.values():
        row.ratio = row.gbps / limits[row.direction]
        report.rows.append(asdict(row))
    report.raw = [asdict(r) for r in raw]
    return report


def to_markdown(report: Report) -> str:
    ref = report.reference
    runs = ref.get("runs", [])
    spread = ", ".join(f"{r['h2d_gbps']:.1f}/{r['d2h_gbps']:.1f}/{r['both_gbps']:.1f}" for r in runs)
    lines = [
        f"Device: {report.device} ({report.sms} SMs), {report.date}; {report.layers} layers, "
        f"~{report.call_bytes / MiB:.0f} MiB per direction per measurement; each figure is the median of "
        f"its timed iterations (CUDA events), best of {ref.get('rounds', 1)} passes over the whole matrix.",
        "",
        f"Limits measured in the same run (contiguous pinned `cudaMemcpyAsync`, {ref['bytes'] / GiB:.0f} GiB, "
        f"best of {len(runs)} runs): H2D {ref['h2d_gbps']:.1f} GB/s, D2H {ref['d2h_gbps']:.1f} GB/s, both "
        f"directions on two streams {ref['both_gbps']:.1f} GB/s (each run H2D/D2H/both: {spread}).",
        "",
        *([f"Host ahead (`--host-ahead`): each case timed after a {HOST_AHEAD_MS:.0f} ms GPU spin, so the "
           "figures are the copies' own rate, without the call's host preamble before its first copy.", ""]
          if report.host_ahead else []),
        "| block | ids | api | path (used) | grid cap / CTAs | H2D GB/s (ratio) | D2H GB/s (ratio) | both GB/s (ratio) "
        "| host submit us (H2D / D2H) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    groups: dict[tuple, dict] = {}
    for r in report.rows:
        key = (r["block_bytes"], r["ids"], r["api"], r["path"], r["grid"], r["kernel"], r["slice"], r["tables"],
               r["chunk"])
        groups.setdefault(key, {})[r["direction"]] = r
    for (bb, ids, api, path, grid, variant, dslice, tables, chunk), by_dir in groups.items():
        used = "/".join(sorted({r["used"] for r in by_dir.values()}))
        ctas = max(r["ctas"] for r in by_dir.values())
        size = f"{bb // MiB} MiB" if bb >= MiB else f"{bb // KiB} KiB"
        cells = []
        for d in ("h2d", "d2h", "both"):
            r = by_dir.get(d)
            cells.append(f"{r['gbps']:.1f} ({r['ratio']:.3f})" if r else "-")
        knobs = f"k{variant} t{tables}" if "kernel" in used else (f"slice {dslice // MiB} MiB" if "dma" in used else "")
        if "staged" in used:
            knobs = f"chunk {chunk // MiB} MiB"
        host = " / ".join(f"{by_dir[d]['host_us']:.0f}" if d in by_dir else "-" for d in ("h2d", "d2h"))
        lines.append(f"| {size} | {ids} | {api} | {path} ({used}) {knobs} | {grid} / {ctas} | "
                     + " | ".join(cells) + f" | {host} |")
    return "\n".join(lines) + "\n"


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--sizes", default="8K,16K,32K,128K,512K,2M")
    parser.add_argument("--call-bytes", default="256M", help="bytes per direction per measured unit")
    parser.add_argument("--ref-bytes", default="1G")
    parser.add_argument("--grid", type=int, default=8, help="kernel grid cap (option copy_grid) for the main rows")
    parser.add_argument("--paths", default="auto,kernel,dma,staged", help="copy paths of the full matrix")
    parser.add_argument("--ids", default=",".join(ID_PATTERNS), help="id patterns of the full matrix")
    parser.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="set a C library option for this run (CApi.set_option), e.g. dma_rows_min_lanes=2; repeatable")
    parser.add_argument("--apis", default="all_layers,per_layer,layer_groups",
                        help="call shapes of the full matrix: all_layers, per_layer, layer_groups, worker (loads as "
                             "layer stacks, device-to-host as one all-layer call on --d2h-copy-path)")
    parser.add_argument("--d2h-copy-path", default=TransferManager.DEFAULT_D2H_COPY_PATH,
                        choices=TransferManager.D2H_COPY_PATHS,
                        help="--apis worker: the device-to-host copy path, as the worker's d2h_copy_path "
                             f"(default {TransferManager.DEFAULT_D2H_COPY_PATH}, the worker's)")
    parser.add_argument("--staging-chunks", default="", help="extra staging chunk sizes (staged, host runs), e.g. 4M,32M")
    parser.add_argument("--grid-sweep", default="", help="extra kernel grid caps (all-layers, scattered), e.g. 4,16,32")
    parser.add_argument("--kernel-variants", default="", help="extra kernel variants to sweep, e.g. 1,2,3")
    parser.add_argument("--dma-slices", default="", help="extra DMA slice sizes (bytes) to sweep, e.g. 4M,64M")
    parser.add_argument("--tables-sweep", action="store_true", help="also time the other kernel_tables mode")
    parser.add_argument("--kernel-max-bytes", default="64K", help="skip kernel sweeps at block sizes >= this")
    parser.add_argument("--host-ahead", action="store_true",
                        help="time each case after a GPU spin, so the host enqueues it ahead: the copies' own rate, "
                             "without the call's host preamble (the default times from the call)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=2, help="passes over the matrix; each case keeps its best")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="fewer sizes and iterations (smoke run)")
    parser.add_argument("--out", default=os.environ.get("OUT") or "build/bench")
    args = parser.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    args.call_bytes = parse_size(args.call_bytes)
    args.ref_bytes = parse_size(args.ref_bytes)
    args.kernel_max_bytes = parse_size(args.kernel_max_bytes)
    args.grid_sweep = [int(g) for g in args.grid_sweep.split(",") if g]
    args.kernel_variants = [int(v) for v in args.kernel_variants.split(",") if v]
    args.dma_slices = [parse_size(v) for v in args.dma_slices.split(",") if v]
    args.paths = [p for p in args.paths.split(",") if p]
    args.ids = [i for i in args.ids.split(",") if i]
    args.apis = [a for a in args.apis.split(",") if a]
    unknown = sorted(set(args.apis) - set(APIS))
    if unknown:
        parser.error(f"--apis: unknown call shape(s) {', '.join(unknown)} ({', '.join(APIS)})")
    args.staging_chunks = [parse_size(v) for v in args.staging_chunks.split(",") if v]
    if args.quick:
        args.sizes, args.iters, args.grid_sweep, args.rounds = [8 * KiB, 512 * KiB], 3, [], 1
        args.call_bytes, args.ref_bytes = 64 * MiB, 256 * MiB

    t0 = time.time()
    report = run(args)
    if report is None:
        return 0
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench_swap.json").write_text(json.dumps(asdict(report), indent=1))
    md = to_markdown(report)
    (out / "bench_swap.md").write_text(md)
    print(f"\n{md}\nwrote {out / 'bench_swap.json'} and {out / 'bench_swap.md'} in {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
