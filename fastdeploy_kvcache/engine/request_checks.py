"""The checks of a request's prompt against the engine's limits, in one place.

``LLMEngine.add_requests`` runs them once per prompt, for the server and for direct callers
alike; the server maps :class:`RequestRejected` to HTTP 400 with its ``param`` and ``code``
(``context_length_exceeded`` for anything that does not fit). The server's only check of its
own is a lower bound from a text prompt's UTF-8 size, before it spends time tokenizing it
(:func:`prompt_too_long` words both the same way).

The vocabulary is the model's: the rows of its embedding (``LoadedModel.vocab_size``). The
model reads any id below it and its logits cover all of them, so it may also generate ids the
tokenizer has no text for; a tokenizer smaller than the embedding is common (padded rows).
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


class RequestRejected(ValueError):
    """A request the engine refuses: ``str()`` is ``"<param>: <detail>"``.

    ``param`` names the field as the engine sees it (``prompt``, ``max_tokens``, ...): a
    caller with other names for them (chat's ``messages``) puts its own before ``detail``.
    """

    def __init__(self, param: str, detail: str, code: Optional[str] = None) -> None:
        super().__init__(f"{param}: {detail}")
        self.param = param
        self.detail = detail
        self.code = code


def prompt_too_long(num_tokens: int, max_model_len: int, what: str = "") -> RequestRejected:
    """The rejection of a prompt that leaves no room to generate one token.

    ``what`` says how the count was found when it is a lower bound (from the text's bytes).
    """
    return RequestRejected(
        "prompt", f"the prompt has {what}{num_tokens} tokens; this model's maximum context length "
                  f"(--max-model-len) is {max_model_len}, which leaves no room to generate",
        CONTEXT_LENGTH_EXCEEDED)


def check_token_ids(ids: Sequence[Any], vocab_size: int, param: str) -> None:
    """Every id an integer in ``[0, vocab_size)``; else the first bad one, by position."""
    for i, t in enumerate(ids):
        if not isinstance(t, (int, np.integer)) or isinstance(t, bool):
            raise RequestRejected(param, f"token id {t!r} at position {i} is not an integer")
        if not 0 <= t < vocab_size:
            raise RequestRejected(param, f"token id {t} at position {i} is out of range [0, {vocab_size}) "
                                         f"(the model's vocabulary)")


def check_prompt(ids: Any, vocab_size: int, max_model_len: int) -> None:
    """A prompt of token ids: a non-empty list, short enough to generate, every id in the vocabulary.

    The length goes first: a huge list is refused without reading every id.
    """
    if not isinstance(ids, (list, tuple)):
        raise RequestRejected("prompt", f"must be a list of token ids, got {type(ids).__name__}")
    if not ids:
        raise RequestRejected("prompt", "the prompt is empty")
    if len(ids) >= max_model_len:
        raise prompt_too_long(len(ids), max_model_len)
    check_token_ids(ids, vocab_size, "prompt")


def check_fits_device_pool(prompt_len: int, max_tokens: int, max_model_len: int, block_size: int,
                           num_gpu_blocks: int) -> None:
    """The request's blocks (prompt + ``max_tokens``, up to the context) fit the device pool.

    A request that cannot fit would wait forever (or preempt everything else) to be admitted.
    """
    tokens = min(prompt_len + max_tokens, max_model_len)
    blocks = -(-tokens // block_size)
    if blocks > num_gpu_blocks:
        raise RequestRejected(
            "prompt", f"{prompt_len} prompt tokens + max_tokens {max_tokens} need {blocks} KV blocks of "
                      f"{block_size} tokens; the device KV pool has {num_gpu_blocks} "
                      f"(at most {num_gpu_blocks * block_size} tokens per request)",
            CONTEXT_LENGTH_EXCEEDED)
