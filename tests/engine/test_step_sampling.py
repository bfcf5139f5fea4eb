"""The step's sampling rows (engine/sampling.py): one uniform draw per sampled token.

* ``StepSampling.sample_host`` picks, for every row of a batch, the token that the request's
  own ``RequestSampler`` picks for that row alone: a seeded request's stream does not depend
  on its batch.
* A draw stays pending until it is consumed: a step whose token is dropped and redone uses
  the same draw (the stream does not shift); ``skip_draw`` advances past a token sampled
  elsewhere, as one ``sample`` would.
* The pick is numpy's ``Generator.choice`` over the kept candidates, with the same draw.
* ``packed`` carries exactly the sampled rows' parameters, for the device path.
"""

from __future__ import annotations

import numpy as np
import pytest

from fastdeploy_kvcache.engine.sampling import RequestSampler, SamplingParams, StepSampling, sample_row

PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.7, seed=11),
    SamplingParams(temperature=1.3, top_k=5, seed=12),
    SamplingParams(temperature=1.0, top_p=0.8, seed=13),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, seed=14),
    SamplingParams(temperature=1.0, top_k=1, seed=15),  # top_k 1 is greedy
]


def _logits(rows: int, vocab: int = 300, seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).standard_normal((rows, vocab)) * 3).astype(np.float32)


def test_batch_sampling_equals_each_request_alone() -> None:
    alone = [RequestSampler(p, 99) for p in PARAMS]
    batched = [RequestSampler(p, 99) for p in PARAMS]
    for step in range(20):
        logits = _logits(len(PARAMS), seed=step)
        want = [s.sample(logits[i]) for i, s in enumerate(alone)]
        sampling = StepSampling.for_samplers(batched)
        got = sampling.sample_host(logits)
        for s in batched:
            s.consume()
        assert got.dtype == np.int64 and got.tolist() == want
        assert got[0] == logits[0].argmax() and got[5] == logits[5].argmax()  # the greedy rows


def test_a_pending_draw_is_reused_until_consumed() -> None:
    s = RequestSampler(SamplingParams(temperature=1.0, seed=3), 0)
    ref = np.random.default_rng(3)
    u = s.draw()
    assert s.draw() == u == ref.random()  # a redone step sees the same draw
    s.consume()
    assert s.draw() == ref.random()
    s.consume()
    s.skip_draw()  # a token sampled on another server
    assert s.draw() == (ref.random(), ref.random())[1]
    greedy = RequestSampler(SamplingParams(temperature=0.0, seed=3), 0)
    state = greedy.rng.bit_generator.state
    greedy.skip_draw()  # a greedy request draws nothing
    assert greedy.rng.bit_generator.state == state


def test_the_pick_is_numpys_choice_with_the_same_draw() -> None:
    logits = _logits(1, vocab=50, seed=5)[0]
    p = np.exp(logits.astype(np.float64) - logits.max())
    p /= p.sum()
    order = np.lexsort((np.arange(50), -logits.astype(np.float64)))
    for seed in range(300):
        want = int(order[np.random.default_rng(seed).choice(50, p=p[order])])
        assert sample_row(logits, 1.0, 0, 1.0, np.random.default_rng(seed).random()) == want


@pytest.mark.parametrize("u", [0.0, 0.5, 1.0 - 1e-12])
def test_top_k_and_top_p_bound_the_candidates(u: float) -> None:
    logits = np.array([5.0, 4.0, 3.0, -10.0, -10.0])
    assert sample_row(logits, 1.0, 2, 1.0, u) in (0, 1)
    assert sample_row(logits, 1.0, 0, 0.5, u) == 0
    assert sample_row(logits, 1.0, 1, 1.0, u) == 0


def test_packed_holds_the_sampled_rows_only() -> None:
    samplers = [RequestSampler(p, 7) for p in PARAMS]
    sampling = StepSampling.for_samplers(samplers)
    rows = sampling.sampled_rows
    assert rows.tolist() == [1, 2, 3, 4]  # greedy and top_k=1 rows take the argmax
    packed = sampling.packed()
    m = len(rows)
    assert packed.dtype == np.int64 and len(packed) == 5 * m
    assert packed[:m].tolist() == rows.tolist()
    assert packed[m:2 * m].tolist() == [0, 5, 0, 40]
    temperature, top_p, u = packed[2 * m:].view(np.float64).reshape(3, m)
    assert temperature.tolist() == [0.7, 1.3, 1.0, 0.9] and top_p.tolist() == [1.0, 1.0, 0.8, 0.9]
    assert u.tolist() == [samplers[r].draw() for r in rows]
    with pytest.raises(ValueError, match="logits: 2 rows for 6 sampling rows"):
        sampling.sample_host(_logits(2))
