"""bench_serving's GPU part: the in-run link limit, the TTFT floor and the engine's host-time split.

* :func:`h2d_limit_gbps`: one contiguous 1 GiB pinned host->device copy with torch (median
  of five), the limit a host hit's load is set against in the same run;
* :func:`gpu_ratios`: the same-run ratios of the GPU targets (round 1 with the cache on over
  recompute, a host hit over its floor ``max(device-hit TTFT, KV bytes / H2D limit)``, the
  cache manager's and worker's share of a step at 32 or more running requests, and output
  tokens/s with the switch off over on when everything fits on the device);
* :func:`format_host_split`: each configuration's per-step host time by phase
  (``engine/step_timing.py``), as a table.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Optional

PHASE_LABELS = (("schedule", "scheduler + cache manager"), ("submit", "worker submit"),
                ("launch", "model launch"), ("gpu_wait", "wait for the GPU"),
                ("complete", "copies completed"), ("sample", "sampling + emit"))


def h2d_limit_gbps(nbytes: int = 1 << 30, repeats: int = 5) -> Optional[float]:
    """GB/s of one contiguous pinned host->device copy of ``nbytes`` (None without a GPU)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.fill_(7)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / statistics.median(times[1:]) / 1e9


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else ""
    except ImportError:
        return ""


def _find(stats: Any, key: str) -> Optional[float]:
    if isinstance(stats, dict):
        if key in stats and isinstance(stats[key], (int, float)):
            return float(stats[key])
        for v in stats.values():
            found = _find(v, key)
            if found is not None:
                return found
    return None


def host_split(engine_stats: dict[str, Any], which: str = "all") -> dict[str, Any]:
    """Seconds per phase per step, and each phase's share of the step (``which``: all or busy)."""
    st = (engine_stats.get("step_times") or {}).get(which) or {}
    steps = st.get("steps", 0)
    if not steps:
        return {"steps": 0}
    step_s = st["step_s"]
    out: dict[str, Any] = {"steps": steps, "step_ms": 1e3 * step_s / steps,
                           "load_wait_gpu_ms": 1e3 * st.get("load_wait_gpu_s", 0.0) / steps}
    for p, _ in PHASE_LABELS:
        out[f"{p}_ms"] = 1e3 * st.get(f"{p}_s", 0.0) / steps
        out[f"{p}_share"] = st.get(f"{p}_s", 0.0) / step_s if step_s else 0.0
    out["cache_and_worker_share"] = out["schedule_share"] + out["submit_share"] + out["complete_share"]
    return out


def gpu_ratios(report: dict[str, Any], h2d_gbps: Optional[float], fit: dict[str, Any]) -> None:
    """Add the GPU targets' ratios and targets to ``report`` (in place)."""
    s, ratios, targets = report["summaries"], report["ratios"], report["targets"]
    base, host = s.get("recompute"), s.get("device+host")

    def round1(r: dict[str, Any]) -> float:
        by = r["ttft_p50_by_round_s"]
        return by.get(1, by.get("1", float("nan")))

    if base and host and not (report.get("round1_interleaved") or {}).get("configs"):
        # One configuration after the other; with --interleave the interleaved figure holds the target.
        ratios["round1_host_over_recompute_ttft_p50"] = round1(host) / round1(base)
        targets["round1_host_over_recompute_ttft_p50"] = 1.05
    probe = report.get("probe") or {}
    est = report["engine_stats"].get("device+host") or {}
    swap_bytes, swap_blocks = _find(est, "swap_in_bytes"), _find(est, "swap_in_blocks")
    bs = report["args"]["block_size"]
    if probe and h2d_gbps and swap_bytes and swap_blocks:
        per_token = swap_bytes / swap_blocks / bs
        kv_bytes = probe["host_cached_tokens_p50"] * per_token
        load_s = kv_bytes / (h2d_gbps * 1e9)
        floor = max(probe["device_hit_ttft_p50_s"], load_s)
        report["floor"] = {"h2d_limit_gbps": h2d_gbps, "kv_bytes_per_token": per_token, "prefix_kv_bytes": kv_bytes,
                           "kv_load_at_limit_s": load_s, "floor_s": floor}
        ratios["host_hit_over_floor"] = probe["host_hit_ttft_p50_s"] / floor
        targets["host_hit_over_floor"] = 1.2
    stats = dict(report["engine_stats"])
    if fit.get("engine_stats_on"):
        stats[f"all on the device, switch on, {fit['concurrency']} in flight"] = fit["engine_stats_on"]
    splits = {name: {"all": host_split(st), "busy": host_split(st, "busy")} for name, st in stats.items()}
    report["host_split"] = splits
    busy = [v["busy"]["cache_and_worker_share"] for v in splits.values() if v["busy"].get("steps")]
    if busy:
        ratios["cache_and_worker_share_busy"] = max(busy)
        targets["cache_and_worker_share_busy"] = 0.03
    if fit:
        report["fit"] = fit
        ratios["fit_off_over_on_output_tok_s"] = fit["off_output_tokens_per_s"] / fit["on_output_tokens_per_s"]
        targets["fit_off_over_on_output_tok_s"] = round(1 / 0.97, 3)
    report["met"] = {k: (ratios[k] <= v) for k, v in targets.items() if k in ratios and ratios[k] == ratios[k]}


TARGET_LABELS = {
    "round1_host_over_recompute_ttft_p50": "round 1 (nothing to reuse), TTFT p50: device+host / recompute",
    "host_hit_over_floor": "same prefix, TTFT p50: host hit / max(device hit, KV bytes / H2D limit)",
    "cache_and_worker_share_busy": "steps with >= 32 running: (scheduler + cache manager + worker) / step",
    "fit_off_over_on_output_tok_s": "all on the device, output tok/s: switch off / switch on (on >= 0.97x off)",
}


def format_host_split(report: dict[str, Any]) -> str:
    splits = report.get("host_split") or {}
    if not splits:
        return ""
    head = "| configuration | steps | ms / step | " + " | ".join(label for _, label in PHASE_LABELS)
    lines = [head + " | GPU waiting for loads (ms / step) | cache + worker share |",
             "|---|---|---|" + "---|" * len(PHASE_LABELS) + "---|---|"]
    for name, v in splits.items():
        for which in ("all", "busy"):
            r = v[which]
            if not r.get("steps"):
                continue
            label = name if which == "all" else f"{name}, >= 32 running"
            cells = [f"{r[f'{p}_ms']:.2f} ({100 * r[f'{p}_share']:.1f}%)" for p, _ in PHASE_LABELS]
            lines.append(f"| {label} | {r['steps']} | {r['step_ms']:.2f} | " + " | ".join(cells)
                         + f" | {r['load_wait_gpu_ms']:.3f} | {100 * r['cache_and_worker_share']:.2f}% |")
    return "\n".join(lines)
