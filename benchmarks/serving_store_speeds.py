"""The store-speed scenario of ``bench_serving`` (``--store-speeds``; run in its invocation).

A writer server stores ``--store-docs`` documents of ``--store-prefix-tokens`` tokens (token
ids, so the stored prefix is exactly that many blocks) and stops.  Then, at each store speed:

* ``warm``: the store's files in the page cache;
* ``cold`` (``--store-cold``): before every server of this speed, each file is fsync'ed and
  dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)`` (no root needed;
  only these files leave the cache, not a shared machine's other tenants');
* ``N GB/s`` (``--store-rate 0.5,1,2,4``): the store's reads held to that rate by
  ``FDKV_STORAGE_THROTTLE_BYTES_PER_S`` (``storage/throttle.py``) in the server's environment;

fresh servers in front of the same store serve every document from storage once, each after a
warm-up (two computed documents, so the planner knows the prefill rate, and one stored
document, so it knows the read rate).  One server per way of serving a hit:

* ``fetch_all``: ``--kvcache-storage-fetch-plan off`` (every stored block read);
* ``online``: ``--kvcache-storage-fetch-plan on`` (the planner's choice from its estimates);
* ``split:N``: the plan forced to fetch N blocks and recompute the rest
  (``FDKV_STORAGE_FORCE_FETCH_BLOCKS``), ``--store-split-points`` values of N from 0 (recompute
  all: the baseline every ratio is taken against) to every block.  The best of them is the
  offline oracle.

Reported per speed: TTFT p50 of each, each over recompute-all, the oracle's split and the
online choice over it; at ``warm`` and ``cold`` also the server's read GB/s (backend calls, as
timed by the backend, from the ``fetch_all`` server) against a plain parallel read of the same
files on as many threads as the server reads on (``--kvcache-storage-read-threads``, given to
every server), in the same state of the page cache.
Targets (docs/benchmarks.md): storage hit <= 1.0x recompute at every speed, online <= 1.1x the
oracle, server read >= 0.8x the plain parallel read.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

logger = logging.getLogger("bench_serving")

StartServer = Callable[[list[str], dict[str, str]], Any]
ENV = {"ENABLE_V1_KVCACHE_MANAGER": "1", "PYTHONFAULTHANDLER": "1"}


def drop_page_cache(directory: Path) -> int:
    """fsync then ``POSIX_FADV_DONTNEED`` every file under ``directory``: a cold store without
    root.  Returns the number of files dropped."""
    from bench_storage import drop_cache

    files = [str(p) for p in sorted(directory.iterdir()) if p.is_file()]
    drop_cache(files)
    return len(files)


def plain_parallel_read_gbps(directory: Path, threads: int) -> float:
    """GB/s of reading every file under ``directory`` whole (open / readinto / close), the
    files spread over ``threads`` threads: the read a store of the same files could reach."""
    paths = sorted(p for p in directory.iterdir() if p.is_file())
    sizes = [p.stat().st_size for p in paths]
    bufs = [bytearray(max(sizes, default=1)) for _ in range(max(1, threads))]

    def read_slice(t: int) -> None:
        view = memoryview(bufs[t])
        for i in range(t, len(paths), threads):
            with open(paths[i], "rb", buffering=0) as f:
                f.readinto(view[:sizes[i]])

    t0 = time.perf_counter()
    if threads <= 1:
        read_slice(0)
    else:
        with ThreadPoolExecutor(max_workers=threads) as pool:
            list(pool.map(read_slice, range(threads)))
    return sum(sizes) / (time.perf_counter() - t0) / 1e9


def _doc(k: int, tokens: int) -> list[int]:
    rng = random.Random(1_000_003 * (k + 1))
    return [rng.randrange(10, 500) for _ in range(tokens)]


def _prompt(k: int, tokens: int) -> list[int]:
    return _doc(k, tokens) + [7, 8, 9]  # a short question after the stored prefix


async def _serve_docs(server: Any, model: str, prefix: int, docs: int) -> list[tuple[float, int]]:
    """Warm-up, then each stored document once: [(ttft_s, storage tokens)] for docs 1..docs-1."""
    from openai import AsyncOpenAI

    from bench_serving import stream_completion, tiers_of, wait_storage_quiet

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    out: list[tuple[float, int]] = []
    try:
        for i in range(2):  # computed: kernels, allocator, and the planner's prefill rate
            await stream_completion(client, model, _prompt(90_000 + i, prefix), 1)  # type: ignore[arg-type]
        for k in range(docs):  # document 0: the planner's read rate (not measured)
            await asyncio.to_thread(wait_storage_quiet, server)
            r = await stream_completion(client, model, _prompt(k, prefix), 1)  # type: ignore[arg-type]
            if k:
                out.append((r[0], tiers_of(r[3])["storage"]))
    finally:
        await client.close()
    return out


def split_points(blocks: int, points: int) -> list[int]:
    """``points`` fetched-block counts from 0 to ``blocks`` (both included), evenly spaced."""
    points = max(2, points)
    return sorted({round(i * blocks / (points - 1)) for i in range(points)})


def run_store_speeds(args: Any, start_server: StartServer, work: Path) -> dict[str, Any]:
    """The scenario (module docstring); returns the figures per speed."""
    from bench_serving import cold_server_args, percentile, wait_storage_quiet
    from fastdeploy_kvcache.storage.file_backend import default_read_threads

    prefix, docs, bs = args.store_prefix_tokens, max(2, args.store_docs), args.block_size
    blocks = prefix // bs
    threads = args.store_read_threads or default_read_threads()
    common, _ = cold_server_args(args, [prefix])
    store = work / "store-speeds"
    storage = ["--kvcache-storage-backend", "file", "--kvcache-storage-path", str(store),
               "--kvcache-storage-min-free", "0", "--kvcache-storage-prefetch-policy", "wait_complete",
               "--kvcache-storage-read-threads", str(threads)]
    writer = start_server(common + storage, dict(ENV))
    try:
        from openai import OpenAI

        client = OpenAI(base_url=writer.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for k in range(docs):
            client.completions.create(model=args.model, prompt=_prompt(k, prefix), max_tokens=1, temperature=0)
        wait_storage_quiet(writer)
    finally:
        writer.stop()
    speeds: list[tuple[str, dict[str, str], bool]] = [("warm", {}, False)]
    if args.store_cold:
        speeds.append(("cold", {}, True))
    for rate in args.store_rates:
        speeds.append((f"{rate:g} GB/s", {"FDKV_STORAGE_THROTTLE_BYTES_PER_S": str(rate * 1e9)}, False))
    modes: list[tuple[str, list[str], dict[str, str]]] = [
        ("fetch_all", ["--kvcache-storage-fetch-plan", "off"], {}),
        ("online", ["--kvcache-storage-fetch-plan", "on"], {}),
    ] + [(f"split:{n}", ["--kvcache-storage-fetch-plan", "on"], {"FDKV_STORAGE_FORCE_FETCH_BLOCKS": str(n)})
         for n in split_points(blocks, args.store_split_points)]
    out: dict[str, Any] = {"prefix_tokens": prefix, "prefix_blocks": blocks, "docs_measured": docs - 1,
                           "read_threads": threads, "speeds": {}}
    for label, speed_env, cold in speeds:
        res: dict[str, Any] = {"ttft_p50_s": {}, "storage_tokens_p50": {}}
        for mode, flags, mode_env in modes:
            if cold:
                drop_page_cache(store)
            server = start_server(common + storage + flags, {**ENV, **speed_env, **mode_env})
            try:
                rows = asyncio.run(_serve_docs(server, args.model, prefix, docs))
                stats = wait_storage_quiet(server)["storage"]
            finally:
                server.stop()
            res["ttft_p50_s"][mode] = percentile([r[0] for r in rows], 50)
            res["storage_tokens_p50"][mode] = percentile([r[1] for r in rows], 50)
            if mode == "fetch_all":
                st = stats["store"]
                res["server_read_gbps"] = (st["read_bytes"] / st["read_seconds"] / 1e9 if st.get("read_seconds")
                                           else float("nan"))
                res["transfer"] = stats["transfer"]
            if mode == "online":
                tier = stats["tier"]
                res["online_plan"] = {k: tier.get(k) for k in ("plan_fetch_all", "plan_recompute_all", "plan_partial",
                                                               "plan_unknown", "plan_blocks_fetched",
                                                               "plan_blocks_recomputed")}
        if label in ("warm", "cold"):
            if cold:
                drop_page_cache(store)
            else:
                plain_parallel_read_gbps(store, threads)  # the files in the cache, as the server read them
            res["plain_parallel_read_gbps"] = plain_parallel_read_gbps(store, threads)
            res["read_over_plain"] = res["server_read_gbps"] / res["plain_parallel_read_gbps"]
        p = res["ttft_p50_s"]
        recompute = p["split:0"]
        splits = {m: t for m, t in p.items() if m.startswith("split:")}
        best = min(splits, key=splits.get)
        res.update({
            "over_recompute": {m: t / recompute for m, t in p.items()},
            "oracle_split": best, "oracle_ttft_p50_s": splits[best],
            "online_over_oracle": p["online"] / splits[best],
        })
        out["speeds"][label] = res
        logger.info("[store %s] TTFT p50 fetch-all %.1f ms, online %.1f ms, recompute-all %.1f ms; oracle %s "
                    "%.1f ms; fetch-all/recompute %.2f, online/recompute %.2f, online/oracle %.2f%s", label,
                    1e3 * p["fetch_all"], 1e3 * p["online"], 1e3 * recompute, best, 1e3 * splits[best],
                    res["over_recompute"]["fetch_all"], res["over_recompute"]["online"], res["online_over_oracle"],
                    (f"; read {res['server_read_gbps']:.2f} GB/s vs plain parallel {res['plain_parallel_read_gbps']:.2f}"
                     f" ({res['read_over_plain']:.2f})") if "read_over_plain" in res else "")
    return out


def format_store_speeds(result: Optional[dict[str, Any]]) -> str:
    """The scenario as a markdown table (empty when it did not run)."""
    if not result or not result.get("speeds"):
        return ""
    lines = [f"Store speeds: {result['prefix_tokens']}-token prefix ({result['prefix_blocks']} blocks), "
             f"{result['docs_measured']} storage hits per server, {result['read_threads']} read threads; TTFT p50 "
             "(ms) and over recompute-all (split:0)", "",
             "| store | fetch-all | online | recompute-all | oracle (split) | online / oracle | read GB/s (plain) |",
             "|---|---|---|---|---|---|---|"]
    for label, r in result["speeds"].items():
        p, o = r["ttft_p50_s"], r["over_recompute"]
        read = (f"{r['server_read_gbps']:.2f} ({r['plain_parallel_read_gbps']:.2f}, {r['read_over_plain']:.2f}x)"
                if "read_over_plain" in r else "-")
        lines.append(f"| {label} | {1e3 * p['fetch_all']:.1f} ({o['fetch_all']:.2f}x) | {1e3 * p['online']:.1f} "
                     f"({o['online']:.2f}x) | {1e3 * p['split:0']:.1f} | {1e3 * r['oracle_ttft_p50_s']:.1f} "
                     f"({r['oracle_split']}) | {r['online_over_oracle']:.2f} | {read} |")
    return "\n".join(lines)
