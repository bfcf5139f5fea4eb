"""The Triton paged decode kernel's logic on the CPU, in Triton's interpreter.

Against a plain float64 reference and the torch fallback (tests/triton_decode_cases.py):
block sizes 8 to 64 (and 24, not a power of two), ragged lengths, lengths that are exact
multiples of the block size, one token, GQA groups 1, 3 and 4, tables wider than needed,
float32 / float16 / bfloat16 caches, one split and several.  The interpreter must be chosen
before Triton is first imported, so the cases run in one subprocess with TRITON_INTERPRET=1;
each test asserts on its case.  The compiled kernel is checked on a GPU by
tests/gpu/test_torch_engine_gpu.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.triton_decode_cases import CASES, DTYPES, SPLITS, TOLERANCE

ROOT = Path(__file__).resolve().parents[2]
TRITON_REASON = "needs Triton for its CPU interpreter (pip install triton; bundled with CUDA builds of torch)"


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    if importlib.util.find_spec("triton") is None:
        pytest.skip(TRITON_REASON)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", "tests.triton_decode_cases"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_float64_and_the_torch_fallback(results: dict[str, Any], case: str, dtype: str) -> None:
    r = results[f"{case}/{dtype}"]
    tol = TOLERANCE[dtype]
    for s in SPLITS:
        assert r[f"f64_splits_{s}"] < tol, (s, r)
    assert r["torch"] < tol, r
    assert r["outside_changed"] == 0.0, "the kernel wrote outside its output rows"
    assert r["padding_changed"] == 0.0, "the kernel read table entries past a seq's length"
    assert r["write_new_f64"] < tol, r
    assert r["write_new_cache_wrong"] == 0.0, "the new token's K/V did not land in (only in) its slot"


def test_runner_with_the_kernel_matches_transformers_sdpa(results: dict[str, Any]) -> None:
    """tiny-llama-random in float32 through the runner, its decode batch on the kernel."""
    assert results["runner"] < 1e-4, results["runner"]
