"""The prompt's token ids as the worker will see them, computed by the router.

The router must agree with the workers token for token, or its block hashes name blocks
no worker has: it loads the same tokenizer the server builds for ``--model`` (the same
builders, :mod:`fastdeploy_kvcache.engine.tokenizer`, without the weights) and turns a
request body into ids exactly as the server's handlers do (text encoded without special
tokens; chat messages rendered by the model's chat template with the generation prompt;
token-id prompts taken as they are).

Anything the router cannot turn into ids (a malformed body, a list of prompts) gets
``None``: such a request is routed without a cache prediction, and the worker answers it
(with its own 400 when it is malformed), so the router never second-guesses validation.

Tokenizing is most of the router's own time per request (about 1 us per token), and a
conversation resends the same messages every round.  :class:`SegmentEncoder` therefore
remembers the ids of the text between two added tokens (``<|im_start|>`` ...): a fast
tokenizer cuts the text at its added tokens before anything else and encodes each piece
on its own, so encoding the pieces and joining them gives the same ids, and a returning
conversation only encodes its new message.
"""

from __future__ import annotations

import logging
import os
import re
from collections import OrderedDict
from typing import Any, Optional

logger = logging.getLogger(__name__)


def load_tokenizer(model: str) -> Any:
    """The :class:`EngineTokenizer` the server builds for ``--model``, without loading weights."""
    from fastdeploy_kvcache.engine import model_loader as ml
    from fastdeploy_kvcache.engine.tokenizer import EngineTokenizer, build_tiny_tokenizer, tokenizer_from_gguf_fields

    if model == ml.TINY_MODEL_NAME:
        return build_tiny_tokenizer(512)
    path = os.path.expanduser(model)
    if model == ml.DEFAULT_MODEL_NAME or (os.path.isfile(path) and path.endswith(".gguf")):
        import gguf

        gguf_path = ml.find_smollm2_gguf() if model == ml.DEFAULT_MODEL_NAME else path
        return tokenizer_from_gguf_fields(ml.read_gguf_metadata(gguf.GGUFReader(gguf_path)))
    if os.path.isdir(path):
        return EngineTokenizer.load(path)
    raise ValueError(f"--model: {model!r} is neither a known model ({ml.DEFAULT_MODEL_NAME}, "
                     f"{ml.TINY_MODEL_NAME}), a checkpoint directory, nor a .gguf file")


class SegmentEncoder:
    """``tokenizer.encode`` with the pieces between added tokens remembered (LRU).

    Used only when cutting at the added tokens is exactly what the tokenizer does: no
    added token strips the whitespace next to it or is matched after normalisation;
    otherwise every call is a plain ``encode``.
    """

    def __init__(self, tokenizer: Any, max_pieces: int = 8192, min_piece_chars: int = 64) -> None:
        self.tokenizer = tokenizer
        self.max_pieces = max_pieces
        self.min_piece_chars = min_piece_chars
        self._cache: "OrderedDict[str, list[int]]" = OrderedDict()
        self._split: Optional[re.Pattern[str]] = None
        self._added: dict[str, int] = {}
        hf = getattr(tokenizer, "hf", None)
        added = getattr(hf, "added_tokens_decoder", None) or {}
        if added and all(not (t.lstrip or t.rstrip or t.normalized or t.single_word) for t in added.values()):
            self._added = {t.content: int(i) for i, t in added.items()}
            names = sorted(self._added, key=len, reverse=True)
            self._split = re.compile("(" + "|".join(re.escape(n) for n in names) + ")")
        elif added:
            logger.info("the tokenizer's added tokens strip or normalise: prompts are encoded whole")
        self._encode_piece = self._backend_encoder(hf) if self._split is not None else None
        if self._encode_piece is None:
            self._encode_piece = tokenizer.encode

    @staticmethod
    def _backend_encoder(hf: Any) -> Optional[Any]:
        """The fast tokenizer's own ``tokenizers.Tokenizer.encode`` for a piece, when it agrees.

        ``transformers``' ``encode`` costs about 0.1-0.2 ms of Python per call around the
        Rust encoder, and a chat prompt is a dozen pieces (roles, newlines, messages), so
        calling the Rust encoder directly halves the router's time per chat request.  A
        piece holds no added token (cut before), so this is what ``encode`` runs inside;
        a few probes check that both agree, else ``encode`` is kept.
        """
        backend = getattr(hf, "backend_tokenizer", None)
        if backend is None:
            return None

        def encode(text: str) -> list[int]:
            return backend.encode(text, add_special_tokens=False).ids

        probes = ("user", "\n", " Hello, world!  Two  spaces\tand a tab.", "ünïcödé 数字 123 émojis 🙂")
        try:
            if all(encode(p) == list(hf.encode(p, add_special_tokens=False)) for p in probes):
                return encode
        except Exception:  # noqa: BLE001 - the plain path still works
            logger.debug("the backend tokenizer cannot be called directly", exc_info=True)
        logger.info("the backend tokenizer disagrees with encode(): pieces go through encode()")
        return None

    def encode(self, text: str) -> list[int]:
        if self._split is None:
            return self.tokenizer.encode(text)
        out: list[int] = []
        cache = self._cache
        for piece in self._split.split(text):
            if not piece:
                continue
            tid = self._added.get(piece)
            if tid is not None:
                out.append(tid)
                continue
            ids = cache.get(piece)
            if ids is not None:
                cache.move_to_end(piece)
            else:
                ids = self._encode_piece(piece)
                if len(piece) >= self.min_piece_chars:  # short pieces cost less to encode than to keep
                    cache[piece] = ids
                    if len(cache) > self.max_pieces:
                        cache.popitem(last=False)
            out.extend(ids)
        return out

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """The ids the server computes for ``messages`` (its chat template, generation prompt added)."""
        text = self.tokenizer.hf.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=add_generation_prompt)
        return self.encode(text)


def _message_text(content: Any) -> Optional[str]:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or not isinstance(part.get("text"), str):
                return None
            parts.append(part["text"])
        return "".join(parts)
    return None


def prompt_token_ids(tokenizer: SegmentEncoder, path: str, body: dict[str, Any]) -> Optional[list[int]]:
    """The ids the worker will compute for ``body`` (one prompt), or None when unknown."""
    try:
        if path.endswith("/chat/completions"):
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages:
                return None
            rendered = []
            for m in messages:
                if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                    return None
                text = _message_text(m.get("content"))
                if text is None:
                    return None
                rendered.append({"role": m["role"], "content": text})
            return tokenizer.apply_chat_template(rendered)
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        if isinstance(prompt, list) and len(prompt) == 1:
            return prompt_token_ids(tokenizer, path, {"prompt": prompt[0]})
    except Exception:  # noqa: BLE001 - the worker gives the real error
        logger.debug("could not tokenize a request; it is routed without a prediction", exc_info=True)
    return None


def system_prefix_length(tokenizer: SegmentEncoder, path: str, body: dict[str, Any], ids: list[int]) -> int:
    """How many leading tokens of a chat's ``ids`` its leading system messages make (the part
    ``--tenant-isolation salt-after-system`` hashes unsalted, as the server does); 0 for
    completions, a chat without system messages or one with nothing else."""
    from fastdeploy_kvcache.entrypoints.auth import system_prefix_tokens

    if not path.endswith("/chat/completions"):
        return 0
    system = []
    messages = body.get("messages") or []
    for m in messages:
        if not isinstance(m, dict) or m.get("role") != "system":
            break
        text = _message_text(m.get("content"))
        if text is None:
            return 0
        system.append({"role": "system", "content": text})
    if not system or len(system) == len(messages):
        return 0
    try:
        return system_prefix_tokens(ids, tokenizer.apply_chat_template(system, add_generation_prompt=False))
    except Exception:  # noqa: BLE001 - no prediction rather than a wrong one
        logger.debug("could not render a chat's system messages", exc_info=True)
        return 0
