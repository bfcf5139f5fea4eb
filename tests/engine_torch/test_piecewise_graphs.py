"""Piecewise graphs (engine/transformers_runner/piecewise_graphs.py) on the CPU.

Capture needs a GPU (tests/gpu/test_piecewise_graphs_gpu.py); here the same cut of the
model at every attention, over the same static buffers with the same padding, runs as plain
calls: a step through it gives the eager fused runner's logits, steps past the largest size
run eagerly, and the engine's tokens through it equal recompute.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import pytest

from fastdeploy_kvcache.engine.transformers_runner.piecewise_graphs import graph_token_sizes, piecewise_reserve_bytes


@pytest.mark.parametrize("max_tokens,head,tail", [
    (1, [1], [1]),
    (40, [16, 32, 40], [16, 32, 40]),
    (512, [16, 32, 64, 128, 256], [256, 384, 512]),
    (8192, [16, 32, 64, 128, 256], [4096, 4608, 5120, 5632, 6144, 6656, 7168, 7680, 8192]),
    (65536, [16, 32, 64, 128, 256], [7168, 7680, 8192]),  # capped: larger steps run eagerly
])
def test_graph_token_sizes(max_tokens: int, head: list[int], tail: list[int]) -> None:
    sizes = graph_token_sizes(max_tokens)
    assert sizes[:len(head)] == head and sizes[-len(tail):] == tail
    assert sizes == sorted(set(sizes)) and sizes[-1] == min(max_tokens, 8192)
    gaps = [b - a for a, b in zip(sizes, sizes[1:])]
    assert max(gaps, default=0) <= 512


def test_graph_token_sizes_rejects_nothing_to_capture() -> None:
    with pytest.raises(ValueError, match="max_tokens: must be >= 1"):
        graph_token_sizes(0)


def _fused(seed: int = 0) -> Any:
    import torch

    from fastdeploy_kvcache.engine.transformers_runner.torch_models import load_torch_model

    return load_torch_model("tiny-llama-random", seed=seed, device=torch.device("cpu"), dtype="float32")


def _mixed_step() -> tuple[list[Any], list[list[Any]], int]:
    import torch

    from fastdeploy_kvcache.engine.runner import ScheduledSeq

    bs = 16
    seqs = [ScheduledSeq([7 + i], 20 + i, [2 * i, 2 * i + 1], True) for i in range(3)]
    seqs.append(ScheduledSeq(list(range(30, 67)), 0, [20, 21, 22], True))  # a prompt chunk, nothing cached
    seqs.append(ScheduledSeq(list(range(90, 99)), 40, [30, 31, 32, 33], False))  # after cached context, no logits
    seqs.append(ScheduledSeq(list(range(100, 104)), 16, [40, 41], True))
    return seqs, [], bs


def _caches(lm: Any, bs: int) -> list[list[Any]]:
    import torch

    gen = torch.Generator().manual_seed(3)
    shape = (64, lm.num_kv_heads, bs, lm.head_dim)
    return [[torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)] for _ in range(lm.num_layers)]


def test_a_mixed_step_through_the_pieces_gives_the_eager_logits_and_cache() -> None:
    """Decodes, a fresh chunk and chunks after cached context, padded to the next size: the
    logits and every cache block equal the eager fused runner's."""
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    lm = _fused()
    seqs, _, bs = _mixed_step()
    caches = _caches(lm, bs)
    eager = TorchModelRunner(lm, bs, "cpu", fused_layers=True)
    c1 = [[k.clone(), v.clone()] for k, v in caches]
    want = eager.forward(seqs, c1, None)
    runner = TorchModelRunner(lm, bs, "cpu", fused_layers=True)
    assert runner.enable_piecewise_graphs(128, capture=False)
    tokens = sum(len(s.token_ids) for s in seqs)
    assert runner.piecewise_graphs.bucket_for(tokens).size == 64 > tokens  # padded rows exist
    c2 = [[k.clone(), v.clone()] for k, v in caches]
    got = runner.forward(seqs, c2, None)
    assert runner.piecewise_steps == 1 and not runner.last_step_replayed  # pieces called, nothing replayed
    assert got.shape == want.shape == (5, lm.vocab_size)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    for (k1, v1), (k2, v2) in zip(c1, c2):
        assert bool((k1 == k2).all()) and bool((v1 == v2).all())
    # A second, smaller step reuses the buffers: stale rows from the first change nothing.
    again = runner.forward(seqs[:4], [[k.clone(), v.clone()] for k, v in caches], None)
    np.testing.assert_allclose(again, eager.forward(seqs[:4], [[k.clone(), v.clone()] for k, v in caches], None),
                               rtol=1e-5, atol=1e-5)
    assert runner.piecewise_steps == 2


def test_a_step_larger_than_every_size_runs_eagerly() -> None:
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    lm = _fused()
    seqs, _, bs = _mixed_step()
    runner = TorchModelRunner(lm, bs, "cpu", fused_layers=True)
    assert runner.enable_piecewise_graphs(32, capture=False)
    runner.forward(seqs, _caches(lm, bs), None)  # 53 tokens > 32
    assert runner.piecewise_steps == 0


def test_piecewise_graphs_need_fused_layers(caplog: pytest.LogCaptureFixture) -> None:
    """Unfused layers: a warning naming the flag, and every such step eager."""
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    runner = TorchModelRunner(_fused(seed=1), 16, "cpu")
    with caplog.at_level("WARNING"):
        assert not runner.enable_piecewise_graphs(128, capture=False)
    assert "--fused-layers on" in caplog.text and runner.piecewise_graphs is None
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device"):
        runner.enable_piecewise_graphs(128, capture=True)


def test_reserve_grows_with_the_step() -> None:
    cfg = _fused().model.config
    assert piecewise_reserve_bytes(2048, cfg) == 2 * piecewise_reserve_bytes(1024, cfg) > 0
    assert piecewise_reserve_bytes(65536, cfg) == piecewise_reserve_bytes(8192, cfg)


@pytest.fixture
def fused_engines(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Engines over a model of their own (fusing changes the model in place)."""
    from tests.torch_engines import engine_factory_for

    engines = engine_factory_for(monkeypatch, _fused(seed=2), model="tiny-llama-random", device="cpu",
                                 fused_layers="on")
    yield next(engines)
    for _ in engines:
        pass


def test_engine_tokens_through_the_pieces_equal_recompute(fused_engines: Any) -> None:
    """The engine with the pieces in place of its eager prompt steps (fused layers, pieces
    called): device and host hits through them give recompute's greedy tokens, and nothing
    leaks."""
    from tests.reuse_workloads import assert_no_leak, recompute_tokens, run_waves

    def with_pieces(**kwargs: Any) -> Any:
        eng = fused_engines(**kwargs)
        assert eng.runner.fused_layers == eng.loaded.num_layers
        assert eng.runner.enable_piecewise_graphs(eng.args.max_num_batched_tokens, capture=False)
        return eng

    want = recompute_tokens(with_pieces)
    eng = with_pieces(write_policy="write_back")
    got, _ = run_waves(eng)
    assert eng.runner.piecewise_steps > 0
    assert got == want
    assert_no_leak(eng)


def _ops_between_pieces(runner: Any, seqs: list[Any], caches: list[list[Any]]) -> tuple[list[int], int]:
    """The aten ops the host dispatches between consecutive pieces of one step (each layer's
    attention, kernels aside), and those before the first piece and after the last."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    graphs = runner.piecewise_graphs
    state = {"in_piece": False, "ops": 0}
    marks: list[int] = []

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if not state["in_piece"]:
                state["ops"] += 1
            return func(*args, **(kwargs or {}))

    piece = graphs.piece

    def counted_piece(index: int, size: int) -> None:
        marks.append(state["ops"])
        state["in_piece"] = True
        try:
            piece(index, size)
        finally:
            state["in_piece"] = False

    graphs.piece = counted_piece
    try:
        with torch.inference_mode(), Count():
            runner.forward(seqs, caches, None)
    finally:
        del graphs.piece
    assert len(marks) == graphs.num_pieces
    return [b - a for a, b in zip(marks, marks[1:])], marks[0] + state["ops"] - marks[-1]


def test_each_layer_between_the_pieces_dispatches_only_its_attention_work() -> None:
    """The host's work per layer between two pieces, as on a GPU (the Triton kernels in place,
    each one launch): for decodes beside a fresh chunk, the chunk's K and V into the caches
    (one index_put_ each), its SDPA and the copy of its result, and the decode kernel's
    launch; a short chunk after cached context adds only the prefill
    kernel's launch.  Every view these need is built once per step.  On a GPU each op is
    microseconds of host time per layer, for every layer: a regression fails here."""
    from fastdeploy_kvcache.engine.runner import ScheduledSeq
    from fastdeploy_kvcache.engine.transformers_runner.torch_runner import TorchModelRunner

    lm = _fused(seed=4)
    bs = 16
    runner = TorchModelRunner(lm, bs, "cpu", fused_layers=True)
    launches: list[str] = []
    # The decode kernel prepared once per step, launched once per layer.
    runner.decode_kernel = lambda *args, **kwargs: pytest.fail("the decode kernel unprepared")
    runner.decode_launcher = lambda *args, **kwargs: lambda k_cache, v_cache, scale: launches.append("decode")
    runner.prefill_kernel = lambda *args, **kwargs: launches.append("prefill")
    runner.prefill_kernel_max_tokens = 16
    assert runner.enable_piecewise_graphs(128, capture=False)
    caches = _caches(lm, bs)
    decodes = [ScheduledSeq([7 + i], 20 + i, [2 * i, 2 * i + 1], True) for i in range(4)]
    fresh = ScheduledSeq(list(range(30, 90)), 0, [20, 21, 22, 23], True)

    per_layer, once = _ops_between_pieces(runner, decodes + [fresh], caches)
    assert per_layer == [4] * lm.num_layers
    assert launches == ["decode"] * lm.num_layers
    # Once per step, whatever the layer count: the indices' upload, the views of the step's
    # rows, the input copies and the logits (44 today on the CPU).
    assert once <= 48

    launches.clear()
    after_context = ScheduledSeq(list(range(100, 104)), 16, [40, 41], True)  # the prefill kernel's
    per_layer, _ = _ops_between_pieces(runner, decodes + [fresh, after_context], caches)
    assert per_layer == [4] * lm.num_layers
    assert launches == ["decode", "prefill"] * lm.num_layers
