"""benchmarks/bench_tp.py runs end to end on the cpu backend (a smoke run; no figure is judged).

The GPU run (CuPy, one GPU per rank) is the one that means something; this keeps its code,
which is the same but for the backend, from rotting where no two-GPU machine is at hand.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

BENCH_DIR = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.mark.usefixtures("capi_cpu")
def test_bench_tp_reports_each_ranks_ratio_to_its_single_rank_run(tmp_path: Path) -> None:
    sys.path.insert(0, str(BENCH_DIR))  # the rank processes unpickle bench_tp.BenchHook
    try:
        import bench_tp

        assert bench_tp.main(["--backend", "cpu", "--ranks", "2", "--quick", "--out", str(tmp_path)]) == 0
    finally:
        sys.path.remove(str(BENCH_DIR))
    report = json.loads((tmp_path / "bench_tp.json").read_text())
    rows = report["rows"]
    assert {(r["figure"], r["rank"]) for r in rows} == {(f, r) for f in ("d2h", "h2d") for r in (0, 1)}
    for row in rows:
        assert row["alone"] > 0 and row["all_ranks"] > 0
        assert row["ratio"] == pytest.approx(row["all_ranks"] / row["alone"])
    assert [i["num_kv_heads"] for i in report["rank_info"]] == [4, 4]  # 8 heads over 2 ranks
    assert "| ratio |" in (tmp_path / "bench_tp.md").read_text()
