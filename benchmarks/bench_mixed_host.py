"""Host work of a mixed step through the piecewise graphs, counted on the CPU.

A step of decodes beside a prompt chunk, through the transformers runner's piecewise graphs
(``engine/transformers_runner/piecewise_graphs.py``) with the pieces called, not replayed
(no GPU needed).  On a GPU the pieces are graph replays; what the host does besides them is
building the step's inputs, each layer's attention between two pieces, and the logits and
sampling.  Every torch op the host dispatches there costs it a few microseconds on a GPU
(Python, the dispatcher, a kernel launch), so the figure to keep small is the number of ops
between pieces per layer, times the layers.

The model is ``tiny-llama-random`` (4 layers): the counts per layer are an 8B model's too,
since the attention's host work does not depend on the widths.  Reported per step:

* aten ops dispatched (a ``TorchDispatchMode`` counting, one step) in each region:
  ``build`` (the step's indices and their upload), ``between`` (everything the piecewise run
  does outside its pieces), split into each layer's ops (between two consecutive pieces) and
  the step's once-per-step ones; ``head`` (``lm_head`` on the sampled rows and the rest of
  the forward pass around the run) and ``sample`` (the device sampling's ops, run here on
  CPU tensors).  Ops inside the pieces and the Triton kernels are not counted; each Triton
  launch is counted apart;
* host time of each region (median of ``--repeat`` steps without the counter, cyclic GC
  off inside them, one torch thread).  On the CPU a region's time includes its ops' own
  compute (asynchronous on a GPU): with a small ``--chunk`` it is mostly dispatch cost.

``--attention triton`` (the GPU's path) takes the Triton kernels, in Triton's CPU
interpreter; ``--kernels stub`` (the default) counts each launch and skips it, so the host
time holds the kernels' Python wrappers but not the interpreter (``interpret`` runs them).
``--attention torch``: the torch fallback.  ``--baseline-ref REF`` runs the same harness,
in the same run, against the package at git commit ``REF`` (``git archive`` into a
temporary folder, in a subprocess) and prints both and their ratio.

    PYTHONPATH=. /path/to/python benchmarks/bench_mixed_host.py [--chunk 64] [--baseline-ref REF]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parent.parent
REGIONS = ("build", "between", "head", "sample")


def _args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decodes", type=int, default=32)
    ap.add_argument("--context", type=int, default=128, help="each decode's tokens of context")
    ap.add_argument("--chunk", type=int, default=2048, help="the prompt chunk's tokens (nothing cached before it)")
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--attention", choices=("triton", "torch"), default="triton")
    ap.add_argument("--kernels", choices=("stub", "interpret"), default="stub",
                    help="with --attention triton: each Triton launch counted and skipped (stub: the host "
                         "times are the GPU's host work), or run in the interpreter (real outputs, slow)")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--baseline-ref", default=None, help="git commit to measure too, in a subprocess")
    ap.add_argument("--json", action="store_true", help="print one JSON line of the figures only")
    return ap.parse_args(argv)


def measure(a: argparse.Namespace) -> dict[str, Any]:
    """The figures of one tree (the one on ``sys.path``)."""
    if a.attention == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.sampling import RequestSampler, SamplingParams, StepSampling
    from fastdeploy_kvcache.engine.transformers_runner import piecewise_graphs as pg
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner
    from fastdeploy_kvcache.engine.transformers_runner.torch_sampling import sample_on_device

    # One thread: the host's own cost, not how a loaded machine schedules torch's thread pool.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    lm = load_torch_model("tiny-llama-random", seed=0, device=torch.device("cpu"), dtype="float32")
    runner = TorchModelRunner(lm, a.block_size, "cpu", attention=a.attention, fused_layers=True)
    tokens = a.decodes + a.chunk
    assert runner.enable_piecewise_graphs(tokens, capture=False)
    bs = a.block_size
    nb_seq = -(-(a.context + 1) // bs)
    nb_chunk = -(-a.chunk // bs)
    num_blocks = a.decodes * nb_seq + nb_chunk + 1
    gen = torch.Generator().manual_seed(1)
    shape = (num_blocks, lm.num_kv_heads, bs, lm.head_dim)
    caches = [[torch.randn(shape, generator=gen) for _ in range(2)] for _ in range(lm.num_layers)]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    seqs = [ScheduledSeq([i + 1], a.context, perm[i * nb_seq:(i + 1) * nb_seq], True) for i in range(a.decodes)]
    seqs.append(ScheduledSeq([(7 * t) % 500 + 1 for t in range(a.chunk)], 0,
                             perm[a.decodes * nb_seq:a.decodes * nb_seq + nb_chunk], True))
    sampling = StepSampling.for_samplers([RequestSampler(SamplingParams(temperature=0.0), 0)] * len(seqs))

    state: dict[str, Any] = {"region": None, "paused": 0}
    counts: dict[str, int] = {}
    names: dict[str, dict[str, int]] = {}
    times: dict[str, float] = {}
    launches = [0]

    class Counter(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            region = state["region"]
            if region is not None and not state["paused"]:
                counts[region] = counts.get(region, 0) + 1
                per = names.setdefault(region, {})
                key = str(func.overloadpacket.__name__)
                per[key] = per.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    # At each piece's start and end: (ops counted between pieces so far, time, time left out).
    marks: list[tuple[str, int, float, float]] = []

    def paused(fn: Callable[..., Any], launch: bool) -> Callable[..., Any]:
        """``fn`` with its own ops and time left out of the regions (a piece, a kernel)."""
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if launch:
                launches[0] += 1
            else:
                marks.append(("start", counts.get("between", 0), time.perf_counter(), state["left_out_s"]))
            state["paused"] += 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                state["left_out_s"] += time.perf_counter() - t0
                state["paused"] -= 1
                if not launch:
                    marks.append(("end", counts.get("between", 0), time.perf_counter(), state["left_out_s"]))
        return wrapper

    def layer_gaps() -> tuple[list[int], float]:
        """Ops and host seconds between consecutive pieces: each layer's attention."""
        ops, secs = [], 0.0
        for end, start in zip(marks[1::2], marks[2::2]):
            ops.append(start[1] - end[1])
            secs += (start[2] - end[2]) - (start[3] - end[3])
        return ops, secs

    def region(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            prev, state["region"] = state["region"], name
            left_before = state["left_out_s"]
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0 - (state["left_out_s"] - left_before)
                times[name] = times.get(name, 0.0) + dt
                state["region"] = prev
                # The enclosing region does not count this one's time.
                state["left_out_s"] += dt
        return wrapper

    graphs = runner.piecewise_graphs
    graphs.piece = paused(graphs.piece, launch=False)
    graphs.run = region("between", graphs.run)
    runner._build = region("build", runner._build)
    if a.attention == "triton":
        from fastdeploy_kvcache.engine.transformers_runner import triton_paged_attention as tpa

        for name in ("_decode_kernel", "_combine_kernel", "_prefill_kernel"):
            jit = getattr(tpa, name)
            setattr(tpa, name, _Launches(jit, a.kernels == "stub", paused))
    forward_logits = region("head", runner._forward_logits)
    sample = region("sample", lambda logits: sample_on_device(torch, logits, sampling,
                                                              torch.from_numpy(sampling.packed())))

    def step(count: bool) -> None:
        marks.clear()
        counts.clear()
        names.clear()
        times.clear()
        launches[0] = 0
        state["left_out_s"] = 0.0
        with torch.inference_mode():
            if count:
                with Counter():
                    sample(forward_logits(seqs, caches, None))
            else:
                sample(forward_logits(seqs, caches, None))

    # Counted once (the mode's own Python cost would distort the times), timed without it.
    step(count=False)  # warm-up
    step(count=True)
    counted = (dict(counts), launches[0], {k: dict(v) for k, v in names.items()})
    gap_ops = layer_gaps()[0]
    runs, gap_s = [], []
    for _ in range(a.repeat):
        # No cyclic GC inside a timed step: the interpreter's garbage would land its pauses on
        # whatever op comes next.
        gc.collect()
        gc.disable()
        try:
            step(count=False)
        finally:
            gc.enable()
        runs.append(dict(times))
        gap_s.append(layer_gaps()[1])
    layers = lm.num_layers
    res: dict[str, Any] = {
        "layers": layers, "tokens": tokens, "bucket": graphs.bucket_for(tokens).size, "attention": a.attention,
        "ops": {r: counted[0].get(r, 0) for r in REGIONS},
        "ops_between_per_layer": counted[0].get("between", 0) / layers,
        # Each layer's own ops (between two pieces) and the step's once-per-step ones.
        "ops_per_layer": sorted(set(gap_ops)),
        "ops_between_once": counted[0].get("between", 0) - sum(gap_ops),
        "layers_us": statistics.median(gap_s) * 1e6,
        "launches_per_layer": counted[1] / layers,
        "us": {r: statistics.median(t.get(r, 0.0) for t in runs) * 1e6 for r in REGIONS},
        "between_ops_by_name": counted[2].get("between", {}),
        "build_ops_by_name": counted[2].get("build", {}),
    }
    res["between_us_per_layer"] = res["layers_us"] / layers
    return res


class _Launches:
    """A Triton kernel as the harness sees it: ``kernel[grid](...)`` counted as one launch,
    its time and ops left out, and (``stub``) skipped: the wrapper's own Python before the
    launch still counts, as on a GPU."""

    def __init__(self, jit: Any, stub: bool, paused: Callable[..., Any]) -> None:
        self.jit, self.stub, self.paused = jit, stub, paused

    def __getitem__(self, grid: Any) -> Callable[..., Any]:
        if self.stub:
            return self.paused(lambda *args, **kwargs: None, launch=True)
        return self.paused(self.jit[grid], launch=True)


def _baseline(a: argparse.Namespace) -> dict[str, Any]:
    """This harness over the package at ``a.baseline_ref``, in a subprocess."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.baseline_ref, "fastdeploy_kvcache"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        argv = [sys.executable, __file__, "--json", "--decodes", str(a.decodes), "--context", str(a.context),
                "--chunk", str(a.chunk), "--block-size", str(a.block_size), "--attention", a.attention,
                "--kernels", a.kernels,
                "--repeat", str(a.repeat)]
        env = dict(os.environ, PYTHONPATH=tmp)
        out = subprocess.run(argv, check=True, capture_output=True, text=True, env=env, cwd=tmp)
        return json.loads(out.stdout.strip().splitlines()[-1])


def _show(label: str, r: dict[str, Any]) -> None:
    ops, us = r["ops"], r["us"]
    print(f"{label}: {r['tokens']} tokens (bucket {r['bucket']}), {r['layers']} layers, attention {r['attention']}")
    per_layer = "/".join(map(str, r["ops_per_layer"]))
    print(f"  aten ops  build {ops['build']}, between pieces {ops['between']} ({per_layer} per layer, "
          f"+ {r['launches_per_layer']:.1f} kernel launches; {r['ops_between_once']} once per step), "
          f"head {ops['head']}, sample {ops['sample']}")
    print(f"  host us   build {us['build']:.0f}, between pieces {us['between']:.0f} "
          f"({r['between_us_per_layer']:.0f} per layer), head {us['head']:.0f}, sample {us['sample']:.0f}")
    top = sorted(r["between_ops_by_name"].items(), key=lambda kv: -kv[1])
    print("  between-pieces ops by name: " + ", ".join(f"{k} {v}" for k, v in top))


def main() -> int:
    a = _args()
    sys.path.insert(0, os.environ.get("PYTHONPATH", "").split(os.pathsep)[0] or str(ROOT))
    if a.attention == "triton":
        os.environ["TRITON_INTERPRET"] = "1"  # read once, when Triton is first imported
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        print("bench_mixed_host: needs torch and transformers; skipped")
        return 0
    res = measure(a)
    if a.json:
        print(json.dumps(res))
        return 0
    base = _baseline(a) if a.baseline_ref else None
    if base is not None:
        _show(f"baseline {a.baseline_ref}", base)
    _show("current", res)
    if base is not None:
        b, c = max(base["ops_per_layer"]), max(res["ops_per_layer"])
        print(f"ops per layer between pieces: {c} vs {b} ({c / b:.2f}x); host us between pieces "
              f"{res['us']['between']:.0f} vs {base['us']['between']:.0f} "
              f"({res['us']['between'] / max(base['us']['between'], 1e-9):.2f}x); build {res['us']['build']:.0f} vs "
              f"{base['us']['build']:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
