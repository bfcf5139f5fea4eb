"""benchmarks/bench_shared_prefix.py runs end to end on the CPU (a smoke run; no figure is judged).

Its GPU run is the one whose ratio means something; this keeps the code (the forward-only
baseline in a child process, the two real servers, the streamed client, the report) from
rotting where no GPU is at hand, and checks that the report holds what the docs say it does.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def test_bench_shared_prefix_quick_reports_both_switches_against_the_forward_only_rate(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import bench_shared_prefix

        assert bench_shared_prefix.main(["--quick", "--out-dir", str(tmp_path)]) == 0
    finally:
        sys.path.remove(str(BENCH_DIR))
    [json_path] = tmp_path.glob("bench_shared_prefix_cpu_*_quick.json")
    report = json.loads(json_path.read_text())
    wl = report["workload"]
    n = wl["groups"] * wl["prompts_per_group"]
    prompt_len = wl["system_tokens"] + wl["question_tokens"]
    base = report["forward_only"]
    assert base["chunk_tokens"] == 512 and base["prefill_tokens_per_s"] > 0  # the CPU's chunk default
    assert (base["pool"], base["runner"]) == ("PlainKVPool", "PaddleModelRunner")  # the switch off, the served runner
    assert set(report["summaries"]) == {"switch off", "switch on"}
    for name, s in report["summaries"].items():
        rows = report["rows"][name]
        assert s["requests"] == len(rows) == n
        # every request ran once, with its own prompt and the full output
        assert sorted((r["group"], r["index"]) for r in rows) == [(g, i) for g in range(wl["groups"])
                                                                  for i in range(wl["prompts_per_group"])]
        assert all(r["prompt_tokens"] == prompt_len and r["completion_tokens"] == wl["output_tokens"] for r in rows)
        assert s["prompt_tokens"] == n * prompt_len and s["output_tokens"] == n * wl["output_tokens"]
        assert s["total_tokens_per_s"] == pytest.approx((s["prompt_tokens"] + s["output_tokens"]) / s["wall_s"])
        assert s["output_tokens_per_s"] > 0 and 0 < s["ttft_p50_s"] <= s["ttft_p99_s"] and s["itl_p50_s"] > 0
        assert report["ratios"][name] == pytest.approx(s["total_tokens_per_s"] / base["prefill_tokens_per_s"])
    # The switch off reuses nothing; on, every prompt after its group's first reuses the system prompt's
    # full blocks (timing may let a group's first prompts run side by side: at least one per group).
    assert report["summaries"]["switch off"]["cached_fraction"] == 0
    bs = base["block_size"]
    on_rows = report["rows"]["switch on"]
    assert all(r["cached_tokens"] % bs == 0 and r["cached_tokens"] <= wl["system_tokens"] for r in on_rows)
    assert sum(r["cached_tokens"] for r in on_rows) >= wl["groups"] * (wl["system_tokens"] // bs) * bs
    assert report["met"] == (report["ratios"]["switch off"] >= 0.8)
