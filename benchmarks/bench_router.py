"""Router benchmark: multi-turn conversations over shared documents, across a fleet of servers.

ONE invocation runs, on the same workload:

* each routing policy (``--policies``: ``cache_aware``, ``round_robin``, ``least_requests``)
  over a fresh fleet of ``--workers`` servers (``tiny-llama-random`` on the CPU, each
  publishing its KV cache events) behind ``python -m fastdeploy_kvcache.entrypoints.router``;
* the **baseline**: one server with the fleet's total cache (``--workers`` times the device
  pool and the running-request limit), clients straight to it.  Its reused tokens are what
  a perfect router could reach.

Workload: ``--documents`` documents of ``--doc-tokens`` tokens; ``--conversations``
conversations, ``conversations / documents`` per document, each ``--rounds`` rounds of chat
(the document as the system message, then the questions and answers so far, then a new
question).  All conversations run at once, at most ``--concurrency`` requests in flight
(FIFO), so between two rounds of one conversation the others pass through the caches.
Each worker's device pool (``--device-blocks``) holds about a third of the working set, so
a worker that sees every document (round-robin) evicts them, while a worker that sees
its own third (cache-aware) can keep it; the fleet's total holds all of it.  No host tier
(``--swap-space 0``): the fleet's cache is exactly the sum of the device pools.

Reported per policy: prompt tokens reused (and the ratio to the baseline), TTFT p50/p99
(all rounds and rounds >= 2), requests/s and prompt tokens/s, how the requests spread over
the workers, the router's predicted against the workers' reported cached tokens, and the
router's added latency:

* **decision** -- the router's own time from a request's arrival to its forwarding (parse,
  tokenize, hash, choose), from the ``x-fdkv-router-overhead-seconds`` header;
* **end to end** -- after the cache_aware run, ``--overhead-pairs`` pairs of the same short
  request (a cached prompt, ``max_tokens=1``, not streamed), one straight to the worker and
  one through the router (which sends it to that worker), interleaved; the p50 of the
  per-pair differences.

Targets: cache_aware reuse >= 0.9x the baseline's; cache_aware TTFT p50 <= 0.5x
round_robin's; router overhead p50 <= 2 ms.  Outputs: a table on stdout, JSON and PNG under
``--out-dir`` (default benchmarks/results).

Usage:
    python benchmarks/bench_router.py            # 5-6 minutes measured on a shared 2-core VM
    python benchmarks/bench_router.py --quick    # smoke run (about 2 minutes); not for tables
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import random
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_serving import WORDS, machine, percentile, sse_events  # noqa: E402

from fastdeploy_kvcache.entrypoints.server_process import RouterProcess, ServerProcess  # noqa: E402

logger = logging.getLogger("bench_router")

POLICIES = ("cache_aware", "round_robin", "least_requests")
BASELINE = "one server, fleet's cache"


@dataclass
class Turn:
    conversation: int
    round: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    cached_tokens: int
    worker: str
    overhead_s: Optional[float]
    predicted: Optional[int]


@dataclass
class RunResult:
    name: str
    wall_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    router_metrics: dict[str, float] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        later = [t for t in self.turns if t.round >= 2]
        ttfts = [t.ttft_s for t in self.turns]
        overheads = [t.overhead_s for t in self.turns if t.overhead_s is not None]
        spread: dict[str, int] = {}
        for t in self.turns:
            spread[t.worker] = spread.get(t.worker, 0) + 1
        return {
            "requests": len(self.turns),
            "wall_s": self.wall_s,
            "prompt_tokens": prompt,
            "cached_tokens": sum(t.cached_tokens for t in self.turns),
            "cached_fraction": sum(t.cached_tokens for t in self.turns) / prompt if prompt else 0.0,
            "predicted_tokens": sum(t.predicted or 0 for t in self.turns) if overheads else None,
            "ttft_p50_s": percentile(ttfts, 50),
            "ttft_p99_s": percentile(ttfts, 99),
            "ttft_p50_round2plus_s": percentile([t.ttft_s for t in later], 50),
            "ttft_p99_round2plus_s": percentile([t.ttft_s for t in later], 99),
            "ttft_p50_by_round_s": {r: percentile([t.ttft_s for t in self.turns if t.round == r], 50)
                                    for r in sorted({t.round for t in self.turns})},
            "requests_per_s": len(self.turns) / self.wall_s if self.wall_s else 0.0,
            "prompt_tokens_per_s": prompt / self.wall_s if self.wall_s else 0.0,
            "overhead_p50_s": percentile(overheads, 50) if overheads else None,
            "overhead_p99_s": percentile(overheads, 99) if overheads else None,
            "requests_per_worker": sorted(spread.values(), reverse=True),
        }


# ---------------------------------------------------------------------- workload
@dataclass
class Workload:
    documents: int
    conversations: int
    rounds: int
    doc_tokens: int
    question_words: int
    output_tokens: int
    concurrency: int
    seed: int
    texts: list[str] = field(default_factory=list)

    def build(self, tokenizer: Any) -> "Workload":
        """Documents of about ``doc_tokens`` tokens each (grown word by word with the model's tokenizer)."""
        self.texts = []
        for d in range(self.documents):
            rng = random.Random(self.seed * 1_000_003 + d)
            parts = [f"Document {d}."]
            while len(tokenizer.encode(" ".join(parts))) < self.doc_tokens:
                parts.extend(rng.choice(WORDS) for _ in range(16))
            self.texts.append(" ".join(parts))
        return self

    def document_of(self, conversation: int) -> str:
        return self.texts[conversation % self.documents]

    def question(self, conversation: int, rnd: int) -> str:
        rng = random.Random(self.seed * 7919 + 104729 * (conversation + 1) + rnd)
        return f"Question {rnd} of reader {conversation}: " + " ".join(rng.choice(WORDS) for _ in range(self.question_words)) + "?"


async def stream_chat(client: Any, url: str, model: str, messages: list[dict[str, str]],
                      max_tokens: int) -> tuple[float, float, str, dict[str, Any], dict[str, str]]:
    """One streamed chat completion: (ttft_s, latency_s, text, usage, response headers)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft: Optional[float] = None
    parts: list[str] = []
    usage: Optional[dict[str, Any]] = None
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        headers = dict(resp.headers)
        async for ev in sse_events(resp):
            for ch in ev.get("choices") or []:
                delta = (ch.get("delta") or {}).get("content")
                if delta:
                    if ttft is None:
                        ttft = time.perf_counter() - t0
                    parts.append(delta)
            usage = ev.get("usage") or usage
    latency = time.perf_counter() - t0
    if usage is None:
        raise RuntimeError("no usage chunk")
    return (ttft if ttft is not None else latency), latency, "".join(parts), usage, headers


async def run_workload(url: str, model: str, wl: Workload, progress: Any) -> tuple[list[Turn], float]:
    import httpx

    sem = asyncio.Semaphore(wl.concurrency)
    turns: list[Turn] = []
    limits = httpx.Limits(max_connections=wl.concurrency * 2, max_keepalive_connections=wl.concurrency * 2)

    async with httpx.AsyncClient(timeout=600.0, limits=limits) as client:

        async def conversation(c: int) -> None:
            messages = [{"role": "system", "content": wl.document_of(c)}]
            for r in range(1, wl.rounds + 1):
                messages.append({"role": "user", "content": wl.question(c, r)})
                async with sem:
                    ttft, latency, text, usage, headers = await stream_chat(client, url, model, messages,
                                                                            wl.output_tokens)
                overhead = headers.get("x-fdkv-router-overhead-seconds")
                predicted = headers.get("x-fdkv-predicted-cached-tokens")
                turns.append(Turn(c, r, ttft, latency, int(usage["prompt_tokens"]),
                                  int(usage["prompt_tokens_details"]["cached_tokens"]),
                                  headers.get("x-fdkv-worker", url),
                                  float(overhead) if overhead is not None else None,
                                  int(predicted) if predicted is not None else None))
                messages.append({"role": "assistant", "content": text})
                progress.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(conversation(c) for c in range(wl.conversations)))
        return turns, time.perf_counter() - start


async def measure_overhead(router_url: str, worker_url: str, model: str, prompt: list[int], pairs: int) -> dict[str, Any]:
    """Same short request straight to ``worker_url`` and through the router, interleaved."""
    import httpx

    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    direct: list[float] = []
    routed: list[float] = []
    workers: set[str] = set()
    async with httpx.AsyncClient(timeout=120.0) as client:
        for url in (worker_url, router_url):  # warm both connections, and the prefix on the worker
            (await client.post(url + "/v1/completions", json=body)).raise_for_status()
        for _ in range(pairs):
            for url, out in ((worker_url, direct), (router_url, routed)):
                t0 = time.perf_counter()
                resp = await client.post(url + "/v1/completions", json=body)
                out.append(time.perf_counter() - t0)
                resp.raise_for_status()
                if url == router_url:
                    workers.add(resp.headers.get("x-fdkv-worker", "?"))
    diffs = [r - d for r, d in zip(routed, direct)]
    return {"pairs": pairs, "direct_p50_s": percentile(direct, 50), "routed_p50_s": percentile(routed, 50),
            "added_p50_s": percentile(diffs, 50), "added_p90_s": percentile(diffs, 90),
            "routed_to_that_worker": workers == {worker_url}}


# ---------------------------------------------------------------------- processes
def worker_args(a: argparse.Namespace, scale: int = 1) -> list[str]:
    return ["--model", a.model, "--device", "cpu", "--block-size", str(a.block_size),
            "--max-model-len", str(a.max_model_len), "--num-gpu-blocks-override", str(a.device_blocks * scale),
            "--max-num-seqs", str(a.max_num_seqs * scale), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--swap-space", "0"]


def warm_up(servers: list[ServerProcess], model: str) -> None:
    """One short request per server, so that no measured request pays a first call's set-up."""
    import httpx

    for server in servers:
        httpx.post(server.base_url + "/v1/completions", json={"model": model, "prompt": "warm up", "max_tokens": 2},
                   timeout=120.0).raise_for_status()


def start_fleet(a: argparse.Namespace, sock_dir: str, policy: str) -> tuple[list[ServerProcess], RouterProcess]:
    specs, workers = [], []
    for i in range(a.workers):
        pub, replay = f"ipc://{sock_dir}/{policy}-w{i}-pub", f"ipc://{sock_dir}/{policy}-w{i}-replay"
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
               "topic": "kv-events"}
        workers.append(ServerProcess([*worker_args(a), "--kv-events-config", json.dumps(cfg), "--log-level", "warning"],
                                     env={"ENABLE_V1_KVCACHE_MANAGER": "1"}))
        specs.append(f"{pub},{replay}")
    try:
        with ThreadPoolExecutor(a.workers) as pool:
            list(pool.map(lambda w: w.start(), workers))
        router = RouterProcess(["--worker-urls", *[w.base_url for w in workers], "--worker-events", *specs,
                                "--model", a.model, "--policy", policy, "--block-size", str(a.block_size),
                                "--log-level", "warning"]).start()
    except BaseException:
        for w in workers:
            w.stop()
        raise
    return workers, router


def scrape(proc: ServerProcess) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(proc.get_text("/metrics")):
        for s in fam.samples:
            if s.name.endswith("_created"):
                continue
            key = s.name + ("{" + ",".join(f"{k}={v}" for k, v in sorted(s.labels.items())) + "}" if s.labels else "")
            out[key] = s.value
    return out


def sum_metric(m: dict[str, float], name: str) -> float:
    return sum(v for k, v in m.items() if k == name or k.startswith(name + "{"))


# ---------------------------------------------------------------------- report
def _ms(x: Optional[float]) -> str:
    return "-" if x is None or x != x else f"{1e3 * x:.1f}"


def build_report(a: argparse.Namespace, results: dict[str, RunResult], overhead: dict[str, Any],
                 wl: Workload, started: float) -> dict[str, Any]:
    sums = {name: r.summary() for name, r in results.items()}
    base = sums.get(BASELINE)
    ca, rr = sums.get("cache_aware"), sums.get("round_robin")
    targets = []
    if ca and base:
        ratio = ca["cached_tokens"] / base["cached_tokens"] if base["cached_tokens"] else float("nan")
        targets.append({"name": "cache_aware reused tokens / one server with the fleet's cache", "value": ratio,
                        "limit": ">= 0.9", "met": ratio >= 0.9})
    if ca and rr:
        ratio = ca["ttft_p50_s"] / rr["ttft_p50_s"]
        targets.append({"name": "cache_aware TTFT p50 / round_robin TTFT p50", "value": ratio, "limit": "<= 0.5",
                        "met": ratio <= 0.5})
    if ca and ca["overhead_p50_s"] is not None:
        targets.append({"name": "router decision time p50 (ms)", "value": 1e3 * ca["overhead_p50_s"],
                        "limit": "<= 2", "met": ca["overhead_p50_s"] <= 0.002})
    if overhead:
        targets.append({"name": "router added latency end to end, p50 of pairs (ms)",
                        "value": 1e3 * overhead["added_p50_s"], "limit": "<= 2", "met": overhead["added_p50_s"] <= 0.002})
    for name, r in results.items():
        if not r.router_metrics:
            continue
        for key in ("fdkv_router:predicted_cached_tokens_total", "fdkv_router:reported_cached_tokens_total"):
            sums[name][key.split(":")[1]] = sum_metric(r.router_metrics, key)
        reasons: dict[str, int] = {}
        for k, v in r.router_metrics.items():
            if k.startswith("fdkv_router:requests_routed_total{"):
                reason = k.split("reason=", 1)[1].split(",", 1)[0].rstrip("}")
                reasons[reason] = reasons.get(reason, 0) + int(v)
        sums[name]["routing_reasons"] = reasons
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(), "loadavg_start": list(started_load), "loadavg_end": list(os.getloadavg()),
        "elapsed_s": time.monotonic() - started, "args": vars(a), "workload": {k: v for k, v in asdict(wl).items()
                                                                               if k != "texts"},
        "summary": sums, "overhead_pairs": overhead, "targets": targets,
        "turns": {name: [asdict(t) for t in r.turns] for name, r in results.items()},
    }


def format_console(rep: dict[str, Any]) -> str:
    base = rep["summary"].get(BASELINE, {})
    lines = [f"bench_router: {rep['date']}, {rep['machine']['cpu']} ({rep['machine']['cores']} cores), "
             f"load {rep['loadavg_start'][0]:.1f} -> {rep['loadavg_end'][0]:.1f}, {rep['elapsed_s']:.0f} s", "",
             "| run | reused tokens | vs baseline | TTFT p50 (ms) | TTFT p99 (ms) | rounds >= 2 p50 (ms) | req/s | "
             "prompt tok/s | requests per worker | predicted / reported | decision p50 (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, s in rep["summary"].items():
        vs = s["cached_tokens"] / base["cached_tokens"] if base.get("cached_tokens") else float("nan")
        pr = (f"{s['predicted_cached_tokens_total'] / s['reported_cached_tokens_total']:.2f}"
              if s.get("reported_cached_tokens_total") else "-")
        lines.append(f"| {name} | {s['cached_tokens']} ({100 * s['cached_fraction']:.0f}%) | {vs:.2f}x | "
                     f"{_ms(s['ttft_p50_s'])} | {_ms(s['ttft_p99_s'])} | {_ms(s['ttft_p50_round2plus_s'])} | "
                     f"{s['requests_per_s']:.2f} | {s['prompt_tokens_per_s']:.0f} | "
                     f"{'/'.join(map(str, s['requests_per_worker']))} | {pr} | {_ms(s['overhead_p50_s'])} |")
    reasons = [f"{name}: " + ", ".join(f"{k} {v}" for k, v in sorted(s["routing_reasons"].items()))
               for name, s in rep["summary"].items() if s.get("routing_reasons")]
    if reasons:
        lines += ["", "Routing decisions by reason: " + "; ".join(reasons) + "."]
    o = rep["overhead_pairs"]
    if o:
        lines += ["", f"Added latency, {o['pairs']} interleaved pairs of one short request (cached prompt, "
                      f"max_tokens=1): direct p50 {_ms(o['direct_p50_s'])} ms, through the router "
                      f"{_ms(o['routed_p50_s'])} ms; per-pair difference p50 {_ms(o['added_p50_s'])} ms, "
                      f"p90 {_ms(o['added_p90_s'])} ms (routed to the same worker: {o['routed_to_that_worker']})."]
    lines += ["", "| target | measured | limit | met |", "|---|---|---|---|"]
    for t in rep["targets"]:
        lines.append(f"| {t['name']} | {t['value']:.3f} | {t['limit']} | {'yes' if t['met'] else 'NO'} |")
    return "\n".join(lines)


def plot(rep: dict[str, Any], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, s in rep["summary"].items():
        rounds = sorted(s["ttft_p50_by_round_s"], key=int)
        ax1.plot([int(r) for r in rounds], [1e3 * s["ttft_p50_by_round_s"][r] for r in rounds], marker="o", label=name)
    ax1.set_xticks(sorted({int(r) for s in rep["summary"].values() for r in s["ttft_p50_by_round_s"]}))
    ax1.set_xlabel("round")
    ax1.set_ylabel("TTFT p50 (ms)")
    ax1.set_yscale("log")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8)
    names = list(rep["summary"])
    ax2.bar(range(len(names)), [100 * rep["summary"][n]["cached_fraction"] for n in names],
            color=["C0", "C1", "C2", "C3", "C4"][: len(names)])
    ax2.set_xticks(range(len(names)))
    ax2.set_xticklabels(names, rotation=15, fontsize=8)
    ax2.set_ylabel("prompt tokens reused (%)")
    ax2.grid(True, axis="y", alpha=0.3)
    fig.suptitle(f"bench_router: {rep['args']['workers']} x {rep['args']['model']}, {rep['machine']['cores']} CPU "
                 f"cores, {rep['date']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


started_load = os.getloadavg()


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama-random")
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--documents", type=int, default=8)
    ap.add_argument("--conversations", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=768)
    ap.add_argument("--question-words", type=int, default=6)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device-blocks", type=int, default=320, help="Device pool of each worker, in blocks.")
    ap.add_argument("--max-num-seqs", type=int, default=4, help="Running requests per worker.")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--overhead-pairs", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true")
    ap.add_argument("--quick", action="store_true", help="Smoke run: 6 conversations x 2 rounds, 30 pairs.")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args(argv)
    if a.quick:
        a.conversations, a.documents, a.rounds, a.overhead_pairs = 6, 2, 2, 30
    policies = [p for p in a.policies.split(",") if p]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        ap.error(f"--policies: unknown {bad}; choose from {', '.join(POLICIES)}")
    logging.basicConfig(level=logging.WARNING)
    from tqdm import tqdm

    from fastdeploy_kvcache.entrypoints.router.prompt import load_tokenizer

    started = time.monotonic()
    tokenizer = load_tokenizer(a.model)
    wl = Workload(a.documents, a.conversations, a.rounds, a.doc_tokens, a.question_words, a.output_tokens,
                  a.concurrency, a.seed).build(tokenizer)
    results: dict[str, RunResult] = {}
    overhead: dict[str, Any] = {}
    total = wl.conversations * wl.rounds
    with tempfile.TemporaryDirectory(prefix="fdkv-bench-router-") as sock_dir:
        for policy in policies:
            workers, router = start_fleet(a, sock_dir, policy)
            try:
                warm_up(workers, a.model)
                bar = tqdm(total=total, desc=policy, unit="req", file=sys.stderr)
                turns, wall = asyncio.run(run_workload(router.base_url, a.model, wl, bar))
                bar.close()
                res = results[policy] = RunResult(policy, wall, turns)
                res.router_metrics = scrape(router)
                if policy == "cache_aware" and a.overhead_pairs:
                    prompt = tokenizer.encode(wl.texts[0])[:256]
                    overhead = asyncio.run(measure_overhead(router.base_url, workers[0].base_url, a.model, prompt,
                                                            a.overhead_pairs))
            finally:
                router.stop()
                for w in workers:
                    w.stop()
        if not a.no_baseline:
            server = ServerProcess([*worker_args(a, scale=a.workers), "--log-level", "warning"],
                                   env={"ENABLE_V1_KVCACHE_MANAGER": "1"}).start()
            try:
                warm_up([server], a.model)
                bar = tqdm(total=total, desc="baseline", unit="req", file=sys.stderr)
                turns, wall = asyncio.run(run_workload(server.base_url, a.model, wl, bar))
                bar.close()
                results[BASELINE] = RunResult(BASELINE, wall, turns)
            finally:
                server.stop()
    rep = build_report(a, results, overhead, wl, started)
    print(format_console(rep))
    a.out_dir.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d_%H%M")
    suffix = "_quick" if a.quick else ""
    json_path = a.out_dir / f"bench_router_{stamp}{suffix}.json"
    png_path = a.out_dir / f"bench_router_{stamp}{suffix}.png"
    json_path.write_text(json.dumps(rep, default=str, separators=(",", ":")))
    plot(rep, png_path)
    print(f"\nwrote {json_path} and {png_path}")
    return 0 if all(t["met"] for t in rep["targets"]) else 1


if __name__ == "__main__":
    sys.exit(main())
