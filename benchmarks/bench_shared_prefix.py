"""Serving benchmark over HTTP: the generated-shared-prefix workload, the switch off and on.

The workload: ``--groups`` groups, each a shared system prompt of ``--system-tokens`` tokens;
``--prompts-per-group`` prompts per group, each the group's system prompt followed by a
question of its own (``--question-tokens``); every request asks for ``--output-tokens`` tokens
(``ignore_eos``); the requests of all groups are shuffled with a fixed seed (``--seed``) and
sent with ``--concurrency`` in flight, each as soon as a slot frees.  Prompts are token ids
drawn from a seeded generator (ids 10-499, inside every built-in model's vocabulary), so their
lengths are exact whatever the tokenizer.

ONE invocation, in this order:

1. **the in-run baseline**: the model runner's forward pass alone over one prompt chunk of the
   server's ``--max-num-batched-tokens`` (the device's default unless given), nothing cached
   before it, logits read back: prefill tokens/s.  It runs in a child process that builds an
   engine from the same flags as the servers (``bench_gpu_runner.runner_prefill_s``), so its
   device memory is freed before the servers start;
2. the workload against a server with ``ENABLE_V1_KVCACHE_MANAGER=0`` (the switch off: the plain
   block allocator, every prompt computed in full);
3. the same workload, same order, against a server with the switch on (``=1``: the device
   prefix cache and a host tier).

Both servers get the flags a user gets: on a GPU those of ``bash build.sh serve-gpu``
(``--model-impl transformers --device gpu --use-cudagraph --swap-space 4``, everything else
the GPU's defaults); on the CPU those of ``bash build.sh serve`` (``--swap-space 1``).  Extra
server flags go after ``--``, to both servers and the baseline alike.

Reported per configuration: total tokens/s (prompt + output tokens over the wall time of the
workload), output tokens/s, TTFT p50/p99, ITL p50 (the gap between two streamed tokens of a
request), the share of prompt tokens served from the cache; and the ratio of the switch-off
total tokens/s to the forward-only prefill rate (target >= 0.8), the switch on beside it.

Usage:
    python benchmarks/bench_shared_prefix.py --quick                 # CPU, tiny-llama-random, under a minute
    python benchmarks/bench_shared_prefix.py --device gpu --tag h200 # llama3-8b-random, 16 x 8 prompts of ~4.3k tokens

Writes ``bench_shared_prefix_<tag>_<date>.json`` (and a plot of TTFT per request) under
``--out-dir``, replacing the benchmark's older files with the same tag (``--quick``: the same
name ending in ``_quick``, replacing nothing).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import math
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_serving import machine, percentile, split_server_args, stream_completion  # noqa: E402

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess  # noqa: E402

logger = logging.getLogger("bench_shared_prefix")

NAME = "bench_shared_prefix"
SWITCH = "ENABLE_V1_KVCACHE_MANAGER"
CONFIGS = (("switch off", "0"), ("switch on", "1"))
TARGET_OFF_OVER_FORWARD = 0.8

# What a user starts on each device: `bash build.sh serve-gpu` / `bash build.sh serve`.
SERVE_FLAGS = {
    "gpu": ["--model-impl", "transformers", "--device", "gpu", "--use-cudagraph", "--swap-space", "4"],
    "cpu": ["--device", "cpu", "--swap-space", "1"],
}
DEFAULT_MODEL = {"gpu": "llama3-8b-random", "cpu": "tiny-llama-random"}
# Workload defaults (groups, prompts per group, system, question, output tokens, concurrency):
# on a GPU the shape of SGLang's generated-shared-prefix run in docs/gpu_serving.md; on the CPU
# the same shape, smaller, so a run takes minutes on two cores.
WORKLOAD_DEFAULTS = {
    "gpu": dict(groups=16, prompts_per_group=8, system_tokens=4096, question_tokens=200, output_tokens=256,
                concurrency=16),
    "cpu": dict(groups=4, prompts_per_group=4, system_tokens=1024, question_tokens=64, output_tokens=32,
                concurrency=4),
    "quick": dict(groups=2, prompts_per_group=3, system_tokens=256, question_tokens=32, output_tokens=8,
                  concurrency=3),
}


@dataclass(frozen=True)
class Workload:
    groups: int
    prompts_per_group: int
    system_tokens: int
    question_tokens: int
    output_tokens: int
    concurrency: int
    seed: int

    def requests(self) -> list[tuple[int, int, list[int]]]:
        """(group, prompt index, token ids) of every request, shuffled with the seed."""
        out = []
        for g in range(self.groups):
            rng = random.Random(self.seed * 1_000_003 + g)
            system = [rng.randrange(10, 500) for _ in range(self.system_tokens)]
            for i in range(self.prompts_per_group):
                question = [rng.randrange(10, 500) for _ in range(self.question_tokens)]
                out.append((g, i, system + question))
        random.Random(self.seed).shuffle(out)
        return out


@dataclass
class Row:
    """One request as the client saw it."""

    group: int
    index: int
    ttft_s: float
    latency_s: float
    itl_s: list[float]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


async def stream_timed(client: Any, model: str, prompt: list[int], max_tokens: int) -> tuple[float, float, list[float], Any]:
    """One streamed completion (bench_serving's client): (TTFT, latency, the gaps between
    streamed chunks, usage)."""
    arrivals: list[float] = []
    ttft, latency, _, usage = await stream_completion(client, model, prompt, max_tokens, arrivals=arrivals)
    if not arrivals:
        raise RuntimeError("the server streamed no token")
    return ttft, latency, [b - a for a, b in zip(arrivals, arrivals[1:])], usage


async def run_workload(base_url: str, model: str, wl: Workload, progress: Any) -> tuple[list[Row], float]:
    """Every request of ``wl`` in its shuffled order, ``wl.concurrency`` in flight."""
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=1800)
    reqs = wl.requests()
    rows: list[Row] = []
    todo = iter(reqs)

    async def worker() -> None:
        for g, i, ids in todo:  # one shared iterator: the requests start in the shuffled order
            ttft, latency, itl, usage = await stream_timed(client, model, ids, wl.output_tokens)
            details = usage.prompt_tokens_details
            rows.append(Row(g, i, ttft, latency, itl, usage.prompt_tokens, usage.completion_tokens,
                            details.cached_tokens if details else 0))
            progress.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(max(1, wl.concurrency))))
    wall = time.perf_counter() - start
    await client.close()
    return rows, wall


def summarize(rows: list[Row], wall: float) -> dict[str, Any]:
    prompt = sum(r.prompt_tokens for r in rows)
    out = sum(r.completion_tokens for r in rows)
    ttfts = [r.ttft_s for r in rows]
    itls = [x for r in rows for x in r.itl_s]
    return {
        "requests": len(rows), "wall_s": wall, "prompt_tokens": prompt, "output_tokens": out,
        "total_tokens_per_s": (prompt + out) / wall, "output_tokens_per_s": out / wall,
        "requests_per_s": len(rows) / wall,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
        "cached_fraction": sum(r.cached_tokens for r in rows) / prompt if prompt else 0.0,
    }


# ------------------------------------------------------------- forward-only baseline
def forward_only_prefill(server_flags: list[str], repeat: int, seed: int) -> dict[str, Any]:
    """In this process: an engine built from ``server_flags`` (switch off), and its runner's
    forward pass over one chunk of its ``max_num_batched_tokens`` with nothing cached."""
    os.environ[SWITCH] = "0"  # the plain pool: the baseline holds no cache
    import bench_gpu_runner

    from fastdeploy_kvcache.engine.args import EngineArgs
    from fastdeploy_kvcache.engine.llm_engine import LLMEngine
    from fastdeploy_kvcache.entrypoints.openai.api_server import make_arg_parser

    flags = [f for f in server_flags if f != "--use-cudagraph"]  # graphs replay decodes only
    engine = LLMEngine(EngineArgs.from_cli_args(make_arg_parser().parse_args(flags)))
    chunk = min(engine.args.max_num_batched_tokens, engine.max_model_len)
    bs = engine.cache_config.block_size
    blocks = math.ceil(chunk / bs)
    if engine.cache_config.num_gpu_blocks < blocks:
        raise RuntimeError(f"the device pool has {engine.cache_config.num_gpu_blocks} blocks, a {chunk}-token "
                           f"chunk needs {blocks}")
    rng = random.Random(seed + 17)
    ids = [rng.randrange(10, 500) for _ in range(chunk)]
    seconds = bench_gpu_runner.runner_prefill_s(engine.runner, engine.pool.layer_caches, list(range(blocks)), ids,
                                                repeat)
    return {"chunk_tokens": chunk, "seconds": seconds, "prefill_tokens_per_s": chunk / seconds,
            "max_num_batched_tokens": engine.args.max_num_batched_tokens, "max_num_seqs": engine.args.max_num_seqs,
            "max_model_len": engine.max_model_len, "block_size": bs, "repeat": repeat,
            "pool": type(engine.pool).__name__, "runner": type(engine.runner).__name__}


def forward_only_in_child(server_flags: list[str], repeat: int, seed: int, timeout_s: float = 1800) -> dict[str, Any]:
    """:func:`forward_only_prefill` in a child process (its device memory is gone when it exits)."""
    cmd = [sys.executable, __file__, "--forward-only-child", json.dumps({"flags": server_flags, "repeat": repeat,
                                                                         "seed": seed})]
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s,
                          env=dict(os.environ, PYTHONPATH=path, **{SWITCH: "0"}))
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"forward-only baseline failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    return json.loads(lines[-1])


# ------------------------------------------------------------------------ output
def format_console(report: dict[str, Any]) -> str:
    wl, base = report["workload"], report["forward_only"]
    lines = [f"{NAME}: {report['model']} on {report['device_name']}, {wl['groups']} groups x "
             f"{wl['prompts_per_group']} prompts of {wl['system_tokens']} + {wl['question_tokens']} tokens, "
             f"{wl['output_tokens']} out, {wl['concurrency']} in flight; server flags: {' '.join(report['server_flags'])}",
             f"forward-only prefill (in-run baseline): {base['chunk_tokens']}-token chunk in "
             f"{1e3 * base['seconds']:.1f} ms = {base['prefill_tokens_per_s']:.0f} tokens/s",
             "| configuration | total tok/s | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) | cached | "
             "total tok/s / forward-only prefill |",
             "|---|---|---|---|---|---|---|---|"]
    for name, s in report["summaries"].items():
        lines.append(f"| {name} | {s['total_tokens_per_s']:.0f} | {s['output_tokens_per_s']:.0f} | "
                     f"{1e3 * s['ttft_p50_s']:.1f} | {1e3 * s['ttft_p99_s']:.1f} | {1e3 * s['itl_p50_s']:.2f} | "
                     f"{100 * s['cached_fraction']:.0f}% | {report['ratios'][name]:.3f} |")
    r = report["ratios"]
    lines.append(f"ratio, switch off: {r['switch off']:.3f} (target >= {TARGET_OFF_OVER_FORWARD}: "
                 f"{'met' if report['met'] else 'not met'}); switch on: {r['switch on']:.3f}; "
                 f"switch on / off total tok/s {r['on_over_off_total_tokens_per_s']:.2f}, TTFT p50 "
                 f"{r['on_over_off_ttft_p50']:.2f}")
    return "\n".join(lines)


def plot(report: dict[str, Any], rows: dict[str, list[dict[str, Any]]], png: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rs in rows.items():
        ax.plot(range(1, len(rs) + 1), sorted(1e3 * r["ttft_s"] for r in rs), label=name)
    ax.set_xlabel("requests (sorted by TTFT)")
    ax.set_ylabel("TTFT (ms)")
    ax.set_yscale("log")
    ax.set_title(f"{NAME}: {report['model']}, {report['date']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return True


def keep_latest(out_dir: Path, tag: str, keep: list[Path]) -> None:
    """Remove this benchmark's older results of the same tag (the latest file per benchmark)."""
    for old in out_dir.glob(f"{NAME}_{tag}_*"):
        if old not in keep:
            old.unlink()


# -------------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--forward-only-child"]:
        spec = json.loads(argv[1])
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(forward_only_prefill(spec["flags"], spec["repeat"], spec["seed"])), flush=True)
        os._exit(0)  # the engine's threads need no orderly stop: the process is done
    argv, extra = split_server_args(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 epilog="Server flags after -- go to both servers and the baseline's engine.")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"),
                    help="cpu: `build.sh serve`'s flags, tiny-llama-random; gpu: `build.sh serve-gpu`'s flags, "
                         "llama3-8b-random.")
    ap.add_argument("--model", default="", help="Default: llama3-8b-random on a GPU, tiny-llama-random on the CPU.")
    ap.add_argument("--groups", type=int, help="Shared system prompts (default: 16 on a GPU, 4 on the CPU).")
    ap.add_argument("--prompts-per-group", type=int, help="Prompts per system prompt (default: 8 on a GPU, 4 on the CPU).")
    ap.add_argument("--system-tokens", type=int, help="Tokens of a system prompt (default: 4096 on a GPU, 1024 on the CPU).")
    ap.add_argument("--question-tokens", type=int, help="Tokens of a question (default: 200 on a GPU, 64 on the CPU).")
    ap.add_argument("--output-tokens", type=int, help="Output tokens per request (default: 256 on a GPU, 32 on the CPU).")
    ap.add_argument("--concurrency", type=int, help="Requests in flight (default: 16 on a GPU, 4 on the CPU).")
    ap.add_argument("--prefill-repeat", type=int, default=5, help="Timed forward passes of the baseline (median).")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="", help="Name part of the output files (default: the device).")
    ap.add_argument("--quick", action="store_true",
                    help="Smoke run: 2 groups x 3 prompts of 256 + 32 tokens, 8 out, 3 in flight.")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    preset = WORKLOAD_DEFAULTS["quick" if args.quick else args.device]
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
        if getattr(args, key) < (0 if key == "question_tokens" else 1):
            ap.error(f"--{key.replace('_', '-')}: must be positive, got {getattr(args, key)}")
    if args.quick:
        args.prefill_repeat = min(args.prefill_repeat, 2)
    model = args.model or DEFAULT_MODEL[args.device]
    tag = args.tag or args.device
    flags = ["--model", model, *SERVE_FLAGS[args.device], "--log-level", "warning",
             "--uvicorn-log-level", "warning", *extra]
    wl = Workload(args.groups, args.prompts_per_group, args.system_tokens, args.question_tokens, args.output_tokens,
                  args.concurrency, args.seed)

    from tqdm import tqdm

    from serving_gpu import gpu_name

    t0 = time.perf_counter()
    logger.info("forward-only prefill baseline (child process): %s", " ".join(flags))
    base = forward_only_in_child(flags, args.prefill_repeat, args.seed)
    logger.info("forward-only prefill: %d-token chunk, %.0f tokens/s", base["chunk_tokens"],
                base["prefill_tokens_per_s"])
    total_prompt = wl.system_tokens + wl.question_tokens + wl.output_tokens
    if total_prompt > base["max_model_len"]:
        raise SystemExit(f"{NAME}: a request needs {total_prompt} tokens, the server's --max-model-len is "
                         f"{base['max_model_len']}; give smaller --system-tokens/--question-tokens/--output-tokens "
                         "or --max-model-len after --")
    summaries: dict[str, dict[str, Any]] = {}
    rows: dict[str, list[dict[str, Any]]] = {}
    engine_stats: dict[str, Any] = {}
    n = wl.groups * wl.prompts_per_group
    for name, switch in CONFIGS:
        server = ServerProcess(flags, env={SWITCH: switch}, startup_timeout_s=1800).start()
        try:
            from openai import OpenAI

            warm = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
            rng = random.Random(args.seed + 99)
            for _ in range(2):  # a fresh server's one-time costs (kernels, allocator), not measured
                warm.completions.create(model=model, prompt=[rng.randrange(10, 500) for _ in range(64)],
                                        max_tokens=4, temperature=0)
            bar = tqdm(total=n, desc=name, unit="req", file=sys.stderr)
            got, wall = asyncio.run(run_workload(server.base_url, model, wl, bar))
            bar.close()
            engine_stats[name] = server.engine_stats()
        finally:
            server.stop()
        summaries[name] = summarize(got, wall)
        rows[name] = [asdict(r) for r in got]
        s = summaries[name]
        logger.info("[%s] %d requests in %.1f s: %.0f total tok/s, %.0f output tok/s, TTFT p50 %.1f ms, "
                    "ITL p50 %.2f ms, cached %.0f%%", name, s["requests"], wall, s["total_tokens_per_s"],
                    s["output_tokens_per_s"], 1e3 * s["ttft_p50_s"], 1e3 * s["itl_p50_s"],
                    100 * s["cached_fraction"])
    rate = base["prefill_tokens_per_s"]
    ratios: dict[str, float] = {name: s["total_tokens_per_s"] / rate for name, s in summaries.items()}
    off, on = summaries["switch off"], summaries["switch on"]
    ratios["on_over_off_total_tokens_per_s"] = on["total_tokens_per_s"] / off["total_tokens_per_s"]
    ratios["on_over_off_ttft_p50"] = on["ttft_p50_s"] / off["ttft_p50_s"]
    now = dt.datetime.now(dt.timezone.utc)
    report = {
        "date": now.strftime("%Y-%m-%d"), "time_utc": now.strftime("%Y-%m-%d %H:%M"), "machine": machine(args.device),
        "device_name": gpu_name() if args.device == "gpu" else "CPU", "model": model, "args": vars(args),
        "server_flags": flags, "workload": asdict(wl), "forward_only": base, "summaries": summaries,
        "ratios": ratios, "target_off_over_forward_only": TARGET_OFF_OVER_FORWARD,
        "met": ratios["switch off"] >= TARGET_OFF_OVER_FORWARD, "total_wall_s": time.perf_counter() - t0,
        "rows": rows, "engine_stats": engine_stats,
    }
    print(format_console(report))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{NAME}_{tag}_{report['date']}" + ("_quick" if args.quick else "")
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    png_path = out_dir / f"{stem}_ttft.png"
    written = [json_path] + ([png_path] if plot(report, rows, png_path) else [])
    if not args.quick:  # a smoke run leaves the figures of a real one alone
        keep_latest(out_dir, tag, written)
    logger.info("wrote %s", ", ".join(str(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
