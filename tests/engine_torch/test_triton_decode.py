"""The Triton paged decode kernel's logic on the CPU, in Triton's interpreter.

Against a plain float64 reference and the torch fallback (tests/triton_decode_cases.py):
block sizes 8 to 64 (and 24, not a power of two), ragged lengths, lengths that are exact
multiples of the block size, one token, GQA groups 1, 3 and 4, tables wider than needed,
float32 / float16 / bfloat16 caches, one split and several, and the kernel writing the new
token's K/V into its slot itself.  The interpreter must be chosen
before Triton is first imported, so the cases run in one subprocess with TRITON_INTERPRET=1;
each test asserts on its case.  The compiled kernel is checked on a GPU by
tests/gpu/test_torch_engine_gpu.py.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

from tests.triton_interpreter import TRITON_REASON, run_in_interpreter
from tests.triton_decode_cases import (
    CASES,
    DTYPES,
    PREFILL_CASES,
    assert_case_ok,
    assert_prefill_ok,
    assert_zero_length_ok,
)

if importlib.util.find_spec("torch") is None or importlib.util.find_spec("triton") is None:
    pytest.skip(TRITON_REASON, allow_module_level=True)


@pytest.fixture(scope="module")
def results() -> dict[str, Any]:
    return run_in_interpreter("tests.triton_decode_cases")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(CASES))
def test_kernel_matches_float64_and_the_torch_fallback(results: dict[str, Any], case: str, dtype: str) -> None:
    assert_case_ok(results[f"{case}/{dtype}"], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_prefill_kernel_matches_float64_and_gather_sdpa(results: dict[str, Any], case: str, dtype: str) -> None:
    """A chunk after cached context, its blocks read in place (lower-right causal)."""
    assert_prefill_ok(results[f"prefill/{case}/{dtype}"], dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_length_zero_rows_read_and_write_nothing(results: dict[str, Any], dtype: str) -> None:
    """A CUDA graph's padded rows (length 0) among real ones: zeros out, no cache slot written,
    the real rows unchanged, at every split choice."""
    assert_zero_length_ok(results[f"zero_length/{dtype}"], dtype)


def test_runner_with_the_kernel_matches_transformers_sdpa(results: dict[str, Any]) -> None:
    """tiny-llama-random in float32 through the runner, its decode batch and its chunk after
    cached context on the kernels."""
    assert results["runner"] < 1e-4, results["runner"]


def test_decode_attention_choice_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` and ``torch`` on the CPU are the torch fallback; ``triton`` there needs the
    interpreter, and an unknown choice is refused with the valid ones."""
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import decode_kernel_for

    cpu = torch.device("cpu")
    assert decode_kernel_for(cpu) is None
    assert decode_kernel_for(cpu, "torch") is None
    with pytest.raises(ValueError, match="expected one of auto, triton, torch"):
        decode_kernel_for(cpu, "flash")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="interpreter"):
        decode_kernel_for(cpu, "triton")
