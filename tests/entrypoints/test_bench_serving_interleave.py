"""bench_serving's round-1 target: with --interleave, the interleaved pairs hold it.

The interleaved figure is the one the target is about (the configurations run one after the
other drift apart); these check that the report says so, from a report built by hand, without
starting servers (the flag's servers are the miss probe's, which the CPU run covers).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


def _report() -> dict[str, Any]:
    summary = lambda r1: {"ttft_p50_by_round_s": {"1": r1}}  # noqa: E731  (keys as after a JSON round trip)
    return {"summaries": {"recompute": summary(1.0), "device+host": summary(1.2)}, "ratios": {}, "targets": {},
            "met": {}, "engine_stats": {}, "probe": {}, "args": {"block_size": 16}}


def _modules() -> tuple[Any, Any]:
    sys.path.insert(0, str(BENCH_DIR))
    try:
        import bench_serving
        import serving_gpu
    finally:
        sys.path.remove(str(BENCH_DIR))
    return bench_serving, serving_gpu


def test_without_interleave_round_one_is_judged_on_the_configurations_run_apart() -> None:
    bench_serving, serving_gpu = _modules()
    report = _report()
    bench_serving.add_round1_interleaved(report, {})
    serving_gpu.gpu_ratios(report, None, {})
    assert report["ratios"]["round1_host_over_recompute_ttft_p50"] == 1.2
    assert report["met"]["round1_host_over_recompute_ttft_p50"] is False


def test_interleaved_pairs_replace_the_sequential_round_one_target() -> None:
    bench_serving, serving_gpu = _modules()
    report = _report()
    pairs = {"configs": {"device+host": {"over_recompute": 1.03, "cached_tokens": 0},
                         "device": {"over_recompute": 0.9, "cached_tokens": 64}}}
    bench_serving.add_round1_interleaved(report, pairs)
    serving_gpu.gpu_ratios(report, None, {})
    assert "round1_host_over_recompute_ttft_p50" not in report["targets"]
    key = "round1_interleaved_over_recompute:device+host"
    assert report["targets"] == {key: 1.05} and report["met"] == {key: True}
    assert report["ratios"][key] == 1.03
    # A burst that reused anything was no round 1: no figure rather than a flattering one.
    assert math.isnan(report["ratios"]["round1_interleaved_over_recompute:device"])
    assert "round 1, interleaved" in bench_serving._target_label(key, report)
