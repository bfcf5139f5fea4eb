"""Storage tier through the HTTP server: the fourth configuration and the cold-server scenario.

Companion of ``bench_serving.py`` (same client, workload and server helpers):

* **device+host+storage** -- the multi-turn workload of ``bench_serving`` on a server with a
  ``file`` storage tier below the host tier, next to ``device+host`` in the same run, so the
  cost of writing every block to storage shows in the same-run TTFT ratio.
* **cold server** -- a server computes ``--probe-repeats`` documents of each prefix length
  and stores them, and is stopped; a *restarted* server in front of the same (warm) store
  then answers, for each document: first from storage (prefetch into host, then the
  layer-by-layer load), then -- after filler documents pushed it off the device -- from
  host; and a never-seen document of the same length is recomputed.  All three TTFTs come
  from the same server process in the same run.  ``file`` and ``mooncake`` backends.

Targets (issue 9, same-run ratios of p50 TTFT): storage hit <= 1.3 x host hit (file), and
storage hit <= 0.25 x recompute at the largest prefix.  Also reported: each backend's GB/s as
the server saw it (bytes / seconds of its storage jobs) next to a plain file write and read of
the same bytes in the same run.

    python benchmarks/bench_storage_serving.py                  # CPU, tiny-llama-random
    python benchmarks/bench_storage_serving.py --quick          # smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_serving import (  # noqa: E402
    ConfigResult,
    Workload,
    calibrate_tokens_per_word,
    machine,
    percentile,
    run_workload,
    scrape_metrics,
    stream_completion,
    tiers_of,
)

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess  # noqa: E402

logger = logging.getLogger("bench_storage_serving")


def wait_storage_quiet(server: ServerProcess, timeout_s: float = 300.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        stats = server.engine_stats()
        st = stats.get("storage") or {}
        if stats.get("num_requests_running") == 0 and st.get("pending_work") == 0:
            return stats
        time.sleep(0.1)
    raise TimeoutError(f"storage work not settled after {timeout_s} s")


async def cold_probe(writer: ServerProcess, make_cold: Any, model: str, wl: Workload, doc_words: int,
                     repeats: int, filler_docs: int, tag: int) -> dict[str, Any]:
    """Store ``repeats`` documents through ``writer``, restart, measure storage/host/recompute hits."""
    from openai import AsyncOpenAI

    def doc(k: int) -> str:
        w = Workload(1, 1, doc_words, wl.question_words, 1, 1, wl.seed)
        return w.document(tag * 100_000 + k)

    client = AsyncOpenAI(base_url=writer.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    for k in range(repeats):
        await stream_completion(client, model, f"{doc(k)}\n\nQuestion: {wl.question(k, 0)}\nAnswer:", 1)
    await client.close()
    wstats = wait_storage_quiet(writer)["storage"]["store"]  # the backend's own call timings
    writer.stop()
    cold = make_cold()  # started
    rows: list[dict[str, Any]] = []
    try:
        client = AsyncOpenAI(base_url=cold.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)

        async def settle(c: Any) -> None:
            # NOTE: before each measured request: a one-token request (its step issues the
            # backups queued before), then wait until those backups and their storage puts
            # are done, so no measured request shares the CPU with earlier requests' writes.
            await stream_completion(c, model, "x", 1)
            await asyncio.to_thread(wait_storage_quiet, cold)

        for i in range(2):  # warm-up of the fresh process (kernels, allocator): not measured
            await stream_completion(client, model, doc(90_000 + i), 1)
        for k in range(repeats):
            q = [wl.question(k, i) for i in range(1, 4)]
            await settle(client)
            st = await stream_completion(client, model, f"{doc(k)}\n\nQuestion: {q[0]}\nAnswer:", 1)
            for f in range(filler_docs):
                await stream_completion(client, model, doc(50_000 + k * filler_docs + f) + "\nAnswer:", 1)
            await settle(client)
            host = await stream_completion(client, model, f"{doc(k)}\n\nQuestion: {q[1]}\nAnswer:", 1)
            await settle(client)
            rec = await stream_completion(client, model, f"{doc(70_000 + k)}\n\nQuestion: {q[2]}\nAnswer:", 1)
            rows.append({"storage_ttft_s": st[0], "host_ttft_s": host[0], "recompute_ttft_s": rec[0],
                         "storage_tiers": tiers_of(st[3]), "host_tiers": tiers_of(host[3]),
                         "recompute_tiers": tiers_of(rec[3]), "prompt_tokens": st[3].prompt_tokens})
        await client.close()
        cstats = wait_storage_quiet(cold)["storage"]
    finally:
        cold.stop()
    valid = [r for r in rows if r["storage_tiers"]["storage"] > 0 and r["host_tiers"]["host"] > 0
             and r["host_tiers"]["storage"] == 0 and sum(r["recompute_tiers"].values()) == 0]
    p = {name: percentile([r[f"{name}_ttft_s"] for r in valid], 50) for name in ("storage", "host", "recompute")}
    t = cstats["tier"]
    store = cstats["store"]
    return {
        "repeats": repeats, "valid_repeats": len(valid), "rows": rows,
        "prompt_tokens_p50": percentile([r["prompt_tokens"] for r in rows], 50),
        "storage_cached_tokens_p50": percentile([r["storage_tiers"]["storage"] for r in valid], 50),
        "storage_ttft_p50_s": p["storage"], "host_ttft_p50_s": p["host"], "recompute_ttft_p50_s": p["recompute"],
        "storage_over_host": p["storage"] / p["host"] if valid else float("nan"),
        "storage_over_recompute": p["storage"] / p["recompute"] if valid else float("nan"),
        # Backend calls (batch_get_into / batch_put_from) as timed by the backend itself.
        "server_read_gbps": store["read_bytes"] / store["read_seconds"] / 1e9 if store.get("read_seconds") else float("nan"),
        # Whole prefetch jobs (queue, get, scatter), as the scheduler waited for them.
        "prefetch_job_gbps": t["read_bytes"] / t["read_seconds"] / 1e9 if t["read_seconds"] else float("nan"),
        "server_write_gbps": wstats["write_bytes"] / wstats["write_seconds"] / 1e9 if wstats["write_seconds"] else float("nan"),
        "read_bytes": t["read_bytes"], "write_bytes": wstats["write_bytes"],
        "aborted_prefetches": t["aborted_prefetches"], "errors": t["errors"],
    }


def plain_file_gbps(nbytes: int, object_bytes: int, directory: Path) -> dict[str, float]:
    """A plain write and read (page cache warm) of the same bytes as files of one object each."""
    import numpy as np

    n = max(1, nbytes // object_bytes)
    data = np.random.default_rng(0).integers(0, 256, object_bytes, dtype=np.uint8).tobytes()
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(n):
        with open(directory / f"{i}.bin", "wb") as f:
            f.write(data)
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n):
        with open(directory / f"{i}.bin", "rb") as f:
            f.read()
    r = time.perf_counter() - t0
    shutil.rmtree(directory, ignore_errors=True)
    return {"plain_write_gbps": n * object_bytes / w / 1e9, "plain_read_gbps": n * object_bytes / r / 1e9}


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama-random")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefix-tokens", default="512,1024,2048", help="Prefix lengths of the cold-server probe.")
    ap.add_argument("--probe-repeats", type=int, default=5)
    ap.add_argument("--backends", default="file,mooncake")
    ap.add_argument("--users", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--swap-space", type=float, default=1.0)
    ap.add_argument("--workload", action=argparse.BooleanOptionalAction, default=True,
                    help="Run the multi-turn workload on device+host and device+host+storage.")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in ("httpx", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick:
        args.prefix_tokens, args.probe_repeats, args.users, args.rounds, args.doc_tokens = "256", 1, 2, 2, 256
    prefixes = [int(x) for x in args.prefix_tokens.split(",") if x]
    bs = args.block_size
    longest = max(prefixes + [args.doc_tokens])
    max_model_len = 1 << math.ceil(math.log2(longest * 2 + 256))
    device_blocks = 3 * math.ceil((longest + 64) / bs) + 8
    common = ["--model", args.model, "--device", "cpu", "--block-size", str(bs), "--max-model-len", str(max_model_len),
              "--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", "512",
              "--num-gpu-blocks-override", str(device_blocks), "--swap-space", str(args.swap_space),
              "--write-policy", "write_through", "--uvicorn-log-level", "warning", "--log-level", "warning"]
    # A crash prints its Python stack into the server log (see start_server).
    env = {"ENABLE_V1_KVCACHE_MANAGER": "1", "PYTHONFAULTHANDLER": "1"}
    failed_starts: list[str] = []

    def start_server(server_args: list[str], server_env: dict[str, str]) -> ServerProcess:
        """Start a server; one retry if it dies during start-up (recorded in the report)."""
        try:
            return ServerProcess(server_args, env=server_env).start()
        except RuntimeError as exc:
            failed_starts.append(str(exc)[-4000:])
            logger.error("server died during start-up (retrying once): %s", str(exc)[-2000:])
            return ServerProcess(server_args, env=server_env).start()

    work = Path(tempfile.mkdtemp(prefix="fdkv-bench-storage-"))
    report: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "time_utc": time.strftime("%H:%M", time.gmtime()),
                              "machine": machine(), "args": vars(args), "device_blocks": device_blocks,
                              "loadavg_start": os.getloadavg(), "cold": {}, "workload": {}}
    tokens_per_word: Optional[float] = None
    wl: Optional[Workload] = None
    local = None
    try:
        first = ServerProcess(common, env=env).start()
        try:
            tokens_per_word = calibrate_tokens_per_word(first, args.model, Workload(0, 0, 0, 0, 0, 1, args.seed))
        finally:
            first.stop()
        wl = Workload(args.users, args.rounds, max(1, round(args.doc_tokens / tokens_per_word)),
                      max(1, round(24 / tokens_per_word)), args.output_tokens, args.concurrency, args.seed)
        backends = [b for b in args.backends.split(",") if b]
        for backend in backends:
            env_b = dict(env)
            if backend == "mooncake":
                from fastdeploy_kvcache.storage.mooncake_local import LocalMooncake

                local = LocalMooncake(segment="1GB", log_dir=work / "mooncake").start()
                env_b.update(local.env())
            for plen in prefixes:
                tag = prefixes.index(plen) + 10 * backends.index(backend)
                sdir = work / f"store-{backend}-{plen}"
                storage = ["--kvcache-storage-backend", backend, "--kvcache-storage-prefetch-policy", "wait_complete"]
                if backend == "file":
                    storage += ["--kvcache-storage-path", str(sdir), "--kvcache-storage-min-free", "0"]
                writer = start_server(common + storage, env_b)
                filler = math.ceil(device_blocks * bs / plen) + 1
                logger.info("[cold %s %d] %d repeats, %d fillers", backend, plen, args.probe_repeats, filler)
                res = asyncio.run(cold_probe(writer, lambda: start_server(common + storage, env_b), args.model,
                                             wl, max(1, round(plen / tokens_per_word)), args.probe_repeats, filler, tag))
                res.update(plain_file_gbps(int(res["read_bytes"]) or (1 << 20), 64 << 10, work / "plain"))
                report["cold"][f"{backend}/{plen}"] = res
                logger.info("[cold %s %d] TTFT p50 storage %.1f ms, host %.1f ms, recompute %.1f ms: "
                            "storage/host %.2f, storage/recompute %.2f (%d/%d valid)", backend, plen,
                            1e3 * res["storage_ttft_p50_s"], 1e3 * res["host_ttft_p50_s"],
                            1e3 * res["recompute_ttft_p50_s"], res["storage_over_host"],
                            res["storage_over_recompute"], res["valid_repeats"], res["repeats"])
            if local is not None:
                local.stop()
                local = None
        if args.workload:
            from tqdm import tqdm

            for name, extra in (("device+host", []),
                                ("device+host+storage", ["--kvcache-storage-backend", "file", "--kvcache-storage-path",
                                                         str(work / "store-workload"), "--kvcache-storage-min-free", "0"])):
                server = start_server(common + extra, env)
                try:
                    bar = tqdm(total=wl.users * wl.rounds, desc=name, unit="req", file=sys.stderr)
                    turns, wall = asyncio.run(run_workload(server.base_url, args.model, wl, bar))
                    bar.close()
                    res = ConfigResult(name, server.args, env, wall, turns, scrape_metrics(server))
                    report["workload"][name] = res.summary()
                    if "storage" in name:
                        report["workload"][name]["storage"] = wait_storage_quiet(server)["storage"]["tier"]
                finally:
                    server.stop()
            w = report["workload"]
            report["workload"]["storage_over_host_ttft_p50"] = (
                w["device+host+storage"]["ttft_p50_s"] / w["device+host"]["ttft_p50_s"])
    finally:
        if local is not None:
            local.stop()
        shutil.rmtree(work, ignore_errors=True)
    report["loadavg_end"] = os.getloadavg()
    report["failed_server_starts"] = failed_starts
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"bench_storage_serving_{args.tag}_{report['date']}{'_quick' if args.quick else ''}.json"
    path.write_text(json.dumps(report, indent=1, default=str))
    print(format_table(report))
    logger.info("wrote %s", path)
    return 0


def format_table(report: dict[str, Any]) -> str:
    lines = ["| backend | prefix tokens | storage hit TTFT p50 | host hit TTFT p50 | recompute TTFT p50 | "
             "storage / host (<= 1.3) | storage / recompute (<= 0.25) | server read GB/s | plain read GB/s | "
             "server write GB/s | plain write GB/s | valid |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in report["cold"].items():
        backend, _ = key.split("/")
        lines.append(
            f"| {backend} | {r['prompt_tokens_p50']:.0f} | {1e3 * r['storage_ttft_p50_s']:.1f} ms | "
            f"{1e3 * r['host_ttft_p50_s']:.1f} ms | {1e3 * r['recompute_ttft_p50_s']:.1f} ms | "
            f"{r['storage_over_host']:.2f} | {r['storage_over_recompute']:.2f} | {r['server_read_gbps']:.2f} | "
            f"{r['plain_read_gbps']:.2f} | {r['server_write_gbps']:.2f} | {r['plain_write_gbps']:.2f} | "
            f"{r['valid_repeats']}/{r['repeats']} |")
    w = report.get("workload") or {}
    if "device+host" in w and "device+host+storage" in w:
        lines += ["", "| configuration | TTFT p50 | TTFT p99 | req/s | cached (device/host/storage) |", "|---|---|---|---|---|"]
        for name in ("device+host", "device+host+storage"):
            s = w[name]
            by = s["cached_fraction_by_tier"]
            lines.append(f"| {name} | {1e3 * s['ttft_p50_s']:.1f} ms | {1e3 * s['ttft_p99_s']:.1f} ms | "
                         f"{s['requests_per_s']:.2f} | {by['device']:.2f} / {by['host']:.2f} / {by['storage']:.2f} |")
        lines.append(f"\nstorage / host workload TTFT p50: {w['storage_over_host_ttft_p50']:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
