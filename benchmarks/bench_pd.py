"""Prefill/decode disaggregation through the store, against a mixed server, at a set concurrency.

ONE invocation starts, on 127.0.0.1:

* ``mixed``: one server (the same engine flags, no storage tier) that prefills and decodes;
* ``pd``: a ``--splitwise-role prefill`` server and a ``--splitwise-role decode`` server over
  one store (``--backend file``: a temporary directory; ``mooncake``: a local master and a
  holder), and the router in front of them.

Both get the same requests: ``--requests`` distinct prompts of ``--prompt-tokens`` token ids
(not a multiple of the block size, so every hand-off has a partial block), streamed, greedy,
``--output-tokens`` each, at most ``--concurrency`` in flight.  The two configurations run
one after the other (never at the same time), each after a warm-up request.

Reported per configuration: TTFT (request sent -> first content chunk) and time per output
token (TPOT: (last chunk - first chunk) / (tokens - 1)), p50 and p90, and for PD the split of
a request's time into

* **prefill**: the router's prefill call (prompt compute + KV write + HTTP), from the
  router's ``x-fdkv-pd-prefill-seconds`` header;
* **store**: seconds in the store: the prefill server's KV writes (``pd.prefill_write_seconds``)
  plus the decode server's reads (storage-tier prefetch ``read_seconds`` and the partial block,
  ``pd.decode_partial_read_seconds``), per request, from the servers' stats;
* **decode**: the rest of the request (load + first-token hand-off + decoding);

and, after the PD run, the same number of new prompts sent straight to the prefill server
with the decode server idle (``prefill_alone``): the prefill call without the decode server
competing for the cores, which separates the prefill queue from core sharing.

NOTE: on one small CPU machine the servers share the same cores, and with a closed loop at a
fixed concurrency faster decodes send clients back to the single prefill server sooner, so
TTFT there reflects the prefill queue.  Disaggregation's TTFT gain needs prefill capacity of
its own; the benchmark measures the hand-off's own cost and its effect on TPOT.

Usage:
    python benchmarks/bench_pd.py                     # tiny-llama-random, file store, ~1 minute
    python benchmarks/bench_pd.py --backend mooncake
    python benchmarks/bench_pd.py --quick             # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_serving import sse_events  # noqa: E402
from fastdeploy_kvcache.entrypoints.server_process import RouterProcess, ServerProcess  # noqa: E402

logger = logging.getLogger("bench_pd")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def server_args(a: argparse.Namespace) -> list[str]:
    return ["--model", a.model, "--device", "cpu", "--block-size", str(a.block_size),
            "--max-model-len", str(a.prompt_tokens + a.output_tokens + 64),
            "--max-num-seqs", str(max(4, a.concurrency)), "--max-num-batched-tokens", str(a.max_num_batched_tokens),
            "--swap-space", "0.25", "--write-policy", "write_through"]


async def one_request(client: Any, url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first: Optional[float] = None
    last = t0
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}")
        prefill_s = resp.headers.get("x-fdkv-pd-prefill-seconds")
        async for ev in sse_events(resp):
            if ev.get("usage"):
                tokens = int(ev["usage"]["completion_tokens"])
            if any(ch.get("text") for ch in ev.get("choices", [])):
                now = time.perf_counter()
                if first is None:
                    first = now
                last = now
    end = time.perf_counter()
    ttft = (first if first is not None else end) - t0
    tpot = (last - first) / (tokens - 1) if first is not None and tokens > 1 else float("nan")
    return {"ttft": ttft, "tpot": tpot, "e2e": end - t0, "tokens": tokens,
            "prefill": float(prefill_s) if prefill_s is not None else None}


async def run(url: str, a: argparse.Namespace, prompts: list[list[int]]) -> tuple[list[dict[str, Any]], float]:
    import httpx

    sem = asyncio.Semaphore(a.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        await one_request(client, url, a.model, [7] * (a.block_size + 3), 4)  # warm-up

        async def go(p: list[int]) -> dict[str, Any]:
            async with sem:
                return await one_request(client, url, a.model, p, a.output_tokens)

        t0 = time.perf_counter()
        out = await asyncio.gather(*(go(p) for p in prompts))
        return list(out), time.perf_counter() - t0


async def prefill_alone(url: str, a: argparse.Namespace, prompts: list[list[int]]) -> list[float]:
    """Seconds of each prefill call sent straight to the prefill server, the decode server
    idle: what the prefill call costs without the decode server competing for the cores."""
    import httpx

    sem = asyncio.Semaphore(a.concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def go(p: list[int]) -> float:
            async with sem:
                t0 = time.perf_counter()
                r = await client.post(url + "/v1/completions", json={
                    "model": a.model, "prompt": p, "max_tokens": 1, "temperature": 0, "ignore_eos": True})
                r.raise_for_status()
                return time.perf_counter() - t0

        return list(await asyncio.gather(*(go(p) for p in prompts)))


def summarize(rs: list[dict[str, Any]], wall: float) -> dict[str, Any]:
    ttft = [r["ttft"] for r in rs]
    tpot = [r["tpot"] for r in rs if r["tpot"] == r["tpot"]]
    return {"requests": len(rs), "wall_s": wall,
            "ttft_p50_ms": 1e3 * percentile(ttft, 0.5), "ttft_p90_ms": 1e3 * percentile(ttft, 0.9),
            "tpot_p50_ms": 1e3 * percentile(tpot, 0.5), "tpot_p90_ms": 1e3 * percentile(tpot, 0.9),
            "e2e_mean_ms": 1e3 * statistics.fmean(r["e2e"] for r in rs),
            "output_tok_per_s": sum(r["tokens"] for r in rs) / wall}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama-random")
    ap.add_argument("--backend", choices=("file", "mooncake"), default="file")
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1000, help="Prompt length (1000 = 62 blocks of 16 + 8).")
    ap.add_argument("--output-tokens", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="", help="JSON result path (default benchmarks/results/bench_pd_<backend>_<date>.json).")
    ap.add_argument("--quick", action="store_true", help="Smoke run: 4 requests of 100 tokens.")
    a = ap.parse_args(argv)
    if a.quick:
        a.requests, a.prompt_tokens, a.output_tokens = 4, 100, 8
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rng = random.Random(a.seed)
    prompts = [[rng.randrange(10, 500) for _ in range(a.prompt_tokens)] for _ in range(a.requests)]
    base = server_args(a)
    env = {"ENABLE_V1_KVCACHE_MANAGER": "1", "FD_PD_TRANSFER_VIA_STORAGE": "1"}
    results: dict[str, Any] = {}

    logger.info("mixed server")
    mixed = ServerProcess(base, env=env).start()
    try:
        rs, wall = asyncio.run(run(mixed.base_url, a, prompts))
        results["mixed"] = summarize(rs, wall)
    finally:
        mixed.stop()

    logger.info("PD: prefill + decode + router, %s store", a.backend)
    local = None
    tmp = tempfile.TemporaryDirectory(prefix="bench-pd-")
    if a.backend == "file":
        store = ["--kvcache-storage-backend", "file", "--kvcache-storage-path", tmp.name,
                 "--kvcache-storage-min-free", "0"]
        store_env = dict(env)
    else:
        from fastdeploy_kvcache.storage.mooncake_local import LocalMooncake

        local = LocalMooncake(segment="1GB").start()
        store = ["--kvcache-storage-backend", "mooncake"]
        store_env = {**env, **local.env()}
    store += ["--kvcache-storage-prefetch-policy", "wait_complete"]
    prefill = ServerProcess([*base, *store, "--splitwise-role", "prefill"], env=store_env).start()
    decode = ServerProcess([*base, *store, "--splitwise-role", "decode"], env=store_env).start()
    router = RouterProcess(["--prefill-url", prefill.base_url, "--decode-url", decode.base_url,
                            "--log-level", "warning"]).start()
    try:
        deadline = time.monotonic() + 60
        while not (prefill.engine_stats()["storage"]["available"] and decode.engine_stats()["storage"]["available"]):
            if time.monotonic() > deadline:
                raise TimeoutError("store not available")
            time.sleep(0.2)
        p0, d0 = prefill.engine_stats(), decode.engine_stats()
        rs, wall = asyncio.run(run(router.base_url, a, prompts))
        p1, d1 = prefill.engine_stats(), decode.engine_stats()
        summary = summarize(rs, wall)
        n = len(rs) + 1  # the warm-up request went through the store too
        write_s = p1["pd"]["prefill_write_seconds"] - p0["pd"]["prefill_write_seconds"]
        read_s = (d1["storage"]["tier"]["read_seconds"] - d0["storage"]["tier"]["read_seconds"]
                  + d1["pd"]["decode_partial_read_seconds"] - d0["pd"]["decode_partial_read_seconds"])
        prefill_ms = 1e3 * statistics.fmean(r["prefill"] for r in rs)
        summary.update({
            "prefill_mean_ms": prefill_ms,
            "store_write_mean_ms": 1e3 * write_s / n,
            "store_read_mean_ms": 1e3 * read_s / n,
            "decode_mean_ms": summary["e2e_mean_ms"] - prefill_ms,
            "recomputed_tokens": d1["pd"]["recomputed_tokens"] - d0["pd"]["recomputed_tokens"],
            "written_blocks": p1["pd"]["prefill_write_blocks_ok"] - p0["pd"]["prefill_write_blocks_ok"],
            "object_bytes": (p1["pd"]["prefill_write_bytes"] // max(1, p1["pd"]["prefill_write_blocks_ok"])),
        })
        # The same number of new prompts (no device hits), straight to the prefill server.
        fresh = [[rng.randrange(10, 500) for _ in range(a.prompt_tokens)] for _ in range(a.requests)]
        alone = asyncio.run(prefill_alone(prefill.base_url, a, fresh))
        summary["prefill_alone_p50_ms"] = 1e3 * percentile(alone, 0.5)
        summary["prefill_alone_mean_ms"] = 1e3 * statistics.fmean(alone)
        results["pd"] = summary
    finally:
        router.stop()
        prefill.stop()
        decode.stop()
        if local is not None:
            local.stop()
        tmp.cleanup()

    m, p = results["mixed"], results["pd"]
    report = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, load avg {os.getloadavg()[0]:.1f}",
        "args": vars(a), "results": results,
        "ratios": {"ttft_pd_over_mixed": p["ttft_p50_ms"] / m["ttft_p50_ms"],
                   "tpot_pd_over_mixed": p["tpot_p50_ms"] / m["tpot_p50_ms"]},
    }
    out = Path(a.out or ROOT / "benchmarks" / "results" / f"bench_pd_{a.backend}_cpu_{dt.date.today()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))
    print()
    print("| config | TTFT p50 / p90 (ms) | TPOT p50 / p90 (ms) | e2e mean (ms) | output tok/s |")
    print("|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['ttft_p50_ms']:.1f} / {r['ttft_p90_ms']:.1f} | {r['tpot_p50_ms']:.1f} / "
              f"{r['tpot_p90_ms']:.1f} | {r['e2e_mean_ms']:.1f} | {r['output_tok_per_s']:.1f} |")
    print()
    print(f"PD split per request (mean): prefill call {p['prefill_mean_ms']:.1f} ms (of which store write "
          f"{p['store_write_mean_ms']:.1f} ms), store read on decode {p['store_read_mean_ms']:.1f} ms, "
          f"decode {p['decode_mean_ms']:.1f} ms; recomputed prompt tokens {p['recomputed_tokens']}")
    print(f"Prefill calls straight to the prefill server, decode server idle: p50 {p['prefill_alone_p50_ms']:.1f} ms, "
          f"mean {p['prefill_alone_mean_ms']:.1f} ms (through the router, decode busy: mean {p['prefill_mean_ms']:.1f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
