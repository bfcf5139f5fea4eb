"""The KV-format scenario of ``bench_serving`` (``--kv-formats``; run in its invocation).

The same servers and workload with the baseline KV dtype (``--kv-baseline-dtype``; ``auto``:
the model's, bfloat16 on a GPU and float32 on the CPU) and with
``--quantization '{"kv_cache_quant_type": "block_wise_fp8"}'``,
each measured in the same run, and reported as fp8 over the baseline:

* **host capacity**: host blocks per GiB of the same ``--swap-space`` (target >= 1.9x
  against bfloat16);
* **host-hit load**: a document of ``--kv-prefix-tokens`` tokens is computed, pushed off the
  device by filler documents (the device pool holds about two of them), and asked again: its
  blocks come back from the host tier.  The load's time is the engine's own (the host->device
  copies' seconds, ``transfer.h2d`` of its stats, over that one request), with the request's
  TTFT beside it (target: load <= 0.55x bfloat16's);
* **storage hit on a rate-limited store**: a writer server stores ``--kv-docs`` documents in
  a file store and stops; a server whose reads are held to ``--kv-store-rate`` GB/s
  (``FDKV_STORAGE_THROTTLE_BYTES_PER_S``) and that fetches every stored block
  (``--kvcache-storage-fetch-plan off``) serves each from storage after a warm-up (target:
  TTFT <= 0.6x bfloat16's); the engine's own TTFT (arrival to first token, no HTTP) and its
  fetch (read and copy to host), from ``request_timings``, beside it.

Each figure is a median over ``--kv-repeats`` documents (storage: ``--kv-docs`` - 1).
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, Callable, Optional

logger = logging.getLogger("bench_serving")

StartServer = Callable[[list[str], dict[str, str]], Any]
ENV = {"ENABLE_V1_KVCACHE_MANAGER": "1", "PYTHONFAULTHANDLER": "1"}
FP8 = ["--quantization", '{"kv_cache_quant_type": "block_wise_fp8"}']


def _h2d(server: Any) -> tuple[float, int]:
    """(seconds, bytes) of every host->device load the server's worker has finished."""
    t = server.engine_stats().get("transfer", {}).get("h2d", {})
    return float(t.get("seconds", 0.0)), int(t.get("bytes", 0))


async def _host_hits(server: Any, model: str, prefix: int, filler: int, repeats: int) -> list[dict[str, float]]:
    """Per repeat: the host hit's TTFT, its load's seconds and bytes, and its host tokens."""
    from openai import AsyncOpenAI

    from bench_serving import stream_completion, tiers_of
    from serving_store_speeds import _doc, _prompt

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rows = []
    try:
        for i in range(2):  # warm-up: kernels and allocators
            await stream_completion(client, model, _prompt(80_000 + i, prefix), 1)  # type: ignore[arg-type]
        for k in range(repeats):
            await stream_completion(client, model, _prompt(60_000 + k, prefix), 1)  # type: ignore[arg-type]
            for f in range(filler):
                await stream_completion(client, model, _doc(70_000 + k * filler + f, prefix), 1)  # type: ignore[arg-type]
            await stream_completion(client, model, [5], 1)  # the backups queued before go in this step
            s0, b0 = await asyncio.to_thread(_h2d, server)
            r = await stream_completion(client, model, _prompt(60_000 + k, prefix) + [11], 1)  # type: ignore[arg-type]
            s1, b1 = await asyncio.to_thread(_h2d, server)
            rows.append({"ttft_s": r[0], "load_s": s1 - s0, "load_bytes": b1 - b0,
                         "host_tokens": tiers_of(r[3])["host"]})
    finally:
        await client.close()
    return rows


async def _storage_hits(server: Any, model: str, prefix: int, docs: int) -> list[dict[str, float]]:
    """Warm-up, then each stored document once (all but the first measured): its TTFT, the
    engine's fetch (``request_timings``: the read and copy into host memory) and its storage tokens."""
    from openai import AsyncOpenAI

    from bench_serving import finished_count, request_timings_after, stream_completion, tiers_of, wait_storage_quiet
    from serving_store_speeds import _prompt

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rows = []
    try:
        for i in range(2):
            await stream_completion(client, model, _prompt(90_000 + i, prefix), 1)  # type: ignore[arg-type]
        for k in range(docs):
            await asyncio.to_thread(wait_storage_quiet, server)
            before = await asyncio.to_thread(finished_count, server)
            r = await stream_completion(client, model, _prompt(k, prefix), 1)  # type: ignore[arg-type]
            timing = await asyncio.to_thread(request_timings_after, server, before, 1)
            fetch = (timing[0].get("fetch") or {}) if timing else {}
            if k:
                rows.append({"ttft_s": r[0], "storage_tokens": tiers_of(r[3])["storage"],
                             "engine_ttft_s": float(timing[0].get("ttft_s") or float("nan")) if timing else float("nan"),
                             "fetch_s": float(fetch.get("job_s") or float("nan"))})
    finally:
        await client.close()
    return rows


def run_kv_formats(args: Any, start_server: StartServer, work: Path) -> dict[str, Any]:
    """The scenario (module docstring); returns the figures per format and the ratios."""
    from bench_serving import cold_server_args, percentile, wait_storage_quiet
    from serving_store_speeds import _prompt

    prefix, bs = args.kv_prefix_tokens, args.block_size
    common, device_blocks = cold_server_args(args, [prefix])
    # Two documents' blocks on the device: three filler documents push one off it.
    doc_blocks = -(-(prefix + 8) // bs)
    common[common.index("--num-gpu-blocks-override") + 1] = str(2 * doc_blocks + 4)
    common[common.index("--max-num-seqs") + 1] = "1"
    filler = 3
    rate_env = {"FDKV_STORAGE_THROTTLE_BYTES_PER_S": str(args.kv_store_rate * 1e9)}
    out: dict[str, Any] = {"prefix_tokens": prefix, "swap_space_gib": args.swap_space,
                           "store_rate_gbps": args.kv_store_rate, "formats": {}}
    base_dtype = args.kv_baseline_dtype
    base_flags = [] if base_dtype == "auto" else ["--kv-cache-dtype", base_dtype]
    if base_dtype == "auto":
        base_dtype = "bfloat16" if args.device == "gpu" else "float32"  # the model's, as the engine picks it
    for name, flags in (("baseline", base_flags), ("block_wise_fp8", FP8)):
        res: dict[str, Any] = {}
        server = start_server(common + flags, dict(ENV))
        try:
            stats = server.engine_stats()
            res["kv_dtype"] = "uint8/block_wise_fp8" if flags == FP8 else base_dtype
            res["host_blocks"] = int(stats["cache"]["host_blocks_total"])
            res["host_blocks_per_gib"] = res["host_blocks"] / args.swap_space
            # The warm-up, the document and its fillers all pass through the host tier (write_through).
            if res["host_blocks"] < (filler + 3) * doc_blocks:
                logger.warning("[kv %s] the host tier (%d blocks) holds fewer than the %d documents of %d blocks "
                               "the host hits pass through: raise --swap-space, or the document is gone from "
                               "host too", name, res["host_blocks"], filler + 3, doc_blocks)
            rows = asyncio.run(_host_hits(server, args.model, prefix, filler, args.kv_repeats))
        finally:
            server.stop()
        # Only real host hits count (a miss would load nothing); none: the figures are NaN.
        valid = [r for r in rows if r["host_tokens"] > 0]
        res["host_hit"] = {
            "valid": len(valid), "repeats": len(rows),
            "ttft_p50_s": percentile([r["ttft_s"] for r in valid], 50),
            "load_p50_s": percentile([r["load_s"] for r in valid], 50),
            "load_bytes_p50": percentile([r["load_bytes"] for r in valid], 50),
            "host_tokens_p50": percentile([r["host_tokens"] for r in valid], 50),
        }
        store = work / f"kv-formats-{name}"
        storage = ["--kvcache-storage-backend", "file", "--kvcache-storage-path", str(store),
                   "--kvcache-storage-min-free", "0", "--kvcache-storage-prefetch-policy", "wait_complete"]
        writer = start_server(common + flags + storage, dict(ENV))
        try:
            from openai import OpenAI

            client = OpenAI(base_url=writer.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
            for k in range(args.kv_docs):
                client.completions.create(model=args.model, prompt=_prompt(k, prefix), max_tokens=1, temperature=0)
            wait_storage_quiet(writer)
        finally:
            writer.stop()
        reader = start_server(common + flags + storage + ["--kvcache-storage-fetch-plan", "off"], {**ENV, **rate_env})
        try:
            served = asyncio.run(_storage_hits(reader, args.model, prefix, args.kv_docs))
            st = wait_storage_quiet(reader)["storage"]["store"]
        finally:
            reader.stop()
        res["storage_hit"] = {
            "ttft_p50_s": percentile([r["ttft_s"] for r in served], 50),
            "fetch_p50_s": percentile([r["fetch_s"] for r in served], 50),
            "engine_ttft_p50_s": percentile([r["engine_ttft_s"] for r in served], 50),
            "storage_tokens_p50": percentile([r["storage_tokens"] for r in served], 50),
            "read_bytes": st.get("read_bytes"), "docs": len(served),
        }
        out["formats"][name] = res
        logger.info("[kv %s] host: %d blocks (%.0f per GiB); host hit TTFT p50 %.1f ms, load p50 %.2f ms (%.1f MB); "
                    "storage hit at %g GB/s TTFT p50 %.1f ms", name, res["host_blocks"], res["host_blocks_per_gib"],
                    1e3 * res["host_hit"]["ttft_p50_s"], 1e3 * res["host_hit"]["load_p50_s"],
                    res["host_hit"]["load_bytes_p50"] / 1e6, args.kv_store_rate, 1e3 * res["storage_hit"]["ttft_p50_s"])
    base, fp8 = out["formats"]["baseline"], out["formats"]["block_wise_fp8"]

    def ratio(a: Optional[float], b: Optional[float]) -> float:
        return a / b if a is not None and b else float("nan")

    out["ratios"] = {
        "host_blocks_per_gib": ratio(fp8["host_blocks_per_gib"], base["host_blocks_per_gib"]),
        "host_hit_load": ratio(fp8["host_hit"]["load_p50_s"], base["host_hit"]["load_p50_s"]),
        "host_hit_load_bytes": ratio(fp8["host_hit"]["load_bytes_p50"], base["host_hit"]["load_bytes_p50"]),
        "host_hit_ttft": ratio(fp8["host_hit"]["ttft_p50_s"], base["host_hit"]["ttft_p50_s"]),
        "storage_hit_ttft": ratio(fp8["storage_hit"]["ttft_p50_s"], base["storage_hit"]["ttft_p50_s"]),
        "storage_hit_fetch": ratio(fp8["storage_hit"]["fetch_p50_s"], base["storage_hit"]["fetch_p50_s"]),
        "storage_hit_engine_ttft": ratio(fp8["storage_hit"]["engine_ttft_p50_s"],
                                         base["storage_hit"]["engine_ttft_p50_s"]),
    }
    return out


def format_kv_formats(result: Optional[dict[str, Any]]) -> str:
    """The console table: each figure with the baseline's, and fp8 over the baseline."""
    if not result:
        return ""
    base, fp8, r = result["formats"]["baseline"], result["formats"]["block_wise_fp8"], result["ratios"]
    rows = [
        ("host blocks per GiB", f"{base['host_blocks_per_gib']:.0f}", f"{fp8['host_blocks_per_gib']:.0f}",
         r["host_blocks_per_gib"], ">= 1.9 (vs bf16)"),
        (f"host-hit load, {result['prefix_tokens']} tokens (ms)", f"{1e3 * base['host_hit']['load_p50_s']:.2f}",
         f"{1e3 * fp8['host_hit']['load_p50_s']:.2f}", r["host_hit_load"], "<= 0.55 (vs bf16)"),
        ("host-hit load bytes (MB)", f"{base['host_hit']['load_bytes_p50'] / 1e6:.1f}",
         f"{fp8['host_hit']['load_bytes_p50'] / 1e6:.1f}", r["host_hit_load_bytes"], ""),
        ("host-hit TTFT (ms)", f"{1e3 * base['host_hit']['ttft_p50_s']:.1f}",
         f"{1e3 * fp8['host_hit']['ttft_p50_s']:.1f}", r["host_hit_ttft"], ""),
        (f"storage-hit TTFT at {result['store_rate_gbps']:g} GB/s (ms)", f"{1e3 * base['storage_hit']['ttft_p50_s']:.1f}",
         f"{1e3 * fp8['storage_hit']['ttft_p50_s']:.1f}", r["storage_hit_ttft"], "<= 0.6 (vs bf16)"),
        ("storage-hit TTFT, engine (ms)", f"{1e3 * base['storage_hit']['engine_ttft_p50_s']:.1f}",
         f"{1e3 * fp8['storage_hit']['engine_ttft_p50_s']:.1f}", r["storage_hit_engine_ttft"], ""),
        ("storage-hit fetch, engine (ms)", f"{1e3 * base['storage_hit']['fetch_p50_s']:.1f}",
         f"{1e3 * fp8['storage_hit']['fetch_p50_s']:.1f}", r["storage_hit_fetch"], ""),
    ]
    lines = ["", f"KV formats (same run): baseline = {base['kv_dtype']} KV, fp8 = block_wise_fp8",
             f"{'figure':<44} {'baseline':>10} {'fp8':>10} {'fp8/base':>9}  target"]
    for label, b, f, x, target in rows:
        lines.append(f"{label:<44} {b:>10} {f:>10} {x:>9.3f}  {target}")
    return "\n".join(lines)
