"""Layer-by-layer load/compute overlap of the worker (GPU, CuPy backend).

A synthetic forward pass of ``--layers`` layers: each layer's "attention" is a CuPy fp16
matmul whose size is calibrated in the run so that one layer's compute takes about as long as
one layer's host->device load.  Measured on the compute stream (CUDA events), median of
``--reps`` repetitions:

* ``T_c``: compute alone;
* ``T_l``: loading alone (submit + per-layer waits, no compute);
* ``T_o``: load and compute overlapped (compute layer i waits on load event i);
* hidden fraction ``(T_c + T_l - T_o) / min(T_c, T_l)`` (target >= 0.9);
* compute slowdown while device->host backups run at full rate on the output stream
  (target <= 3%), and the delay a write_back eviction's rule-2 fence adds to compute;
* the hidden fraction of a step whose submit carries a backup as large as the load, as
  configured (the worker's ``backups_after_loads``: the backup starts once the load landed) and
  with the backup beside the load (both directions on the link at once);
* a timeline of one overlapped step: per layer, how long the compute stream stalled
  waiting for the layer's load;
* the contiguous pinned host->device bandwidth measured in the same run (1 GiB
  ``cudaMemcpyAsync``) and the load's ratio to it.

Usage (on the device tool, after ``bash build.sh gpu``)::

    python benchmarks/bench_overlap.py --layers 48 --json out.json
    python benchmarks/bench_overlap.py --layers 48 --heads 1 --blocks 512   # 16 KiB blocks
    python benchmarks/bench_overlap.py --sm-check   # copy kernel vs DMA next to GEMMs
    python benchmarks/bench_overlap.py --kv-formats --layers 32 --heads 8 --head-dim 128 --blocks 127
        # an 8k-prefix host hit's load, block_wise_fp8 against bfloat16 (llama3-8b's shape)

``--kv-formats`` runs only that comparison (:func:`kv_formats_load`): two controllers, one per
KV format, load the same ``--blocks`` host blocks (one run of host ids, scattered device ids)
layer by layer, alternating, ``--reps`` times; printed are each median load (on the GPU, from
the submit to the last layer's event on the compute stream; without one, on the CPU backend,
host wall time), the bytes, the blocks one GiB of host tier holds, and fp8 over the baseline
(targets: load <= 0.55x, blocks per GiB >= 1.9x).  It runs on the CPU too (no CuPy needed).

``--copy-paths`` sets the process-wide ``copy_path`` option, which the loads follow; the
worker's device->host copies take their own per-call path (``--d2h-copy-path``, default
the worker's, dma).  ``--d2h-copy-path process`` gives the behaviour before the
per-call path existed (evictions on the process-wide rule too).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastdeploy_kvcache.config import CacheConfig  # noqa: E402
from fastdeploy_kvcache.core.metadata import CacheLevel, CacheSwapMetadata, CopyDirection, TransferKind  # noqa: E402

logger = logging.getLogger("bench_overlap")

# Untimed repetitions first: they warm CuPy's kernel cache, cuBLAS and the ops' scratch ring.
WARMUP = 2


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=48, help="model layers (32-64 per the issue)")
    p.add_argument("--blocks", type=int, default=64, help="blocks loaded per step (scattered ids)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=11)
    p.add_argument("--matmul-n", type=int, default=0,
                   help="size n of one layer's n x n fp16 matmul; 0 (default) calibrates it in the run so a "
                        "layer's compute takes about as long as its load. Fix it (the matmul_n of an earlier run) "
                        "to compare two builds: the calibration follows the run's first timed loads, which vary "
                        "with the machine's state")
    p.add_argument("--copy-paths", default="auto", help="comma list of copy paths to run: auto,kernel,dma,staged")
    p.add_argument("--host-ids", default="runs", choices=["runs", "scattered"],
                   help="host block ids of loads and evictions: 'runs' (consecutive per step, as the block "
                        "allocator hands them out) or 'scattered' (random: the worst case); device ids are "
                        "always scattered")
    p.add_argument("--d2h-copy-path", default=None, choices=["dma", "auto", "kernel", "staged", "process"],
                   help="the worker's device->host copy path (default: the worker's, dma); "
                        "'process' follows --copy-paths like loads do")
    p.add_argument("--fence-blocks", type=int, default=8, help="blocks of the write_back eviction fence row")
    p.add_argument("--json", default="", help="write the results here too")
    p.add_argument("--staging-grids", default="", help="--sm-check: staged path at these staging_grid values too")
    p.add_argument("--compute-priority", default="normal", choices=["normal", "high"],
                   help="priority of the compute stream: 'high' lets the forward's kernels take SMs ahead of "
                        "the staged path's gathers (an engine choice; CUDA streams default to the lowest)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="set a C library option for this run (CApi.set_option), e.g. dma_rows_min_lanes=2; repeatable")
    p.add_argument("--staging-grid", type=int, default=0,
                   help="CTAs of the staged path's gather/scatter kernel for this run (0: the library's default)")
    p.add_argument("--kv-formats", action="store_true",
                   help="only compare a host hit's load with block_wise_fp8 KV against --kv-baseline-dtype KV "
                        "(same shape, same blocks; runs on the CPU too)")
    p.add_argument("--kv-baseline-dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"],
                   help="--kv-formats: the KV dtype fp8 is set against")
    p.add_argument("--sm-check", action="store_true",
                   help="only run the SM-sharing check: cuBLAS GEMMs and elementwise kernels, alone and "
                        "while device->host copies run through the copy kernel or the DMA batch")
    args = p.parse_args()
    if args.matmul_n < 0:
        p.error(f"--matmul-n must be >= 0 (0: calibrate), got {args.matmul_n}")
    return args


def _skip_reason() -> "str | None":
    """Why this GPU benchmark cannot run here (None if it can)."""
    try:
        import cupy as cp
    except ImportError:
        return "needs CuPy and a CUDA GPU"
    try:
        if cp.cuda.runtime.getDeviceCount() < 1:
            return "no CUDA GPU visible"
    except Exception:  # noqa: BLE001 - no driver
        return "no CUDA GPU visible"
    from fastdeploy_kvcache import ops

    try:
        if not ops.load_capi(variant="cuda").is_cuda:
            return "needs build/libfdkv_capi.so from `bash build.sh gpu`"
    except ops.OpsNotBuiltError:
        return "needs build/libfdkv_capi.so from `bash build.sh gpu`"
    return None


def compute_stream(cp: Any, priority: str) -> Any:
    """The benchmark's compute stream; 'high' = the device's greatest stream priority."""
    if priority == "high":
        # CUDA clamps a priority outside cudaDeviceGetStreamPriorityRange to the nearest end
        # (CuPy does not wrap that query): -1000 asks for the greatest.
        return cp.cuda.Stream(non_blocking=True, priority=-1000)
    return cp.cuda.Stream(non_blocking=True)


def sm_sharing_check(staging_grids: "list[int]", priority: str = "normal") -> int:
    """Why the copy kernel path slows GEMMs far more than its 8 SMs would suggest.

    A GEMM and an elementwise kernel are timed alone and while all-layer device->host copies
    (96 tensors x 512 scattered 16 KiB blocks) run on another stream through each copy path.
    """
    import cupy as cp
    import numpy as np

    from fastdeploy_kvcache import ops

    capi = ops.load_capi(variant="cuda")
    tensors, nblocks, block_bytes = 96, 512, 16384
    dev = [cp.zeros(nblocks * block_bytes, dtype=cp.uint8) for _ in range(tensors)]
    host = [capi.host_alloc(nblocks * block_bytes) for _ in range(tensors)]
    ids = np.random.default_rng(0).permutation(nblocks).astype(np.int64)
    host_ids = np.arange(nblocks, dtype=np.int64)  # a host run: what the staged path merges
    copy_stream, compute = cp.cuda.Stream(non_blocking=True), compute_stream(cp, priority)
    mat = cp.ones((4928, 4928), cp.float16)
    vec = cp.ones(1 << 27, cp.float32)

    def copies(path: int) -> None:
        for _ in range(3):  # the call's own path: the process-wide option is left alone
            capi.swap_all_layers([d.data.ptr for d in dev], host, nblocks, block_bytes, nblocks, ids, host_ids, 0,
                                 stream=copy_stream.ptr, path=path)

    def time_ms(work: Callable[[], None], path: int, with_copies: bool) -> float:
        cp.cuda.runtime.deviceSynchronize()
        if with_copies:
            copies(path)
        with compute:
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(compute)
            work()
            end.record(compute)
        end.synchronize()
        cp.cuda.runtime.deviceSynchronize()
        return cp.cuda.get_elapsed_time(start, end)

    works = {"gemm (cuBLAS)": lambda: [mat @ mat for _ in range(20)],
             "elementwise": lambda: [vec * 1.0001 + 0.5 for _ in range(40)]}
    base_grid = capi.get_option("staging_grid")
    variants = [(1, "kernel", base_grid), (2, "dma", base_grid), (3, "staged", base_grid)]
    variants += [(3, f"staged/g{g}", g) for g in staging_grids if g != base_grid]
    for name, work in works.items():
        for path, path_name, grid in variants:
            capi.set_option("staging_grid", grid)
            alone = statistics.median(time_ms(work, path, False) for _ in range(5))
            loaded = statistics.median(time_ms(work, path, True) for _ in range(5))
            print(f"{name:14s} copy path={path_name:10s} alone={alone:7.2f} ms  with copies={loaded:7.2f} ms  "
                  f"slowdown={loaded / alone - 1:+.1%}")
    capi.set_option("staging_grid", base_grid)
    cp.cuda.runtime.deviceSynchronize()
    for ptr in host:
        capi.host_free(ptr)
    return 0


def kv_formats_load(args: argparse.Namespace, gpu: bool) -> int:
    """A host hit's load, block_wise_fp8 against the baseline dtype (the module docstring)."""
    import numpy as np

    from fastdeploy_kvcache.worker import CacheController

    shape = dict(num_layers=args.layers, num_kv_heads=args.heads, block_size=args.block_size, head_dim=args.head_dim)
    formats = {"baseline": CacheConfig(dtype=args.kv_baseline_dtype, **shape),
               "block_wise_fp8": CacheConfig(dtype="uint8", kv_cache_quant="block_wise_fp8", **shape)}
    n = args.blocks
    total = 2 * n
    rng = np.random.default_rng(0)
    load_dev = rng.permutation(total)[:n].tolist()
    load_host = list(range(n))
    ctrls = {}
    for name, cfg in formats.items():
        ctrl = CacheController(cfg, backend="cupy" if gpu else "cpu")
        ctrl.initialize_kv_cache(total)
        ctrl.initialize_host_cache(total)
        ctrls[name] = ctrl
    if gpu:
        import cupy as cp

        compute = cp.cuda.Stream(non_blocking=True)

    def load_once(ctrl: Any) -> float:
        meta = CacheSwapMetadata(list(load_host), list(load_dev), CacheLevel.HOST, CacheLevel.DEVICE)
        ctrl.collect_finished(wait=True)
        if not gpu:
            t0 = time.perf_counter()
            counter = ctrl.submit_swap_tasks(None, meta)
            for layer in range(args.layers):
                counter.wait_for_layer(layer)
            elapsed = time.perf_counter() - t0
        else:
            cp.cuda.runtime.deviceSynchronize()
            with compute:
                start, end = cp.cuda.Event(), cp.cuda.Event()
                start.record(compute)
                counter = ctrl.submit_swap_tasks(None, meta)
                for layer in range(args.layers):
                    counter.wait_for_layer(layer)
                end.record(compute)
            end.synchronize()
            elapsed = cp.cuda.get_elapsed_time(start, end) / 1e3
        ctrl.collect_finished(wait=True)
        return elapsed

    samples: dict[str, list[float]] = {name: [] for name in formats}
    for rep in range(args.reps + WARMUP):
        for name, ctrl in ctrls.items():  # alternating: drifts reach both alike
            t = load_once(ctrl)
            if rep >= WARMUP:
                samples[name].append(t)
    out: dict[str, Any] = {"device": "gpu" if gpu else "cpu", "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           "blocks": n, "tokens": n * args.block_size, "shape": shape, "formats": {}}
    for name, cfg in formats.items():
        out["formats"][name] = {
            "dtype": cfg.dtype if cfg.kv_cache_quant is None else f"{cfg.dtype}/{cfg.kv_cache_quant}",
            "load_s_median": statistics.median(samples[name]), "load_bytes": n * cfg.bytes_per_block,
            "host_blocks_per_gib": (1 << 30) // cfg.bytes_per_block,
        }
    for ctrl in ctrls.values():
        ctrl.close()
    base, fp8 = out["formats"]["baseline"], out["formats"]["block_wise_fp8"]
    out["ratios"] = {"load": fp8["load_s_median"] / base["load_s_median"],
                     "load_bytes": fp8["load_bytes"] / base["load_bytes"],
                     "host_blocks_per_gib": fp8["host_blocks_per_gib"] / base["host_blocks_per_gib"]}
    print(f"host hit of {out['tokens']} tokens ({n} blocks, {args.layers} layers, {args.heads} KV heads of "
          f"{args.head_dim}), median of {args.reps}, on the {out['device']}:")
    print(f"{'':20} {'baseline':>20} {'fp8':>20} {'fp8/base':>9}  target")
    print(f"{'KV':20} {base['dtype']:>20} {fp8['dtype']:>20}")
    print(f"{'load (ms)':20} {1e3 * base['load_s_median']:20.3f} {1e3 * fp8['load_s_median']:20.3f} "
          f"{out['ratios']['load']:9.3f}  <= 0.55")
    print(f"{'load (MB)':20} {base['load_bytes'] / 1e6:20.1f} {fp8['load_bytes'] / 1e6:20.1f} "
          f"{out['ratios']['load_bytes']:9.3f}")
    print(f"{'host blocks per GiB':20} {base['host_blocks_per_gib']:20d} {fp8['host_blocks_per_gib']:20d} "
          f"{out['ratios']['host_blocks_per_gib']:9.3f}  >= 1.9")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parse_args()
    reason = _skip_reason()
    if args.kv_formats:
        return kv_formats_load(args, gpu=reason is None)
    if reason is not None:
        print(f"bench_overlap: skipped ({reason})")
        return 0
    if args.sm_check:
        return sm_sharing_check([int(g) for g in args.staging_grids.split(",") if g], args.compute_priority)
    import cupy as cp
    import numpy as np

    from fastdeploy_kvcache import ops
    from fastdeploy_kvcache.worker import CacheController

    capi = ops.load_capi(variant="cuda")
    capi.set_options(args.option)
    if args.staging_grid > 0:
        capi.set_option("staging_grid", args.staging_grid)
    props = cp.cuda.runtime.getDeviceProperties(0)
    device_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])

    n_blocks = args.blocks
    config = CacheConfig(num_layers=args.layers, num_kv_heads=args.heads, block_size=args.block_size,
                         head_dim=args.head_dim, dtype="float16")
    total_blocks = 3 * n_blocks + 2 * args.fence_blocks
    ctrl = CacheController(config, backend="cupy", d2h_copy_path=args.d2h_copy_path)
    ctrl.initialize_kv_cache(total_blocks)
    ctrl.initialize_host_cache(total_blocks)
    tm = ctrl.transfer_manager
    rng = np.random.default_rng(0)
    # Scattered device ids, as a long-running server's pools look: no long consecutive runs.
    load_dev = rng.permutation(total_blocks)[:n_blocks].tolist()
    spare = [b for b in range(total_blocks) if b not in set(load_dev)]
    evict_dev = rng.permutation(spare)[:n_blocks].tolist()
    fence_dev = spare[n_blocks:n_blocks + args.fence_blocks]
    # Backups/evictions write host blocks the loads do not read: a shared block would make
    # the load wait for the copy (ordering rule 5), which is correct but not what we measure.
    if args.host_ids == "scattered":
        load_host = rng.permutation(total_blocks)[:n_blocks].tolist()
        other_host = [h for h in rng.permutation(total_blocks).tolist() if h not in set(load_host)]
        evict_host = other_host[:n_blocks]
        fence_host = other_host[n_blocks:n_blocks + args.fence_blocks]
    else:  # one run per step (a request's blocks), as the host pool's run allocator gives them
        load_host = list(range(0, n_blocks))
        evict_host = list(range(n_blocks, 2 * n_blocks))
        fence_host = list(range(2 * n_blocks, 2 * n_blocks + args.fence_blocks))
    load_bytes = n_blocks * config.bytes_per_block

    compute = compute_stream(cp, args.compute_priority)

    def run_once(body: Any) -> float:
        """Seconds on the compute stream from before ``body`` to after it.

        ``body`` may be a ``(setup, body)`` pair: ``setup`` runs first, untimed (used to get
        copies running before the timed compute starts).
        """
        setup, body = body if isinstance(body, tuple) else (None, body)
        cp.cuda.runtime.deviceSynchronize()
        ctrl.collect_finished()
        with compute:
            if setup is not None:
                setup()
            start, end = cp.cuda.Event(), cp.cuda.Event()
            start.record(compute)
            body()
            end.record(compute)
        end.synchronize()
        elapsed = cp.cuda.get_elapsed_time(start, end) / 1e3
        cp.cuda.runtime.deviceSynchronize()
        ctrl.collect_finished(wait=True)
        return elapsed

    def timed(*bodies: Any) -> list[float]:
        """Median seconds of each body; the bodies alternate, so drifts hit all alike."""
        samples: list[list[float]] = [[] for _ in bodies]
        for rep in range(args.reps + WARMUP):
            for i, body in enumerate(bodies):
                t = run_once(body)
                if rep >= WARMUP:
                    samples[i].append(t)
        return [statistics.median(x) for x in samples]

    def load_meta() -> CacheSwapMetadata:
        return CacheSwapMetadata(list(load_host), list(load_dev), CacheLevel.HOST, CacheLevel.DEVICE)

    # ---- contiguous pinned reference, measured in this run
    ref_bytes = 1 << 30
    host_ref = capi.host_alloc(ref_bytes)
    dev_ref = cp.empty(ref_bytes, dtype=cp.uint8)
    ref_samples = []
    for _ in range(4):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record(compute)
        cp.cuda.runtime.memcpyAsync(dev_ref.data.ptr, host_ref, ref_bytes, cp.cuda.runtime.memcpyHostToDevice,
                                    compute.ptr)
        e.record(compute)
        e.synchronize()
        ref_samples.append(cp.cuda.get_elapsed_time(s, e) / 1e3)
    contiguous_h2d = ref_bytes / statistics.median(ref_samples[1:]) / 1e9
    del dev_ref
    capi.host_free(host_ref)

    results: dict[str, Any] = {
        "device": device_name, "date": time.strftime("%Y-%m-%d"), "layers": args.layers,
        "blocks_loaded": n_blocks, "bytes_per_block_all_layers": config.bytes_per_block,
        "layer_load_bytes": n_blocks * 2 * config.bytes_per_layer_block,
        "contiguous_pinned_h2d_GBps": contiguous_h2d, "host_cache_numa_node": ctrl.numa_node,
        "d2h_copy_path": tm.d2h_copy_path, "host_ids": args.host_ids,
        "staging_grid": capi.get_option("staging_grid"), "compute_priority": args.compute_priority,
        "options": list(args.option), "runs": [],
    }
    path_names = {ops.PATH_MEMCPY: "memcpy", ops.PATH_KERNEL: "kernel", ops.PATH_DMA: "dma", ops.PATH_CPU: "cpu",
                  ops.PATH_STAGED: "staged", ops.PATH_DMA_ROWS: "rows"}

    def paths_str(bits: int) -> str:
        return "+".join(name for bit, name in path_names.items() if bits & bit) or "-"

    for path in args.copy_paths.split(","):
        path_code = {"auto": 0, "kernel": 1, "dma": 2, "staged": 3}[path]
        capi.set_option("copy_path", path_code)
        tm.reset_stats()  # the paths each direction used, per run

        def load_only() -> None:
            counter = ctrl.submit_swap_tasks(None, load_meta())
            for layer in range(args.layers):
                counter.wait_for_layer(layer)

        (t_l,) = timed(load_only)
        per_layer_load = t_l / args.layers

        # ---- calibrate the matmul so one layer's compute ~ one layer's load
        def matmul_time(n: int) -> float:
            a = cp.ones((n, n), dtype=cp.float16)
            with compute:
                a @ a
                s, e = cp.cuda.Event(), cp.cuda.Event()
                s.record(compute)
                for _ in range(10):
                    a @ a
                e.record(compute)
            e.synchronize()
            return cp.cuda.get_elapsed_time(s, e) / 1e3 / 10

        lo, hi = 256, 16384
        while not args.matmul_n and hi - lo > 64:
            mid = (lo + hi) // 2 // 64 * 64
            if matmul_time(mid) < per_layer_load:
                lo = mid
            else:
                hi = mid
        n = args.matmul_n or hi
        mats = [cp.ones((n, n), dtype=cp.float16) * 0.001 for _ in range(2)]
        out = cp.empty((n, n), dtype=cp.float16)

        def layer_compute(layer: int) -> None:
            cp.matmul(mats[layer % 2], mats[(layer + 1) % 2], out=out)

        def compute_only() -> None:
            for layer in range(args.layers):
                layer_compute(layer)

        submit_s: list[float] = []

        def forward(counter: Any) -> None:
            """The step's layers, each after its load (ordering rule 3)."""
            for layer in range(args.layers):
                counter.wait_for_layer(layer)
                layer_compute(layer)

        def overlapped() -> None:
            t0 = time.perf_counter()
            counter = ctrl.submit_swap_tasks(None, load_meta())
            submit_s.append(time.perf_counter() - t0)
            forward(counter)

        # NOTE: every figure of a hidden fraction comes from one timed() call, its bodies
        # alternating: the GPU's clocks drift between calls (a later call's GEMMs ran a few
        # percent faster), which read as a step with backups hiding more than one without.
        t_c, t_l, t_o = timed(compute_only, load_only, overlapped)
        hidden = (t_c + t_l - t_o) / min(t_c, t_l)

        # ---- where the overlapped step loses time: on the compute stream, when each layer's
        # wait for its load was passed and when its compute ended (one more step)
        def timeline() -> dict[str, Any]:
            cp.cuda.runtime.deviceSynchronize()
            ctrl.collect_finished()
            with compute:
                start = cp.cuda.Event()
                start.record(compute)
                counter = ctrl.submit_swap_tasks(None, load_meta())
                passed, ended = [], []
                for layer in range(args.layers):
                    counter.wait_for_layer(layer)
                    passed.append(cp.cuda.Event())
                    passed[-1].record(compute)
                    layer_compute(layer)
                    ended.append(cp.cuda.Event())
                    ended[-1].record(compute)
            ended[-1].synchronize()
            ms = lambda e: cp.cuda.get_elapsed_time(start, e)  # noqa: E731
            stalls = [ms(passed[0])] + [ms(passed[i]) - ms(ended[i - 1]) for i in range(1, args.layers)]
            ctrl.collect_finished(wait=True)
            return {"step_ms": ms(ended[-1]), "stall_ms_total": sum(stalls), "stall_ms_first_layer": stalls[0],
                    "stall_ms_per_layer": [round(x, 4) for x in stalls],
                    "compute_ms_per_layer_median": statistics.median(ms(ended[i]) - ms(passed[i])
                                                                       for i in range(args.layers))}

        step_timeline = timeline()

        # ---- compute while device->host backups run at full rate (no rule-2 fence: BACKUP)
        def backup_meta() -> CacheSwapMetadata:
            return CacheSwapMetadata(list(evict_dev), list(evict_host), CacheLevel.DEVICE, CacheLevel.HOST,
                                     kind=TransferKind.BACKUP)

        def evict_only() -> None:
            ctrl.submit_swap_tasks(backup_meta(), None)
            tm.flush_launches()  # the launcher thread has enqueued the copy
            copied = cp.cuda.Event(disable_timing=True)
            copied.record(tm.output_stream)
            compute.wait_event(copied)  # so the compute-stream timer spans the copy

        (t_e,) = timed(evict_only)
        n_evicts = int(t_c / t_e) + 2  # enough queued copies to outlast the compute

        evict_submit_s: list[float] = []

        def start_evictions() -> None:
            """Queue enough backups to outlast the compute; they run while it is timed."""
            for _ in range(n_evicts):
                t0 = time.perf_counter()
                ctrl.submit_swap_tasks(backup_meta(), None)
                evict_submit_s.append(time.perf_counter() - t0)
            tm.flush_launches()

        t_c2, t_ce = timed(compute_only, (start_evictions, compute_only))
        slowdown = t_ce / t_c2 - 1.0

        # ---- the rule-2 fence: a write_back eviction of a few blocks ahead of the compute
        def fenced_step() -> None:
            meta = CacheSwapMetadata(list(fence_dev), list(fence_host), CacheLevel.DEVICE, CacheLevel.HOST,
                                     kind=TransferKind.EVICT)
            ctrl.submit_swap_tasks(meta, None)
            compute_only()

        t_c3, t_fence = timed(compute_only, fenced_step)

        # ---- a mixed step: this step's write-through backups plus the layer-by-layer load
        # NOTE: the backup goes in the same submit as the load, as a scheduler's step hands
        # them over; with backups_after_loads (the default) it starts once the load landed.
        def overlapped_with_backups() -> None:
            forward(ctrl.submit_swap_tasks(backup_meta(), load_meta()))

        configured = tm.backups_after_loads  # the worker's default

        def overlapped_beside_backups() -> None:
            tm.backups_after_loads = False
            try:
                overlapped_with_backups()
            finally:
                tm.backups_after_loads = configured

        t_cb, t_lb, t_ob, t_obb = timed(compute_only, load_only, overlapped_with_backups, overlapped_beside_backups)

        # ---- host cost of one op launch, straight through the C ABI (no worker code)
        layer0 = tm.layout.device[0]
        host0 = tm.layout.host[0]
        ids_dev = np.asarray(load_dev, dtype=np.int64)
        ids_host = np.asarray(load_host, dtype=np.int64)
        all_dev = [a for layer in tm.layout.device for a in layer]
        all_host = [p for layer in tm.layout.host for p in layer]
        ev_dev = np.asarray(evict_dev, dtype=np.int64)
        ev_host = np.asarray(evict_host, dtype=np.int64)

        d2h_code = ops.copy_path_code(tm.d2h_copy_path)  # the eviction call as the worker makes it

        def capi_call_us(arrays: list, ptrs: list, d_ids: Any, h_ids: Any, mode: int, stream: Any, n: int,
                         path: int = ops.COPY_PATH_PROCESS) -> float:
            cp.cuda.runtime.deviceSynchronize()
            t0 = time.perf_counter()
            for _ in range(n):
                capi.swap_all_layers([a.data.ptr for a in arrays], ptrs, [a.shape[0] for a in arrays],
                                     [a.nbytes // a.shape[0] for a in arrays], total_blocks, d_ids, h_ids,
                                     mode, stream=stream.ptr, path=path)
            dt = (time.perf_counter() - t0) / n
            cp.cuda.runtime.deviceSynchronize()
            return dt * 1e6

        capi_call_us(layer0, host0, ids_dev, ids_host, 1, tm.input_stream, 5)
        capi_layer_us = capi_call_us(layer0, host0, ids_dev, ids_host, 1, tm.input_stream, 48)
        capi_call_us(all_dev, all_host, ev_dev, ev_host, 0, tm.output_stream, 2, d2h_code)
        capi_evict_us = capi_call_us(all_dev, all_host, ev_dev, ev_host, 0, tm.output_stream, 4, d2h_code)

        # One all-layer eviction call on an idle GPU (the host submit figure): the
        # call as the worker's launcher makes it (backend.swap_blocks on the layout's array
        # table), and the part of it inside the C library (the native submit, GIL released),
        # per path; median of 5.
        table = tm.backend.describe_arrays(all_dev, all_host)  # the worker's table: addresses and host buffers
        ev_dev_p, ev_host_p = tm.backend.prepare_ids(evict_dev), tm.backend.prepare_ids(evict_host)
        bench_table = ops.TensorTable([a.data.ptr for a in all_dev], [a.shape[0] for a in all_dev],
                                      [a.nbytes // a.shape[0] for a in all_dev], all_host)

        def idle_call_us(p: int) -> tuple[float, float]:
            whole, native = [], []
            c = capi.swap_args("bench", bench_table, 0, 0, None, total_blocks, ev_dev_p, ev_host_p, 0, p)
            for _ in range(6):
                cp.cuda.runtime.deviceSynchronize()
                t0 = time.perf_counter()
                tm.backend.swap_blocks(table, all_host, total_blocks, ev_dev_p, ev_host_p, CopyDirection.DEVICE_TO_HOST,
                                       tm.output_stream, path=p)
                t1 = time.perf_counter()
                cp.cuda.runtime.deviceSynchronize()
                t2 = time.perf_counter()
                capi.lib.fdkv_swap_layers(b"bench", c.dev_ptrs, c.num_blocks, c.block_bytes, c.count, c.host_ptrs,
                                           c.num_host_blocks, c.dev_ids, c.num_dev_ids, c.host_ids, c.num_host_ids,
                                           c.mode, ctypes.c_void_p(tm.output_stream.ptr), 0, c.path)
                t3 = time.perf_counter()
                whole.append(t1 - t0)
                native.append(t3 - t2)
            return statistics.median(whole[1:]) * 1e6, statistics.median(native[1:]) * 1e6

        idle_evict = {name: idle_call_us(code) for name, code in
                      (("process", d2h_code), ("staged", ops.COPY_PATH_STAGED), ("dma", ops.COPY_PATH_DMA))}
        cp.cuda.runtime.deviceSynchronize()

        ctrl.collect_finished(wait=True)
        stats = ctrl.get_stats()
        run = {
            "copy_path": path, "d2h_copy_path": tm.d2h_copy_path,
            "h2d_paths_used": paths_str(stats["h2d"]["paths"]), "d2h_paths_used": paths_str(stats["d2h"]["paths"]),
            "matmul_n": n, "T_c_ms": t_c * 1e3, "T_l_ms": t_l * 1e3, "T_o_ms": t_o * 1e3,
            "hidden_fraction": hidden, "load_GBps": load_bytes / t_l / 1e9,
            "submit_host_us_per_layer": statistics.median(submit_s) / args.layers * 1e6,
            "load_ratio_to_contiguous": load_bytes / t_l / 1e9 / contiguous_h2d,
            "evict_GBps": n_blocks * config.bytes_per_block / t_e / 1e9,
            "evictions_queued": n_evicts, "T_c_alone_paired_ms": t_c2 * 1e3, "T_c_under_evictions_ms": t_ce * 1e3,
            "compute_slowdown_under_evictions": slowdown,
            "fence_blocks": args.fence_blocks, "T_step_with_writeback_fence_ms": t_fence * 1e3,
            "fence_delay_ms": (t_fence - t_c3) * 1e3,
            "T_o_with_backups_ms": t_ob * 1e3,
            "backups_after_loads": configured,
            "hidden_fraction_with_backups": (t_cb + t_lb - t_ob) / min(t_cb, t_lb),
            "T_o_with_backups_beside_ms": t_obb * 1e3,
            "hidden_fraction_with_backups_beside": (t_cb + t_lb - t_obb) / min(t_cb, t_lb),
            "timeline": step_timeline,
            "evict_submit_host_us": statistics.median(evict_submit_s) * 1e6,
            "capi_host_us_per_layer_load_call": capi_layer_us,
            "capi_host_us_per_eviction_call_back_to_back": capi_evict_us,
            "eviction_call_idle_host_us": {k: v[0] for k, v in idle_evict.items()},
            "eviction_call_idle_native_us": {k: v[1] for k, v in idle_evict.items()},
        }
        results["runs"].append(run)

    capi.set_option("copy_path", 0)
    ctrl.close()

    print(f"# bench_overlap on {device_name}, {results['date']}")
    print(f"layers={args.layers} blocks/step={n_blocks} layer load={results['layer_load_bytes'] / 2**20:.1f} MiB "
          f"contiguous pinned H2D (1 GiB cudaMemcpyAsync, this run) = {contiguous_h2d:.1f} GB/s")
    cols = ["copy_path", "d2h_copy_path", "h2d_paths_used", "d2h_paths_used", "matmul_n", "T_c_ms", "T_l_ms", "T_o_ms", "hidden_fraction", "hidden_fraction_with_backups", "hidden_fraction_with_backups_beside", "load_GBps",
            "load_ratio_to_contiguous", "evict_GBps", "compute_slowdown_under_evictions",
            "fence_delay_ms", "submit_host_us_per_layer", "capi_host_us_per_layer_load_call",
            "capi_host_us_per_eviction_call_back_to_back", "evict_submit_host_us", "eviction_call_idle_host_us",
            "eviction_call_idle_native_us"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for run in results["runs"]:
        cells = [f"{run[c]:.3f}" if isinstance(run[c], float) else str(run[c]) for c in cols]
        print("| " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
