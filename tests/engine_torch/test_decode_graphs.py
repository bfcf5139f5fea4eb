"""The CUDA-graph decode path (``--use-cudagraph``, engine/transformers_runner/decode_graphs.py) on the CPU.

Capture needs a GPU (tests/gpu/test_torch_engine_gpu.py); here the same static buffers,
padding and read-back run with an eager forward pass in place of the replay
(tests/decode_graph_check.py, in Triton's interpreter), also inside the engine, and the
engine on a CPU falls back to eager steps with a warning.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

import pytest

from tests.triton_interpreter import TRITON_REASON, run_in_interpreter
from fastdeploy_kvcache.engine.transformers_runner.decode_graphs import graph_batch_sizes



@pytest.mark.parametrize("max_num_seqs,sizes", [
    (1, [1]),
    (4, [1, 2, 4]),
    (16, [1, 2, 4, 8, 16]),
    (20, [1, 2, 4, 8, 16, 20]),
    (32, [1, 2, 4, 8, 16, 24, 32]),
    (100, [1, 2, 4, 8, 16, 24, 32, 48, 64, 80, 96, 100]),
])
def test_graph_batch_sizes(max_num_seqs: int, sizes: list[int]) -> None:
    assert graph_batch_sizes(max_num_seqs) == sizes


@pytest.fixture(scope="module")
def padded() -> dict[str, Any]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip(TRITON_REASON)
    return run_in_interpreter("tests.decode_graph_check")


def test_padded_static_decode_matches_the_eager_path(padded: dict[str, Any]) -> None:
    """Steps of 1, 3 (padded to 4) and 2 seqs through the static buffers: the same greedy
    tokens and (float32) logits as the ordinary path, and every such step counted."""
    assert padded["tokens_equal"], padded
    assert padded["logits_err"] < 1e-4, padded
    assert padded["replays"] == padded["expected_replays"], padded


def test_padded_rows_leave_other_blocks_untouched(padded: dict[str, Any]) -> None:
    """Block 0 (where the padded rows' zeroed tables point) and every other block no seq owns
    keep their contents."""
    assert padded["untouched_changed"] == 0.0, padded


def test_steps_the_graphs_cannot_express_run_eagerly(padded: dict[str, Any]) -> None:
    """Prefills, a decode beside a prompt chunk, more seqs than the largest size, and caches
    other than the captured ones."""
    assert padded["eager_steps_replayed"] == 0, padded
    assert padded["oversize_bucket"] is False and padded["other_caches_bucket"] is False, padded


def test_engine_through_the_static_path_changes_no_token(padded: dict[str, Any]) -> None:
    """The engine's decode steps through the static path (tiny-llama-random, Triton kernels in
    the interpreter): the host-hit workload under write_back (device and host hits, loads,
    evictions) gives the eager runner's recompute tokens, leaks nothing, and its decode steps
    went through the path."""
    engine = padded["engine"]
    assert engine["error"] is None, engine["error"]
    assert engine["replays"] > 0 and engine["eager_engine_replays"] == 0, engine


def test_engine_on_the_cpu_logs_and_runs_eagerly(engine_factory: Any, caplog: pytest.LogCaptureFixture) -> None:
    """--use-cudagraph without a CUDA device: a warning, then ordinary eager steps."""
    from tests.reuse_workloads import Collector, greedy

    with caplog.at_level(logging.WARNING, logger="fastdeploy_kvcache.engine.transformers_runner.torch_runner"):
        eng = engine_factory(use_cudagraph=True)
    assert any("--use-cudagraph: no CUDA device" in r.getMessage() for r in caplog.records), caplog.text
    assert eng.runner.decode_graphs is None
    out = Collector()
    eng.add_request("r", list(range(5, 25)), greedy(4), out)
    assert eng.wait_idle(120)
    assert out.final("r").num_output_tokens == 4
    stats = eng.get_stats()["engine"]
    assert stats["cudagraph_replays"] == 0 and stats["num_steps"] >= 4, stats
