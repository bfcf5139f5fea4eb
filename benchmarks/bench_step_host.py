"""Host time of one engine step with a model that costs nothing: scheduler, cache manager,
worker submit, finished copies and sampling, at a steady 32 and 64 running requests.

On a GPU the model's forward pass is asynchronous and a decode step takes a few to tens of
milliseconds; whatever the host spends around it (``LLMEngine._step``'s phases, see
``engine/step_timing.py``) is added to every step.  This benchmark runs the real engine
(``LLMEngine`` on the CPU: the ``ManagedKVPool`` with its ``CacheManager``, a device and a host
tier, the worker's ``CacheController`` with its copies, the per-request samplers and
detokenizers, the output callbacks) with the model runner replaced by a null runner: it
returns a precomputed logits row per sampled request (the tiny random Llama's 512-token
vocabulary) and waits for the step's host->device loads to land, nothing else.

Workload: multi-turn conversations over a few shared system prompts.  Each request is the
conversation so far plus 16-96 new tokens and answers 16-160 tokens greedily (eos ignored);
a finished turn is followed at once by the next turn of an idle conversation, so the engine
keeps the target number of requests running, with a few arrivals (prefills) and finishes
every step.  The device pool holds the running requests and a little more, so idle
conversations are evicted to the host tier and come back as host hits.

Reported per step (mean microseconds over the measured steps, each with the target number
of requests running): the phases ``schedule``, ``submit``, ``launch``, ``complete`` and
``sample`` as the engine records them (``launch``: the step's sequences built for the runner,
plus the null runner), ``other`` (the inbox, the stats refresh and the event flush), and
``host`` = all of them; ``gc``: the part of them that CPython's cyclic GC took (shown, not
added).  The engine is driven as its thread's loop drives it (inbox, then
``_step``).  Baselines from the same run:

* ``floor``: a bare loop that does for each running request what any Python engine must
  (append a token, build an output, call the request's callback), per step;
* ``budget``: 3% of a 15 ms decode step (a CUDA-graph decode step on an H100), 450 µs;
* with ``--baseline-ref REF``: the same measurement on the package as it was at git commit
  ``REF`` (exported with ``git archive`` into a temporary folder), interleaved round by round
  with the current tree, and the ratio current / REF per phase.

With ``--server-loop`` the outputs go to an asyncio loop on another thread, as in the server
(``entrypoints/openai/engine_client.py``), which serialises each as a streamed chunk: the
server's share of the GIL shows in the engine's phases where it lands inside them.  With
``--gpu-step-ms`` the null runner sleeps that long per step, as the host waits for a GPU (the
GIL is free meanwhile; reported as ``gpu_wait``, not host time).  With ``--model-impl transformers``
the torch path runs instead (``--device gpu``: the worker's copies on the GPU;
``--model llama3-8b-random`` sizes the cache like an 8B model's).

Usage: python benchmarks/bench_step_host.py [--running 32,64] [--steps 400] [--rounds 5]
           [--server-loop] [--baseline-ref <commit>] [--json benchmarks/results/<name>.json]
       python benchmarks/bench_step_host.py --quick     # seconds: 60 steps, 1 round

Needs paddlepaddle, paddleformers and the compiled Paddle custom ops (``bash build.sh``), or
torch and transformers with ``--model-impl transformers``; exits 0 with a message without them.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

# A --baseline-ref child imports the package from the exported tree, not from this checkout.
ROOT = Path(os.environ.get("FDKV_BENCH_PACKAGE_ROOT") or Path(__file__).resolve().parents[1])
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

PHASES = ("schedule", "submit", "launch", "complete", "sample", "other")
BUDGET_US = 0.03 * 15_000.0  # 3% of a 15 ms step
BLOCK = 16
VOCAB_ROWS = 257  # distinct precomputed logits rows (a prime, so rows do not repeat in step)


class NullRunner:
    """The ``ModelRunner`` protocol (``engine/runner.py``) at no cost: precomputed logits rows.

    It still waits for the step's host->device loads (``wait_all``), as the real forward
    pass does layer by layer, so the copies complete as they would.
    """

    last_layers_waited = 0
    last_gpu_wait_s = 0.0
    last_load_wait_gpu_s = 0.0
    last_step_replayed = False

    def __init__(self, vocab: int, seed: int, gpu_step_s: float = 0.0) -> None:
        self.gpu_step_s = gpu_step_s
        rng = np.random.default_rng(seed)
        self.table = rng.standard_normal((VOCAB_ROWS + 256, vocab)).astype(np.float32)
        self.calls = 0

    def forward(self, seqs: list[Any], kv_caches: Any, layer_done: Optional[Any]) -> np.ndarray:
        if layer_done is not None:
            layer_done.wait_all()
        if self.gpu_step_s:
            # The device's share of the step: the host sleeps (GIL released), as it waits for
            # a GPU; reported as gpu_wait, not host time.
            t = time.perf_counter()
            time.sleep(self.gpu_step_s)
            self.last_gpu_wait_s = time.perf_counter() - t
        n = sum(1 for s in seqs if s.wants_logits)
        self.calls += 1
        off = self.calls % VOCAB_ROWS
        return self.table[off : off + n]

    def forward_sample(self, seqs: list[Any], kv_caches: Any, layer_done: Optional[Any], sampling: Any) -> np.ndarray:
        return sampling.sample_host(self.forward(seqs, kv_caches, layer_done))


def num_running(engine: Any) -> int:
    """The engine's running requests.  A ``--baseline-ref`` tree may predate the engine's
    ``Scheduler`` and keep its queue on the engine (``engine.running``)."""
    scheduler = getattr(engine, "scheduler", None)
    return scheduler.num_running if scheduler is not None else len(engine.running)


class GcMeter:
    """Seconds CPython's cyclic GC ran while installed in ``gc.callbacks``, and its passes per generation."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.passes = [0, 0, 0]
        self._start = 0.0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._start = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._start
            self.passes[info["generation"]] += 1


class ServerLoop:
    """An asyncio loop on its own thread that receives the outputs as the server's does: through
    ``LoopHandoff`` where the measured tree has it, else one ``call_soon_threadsafe`` per output.
    Each output is serialised there as a streamed chunk, competing for the GIL as in the server."""

    def __init__(self) -> None:
        import asyncio
        import threading

        self.asyncio = asyncio
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bench-loop", daemon=True)
        self.thread.start()
        self.flush: Optional[Any] = None
        try:
            from fastdeploy_kvcache.entrypoints.openai.engine_client import LoopHandoff
        except ImportError:  # a tree from before it
            self.hand = self.loop.call_soon_threadsafe
        else:
            handoff = LoopHandoff.of(self.loop)
            self.hand = handoff.call
            if hasattr(handoff, "wait_for_flush"):  # as the server sets it up (AsyncEngineClient.start)
                handoff.wait_for_flush()
                self.flush = handoff.flush

    def attach(self, engine: Any) -> None:
        """Let ``engine`` wake the loop once per step, as the server does."""
        if self.flush is not None:
            engine.add_output_flush_hook(self.flush)

    def sync(self) -> None:
        """Wait until the loop has run everything handed to it so far."""
        self.asyncio.run_coroutine_threadsafe(self.asyncio.sleep(0), self.loop).result()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()
        self.loop.close()


class Workload:
    """Keeps ``running`` requests in the engine: a finished turn starts another one."""

    def __init__(self, engine: Any, running: int, seed: int, max_len: int, server: Optional[ServerLoop] = None) -> None:
        from fastdeploy_kvcache.engine.sampling import SamplingParams

        self.engine = engine
        self.params_cls = SamplingParams
        self.rng = random.Random(seed)
        self.max_len = max_len
        self.target = running
        vocab = engine.loaded.vocab_size
        self.vocab = vocab
        self.system = [[self.rng.randrange(vocab) for _ in range(self.rng.randint(64, 320))] for _ in range(4)]
        self.idle: list[list[int]] = [list(self.rng.choice(self.system)) for _ in range(running * 4)]
        self.live: dict[str, list[int]] = {}  # request id -> its conversation (prompt + output so far)
        self.finished: list[str] = []
        self.next_id = 0
        self.outputs = 0
        self.server = server
        self.chunks = 0

    def on_output(self, out: Any) -> None:
        if self.server is not None:
            self.server.hand(self._record, out)
        else:
            self._record(out)

    def _record(self, out: Any) -> None:
        if self.server is not None:  # what the server does per output: a streamed chunk
            self.chunks += len(json.dumps({"id": out.request_id, "choices": [{"index": 0, "text": out.text}]}))
        conv = self.live[out.request_id]
        conv.extend(out.new_token_ids)
        self.outputs += 1
        if out.finished:
            self.finished.append(out.request_id)

    def refill(self) -> None:
        """Retire finished turns and add new ones until ``target`` requests are live."""
        for rid in self.finished:
            conv = self.live.pop(rid)
            if len(conv) > self.max_len - 512:
                conv = list(self.rng.choice(self.system))
            self.idle.append(conv)
        self.finished.clear()
        while len(self.live) < self.target:
            conv = self.idle.pop(self.rng.randrange(len(self.idle)))
            conv = conv + [self.rng.randrange(self.vocab) for _ in range(self.rng.randint(16, 96))]
            rid = f"r{self.next_id}"
            self.next_id += 1
            self.live[rid] = conv
            params = self.params_cls(max_tokens=self.rng.randint(16, 160), temperature=0.0, ignore_eos=True)
            self.engine.add_request(rid, list(conv), params, self.on_output)


def build_engine(running: int, seed: int, model_impl: str = "paddleformers", device: str = "cpu",
                 model: str = "tiny-llama-random", gpu_step_ms: float = 0.0) -> Any:
    """An engine over ``model``, its runner replaced by :class:`NullRunner`.

    ``paddleformers``: the tiny random Llama on the CPU (Paddle).  ``transformers``: the torch
    path, where the worker's copies run on a GPU with ``device="gpu"`` (the model's own
    shapes size the KV cache, so ``llama3-8b-random`` copies what an 8B model would).
    """
    os.environ["ENABLE_V1_KVCACHE_MANAGER"] = "1"
    from fastdeploy_kvcache.config import AUTO_DTYPE, CacheConfig
    from fastdeploy_kvcache.engine.args import EngineArgs
    from fastdeploy_kvcache.engine.llm_engine import LLMEngine

    if model_impl == "paddleformers":
        from fastdeploy_kvcache.engine.model_loader import build_tiny_llama

        loaded = build_tiny_llama(seed=0)
    else:
        from fastdeploy_kvcache.engine.transformers_runner import torch_runner

        probe = EngineArgs(model=model, model_impl=model_impl, device=device, seed=0)
        loaded = torch_runner.load_model_for(probe, torch_runner.select_device(device))
    max_len = 2048
    # A live turn holds about 30 blocks on average: the device pool holds the running
    # requests and little more, the host tier 4x more, so idle conversations move to host.
    device_blocks = running * 40
    cache = CacheConfig(dtype=AUTO_DTYPE, block_size=BLOCK, num_gpu_blocks=device_blocks,
                        num_host_blocks=device_blocks * 4, write_policy="write_through_selective")
    args = EngineArgs(model=model, max_model_len=max_len, max_num_seqs=running, model_impl=model_impl,
                      max_num_batched_tokens=2048, cache=cache, device=device, seed=seed)
    engine = LLMEngine(args, loaded_model=loaded)
    engine.runner = NullRunner(loaded.vocab_size, seed, gpu_step_ms / 1000.0)
    return engine, max_len


def floor_us(running: int, steps: int) -> float:
    """Per step: what any Python engine does per running request (token, output, callback)."""

    class Out:
        __slots__ = ("request_id", "new_token_ids", "text", "finished")

        def __init__(self, rid: str, tokens: list[int], text: str) -> None:
            self.request_id, self.new_token_ids, self.text, self.finished = rid, tokens, text, False

    reqs = [(f"r{i}", []) for i in range(running)]
    sink: list[Any] = []
    t = time.perf_counter()
    for s in range(steps):
        for rid, toks in reqs:
            toks.append(s)
            sink.append(Out(rid, [s], ""))
        sink.clear()
    return (time.perf_counter() - t) / steps * 1e6


def measure(running: int, steps: int, seed: int, profile: Optional[str] = None,
            engine_kw: Optional[dict[str, str]] = None) -> dict[str, Any]:
    """Mean µs per phase over ``steps`` steps with ``running`` requests running."""
    kw = dict(engine_kw or {})
    server = ServerLoop() if kw.pop("server_loop", False) else None
    engine, max_len = build_engine(running, seed, **kw)
    if server is not None:
        server.attach(engine)
    load = Workload(engine, running, seed, max_len, server)
    # What the engine thread's loop runs per step: the inbox, then the step, each followed by
    # the output flush where the tree has one.
    flush = getattr(engine, "_flush_outputs", lambda: None)

    def one_step() -> None:
        engine._drain_inbox()
        if not num_running(engine):
            flush()
        engine._step()
        if not num_running(engine):
            flush()

    st = engine.step_times
    # Warm-up: fill the engine and let conversations cycle through the host tier.
    warm = max(200, steps // 2)
    for _ in range(warm):
        if server is not None:
            flush()
            server.sync()
        load.refill()
        one_step()
    sums = {p: 0.0 for p in PHASES}
    counted = 0
    gc_meter = GcMeter()
    prof = None
    if profile:
        import cProfile

        prof = cProfile.Profile()
    gc.collect()
    gc.callbacks.append(gc_meter)
    pc = time.perf_counter
    while counted < steps:
        if server is not None:
            # The last step's outputs are in before the workload reads them.  Where the engine
            # hands them over as the next forward starts, this flush comes first (untimed): on
            # a GPU the loop's work runs while the engine waits for the device.
            flush()
            server.sync()
        load.refill()
        before = dict(st._all)
        a = pc()
        if prof is not None:
            prof.enable()
        one_step()
        if prof is not None:
            prof.disable()
        total = pc() - a
        after = st._all
        if after["steps"] == before["steps"] or num_running(engine) < running:
            continue  # a step with fewer running (a preemption, or nothing scheduled)
        ph = {p: after[f"{p}_s"] - before[f"{p}_s"] for p in ("schedule", "submit", "launch", "gpu_wait",
                                                               "complete", "sample")}
        for p in ("schedule", "submit", "launch", "complete", "sample"):
            sums[p] += ph[p]
        sums["other"] += total - sum(ph.values())
        counted += 1
    gc.callbacks.remove(gc_meter)
    stats = engine.get_stats()
    cache = stats.get("cache", {})
    result = {p: sums[p] / counted * 1e6 for p in PHASES}
    result["host"] = sum(result[p] for p in PHASES)
    # Cyclic GC passes land inside the phases above (and in the workload's refill between
    # steps, a small share): shown on their own, not added.
    result["gc"] = gc_meter.seconds / counted * 1e6
    result["gc_passes"] = gc_meter.passes
    result["steps"] = counted
    result["hit_rate"] = cache.get("hit_rate")
    result["host_hit_tokens"] = cache.get("matched_tokens_host")
    result["swap_in_blocks"] = cache.get("swap_in_blocks")
    result["finished"] = stats["engine"]["num_finished"]
    engine.shutdown()
    if server is not None:
        server.close()
    if prof is not None:
        prof.dump_stats(profile)
    return result


def child_main(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    kw = {"model_impl": args.model_impl, "device": args.device, "model": args.model, "server_loop": args.server_loop,
          "gpu_step_ms": args.gpu_step_ms}
    out = {str(n): measure(n, args.steps, args.seed, args.profile, kw) for n in args.running_list}
    print("RESULT " + json.dumps(out))


def run_child(package_root: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ, FDKV_BENCH_PACKAGE_ROOT=str(package_root), PYTHONPATH=str(package_root))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--running", args.running,
           "--steps", str(args.steps), "--seed", str(args.seed), "--model-impl", args.model_impl,
           "--device", args.device, "--model", args.model, "--gpu-step-ms", str(args.gpu_step_ms)]
    cmd += ["--server-loop"] if args.server_loop else []
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"bench_step_host: the run on {package_root} failed:\n{proc.stderr[-4000:]}")
    return json.loads(line[len("RESULT "):])


def export_ref(ref: str, into: Path) -> Path:
    """The package at ``ref`` (git archive) with this checkout's compiled ops (build/)."""
    here = Path(__file__).resolve().parents[1]
    archive = subprocess.run(["git", "-C", str(here), "archive", ref], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    (into / "build").symlink_to(here / "build")
    return into


def _missing_dependency(model_impl: str) -> str:
    """What the engine path lacks here ('' when it can run)."""
    import importlib.util

    names = ("paddle", "paddleformers") if model_impl == "paddleformers" else ("torch", "transformers")
    for name in names:
        if importlib.util.find_spec(name) is None:
            return f"{name} is not installed"
    if model_impl != "paddleformers":
        return ""
    from fastdeploy_kvcache import ops

    return "" if ops.paddle_ops_available() else "the compiled Paddle custom ops are missing"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--running", default="32,64", help="running-request counts, comma-separated")
    parser.add_argument("--steps", type=int, default=400, help="measured steps per count and round")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median per phase)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-ref", default="", help="git commit to measure against in the same run")
    parser.add_argument("--baseline-tree", type=Path, default=None,
                        help="instead of --baseline-ref where there is no git history: a folder holding the "
                             "package to measure against (git archive REF fastdeploy_kvcache setup_ops.py), "
                             "with a build/ of the compiled libraries")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--profile", default=None, help="(child) cProfile the measured steps into this file")
    parser.add_argument("--quick", action="store_true", help="smoke run: 60 steps, 1 round")
    parser.add_argument("--server-loop", action="store_true",
                        help="outputs go to an asyncio loop thread as in the server (see ServerLoop)")
    parser.add_argument("--gpu-step-ms", type=float, default=0.0,
                        help="the null runner sleeps this long per step (GIL released), as the host waits for a GPU")
    parser.add_argument("--model-impl", choices=("paddleformers", "transformers"), default="paddleformers",
                        help="the engine path: Paddle on the CPU, or torch (the GPU path; --device gpu)")
    parser.add_argument("--device", default="cpu", help="cpu, or gpu with --model-impl transformers")
    parser.add_argument("--model", default="tiny-llama-random",
                        help="with --model-impl transformers: llama3-8b-random sizes the cache like an 8B model")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds = 60, 1
    args.running_list = [int(x) for x in args.running.split(",")]
    missing = _missing_dependency(args.model_impl)
    if missing:
        print(f"bench_step_host: skipped, {missing} (bash build.sh)")
        return
    if args.child or args.profile:
        child_main(args)
        return
    from tqdm import tqdm

    here = Path(__file__).resolve().parents[1]
    trees = {"current": here}
    tmp = None
    if args.baseline_ref:
        tmp = tempfile.TemporaryDirectory(prefix="bench_step_host_")
        trees[args.baseline_ref] = export_ref(args.baseline_ref, Path(tmp.name))
    elif args.baseline_tree is not None:
        args.baseline_ref = str(args.baseline_tree)
        trees[args.baseline_ref] = args.baseline_tree.resolve()
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in trees}
    started = time.perf_counter()
    with tqdm(total=args.rounds * len(trees), desc="bench_step_host", unit="run") as bar:
        for _ in range(args.rounds):
            for name, root in trees.items():
                runs[name].append(run_child(root, args))
                bar.update(1)
    floors = {n: statistics.median(floor_us(n, 2000) for _ in range(5)) for n in args.running_list}
    keys = PHASES + ("host", "gc")
    med = {name: {n: {k: statistics.median(r[str(n)][k] for r in rs) for k in keys}
                  for n in args.running_list} for name, rs in runs.items()}
    lines = [f"bench_step_host: {args.model_impl} on {args.device} ({args.model})"
             f"{', outputs through an event loop thread' if args.server_loop else ''}"
             f"{f', {args.gpu_step_ms:g} ms device wait per step' if args.gpu_step_ms else ''}, "
             f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
             f"load {os.getloadavg()[0]:.1f}, {time.strftime('%Y-%m-%d %H:%M')}; {args.steps} steps x "
             f"{args.rounds} rounds, median of rounds, µs per step"]
    for n in args.running_list:
        lines.append(f"\n{n} running    " + "  ".join(f"{k:>8}" for k in keys)
                     + "  µs/req   floor  host/floor  host/budget")
        for name in trees:
            m = med[name][n]
            label = "current" if name == "current" else "ref"
            lines.append(f"{label:<12}" + "  ".join(f"{m[k]:8.1f}" for k in keys)
                         + f"  {m['host'] / n:6.2f}  {floors[n]:6.1f}  {m['host'] / floors[n]:9.1f}x"
                         + f"  {m['host'] / BUDGET_US:10.2f}")
        if args.baseline_ref:
            cur, ref = med["current"][n], med[args.baseline_ref][n]
            lines.append("current/ref " + "  ".join(f"{cur[k] / ref[k] if ref[k] else float('nan'):8.2f}"
                                                    for k in keys))
        m = med["current"][n]
        lines.append(f"  current host {m['host']:.0f} µs = {m['host'] / 150:.1f}% of a 15 ms step "
                     f"(budget {BUDGET_US:.0f} µs = 3%); cache manager + worker (schedule + submit + complete) "
                     f"{m['schedule'] + m['submit'] + m['complete']:.0f} µs = "
                     f"{(m['schedule'] + m['submit'] + m['complete']) / 150:.1f}%; first round: hit rate "
                     f"{runs['current'][0][str(n)]['hit_rate']:.2f}, host-hit tokens "
                     f"{runs['current'][0][str(n)]['host_hit_tokens']}")
    if args.baseline_ref:
        lines.append(f"\nref: the same benchmark on the package at {args.baseline_ref}, interleaved round by round")
    print("\n".join(lines))
    print(f"took {time.perf_counter() - started:.0f} s")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                                         "baseline_ref": args.baseline_ref or None, "server_loop": args.server_loop,
                                         "model_impl": args.model_impl, "device": args.device, "model": args.model,
                                         "gpu_step_ms": args.gpu_step_ms,
                                         "load_avg_1min": os.getloadavg()[0],
                                         "steps": args.steps, "rounds": args.rounds, "budget_us": BUDGET_US,
                                         "floor_us": floors, "median_us": med, "runs": runs}, indent=1))
    if tmp is not None:
        tmp.cleanup()


if __name__ == "__main__":
    main()
