"""Sampling (seeds, top_k, top_p, stop strings and ids, max_tokens), abort, and bad input."""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any

import numpy as np
import pytest

from fastdeploy_kvcache.engine.args import EngineArgs, add_engine_cli_args
from fastdeploy_kvcache.engine.request_checks import RequestRejected
from fastdeploy_kvcache.engine.sampling import RequestSampler, SamplingParams
from fastdeploy_kvcache.engine.tokenizer import IncrementalDetokenizer, build_tiny_tokenizer
from tests.engine.conftest import Collector, greedy

PROMPT = [5 + (i * 7) % 400 for i in range(40)]


def _run(eng: Any, params: SamplingParams, rid: str = "r", prompt: list[int] = PROMPT) -> Collector:
    col = Collector()
    eng.add_request(rid, prompt, params, col)
    assert eng.wait_idle(60)
    return col


def test_seeded_sampling_is_reproducible_and_seeds_differ(engine_factory: Any) -> None:
    eng = engine_factory(v1=True)
    p = dict(max_tokens=12, temperature=1.0, top_p=0.95)
    a = _run(eng, SamplingParams(seed=7, **p), "a").tokens("a")
    b = _run(eng, SamplingParams(seed=7, **p), "b").tokens("b")
    c = _run(eng, SamplingParams(seed=8, **p), "c").tokens("c")
    assert a == b
    assert a != c


def test_top_k_1_equals_greedy(engine_factory: Any) -> None:
    eng = engine_factory(v1=True)
    g = _run(eng, greedy(10), "g").tokens("g")
    k1 = _run(eng, SamplingParams(max_tokens=10, temperature=0.8, top_k=1, seed=3), "k").tokens("k")
    assert g == k1


def test_stop_token_ids_and_max_tokens(engine_factory: Any) -> None:
    eng = engine_factory(v1=False)
    g = _run(eng, greedy(10), "g")
    toks = g.tokens("g")
    assert len(toks) == 10 and g.final("g").finish_reason == "length"
    stop_id = toks[3]
    first = toks.index(stop_id)
    s = _run(eng, greedy(10, stop_token_ids=[stop_id]), "s")
    assert s.tokens("s") == toks[: first + 1]
    assert s.final("s").finish_reason == "stop"


def test_stop_string_is_removed_and_stops(engine_factory: Any) -> None:
    eng = engine_factory(v1=True)
    g = _run(eng, greedy(16), "g")
    text = g.text("g")
    assert text, "the tiny model produced no text"
    # A stop string from the middle of the greedy text.
    mid = len(text) // 2
    stop = text[mid : mid + 2] if text[mid : mid + 2].strip() else text[mid - 2 : mid]
    start = text.find(stop)
    s = _run(eng, greedy(16, stop=[stop]), "s")
    assert s.final("s").finish_reason == "stop"
    assert s.text("s") == text[:start]
    assert stop not in s.text("s")


def test_abort_frees_blocks_and_reports_abort(engine_factory: Any) -> None:
    eng = engine_factory(v1=True)
    col = Collector()
    eng.add_request("long", PROMPT, greedy(400), col)
    deadline = time.monotonic() + 30
    while not col.outputs.get("long") and time.monotonic() < deadline:
        time.sleep(0.01)
    eng.abort("long")
    eng.abort("no-such-request")  # unknown id: no-op
    assert eng.wait_idle(30)
    fin = col.final("long")
    assert fin.finish_reason == "abort"
    assert fin.num_output_tokens < 400
    counts = eng.pool.check_invariants()
    assert counts["device_owned"] == 0
    # The id is free again.
    assert _run(eng, greedy(2), "long").final("long").finish_reason == "length"


def test_outputs_fields(engine_factory: Any) -> None:
    eng = engine_factory(v1=True)
    col = _run(eng, greedy(5), "r")
    outs = col.outputs["r"]
    fin = col.final("r")
    assert fin.num_prompt_tokens == len(PROMPT) and fin.num_output_tokens == 5
    assert sum(len(o.new_token_ids) for o in outs) == 5
    assert fin.first_token_time is not None and fin.first_token_time >= fin.arrival_time
    assert set(fin.cached_tokens_by_tier) == {"device", "host", "storage"}
    assert eng.get_stats()["num_requests_running"] == 0


def test_callback_that_raises_does_not_stop_the_engine(engine_factory: Any) -> None:
    eng = engine_factory(v1=True)

    def bad(out: Any) -> None:
        raise RuntimeError("client went away")

    eng.add_request("bad", PROMPT, greedy(5), bad)
    assert eng.wait_idle(30)
    assert _run(eng, greedy(3), "ok").final("ok").finish_reason == "length"
    assert eng.pool.check_invariants()["device_owned"] == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(seed=-1), "seed"),
        (dict(stop=[""]), "stop"),
        (dict(stop=[1]), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(stop_token_ids=[10**9]), "stop_token_ids"),
    ],
)
def test_bad_sampling_values_are_value_errors(engine_factory: Any, kwargs: dict, field: str) -> None:
    eng = engine_factory(v1=True)
    with pytest.raises(ValueError, match=f"^{field}:"):
        eng.add_request("x", PROMPT, SamplingParams(**kwargs), lambda o: None)


def test_bad_requests_are_value_errors(engine_factory: Any) -> None:
    eng = engine_factory(v1=True, max_model_len=64)
    cb = lambda o: None  # noqa: E731
    with pytest.raises(RequestRejected, match="prompt: the prompt is empty"):
        eng.add_request("a", [], greedy(), cb)
    with pytest.raises(RequestRejected, match=r"prompt: the prompt has 67 tokens; .*\(--max-model-len\) is 64") as info:
        eng.add_request("b", list(range(3, 70)), greedy(), cb)
    assert info.value.code == "context_length_exceeded"
    vocab = eng.loaded.vocab_size
    with pytest.raises(RequestRejected, match=rf"prompt: token id 1000000 at position 1 is out of range \[0, {vocab}\)"):
        eng.add_request("c", [5, 10**6], greedy(), cb)
    # One definition of the vocabulary, one wording, for the prompt and stop_token_ids alike.
    with pytest.raises(RequestRejected, match=rf"stop_token_ids: token id {vocab} at position 0 is out of range \[0, {vocab}\)"):
        eng.add_request("c", [5], SamplingParams(stop_token_ids=[vocab]), cb)
    with pytest.raises(RequestRejected, match="prompt: token id True at position 0 is not an integer"):
        eng.add_request("c", [True], greedy(), cb)
    # All or none: a bad request in a group leaves the good one unqueued too.
    group = Collector()
    with pytest.raises(RequestRejected, match="prompt: the prompt is empty"):
        eng.add_requests([("g1", [5, 6], greedy(), group, None), ("g2", [], greedy(), group, None)])
    assert eng.wait_idle(30) and group.outputs == {}  # g1 never ran
    with pytest.raises(ValueError, match="request_id"):
        eng.add_request("", [5], greedy(), cb)
    col = Collector()
    eng.add_request("dup", PROMPT[:10], greedy(80), col)
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("dup", PROMPT[:10], greedy(), cb)
    assert eng.wait_idle(30)
    # A prompt that fits but runs into max_model_len stops with "length" at the limit.
    fin = col.final("dup")
    assert fin.finish_reason == "length" and fin.num_prompt_tokens + fin.num_output_tokens == 64


def test_kv_cache_dtype_is_the_models_unless_named(engine_factory: Any) -> None:
    """cache.dtype "auto" becomes the model's dtype (float32 on the CPU) in the engine's
    resolved config and its cache tensors; a named dtype is used as given."""
    auto = engine_factory(v1=True)
    assert auto.args.cache.dtype == "auto" and auto.cache_config.dtype == "float32"
    named = engine_factory(v1=True, dtype="bfloat16")
    assert named.cache_config.dtype == "bfloat16"
    assert "bfloat16" in str(named.pool.layer_caches[0][0].dtype)
    assert len(_run(named, greedy(4), "b").tokens("b")) == 4  # it serves from that cache


def test_sampler_respects_top_k_and_top_p() -> None:
    logits = np.array([5.0, 4.0, 3.0, -10.0, -10.0])
    s = RequestSampler(SamplingParams(temperature=1.0, top_k=2, seed=1), 0)
    assert {s.sample(logits) for _ in range(200)} <= {0, 1}
    s = RequestSampler(SamplingParams(temperature=1.0, top_p=0.5, seed=1), 0)
    assert {s.sample(logits) for _ in range(50)} == {0}


def test_engine_args_parser_adds_to_a_parser_with_overlapping_flags() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="x")  # a host server's own flags
    parser.add_argument("--block-size", type=int, default=64)
    add_engine_cli_args(parser)
    add_engine_cli_args(parser)  # twice is harmless
    ns = parser.parse_args(["--model", "tiny-llama-random", "--block-size", "32", "--swap-space", "1.5",
                            "--write-policy", "write_back", "--max-num-seqs", "3"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.model, args.cache.block_size, args.cache.swap_space, args.cache.write_policy, args.max_num_seqs) == (
        "tiny-llama-random", 32, 1.5, "write_back", 3)
    assert args.host_tier_enabled
    assert args.cache.dtype == "auto" and args.cache.num_gpu_blocks == 0
    ns = parser.parse_args(["--kv-cache-dtype", "bfloat16", "--num-gpu-blocks-override", "7",
                            "--no-enable-prefix-caching", "--no-enable-output-caching"])
    args = EngineArgs.from_cli_args(ns)
    assert (args.cache.dtype, args.cache.num_gpu_blocks) == ("bfloat16", 7)
    assert not args.cache.enable_prefix_caching and not args.cache.enable_output_caching
    help_text = add_engine_cli_args(argparse.ArgumentParser()).format_help()
    for flag in ("--max-model-len", "--max-num-batched-tokens", "--num-gpu-blocks-override", "--kv-cache-dtype",
                 "--model-cache-dir", "--swap-space", "--write-policy"):
        assert flag in help_text


def test_tiny_tokenizer_is_deterministic_and_round_trips() -> None:
    a, b = build_tiny_tokenizer(), build_tiny_tokenizer()
    text = "Hello world! The capital of France is Paris. 2048\n"
    assert a.encode(text) == b.encode(text)
    assert a.decode(a.encode(text)) == text
    ids = a.apply_chat_template([{"role": "user", "content": "hi"}])
    assert a.decode(ids, skip_special_tokens=False).endswith("<|im_start|>assistant\n")
    d = IncrementalDetokenizer(a)
    assert "".join(d.add(t) for t in a.encode(text)) + d.flush() == text


@pytest.mark.parametrize("clean_up", [False, True])
def test_decode_matches_transformers_decode(clean_up: bool) -> None:
    """The engine decodes through the Rust tokenizer directly (it runs twice per output
    token); the text must be what transformers' own decode gives, special tokens and the
    clean-up of spaces before punctuation included."""
    tok = build_tiny_tokenizer()
    tok.hf.clean_up_tokenization_spaces = clean_up
    fast = type(tok)(tok.hf, tok.eos_token_ids)
    assert fast._backend_decode is not None  # the direct path is the one under test
    rng = np.random.default_rng(0)
    specials = tok.encode("<|im_start|>user\nhi , there .<|im_end|>")
    cases = [specials, tok.encode("a , b . c ! d ?"), []]
    cases += [rng.integers(0, tok.vocab_size, size=int(n)).tolist() for n in rng.integers(1, 40, size=50)]
    for ids in cases:
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == tok.hf.decode(ids, skip_special_tokens=skip), ids
    assert fast.decode(np.asarray(cases[0])) == tok.hf.decode(cases[0], skip_special_tokens=True)


def test_a_consumer_that_delivers_on_the_output_flush_gets_every_output(engine_factory: Any) -> None:
    """The server hands outputs to its event loop only when the engine flushes them
    (LLMEngine.add_output_flush_hook): every output must be followed by a flush, the last
    step's and an abort of a waiting request included, or a stream would hang."""
    eng = engine_factory(v1=True, max_num_seqs=1)
    lock = threading.Lock()
    pending: list[Any] = []
    delivered = Collector()

    def on_output(out: Any) -> None:
        with lock:
            pending.append(out)

    def flush() -> None:
        with lock:
            items = pending[:]
            pending.clear()
        for out in items:
            delivered(out)

    def broken() -> None:
        raise RuntimeError("a consumer's bug")

    eng.add_output_flush_hook(broken)  # logged; the engine and the other hooks go on
    eng.add_output_flush_hook(flush)
    eng.add_request("a", PROMPT, greedy(12), on_output)
    eng.add_request("b", PROMPT, greedy(12), on_output)  # waits: one request runs at a time
    deadline = time.monotonic() + 30
    while not delivered.outputs.get("a") and time.monotonic() < deadline:
        time.sleep(0.005)
    eng.abort("b")
    assert eng.wait_idle(30)
    assert pending == []
    assert delivered.final("a").finish_reason == "length" and len(delivered.tokens("a")) == 12
    assert delivered.final("b").finish_reason == "abort"
