"""Time to first token on the GPU: prefix recomputed, prefix already on the device, or
prefix loaded from pinned host memory layer by layer through our copy ops.

A Llama-8B-shaped layer stack in torch (bf16): 32 layers, hidden 4096, 32 query heads and
8 KV heads of 128, MLP 14336 (SwiGLU), RMSNorm; GEMMs on cuBLAS, attention through torch
SDPA (flash / memory-efficient kernels; prefix attention with a lower-right causal mask).
Weights are random and shared by all layers (436 MB, far beyond L2, so each layer still
streams its weights from HBM).  The KV cache is paged: blocks of 64 tokens, scattered
device block ids, so attention gathers the request's blocks (the same cost for every
source).  A host hit loads the prefix layer by layer on a load stream: ``--loaders launched``
hands the whole stack to the library's launcher thread in one ``LayerStackCall.launch``
from the step's own thread, which enqueues the first layer itself (the worker's way);
``groups`` issues it in one ``LayerStackCall.run`` from a Python loader thread (the
worker's way before); ``per-layer`` one ``swap_all_layers`` call of K and V per layer from a
Python loader thread.  Each layer's event is recorded natively in the first two;
``--paths`` picks the copy path per call.  Layer i's
attention waits on layer i's event on the GPU.  The load starts with the step, so TTFT includes it.

Reported, with the limit measured in the same run (one contiguous 1 GiB pinned
``cudaMemcpyAsync`` host to device):

* ``floor = max(device hit, prefix KV bytes / H2D limit)`` and ``host hit / floor``
  (target <= 1.10);
* ``host hit / recompute`` (target <= 0.25).

``--launch graphs`` replays each layer from a CUDA graph captured for the row's shape (one
launch per layer), beside the eager pass (``LayerGraphs`` says why both are measured).

    python benchmarks/bench_ttft.py [--prefixes 1k,8k,32k] [--new 1,128,2k] [--paths auto,staged]
        [--loaders launched,groups,per-layer] [--launch eager,graphs]

Writes ``bench_ttft.json`` under ``--out``.  Exits 0 with a message without a GPU, torch or
the CUDA C ABI library.
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastdeploy_kvcache import ops  # noqa: E402

LAYERS, HIDDEN, Q_HEADS, KV_HEADS, HEAD_DIM, MLP = 32, 4096, 32, 8, 128, 14336
BLOCK = 64  # tokens per KV block


def parse_tokens(text: str) -> int:
    text = text.strip().lower()
    return int(float(text[:-1]) * 1024) if text.endswith("k") else int(text)


class Model:
    """The layer stack, its paged device KV cache and a pinned host copy of the prefix KV."""

    def __init__(self, torch: Any, capi: ops.CApi, max_prefix: int, seed: int = 0) -> None:
        self.torch, self.capi = torch, capi
        self.launcher = capi.stack_launcher()  # the "launched" loader's
        g = torch.Generator(device="cuda").manual_seed(seed)
        dt, dev = torch.bfloat16, "cuda"

        def w(i: int, o: int) -> Any:
            return (torch.randn(i, o, generator=g, device=dev, dtype=torch.float32) / i ** 0.5).to(dt)

        self.w_qkv = w(HIDDEN, (Q_HEADS + 2 * KV_HEADS) * HEAD_DIM)
        self.w_o = w(Q_HEADS * HEAD_DIM, HIDDEN)
        self.w_gu = w(HIDDEN, 2 * MLP)
        self.w_down = w(MLP, HIDDEN)
        self.norm = torch.ones(HIDDEN, device=dev, dtype=dt)
        self.nblocks = max_prefix // BLOCK
        self.pool = self.nblocks + 8
        self.block_bytes = BLOCK * KV_HEADS * HEAD_DIM * 2
        # Device KV cache per layer: K and V, [pool, BLOCK, KV_HEADS, HEAD_DIM], views of one
        # allocation in the copy op's tensor order, as the worker allocates it (one pitch).
        kv = torch.empty(LAYERS, 2, self.pool, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=dt)
        self.k = [kv[l, 0] for l in range(LAYERS)]
        self.v = [kv[l, 1] for l in range(LAYERS)]
        rng = np.random.default_rng(seed)
        self.dev_ids = rng.permutation(self.pool)[: self.nblocks].astype(np.int64)  # scattered, as a pool looks
        self.block_table = torch.as_tensor(self.dev_ids, device=dev)
        # Pinned host cache, a buffer per tensor carved from one allocation (the worker's
        # layout), the prefix in one run of host blocks.
        self.host_slab = capi.host_alloc(2 * LAYERS * self.nblocks * self.block_bytes)
        self.host = [self.host_slab + i * self.nblocks * self.block_bytes for i in range(2 * LAYERS)]
        src = torch.randn(self.nblocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g, device=dev).to(dt) * 0.5
        src_cpu = src.cpu()
        for ptr in self.host:  # random prefix KV in the host tier
            ctypes.memmove(ptr, src_cpu.data_ptr(), self.nblocks * self.block_bytes)
        self.prefix_src = src
        self.used_paths: list[int] = []  # last_path() of the loader thread's calls
        self.load_stream = torch.cuda.Stream()

    def close(self) -> None:
        self.torch.cuda.synchronize()
        self.capi.host_free(self.host_slab)

    def fill_device_prefix(self, blocks: int) -> None:
        for l in range(LAYERS):
            self.k[l][self.block_table[:blocks]] = self.prefix_src[:blocks]
            self.v[l][self.block_table[:blocks]] = self.prefix_src[:blocks]

    # ------------------------------------------------------------------ compute
    def attention(self, q: Any, k: Any, v: Any, tq: int, tk: int) -> Any:
        """q [1, 32, tq, 128]; k, v [1, 8, tk, 128]; causal, aligned to the last key."""
        torch = self.torch
        F = torch.nn.functional
        if tq == tk:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        if tq == 1:
            return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        from torch.nn.attention.bias import causal_lower_right

        bias = causal_lower_right(tq, tk)
        try:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, enable_gqa=True)
        except (TypeError, RuntimeError):
            rep = Q_HEADS // KV_HEADS
            return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                                  attn_mask=bias)

    def layer(self, x: Any, l: int, prefix: int, wait: Optional[Any] = None) -> Any:
        """Layer ``l`` over x [T, 4096], T new tokens after ``prefix`` cached tokens."""
        torch = self.torch
        F = torch.nn.functional
        t = x.shape[0]
        blocks = prefix // BLOCK
        h = F.rms_norm(x, (HIDDEN,), self.norm)
        qkv = h @ self.w_qkv
        q = qkv[:, : Q_HEADS * HEAD_DIM].view(t, Q_HEADS, HEAD_DIM).transpose(0, 1).unsqueeze(0)
        k_new = qkv[:, Q_HEADS * HEAD_DIM: (Q_HEADS + KV_HEADS) * HEAD_DIM].view(t, KV_HEADS, HEAD_DIM)
        v_new = qkv[:, (Q_HEADS + KV_HEADS) * HEAD_DIM:].view(t, KV_HEADS, HEAD_DIM)
        if blocks:
            if wait is not None:
                wait(l)  # this layer's prefix KV has arrived (a wait on the GPU)
            bt = self.block_table[:blocks]
            k_pre = self.k[l][bt].view(blocks * BLOCK, KV_HEADS, HEAD_DIM)
            v_pre = self.v[l][bt].view(blocks * BLOCK, KV_HEADS, HEAD_DIM)
            k_all = torch.cat([k_pre, k_new]).transpose(0, 1).unsqueeze(0)
            v_all = torch.cat([v_pre, v_new]).transpose(0, 1).unsqueeze(0)
        else:
            k_all = k_new.transpose(0, 1).unsqueeze(0)
            v_all = v_new.transpose(0, 1).unsqueeze(0)
        o = self.attention(q, k_all, v_all, t, k_all.shape[2])
        x = x + o.squeeze(0).transpose(0, 1).reshape(t, Q_HEADS * HEAD_DIM) @ self.w_o
        h = F.rms_norm(x, (HIDDEN,), self.norm)
        gu = h @ self.w_gu
        return x + (F.silu(gu[:, :MLP]) * gu[:, MLP:]) @ self.w_down

    def forward(self, x: Any, prefix: int, wait: Optional[Any] = None, marks: Optional[list[Any]] = None) -> Any:
        """x [T, 4096]: T new tokens after `prefix` cached tokens (prefix 0: recompute)."""
        for l in range(LAYERS):
            x = self.layer(x, l, prefix, wait)
            if marks is not None:  # --timeline: when layer l's compute ended
                mark = self.torch.cuda.Event(enable_timing=True)
                mark.record()
                marks.append(mark)
        return x[-1:]

    def capture_layers(self, x: Any, prefix: int) -> "LayerGraphs":
        """Each layer of the forward pass over ``x`` as a CUDA graph (``--launch graphs``)."""
        return LayerGraphs(self, x, prefix)

    # ------------------------------------------------------------------ host hit
    def start_load(self, blocks: int, path: Any, loader: str = "groups", timing: bool = False
                   ) -> tuple[list[Any], Callable[[int], Any], threading.Thread]:
        """Loader thread on the load stream, then each layer's event; returns the events and a
        ``ready(l)`` that blocks until layer l's event is recorded, which the compute side
        calls before it enqueues its GPU wait (a wait on an unrecorded event is a no-op).

        ``loader``: ``per-layer`` calls ``swap_all_layers`` once per layer (K and V) from
        Python and records the layer's event after it; ``groups`` issues the whole stack in
        one layer-stack ``run`` that records every layer's event natively; ``launched``
        hands the stack to the library's launcher with one layer-stack ``launch`` from
        this thread (what the worker's CuPy backend does): no loader thread, and the "thread"
        returned only waits for the launch to close."""
        torch = self.torch
        events = [torch.cuda.Event(enable_timing=timing) for _ in range(LAYERS)]
        recorded = [threading.Event() for _ in range(LAYERS)]
        dev_ids = self.dev_ids[:blocks]
        host_ids = np.arange(blocks, dtype=np.int64)
        stream = self.load_stream
        start = torch.cuda.Event()
        start.record(torch.cuda.current_stream())
        dev_ptrs = [t.data_ptr() for l in range(LAYERS) for t in (self.k[l], self.v[l])]

        if loader == "launched":
            for e in events:  # torch makes the CUDA event at its first record
                e.record(stream)
            progress = self.capi.group_progress()
            # The load starts with the step: the launch's own fence (it is enqueued in order).
            call = self.capi.layer_stack_call(self.launcher, dev_ptrs, self.host, 2, self.pool, self.block_bytes,
                                              self.nblocks, ops.CopyDirection.HOST_TO_DEVICE,
                                              stream=stream.cuda_stream, path=path)
            call.launch(dev_ids, host_ids, progress, events=[e.cuda_event for e in events],
                        waits=[start.cuda_event])
            return events, (lambda l: progress.wait(l + 1, 60.0)), _LaunchClosed(progress, self.used_paths, start)

        stream.wait_event(start)  # the load starts with the step
        if loader == "groups":
            for e in events:  # torch makes the CUDA event at its first record
                e.record(stream)
            handles = [e.cuda_event for e in events]

            progress = self.capi.group_progress()

            def run_groups() -> None:
                call = self.capi.layer_stack_call(None, dev_ptrs, self.host, 2, self.pool, self.block_bytes,
                                                  self.nblocks, ops.CopyDirection.HOST_TO_DEVICE,
                                                  stream=stream.cuda_stream, path=path)
                call.run(dev_ids, host_ids, events=handles, progress=progress)
                self.used_paths.append(self.capi.last_path())

            th = threading.Thread(target=run_groups)
            th.start()
            return events, (lambda l: progress.wait(l + 1, 60.0)), th

        def run() -> None:
            for l in range(LAYERS):
                self.capi.swap_all_layers([self.k[l].data_ptr(), self.v[l].data_ptr()],
                                          [self.host[2 * l], self.host[2 * l + 1]], self.pool, self.block_bytes,
                                          self.nblocks, dev_ids, host_ids, ops.CopyDirection.HOST_TO_DEVICE, stream=stream.cuda_stream,
                                          path=path)
                self.used_paths.append(self.capi.last_path())
                events[l].record(stream)
                recorded[l].set()

        th = threading.Thread(target=run)
        th.start()
        return events, (lambda l: recorded[l].wait()), th


class _LaunchClosed:
    """``join()`` of a launched load: waits until the launcher has enqueued all of it."""

    def __init__(self, progress: Any, used_paths: list[int], fence: Any) -> None:
        # The fence event lives until the launch is closed (the launcher may wait on it late).
        self.progress, self.used_paths, self.fence = progress, used_paths, fence

    def join(self) -> None:
        if not self.progress.wait_closed(60.0):
            raise TimeoutError("the launched load was not enqueued within 60 s")
        self.used_paths.append(self.progress.state().paths)


class LayerGraphs:
    """The forward pass over one shape, each layer captured as a CUDA graph: a replay is one
    launch per layer where the eager pass makes about a dozen.

    Why it is measured: while a host-to-device load fills the PCIe link, every kernel launch
    costs the host more (about 6 us per ``cudaLaunchKernel`` on an idle link, about 16 us
    during an 8k-token load, measured on an H200), so an eager pass whose launch time is near
    the load's time becomes bound by its own launches.  Replayed layers take that cost out,
    which shows how much of a host hit's gap over its floor is launch time.  A host hit still
    waits for each layer's load between replays, on the GPU.
    """

    def __init__(self, model: "Model", x: Any, prefix: int) -> None:
        torch = model.torch
        self.torch = torch
        self.static_x = x.clone()
        self.graphs: list[Any] = []
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture (cuBLAS workspaces, kernels)
            h = self.static_x
            for l in range(LAYERS):
                h = model.layer(h, l, prefix)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        h = self.static_x
        for l in range(LAYERS):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                h = model.layer(h, l, prefix)
            self.graphs.append(g)
        self.out = h

    def forward(self, x: Any, wait: Optional[Any] = None) -> Any:
        self.static_x.copy_(x)
        for l, g in enumerate(self.graphs):
            if wait is not None:
                wait(l)
            g.replay()
        return self.out[-1:]


def layer_timeline(torch: Any, model: "Model", compute: Any, x: Any, prefix: int, blocks: int, path: Any,
                   loader: str) -> dict[str, list[float]]:
    """One host hit with timing events: when each layer's load landed and when its compute
    ended, in ms from the step's start on the compute stream (``--timeline``)."""
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    start.record(compute)
    events, ready, th = model.start_load(blocks, path, loader, timing=True)
    marks: list[Any] = []

    def wait(l: int) -> None:
        ready(l)
        compute.wait_event(events[l])

    model.forward(x, prefix, wait, marks)
    th.join()
    torch.cuda.synchronize()
    return {"load_done_ms": [start.elapsed_time(e) for e in events],
            "compute_done_ms": [start.elapsed_time(m) for m in marks]}


def count_syncs(torch: Any, fn: Callable[[], Any]) -> int:
    """Host<->GPU synchronizations torch reports while ``fn`` runs (its sync debug mode)."""
    import warnings

    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return sum(1 for w in caught if "synchroniz" in str(w.message).lower())


def measure_h2d_limit(torch: Any, nbytes: int = 1 << 30) -> float:
    """One contiguous pinned host->device copy (cudaMemcpyAsync under torch's copy_)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    s = torch.cuda.Stream()
    times = []
    with torch.cuda.stream(s):
        for _ in range(4):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(s)
            dev.copy_(host, non_blocking=True)
            b.record(s)
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3)
    torch.cuda.synchronize()
    return nbytes / statistics.median(times[1:]) / 1e9


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prefixes", default="1k,8k,32k")
    p.add_argument("--new", default="1,128,2k")
    p.add_argument("--paths", default="auto,staged", help="copy paths of the host-hit load (per call)")
    p.add_argument("--loaders", default="launched,groups",
                   help="how the host-hit load is issued: launched (one LayerStackCall.launch from the step's "
                        "thread, the worker's way), groups (one LayerStackCall.run from a loader thread) "
                        "and/or per-layer (one Python call per layer from a loader thread)")
    p.add_argument("--reps", type=int, default=9,
                   help="rounds; each round times the device hit, every host hit and every load alone once, "
                        "and each figure is the median over the rounds")
    p.add_argument("--launch", default="eager,graphs",
                   help="how the forward pass is launched: eager (kernel by kernel) and/or graphs (each layer "
                        "replayed from a CUDA graph captured for the row's shape; the floor of each uses the "
                        "device hit launched the same way)")
    p.add_argument("--timeline", action="store_true",
                   help="record when each layer's load landed and its compute ended (one extra host hit per row)")
    p.add_argument("--sync-check", action="store_true",
                   help="count host<->GPU synchronizations in one forward of each kind (torch sync debug mode)")
    p.add_argument("--option", action="append", default=[], metavar="NAME=VALUE", help="set a C library option for this run (CApi.set_option), e.g. dma_rows_min_lanes=2; repeatable")
    p.add_argument("--out", default=os.environ.get("OUT") or "build/bench")
    args = p.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("bench_ttft: skipped (needs torch with CUDA)")
        return 0
    if not torch.cuda.is_available():
        print("bench_ttft: skipped (no CUDA GPU visible)")
        return 0
    try:
        capi = ops.load_capi(variant="cuda")
    except ops.OpsNotBuiltError:
        print("bench_ttft: skipped (needs build/libfdkv_capi.so from `bash build.sh gpu`)")
        return 0
    capi.set_options(args.option)
    prefixes = [parse_tokens(x) for x in args.prefixes.split(",") if x]
    news = [parse_tokens(x) for x in args.new.split(",") if x]
    paths = [x for x in args.paths.split(",") if x]
    loaders = [x for x in args.loaders.split(",") if x]
    launches = [x for x in args.launch.split(",") if x]
    if not launches or set(launches) - {"eager", "graphs"}:
        p.error(f"--launch {args.launch!r}: give eager and/or graphs")
    bad = sorted(set(loaders) - {"launched", "groups", "per-layer"})
    if bad:
        p.error(f"--loaders: {', '.join(bad)} is not a loader (launched, groups, per-layer)")
    torch.backends.cuda.matmul.allow_tf32 = False
    model = Model(torch, capi, max(prefixes))
    limit = measure_h2d_limit(torch)
    name = torch.cuda.get_device_name(0)
    print(f"# bench_ttft on {name}, {time.strftime('%Y-%m-%d')}; contiguous pinned H2D limit {limit:.1f} GB/s",
          flush=True)
    compute = torch.cuda.current_stream()
    g = torch.Generator(device="cuda").manual_seed(1)

    def once(fn: Any) -> float:
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(compute)
        fn()
        b.record(compute)
        b.synchronize()
        return a.elapsed_time(b)

    def timed(fn: Any, reps: int) -> float:
        fn()  # warm-up (cuBLAS handles, kernels, the staging ring)
        return statistics.median(once(fn) for _ in range(reps))

    def timed_together(fns: dict[str, Any], reps: int) -> dict[str, list[float]]:
        """Each function once per round, ``reps`` rounds: the device hit and the host hits it
        is compared with see the same moments of the machine (the host's launch speed drifts
        by tens of percent over seconds, which per-figure batches of repeats turned into
        ratios that moved by as much between runs)."""
        for fn in fns.values():
            fn()  # warm-up
        samples: dict[str, list[float]] = {k: [] for k in fns}
        for _ in range(reps):
            for k, fn in fns.items():
                samples[k].append(once(fn))
        return samples

    def host_hit(blocks: int, path: Any, loader: str, forward: Any) -> None:
        events, ready, th = model.start_load(blocks, path, loader)

        def wait(l: int) -> None:
            ready(l)
            compute.wait_event(events[l])

        forward(wait=wait)
        th.join()

    def load_alone(blocks: int, path: Any, loader: str) -> None:
        events, _, th = model.start_load(blocks, path, loader)
        th.join()
        compute.wait_event(events[-1])

    rows = []
    try:
        for prefix in prefixes:
            blocks = prefix // BLOCK
            kv_bytes = 2 * LAYERS * blocks * model.block_bytes
            for new in news:
                reps = args.reps if prefix + new <= 10000 else max(2, args.reps // 2)
                x_all = torch.randn(prefix + new, HIDDEN, generator=g, device="cuda").to(torch.bfloat16)
                x_new = x_all[prefix:].contiguous()
                t_re = timed(lambda: model.forward(x_all, 0), reps)
                model.fill_device_prefix(blocks)
                forwards: dict[str, Any] = {"": functools.partial(model.forward, x_new, prefix)}
                if "graphs" in launches:
                    try:
                        forwards["/graphs"] = functools.partial(model.capture_layers(x_new, prefix).forward, x_new)
                    except RuntimeError as exc:  # a capture the driver refuses: the eager figures stand
                        print(f"prefix {prefix} new {new}: layers not captured ({exc})", flush=True)
                if "eager" not in launches:
                    del forwards[""]
                fns: dict[str, Any] = {}
                for mode, fwd in forwards.items():
                    fns[f"device{mode}"] = fwd
                    for path, loader in [(pa, lo) for lo in loaders for pa in paths]:
                        fns[f"host {loader}/{path}{mode}"] = functools.partial(host_hit, blocks, path, loader, fwd)
                for path, loader in [(pa, lo) for lo in loaders for pa in paths]:
                    fns[f"load {loader}/{path}"] = functools.partial(load_alone, blocks, path, loader)
                samples = timed_together(fns, reps)
                first = next(iter(forwards))
                t_dev = statistics.median(samples[f"device{first}"])
                syncs = count_syncs(torch, lambda: model.forward(x_new, prefix)) if args.sync_check else None
                row: dict[str, Any] = {"prefix": prefix, "new": new, "kv_bytes": kv_bytes, "recompute_ms": t_re,
                                       "device_hit_ms": t_dev, "device_hit_samples_ms": samples[f"device{first}"],
                                       "h2d_limit_GBps": limit, "pcie_floor_ms": kv_bytes / limit / 1e6, "host_hit": {},
                                       "device_hit_syncs": syncs}
                if "/graphs" in forwards:
                    row["device_hit_graphs_ms"] = statistics.median(samples["device/graphs"])
                row["floor_ms"] = max(t_dev, row["pcie_floor_ms"])
                for (path, loader), mode in [((pa, lo), m) for lo in loaders for pa in paths for m in forwards]:
                    key = f"{loader}/{path}{mode}"
                    t_dev = statistics.median(samples[f"device{mode}"])
                    floor = max(t_dev, row["pcie_floor_ms"])
                    t_host = statistics.median(samples[f"host {key}"])
                    t_load = statistics.median(samples[f"load {loader}/{path}"])
                    timeline = None
                    if args.timeline and not mode:
                        timeline = layer_timeline(torch, model, compute, x_new, prefix, blocks, path, loader)
                    used = sorted(set(model.used_paths))
                    model.used_paths.clear()
                    row["host_hit"][key] = {"ms": t_host, "load_alone_ms": t_load,
                                             "samples_ms": samples[f"host {key}"], "timeline": timeline, "device_hit_ms": t_dev, "floor_ms": floor,
                                             "ratio_to_floor": t_host / floor,
                                             "ratio_to_recompute": t_host / t_re, "paths_used": used}
                    print(f"prefix {prefix:>6} new {new:>5}: recompute {t_re:8.2f} ms  device hit {t_dev:7.2f} ms  "
                          f"PCIe floor {row['pcie_floor_ms']:6.2f} ms  syncs {syncs}  host hit [{key}] {t_host:7.2f} ms  "
                          f"host/floor {t_host / floor:.3f}  host/recompute {t_host / t_re:.3f} load alone {t_load:.2f} ms "
                          f"used={used}",
                          flush=True)
                rows.append(row)
    finally:
        model.close()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    report = {"device": name, "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "options": list(args.option),
              "h2d_limit_GBps": limit, "layers": LAYERS, "rows": rows}
    (out / "bench_ttft.json").write_text(json.dumps(report, indent=1))
    print("| prefix + new | recompute ms | device hit ms (same launch) | KV / H2D limit ms | host hit ms (loader/path[/graphs]) "
          "| host / floor "
          "| host / recompute |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        for path, h in r["host_hit"].items():
            print(f"| {r['prefix']} + {r['new']} | {r['recompute_ms']:.1f} | {h['device_hit_ms']:.1f} | "
                  f"{r['pcie_floor_ms']:.1f} | {h['ms']:.1f} ({path}) | {h['ratio_to_floor']:.3f} | "
                  f"{h['ratio_to_recompute']:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
