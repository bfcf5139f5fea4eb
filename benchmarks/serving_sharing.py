"""Two scenarios of ``bench_serving`` where work in flight is shared (run in its invocation).

* **cold-burst**: ``--burst-size`` simultaneous requests (16 output tokens each) share a
  ``--burst-prefix-tokens`` prefix that no tier holds.  Each burst (a fresh prefix each time) goes to two servers started
  side by side, alternately: one with in-batch prefix sharing (the default
  ``--max-prefix-hold-s``) and one with ``--max-prefix-hold-s 0`` (sharing off: every request
  admitted together computes the prefix itself).  The token budget of a step holds the whole
  burst, so without sharing all of it is admitted in the first step.  Reported: TTFT p50/p99 of
  all requests of all bursts, how many requests of each burst reused the prefix, the ratio of the
  p50s.  Targets: >= N-1 of N reuse the prefix in every burst; p50 <= 0.6x sharing off.
* **queued-storage**: ``--queued-requests`` requests, more than the server's
  ``--queued-max-num-seqs``, each with a document that only the storage tier holds (a writer
  server stored them and was stopped).  A restarted server gets a set all at once (storage
  hits, most of them queued) and, right beside it (the order alternating), the set before,
  which filler documents pushed off the device, all at once (host hits); the first set is a
  warm-up fetched from storage unmeasured.  Done twice, on fresh processes over the same
  store: with prefetch on arrival (the default) and with ``--arrival-prefetch-host-blocks 0``
  (prefetch at admission), ``--queued-repeats`` pairs of bursts each.  Target: storage-hit
  TTFT p50 <= 1.1x host-hit TTFT p50, with prefetch on arrival; the pairs' ratio of p50s
  (median, p25-p75) and the engine's per-request timings are reported beside it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import random
import sys
from pathlib import Path
from typing import Any, Callable

logger = logging.getLogger("bench_serving")

StartServer = Callable[[list[str], dict[str, str]], Any]


def _ids(rng: random.Random, n: int) -> list[int]:
    """Token ids valid in any vocabulary of 500+ entries (tiny-llama-random has 512)."""
    return [rng.randrange(10, 500) for _ in range(n)]


def _pct(values: list[float], q: float) -> float:
    from bench_serving import percentile

    return percentile(values, q)


async def _burst(base_url: str, model: str, prompts: list[list[int]], max_tokens: int = 1) -> list[tuple[float, int]]:
    """All prompts at once (one streamed completion each): [(ttft_s, cached_tokens)]."""
    from openai import AsyncOpenAI

    from bench_serving import stream_completion

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    try:
        outs = await asyncio.gather(*(stream_completion(client, model, p, max_tokens) for p in prompts))  # type: ignore[arg-type]
    finally:
        await client.close()
    return [(o[0], int(getattr(o[3].prompt_tokens_details, "cached_tokens", 0) or 0)) for o in outs]


def _server_args(args: Any, block_size: int, max_model_len: int, max_num_seqs: int, batched: int,
                 device_blocks: int, swap_space: float) -> list[str]:
    """The scenario's server flags, on the model, runner and device of the run (``args``)."""
    return ["--model", args.model, "--device", args.device, "--model-impl", args.model_impl,
            "--block-size", str(block_size), "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(batched),
            "--num-gpu-blocks-override", str(device_blocks), "--swap-space", str(swap_space),
            "--write-policy", "write_through", "--uvicorn-log-level", "warning", "--log-level", "warning"]


def run_cold_burst(args: Any, start_server: StartServer) -> dict[str, Any]:
    """The cold-burst scenario (see the module docstring)."""
    from tqdm import tqdm

    n, plen, bs = args.burst_size, args.burst_prefix_tokens, args.block_size
    suffix = 8
    prompt_len = plen + suffix
    from bench_serving import model_len_for

    max_model_len = model_len_for(prompt_len + 64, args.model)
    batched = n * prompt_len  # the whole burst fits one step: without sharing all are admitted at once
    device_blocks = (n + 2) * math.ceil(prompt_len / bs) + 2 * n  # the whole burst computing, plus room
    common = _server_args(args, bs, max_model_len, n, batched, device_blocks, 0.0)
    env = {"ENABLE_V1_KVCACHE_MANAGER": "1", "PYTHONFAULTHANDLER": "1"}
    servers = {"sharing": start_server(common, env),
               "off": start_server(common + ["--max-prefix-hold-s", "0"], env)}
    rows: dict[str, list[dict[str, Any]]] = {k: [] for k in servers}
    try:
        rng = random.Random(args.seed + 4242)
        for name, server in servers.items():  # warm-up (not measured): kernels, allocator
            asyncio.run(_burst(server.base_url, args.model, [_ids(rng, prompt_len) for _ in range(2)]))
        bar = tqdm(total=2 * args.burst_repeats, desc="cold-burst", unit="burst", file=sys.stderr)
        for r in range(args.burst_repeats):
            order = list(servers) if r % 2 == 0 else list(servers)[::-1]  # alternate: drift hits both
            for name in order:
                prefix = _ids(rng, plen)  # a fresh prefix per burst and server: cold everywhere
                prompts = [prefix + _ids(rng, suffix) for _ in range(n)]
                # NOTE: 16 output tokens: the first request is still decoding when the last ones
                # arrive, so without sharing they cannot reuse its blocks (they are cached at finish).
                outs = asyncio.run(_burst(servers[name].base_url, args.model, prompts, 16))
                aligned = plen // bs * bs
                rows[name].append({"ttft_s": [t for t, _ in outs], "cached": [c for _, c in outs],
                                   "reused": sum(1 for _, c in outs if c >= aligned)})
                bar.update(1)
        bar.close()
        stats = {name: s.engine_stats() for name, s in servers.items()}
    finally:
        for s in servers.values():
            s.stop()
    out: dict[str, Any] = {"burst_size": n, "prefix_tokens": plen, "repeats": args.burst_repeats,
                           "server_args": common, "max_num_batched_tokens": batched}
    for name, rs in rows.items():
        ttfts = [t for row in rs for t in row["ttft_s"]]
        out[name] = {
            "ttft_p50_s": _pct(ttfts, 50), "ttft_p99_s": _pct(ttfts, 99),
            "reused_per_burst": [row["reused"] for row in rs],
            "cached_tokens_mean": sum(c for row in rs for c in row["cached"]) / max(1, len(ttfts)),
            "reused_tokens_total": sum(c for row in rs for c in row["cached"]),
            "prefix_sharing": stats[name].get("prefix_sharing", {}),
            "prompt_tokens_computed": stats[name].get("engine", {}).get("prompt_tokens_computed"),
        }
    out["p50_ratio"] = out["sharing"]["ttft_p50_s"] / out["off"]["ttft_p50_s"]
    out["p99_ratio"] = out["sharing"]["ttft_p99_s"] / out["off"]["ttft_p99_s"]
    out["min_reused"] = min(out["sharing"]["reused_per_burst"])
    logger.info("[cold-burst] %d x %d-token prefix: TTFT p50 %.1f ms sharing vs %.1f ms off (%.2fx), p99 %.1f vs "
                "%.1f ms; reused per burst %s (off: %s)", n, plen, 1e3 * out["sharing"]["ttft_p50_s"],
                1e3 * out["off"]["ttft_p50_s"], out["p50_ratio"], 1e3 * out["sharing"]["ttft_p99_s"],
                1e3 * out["off"]["ttft_p99_s"], out["sharing"]["reused_per_burst"], out["off"]["reused_per_burst"])
    return out


def run_queued_storage(args: Any, start_server: StartServer, work: Path) -> dict[str, Any]:
    """The queued-storage scenario (see the module docstring)."""
    from tqdm import tqdm

    from bench_serving import engine_ratio, finished_count, request_timings_after, timing_summary, wait_storage_quiet

    m, seqs, plen, bs = args.queued_requests, args.queued_max_num_seqs, args.queued_prefix_tokens, args.block_size
    prompt_len = plen + 8
    from bench_serving import model_len_for

    max_model_len = model_len_for(prompt_len + 64, args.model)
    per_doc = math.ceil(prompt_len / bs) + 1
    device_blocks = (seqs + 2) * per_doc  # the burst's documents cannot all stay on the device
    common = _server_args(args, bs, max_model_len, seqs, args.max_num_batched_tokens, device_blocks,
                          args.swap_space)
    store = ["--kvcache-storage-backend", "file", "--kvcache-storage-path", str(work / "store-queued"),
             "--kvcache-storage-min-free", "0", "--kvcache-storage-prefetch-policy", "wait_complete"]
    env = {"ENABLE_V1_KVCACHE_MANAGER": "1", "PYTHONFAULTHANDLER": "1"}
    rng = random.Random(args.seed + 777)
    configs = {"arrival": [], "admission": ["--arrival-prefetch-host-blocks", "0"]}
    sets = args.queued_repeats  # measured document sets per configuration, each storage-only until its burst
    # Set 0 of each configuration is a warm-up burst from storage: the host-hit partner of set 1.
    docs = {name: [[_ids(rng, plen) for _ in range(m)] for _ in range(sets + 1)] for name in configs}
    filler = [_ids(rng, plen) for _ in range(seqs + 3)]
    warm = [_ids(rng, plen) for _ in range(2)]
    writer = start_server(common + store, env)
    try:
        for name in configs:  # each configuration its own documents, all stored by the writer
            for docset in docs[name]:
                for d in docset:
                    asyncio.run(_burst(writer.base_url, args.model, [d + [5]]))
        wait_storage_quiet(writer)
    finally:
        writer.stop()
    out: dict[str, Any] = {"requests": m, "max_num_seqs": seqs, "prefix_tokens": plen, "server_args": common + store,
                           "device_blocks": device_blocks}
    out["repeats"] = sets
    bar = tqdm(total=2 * len(configs) * sets, desc="queued-storage", unit="burst", file=sys.stderr)
    for name, extra in configs.items():
        server = start_server(common + store + extra, env)  # a fresh process: the documents are in storage only
        st: list[tuple[float, int]] = []
        host: list[tuple[float, int]] = []
        pairs: list[float] = []
        st_t: list[dict[str, Any]] = []
        host_t: list[dict[str, Any]] = []

        def burst(docset: list[list[int]]) -> tuple[list[tuple[float, int]], list[dict[str, Any]]]:
            wait_storage_quiet(server)  # no earlier request's backups share the cores with this burst
            before = finished_count(server)
            outs = asyncio.run(_burst(server.base_url, args.model, [d + _ids(rng, 8) for d in docset]))
            return outs, request_timings_after(server, before, len(docset))

        def push_off() -> None:
            for f in filler:  # push the documents off the device (host keeps them)
                asyncio.run(_burst(server.base_url, args.model, [f + _ids(rng, 8)]))

        try:
            asyncio.run(_burst(server.base_url, args.model, warm))  # warm-up, not measured
            burst(docs[name][0])  # set 0 from storage, not measured: set 1's host-hit partner
            push_off()
            for r in range(1, sets + 1):
                # A storage-hit burst (set r) and a host-hit burst (set r - 1) side by side, the
                # order alternating, so load drifts reach both.
                if r % 2:
                    s_out, s_t = burst(docs[name][r])
                    h_out, h_t = burst(docs[name][r - 1])
                else:
                    h_out, h_t = burst(docs[name][r - 1])
                    s_out, s_t = burst(docs[name][r])
                bar.update(2)
                st += s_out
                host += h_out
                st_t += s_t
                host_t += h_t
                pairs.append(_pct([t for t, _ in s_out], 50) / _pct([t for t, _ in h_out], 50))
                push_off()
            tier = wait_storage_quiet(server)["storage"]["tier"]
        finally:
            server.stop()
        aligned = plen // bs * bs
        out[name] = {
            "storage_ttft_p50_s": _pct([t for t, _ in st], 50), "storage_ttft_p99_s": _pct([t for t, _ in st], 99),
            "host_ttft_p50_s": _pct([t for t, _ in host], 50), "host_ttft_p99_s": _pct([t for t, _ in host], 99),
            "storage_reused": sum(1 for _, c in st if c >= aligned), "host_reused": sum(1 for _, c in host if c >= aligned),
            "samples": len(st),
            # Per pair of bursts side by side: storage-hit p50 / host-hit p50.
            "pair_ratios": pairs, "pair_ratio_p50": _pct(pairs, 50),
            "pair_ratio_p25_p75": [_pct(pairs, 25), _pct(pairs, 75)],
            "storage_timing": timing_summary(st_t), "host_timing": timing_summary(host_t),
            "storage_timings": st_t, "host_timings": host_t,
            "arrival_prefetch_jobs": tier.get("arrival_prefetch_jobs"), "storage_hit_tokens": tier.get("storage_hit_tokens"),
            "prefetch_blocks_shared": tier.get("prefetch_blocks_shared"),
        }
        out[name]["storage_over_host"] = out[name]["storage_ttft_p50_s"] / out[name]["host_ttft_p50_s"]
        out[name]["engine_storage_over_host"] = engine_ratio(st_t, host_t)
        logger.info("[queued-storage %s] %d requests, %d seqs: storage-hit TTFT p50 %.1f ms, host-hit %.1f ms: %.2fx "
                    "(pairs of bursts: median %.2fx, p25-p75 %.2f-%.2f; reused %d/%d and %d/%d)", name, m, seqs,
                    1e3 * out[name]["storage_ttft_p50_s"], 1e3 * out[name]["host_ttft_p50_s"],
                    out[name]["storage_over_host"], out[name]["pair_ratio_p50"], *out[name]["pair_ratio_p25_p75"],
                    out[name]["storage_reused"], len(st), out[name]["host_reused"], len(host))
    bar.close()
    return out


def _table(header: str, rows: list[list[str]]) -> list[str]:
    cols = header.count("|") - 1
    return [header, "|" + "---|" * cols] + ["| " + " | ".join(r) + " |" for r in rows]


def _pairs(row: dict[str, Any]) -> str:
    if "pair_ratio_p50" not in row:
        return "-"
    lo, hi = row["pair_ratio_p25_p75"]
    return f"{row['pair_ratio_p50']:.2f}x ({lo:.2f}-{hi:.2f})"


def format_sharing(report: dict[str, Any]) -> str:
    """The two scenarios as markdown tables ('' where they did not run)."""
    lines: list[str] = []
    cb = report.get("cold_burst") or {}
    if cb:
        n = cb["burst_size"]
        rows = [[label, f"{1e3 * cb[k]['ttft_p50_s']:.1f} ms", f"{1e3 * cb[k]['ttft_p99_s']:.1f} ms",
                 ", ".join(f"{x}/{n}" for x in cb[k]["reused_per_burst"]), str(cb[k].get("reused_tokens_total", "?"))]
                for k, label in (("sharing", "sharing on"), ("off", "sharing off (`--max-prefix-hold-s 0`)"))]
        lines += [f"**cold-burst** ({n} simultaneous requests, {cb['prefix_tokens']}-token prefix cached nowhere, "
                  f"{cb['repeats']} bursts per server, one step's budget holds the burst):", ""]
        lines += _table("| server | TTFT p50 | TTFT p99 | requests that reused the prefix, per burst | tokens reused |",
                        rows)
        lines += ["", f"Ratio to sharing off: p50 {cb['p50_ratio']:.2f}x (target <= 0.6x), p99 {cb['p99_ratio']:.2f}x; "
                  f"fewest reusing requests in a burst {cb['min_reused']}/{n} (target >= {n - 1}/{n}).", ""]
    qs = report.get("queued_storage") or {}
    if qs:
        rows = [[label, f"{1e3 * qs[k]['storage_ttft_p50_s']:.1f} ms", f"{1e3 * qs[k]['host_ttft_p50_s']:.1f} ms",
                 f"{qs[k]['storage_over_host']:.2f}x (engine {qs[k].get('engine_storage_over_host', float('nan')):.2f}x)",
                 _pairs(qs[k])]
                for k, label in (("arrival", "on arrival (default)"),
                                 ("admission", "at admission (`--arrival-prefetch-host-blocks 0`)"))]
        lines += [f"**queued-storage** ({qs.get('repeats', 1)} bursts of {qs['requests']} requests at once per "
                  f"server, `--max-num-seqs {qs['max_num_seqs']}`, {qs['prefix_tokens']}-token documents in "
                  "storage only, then the same documents from host):", ""]
        lines += _table("| prefetch | storage-hit TTFT p50 | host-hit TTFT p50 | storage / host | "
                        "bursts side by side: median (p25-p75) |", rows)
        lines += ["", "Target: storage / host <= 1.1x with prefetch on arrival.", ""]
    return "\n".join(lines)
