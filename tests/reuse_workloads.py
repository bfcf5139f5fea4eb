"""Reuse-changes-nothing workloads and checks, shared by both model runners' tests.

Each workload runs on an engine with ENABLE_V1_KVCACHE_MANAGER=0 (plain block allocator, every
prompt recomputed) and on one with it on, in the situation named (device hits, host hits,
write_back evictions, failed loads, preemption).  The checks assert that the greedy token ids
are identical, that the situation really happened (reuse counters), and that after everything
finished every block is free or cached.  ``tests/engine/test_reuse.py`` runs them on the
paddleformers runner, ``tests/engine_torch`` and ``tests/gpu/test_torch_engine_gpu.py`` on the
transformers runner (CPU, and GPU with SmolLM2).

An engine factory is ``factory(v1: bool, **engine_args) -> LLMEngine`` (started).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

from fastdeploy_kvcache.core.metadata import CopyDirection
from fastdeploy_kvcache.engine.outputs import RequestOutput
from fastdeploy_kvcache.engine.sampling import SamplingParams
from fastdeploy_kvcache.worker.backends.faulty import CopyCall, FaultInjectingBackend

POLICIES = ("write_through", "write_through_selective", "write_back")
BS = 16  # the block size every workload below is laid out for

Factory = Callable[..., Any]


class Collector:
    """Gathers RequestOutputs per request, thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.outputs: dict[str, list[RequestOutput]] = {}

    def __call__(self, out: RequestOutput) -> None:
        with self.lock:
            self.outputs.setdefault(out.request_id, []).append(out)

    def tokens(self, rid: str) -> list[int]:
        return [t for o in self.outputs[rid] for t in o.new_token_ids]

    def text(self, rid: str) -> str:
        return "".join(o.text for o in self.outputs[rid])

    def final(self, rid: str) -> RequestOutput:
        outs = self.outputs[rid]
        assert outs[-1].finished, f"{rid} did not finish"
        assert sum(1 for o in outs if o.finished) == 1, f"{rid} finished more than once"
        return outs[-1]


def greedy(max_tokens: int = 8, **kw: Any) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


def doc(i: int, n: int = 3 * BS) -> list[int]:
    """A fixed 'document' of n token ids, different per i (ids stay below the tiny vocab)."""
    return [3 + (i * 37 + j * 11) % 500 for j in range(n)]


def question(i: int, j: int) -> list[int]:
    return [3 + (i * 13 + j * 29 + k * 7) % 500 for k in range(6)]


def req(i: int, j: int) -> tuple[str, list[int]]:
    return f"d{i}q{j}", doc(i) + question(i, j)


# A prompt that is exactly a cached prefix plus one token, and one that shares none.
TAIL = [("d0short", doc(0)[: 2 * BS + 1]), ("fresh", doc(9))]


def waves(concurrent: bool) -> list[list[tuple[str, list[int]]]]:
    """Three documents, three questions each.

    Sequential: each document is asked twice in a row (a device hit, which is what makes
    write_through_selective back it up), then all three again after the others pushed it
    out of a small device pool (host hits).  Concurrent: one wave per question.
    """
    if concurrent:
        return [[req(i, j) for i in range(3)] for j in range(3)] + [TAIL]
    order = [req(i, j) for i in range(3) for j in range(2)] + [req(i, 2) for i in range(3)] + TAIL
    return [order]


def run_waves(engine: Any, concurrent: bool = False, max_tokens: int = 8) -> tuple[dict[str, list[int]], Collector]:
    col = Collector()
    for wave in waves(concurrent):
        for rid, prompt in wave:
            engine.add_request(rid, prompt, greedy(max_tokens), col)
            if not concurrent:
                assert engine.wait_idle(120), f"{rid} did not finish"
        assert engine.wait_idle(120), "wave did not finish"
    return {rid: col.tokens(rid) for wave in waves(concurrent) for rid, _ in wave}, col


def recompute_tokens(factory: Factory, concurrent: bool = False) -> dict[str, list[int]]:
    """The workload's tokens with the switch off (nothing reused)."""
    eng = factory(v1=False)
    out, col = run_waves(eng, concurrent)
    for rid in out:
        assert col.final(rid).num_cached_tokens == 0, "the switch off must reuse nothing"
    assert eng.pool.check_invariants()["device_owned"] == 0
    return out


class RecomputeBaseline:
    """The recompute tokens of each workload, computed once per test module (one per runner)."""

    def __init__(self) -> None:
        self._tokens: dict[bool, dict[str, list[int]]] = {}

    def __call__(self, factory: Factory, concurrent: bool = False) -> dict[str, list[int]]:
        if concurrent not in self._tokens:
            self._tokens[concurrent] = recompute_tokens(factory, concurrent)
        return self._tokens[concurrent]


def assert_no_leak(engine: Any) -> dict[str, int]:
    counts = engine.pool.check_invariants()
    assert counts["device_owned"] == 0, f"device blocks still owned after everything finished: {counts}"
    assert counts.get("host_owned", 0) == 0, f"host blocks still owned: {counts}"
    assert engine.pool.copies_in_flight == 0
    return counts


class FailLoads:
    """Fault rule (``FaultInjectingBackend.rule``): the first ``n`` host->device loads fail at
    ``layer``."""

    def __init__(self, n: int, layer: int = 1) -> None:
        self.left = n
        self.layer = layer
        self.failed = 0

    def __call__(self, call: CopyCall) -> None:
        if call.direction is CopyDirection.HOST_TO_DEVICE and call.layer == self.layer and self.left > 0:
            self.left -= 1
            self.failed += 1
            raise RuntimeError("injected load failure")


# ---------------------------------------------------------------------- the cases
def check_device_hits(factory: Factory, ref: dict[str, list[int]], policy: str) -> None:
    eng = factory(v1=True, write_policy=policy, write_through_threshold=1)
    got, col = run_waves(eng)
    assert got == ref
    assert col.final("d0q0").num_cached_tokens == 0
    for rid in ("d0q1", "d1q1", "d1q2", "d0short"):
        fin = col.final(rid)
        assert fin.num_cached_tokens > 0 and fin.cached_tokens_by_tier["device"] == fin.num_cached_tokens, fin
    assert col.final("d0short").num_cached_tokens == 2 * BS
    assert_no_leak(eng)


def check_host_hits(factory: Factory, ref: dict[str, list[int]], policy: str) -> None:
    """A device pool of 8 blocks holds two of the three documents: LRU sends each to host in turn."""
    eng = factory(v1=True, write_policy=policy, write_through_threshold=1,
                  num_gpu_blocks=8, num_host_blocks=64, max_num_seqs=2)
    got, col = run_waves(eng)
    assert got == ref
    host = sum(col.final(rid).cached_tokens_by_tier["host"] for rid in got)
    assert host > 0, "no host hit happened: the test does not test what it says"
    stats = eng.get_stats()
    assert stats["cache"]["swap_in_blocks"] > 0
    # Every layer of every step with a load waited for that layer's copy before attending.
    eng_stats = stats["engine"]
    assert eng_stats["steps_with_loads"] > 0
    assert eng_stats["layer_waits"] == eng_stats["steps_with_loads"] * eng.loaded.num_layers
    if policy == "write_back":
        assert stats["cache"]["write_back_blocks"] > 0, "write_back never evicted to host"
    else:
        assert stats["cache"]["backup_blocks"] > 0
    assert_no_leak(eng)


def check_write_back_under_concurrency(factory: Factory, ref_concurrent: dict[str, list[int]]) -> None:
    """Concurrent waves on a small pool: evictions to host run in the same steps as compute."""
    eng = factory(v1=True, write_policy="write_back", num_gpu_blocks=9, num_host_blocks=48, max_num_seqs=2)
    got, col = run_waves(eng, concurrent=True)
    assert got == ref_concurrent
    st = eng.get_stats()["cache"]
    assert st["write_back_blocks"] > 0 and st["swap_in_blocks"] > 0, st
    assert sum(col.final(r).num_cached_tokens for r in got) > 0
    assert_no_leak(eng)


def check_failed_loads(factory: Factory, ref: dict[str, list[int]], policy: str) -> None:
    eng = factory(v1=True, write_policy=policy, write_through_threshold=1,
                  num_gpu_blocks=8, num_host_blocks=64, max_num_seqs=2)
    inject = FailLoads(2)
    eng.pool.controller.transfer_manager.wrap_backend(FaultInjectingBackend).rule = inject
    got, col = run_waves(eng)
    assert inject.failed == 2, "no load was attempted: the test does not test what it says"
    assert got == ref
    st = eng.get_stats()
    assert st["failed_loads"] >= 1 and st["cache"]["failed_blocks"] > 0, st
    assert st["engine"]["num_failed_load_steps"] >= 1
    assert_no_leak(eng)


def check_preemption(factory: Factory, policy: str) -> None:
    """Four long requests at once on 12 blocks: some are preempted and resume from the cache."""
    prompts = {f"p{i}": doc(0)[:BS] + doc(i + 1, 3 * BS) for i in range(4)}

    def run(eng: Any) -> dict[str, list[int]]:
        col = Collector()
        for rid, p in prompts.items():
            eng.add_request(rid, p, greedy(24, ignore_eos=True), col)
        assert eng.wait_idle(120)
        return {rid: col.tokens(rid) for rid in prompts}

    ref = run(factory(v1=False, num_gpu_blocks=12, max_num_seqs=4))
    eng = factory(v1=True, write_policy=policy, write_through_threshold=1, num_gpu_blocks=12,
                  num_host_blocks=32, max_num_seqs=4)
    got = run(eng)
    assert got == ref
    assert all(len(t) == 24 for t in got.values())
    assert eng.get_stats()["engine"]["num_preemptions"] > 0, "nothing was preempted"
    assert_no_leak(eng)


def check_idle_backup(factory: Factory) -> None:
    """write_through: the blocks of the last request before the engine goes idle reach host
    without another request (the next one's allocation would evict them from the device
    first, and the next turn would recompute them)."""
    eng = factory(v1=True, write_policy="write_through", write_through_threshold=1,
                  num_gpu_blocks=8, num_host_blocks=64, max_num_seqs=1)
    col = Collector()
    eng.add_request("first", doc(0), greedy(2), col)
    assert eng.wait_idle(60)
    deadline = time.monotonic() + 30
    while eng.pool.copies_in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    assert eng.pool.copies_in_flight == 0, "the idle engine left copies or queued backups"
    # Its 3 full blocks (48 tokens: the prompt and its first generated tokens) are on host.
    assert eng.get_stats()["cache"]["backup_blocks"] >= 2, eng.get_stats()["cache"]
    # A different document fills the 8-block device pool; the first one comes back from host.
    eng.add_request("other", doc(5, 7 * BS), greedy(2), col)
    assert eng.wait_idle(60)
    eng.add_request("again", doc(0) + [7], greedy(2), col)
    assert eng.wait_idle(60)
    again = col.final("again").cached_tokens_by_tier
    assert again["host"] >= 2 * BS, again
    assert_no_leak(eng)


class ReuseChecks:
    """The checks above as test methods over the ``engine_factory`` fixture of the module that
    subclasses this (``class TestReuse(ReuseChecks)``), so every runner runs the same tests.

    ``policies`` names, per test method, the write policies it runs under (a slower runner
    runs fewer); a method not named runs under every policy.  Each subclass gets its own
    recompute baseline (one per runner).
    """

    policies: dict[str, tuple[str, ...]] = {}
    baseline: RecomputeBaseline

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.baseline = RecomputeBaseline()

    def pytest_generate_tests(self, metafunc: Any) -> None:
        if "policy" in metafunc.fixturenames:
            metafunc.parametrize("policy", self.policies.get(metafunc.function.__name__, POLICIES))

    def test_device_hits_change_nothing(self, engine_factory: Factory, policy: str) -> None:
        check_device_hits(engine_factory, self.baseline(engine_factory), policy)

    def test_host_hits_change_nothing(self, engine_factory: Factory, policy: str) -> None:
        check_host_hits(engine_factory, self.baseline(engine_factory), policy)

    def test_write_back_evictions_under_concurrency(self, engine_factory: Factory) -> None:
        check_write_back_under_concurrency(engine_factory, self.baseline(engine_factory, concurrent=True))

    def test_failed_loads_recompute_and_change_nothing(self, engine_factory: Factory, policy: str) -> None:
        check_failed_loads(engine_factory, self.baseline(engine_factory), policy)

    def test_preemption_changes_nothing(self, engine_factory: Factory, policy: str) -> None:
        check_preemption(engine_factory, policy)
