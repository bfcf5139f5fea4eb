"""Tokenizers for the engine: built offline (from GGUF metadata, or trained on fixed text).

No vocabulary file ships with paddleformers, transformers or tokenizers, and the engine must
not download one, so:

* the GGUF's own vocabulary, merges and chat template become a ``tokenizers`` byte-level BPE
  through transformers' GGUF converter (the part of it that needs no torch);
* ``tiny-llama-random`` trains a small byte-level BPE on a fixed text, deterministically.

Either is wrapped in ``transformers.PreTrainedTokenizerFast`` (for the chat template) and saved
next to the converted model, so later starts just load ``tokenizer.json``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any, Callable, Optional, Sequence

from fastdeploy_kvcache.engine.dependency_notices import import_transformers

logger = logging.getLogger(__name__)

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# GGUF token types (llama.cpp's llama_token_type): 3 = control, 4 = user defined.
_SPECIAL_TOKEN_TYPES = (3, 4)


class EngineTokenizer:
    """What the engine and the server need of a tokenizer, over a PreTrainedTokenizerFast."""

    def __init__(self, hf_tokenizer: Any, eos_token_ids: Sequence[int]) -> None:
        self.hf = hf_tokenizer
        self.eos_token_ids: list[int] = sorted({int(t) for t in eos_token_ids})
        self.vocab_size: int = len(hf_tokenizer)
        # NOTE: decode runs twice per output token (IncrementalDetokenizer); transformers'
        # decode wraps the Rust tokenizer's in argument conversions that cost more than the
        # decoding itself, so a fast tokenizer's backend is called directly (what its
        # _decode does, clean-up included).
        backend = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._backend_decode = getattr(backend, "decode", None)
        self._clean_up = bool(getattr(hf_tokenizer, "clean_up_tokenization_spaces", False))

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise ValueError(f"prompt: must be a string, got {type(text).__name__}")
        return list(self.hf.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is None:
            return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)
        text = self._backend_decode(ids if isinstance(ids, list) else [int(t) for t in ids],
                                    skip_special_tokens=skip_special_tokens)
        return self.hf.clean_up_tokenization(text) if self._clean_up else text

    def list_decoder(self) -> Callable[[list[int]], str]:
        """``decode`` of a list of ids, special tokens skipped, as one call with nothing in
        between where the backend allows it (the incremental detokenizer's per-token path)."""
        backend_decode = self._backend_decode
        if backend_decode is None or self._clean_up:
            return self.decode
        return functools.partial(backend_decode, skip_special_tokens=True)

    def convert_ids_to_tokens(self, ids: Sequence[int]) -> list[str]:
        return list(self.hf.convert_ids_to_tokens(list(ids)))

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template (generation prompt added)."""
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages: must be a non-empty list of {role, content} objects")
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"messages[{i}]: must be an object with string 'role' and 'content'")
        text = self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
        # The template's special tokens ("<|im_start|>") are added tokens: encode() maps them
        # to their ids; no BOS is added twice because add_special_tokens is off.
        return self.encode(text)

    def save(self, directory: str, model_max_length: Optional[int] = None) -> None:
        """Write a Hugging Face tokenizer directory (``tokenizer.json``, ``tokenizer_config.json``)
        that every transformers release since 4.x loads with ``AutoTokenizer.from_pretrained``.

        NOTE: not ``save_pretrained``: transformers 5 names its own class there
        (``TokenizersBackend``) and moves the chat template to a separate file, which a client
        on transformers 4 cannot load.  ``tokenizer.json`` is the tokenizers library's format,
        the same in both; the config names ``PreTrainedTokenizerFast`` (both know it) and keeps
        the chat template inline.  Special tokens are marked in ``tokenizer.json`` itself.
        """
        hf = self.hf
        os.makedirs(directory, exist_ok=True)
        hf.backend_tokenizer.save(os.path.join(directory, "tokenizer.json"))
        config: dict[str, Any] = {"tokenizer_class": "PreTrainedTokenizerFast",
                                  "clean_up_tokenization_spaces": self._clean_up}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = getattr(hf, name, None)
            if isinstance(value, str):
                config[name] = value
        if isinstance(hf.chat_template, str):
            config["chat_template"] = hf.chat_template
        if model_max_length:
            config["model_max_length"] = int(model_max_length)
        with open(os.path.join(directory, "tokenizer_config.json"), "w") as fh:
            json.dump(config, fh, indent=1, ensure_ascii=False)

    @classmethod
    def load(cls, directory: str, eos_token_ids: Optional[Sequence[int]] = None) -> "EngineTokenizer":
        import_transformers()  # without its "PyTorch was not found" advice
        from transformers import PreTrainedTokenizerFast

        hf = PreTrainedTokenizerFast.from_pretrained(directory)
        if eos_token_ids is None:
            eos_token_ids = [hf.eos_token_id] if hf.eos_token_id is not None else []
        return cls(hf, eos_token_ids)


def publish_tokenizer(tokenizer: EngineTokenizer, cache_dir: str, model_name: str,
                      model_max_length: Optional[int] = None) -> str:
    """Save ``tokenizer`` as ``<cache_dir>/tokenizers/<model_name>`` for clients; its path.

    The directory is a Hugging Face tokenizer (:meth:`EngineTokenizer.save`): a client or
    benchmark loads it with ``transformers.AutoTokenizer.from_pretrained(path)`` and counts
    tokens exactly as the server does.  Rewritten only when its files would differ.
    """
    return export_tokenizer(tokenizer, os.path.join(cache_dir, "tokenizers", model_name), model_max_length)


def export_tokenizer(tokenizer: EngineTokenizer, target: str, model_max_length: Optional[int] = None) -> str:
    """Write ``tokenizer`` into the directory ``target`` (:meth:`EngineTokenizer.save`), unless
    it already holds the same files; returns ``target``.  Written into a sibling and renamed,
    so a reader never sees half a tokenizer and two writers at once both leave a whole one."""
    import shutil
    import tempfile

    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}-", dir=parent)
    try:
        tokenizer.save(tmp, model_max_length)
        if _same_files(tmp, target):
            return target
        os.chmod(tmp, 0o755)  # mkdtemp makes it private
        shutil.rmtree(target, ignore_errors=True)
        try:
            os.rename(tmp, target)
        except OSError:
            pass  # another process wrote it at the same time
        return target
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _same_files(a: str, b: str) -> bool:
    """Whether directory ``b`` holds exactly ``a``'s files with the same JSON contents."""
    try:
        names = sorted(os.listdir(a))
        if sorted(os.listdir(b)) != names:
            return False
        for name in names:
            with open(os.path.join(a, name)) as fa, open(os.path.join(b, name)) as fb:
                if json.load(fa) != json.load(fb):
                    return False
    except (OSError, ValueError):
        return False
    return True


class IncrementalDetokenizer:
    """Turns a growing list of output ids into text deltas without re-decoding everything.

    Decodes a short window (from ``prefix_offset``) so a multi-byte character split across
    tokens is emitted only once complete (no U+FFFD in the output), the way vLLM does.
    """

    def __init__(self, tokenizer: EngineTokenizer) -> None:
        self.tokenizer = tokenizer
        self._decode = tokenizer.list_decoder()
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""

    def add(self, token_id: int) -> str:
        """Append one id; return the text it completes (may be empty)."""
        self.ids.append(int(token_id))
        dec = self._decode
        prefix = dec(self.ids[self.prefix_offset : self.read_offset])
        full = dec(self.ids[self.prefix_offset :])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix) :]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            self.text += delta
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end), as decoded."""
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        delta = full[len(prefix) :] if len(full) > len(prefix) else ""
        self.read_offset = self.prefix_offset = len(self.ids)
        self.text += delta
        return delta


# ---------------------------------------------------------------------- builders
def tokenizer_from_gguf_fields(fields: dict[str, Any]) -> EngineTokenizer:
    """Byte-level BPE tokenizer from a GGUF's ``tokenizer.ggml.*`` metadata.

    ``fields`` maps metadata keys to values (lists for tokens, merges and token types).
    """
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    import_transformers()  # without its "PyTorch was not found" advice
    from transformers import PreTrainedTokenizerFast

    model = fields.get("tokenizer.ggml.model")
    if model != "gpt2":
        raise ValueError(f"GGUF tokenizer model {model!r} is not supported (only byte-level BPE, 'gpt2')")
    tokens: list[str] = list(fields["tokenizer.ggml.tokens"])
    # The GPT-2 byte-level BPE built with tokenizers directly (transformers moved and changed
    # its GGUF converter between releases): the file's vocabulary and merges, bytes mapped to
    # printable characters before the merges and back when decoding.
    merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
    backend = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None,
                                   continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(
        add_prefix_space=bool(fields.get("tokenizer.ggml.add_space_prefix", False)))
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    if fields.get("tokenizer.ggml.pre") == "smollm":
        # llama.cpp's "smollm" pre-tokenizer splits every digit on its own before the GPT-2
        # regex (as the original tokenizer.json does); without it numbers tokenize differently.
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
            ]
        )
    types = list(fields.get("tokenizer.ggml.token_type") or [])
    specials = [AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if int(t) in _SPECIAL_TOKEN_TYPES]
    if specials:
        backend.add_special_tokens(specials)

    def tok(key: str) -> Optional[str]:
        i = fields.get(key)
        return tokens[int(i)] if i is not None and 0 <= int(i) < len(tokens) else None

    hf = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=tok("tokenizer.ggml.bos_token_id"),
        eos_token=tok("tokenizer.ggml.eos_token_id"),
        unk_token=tok("tokenizer.ggml.unknown_token_id"),
        pad_token=tok("tokenizer.ggml.padding_token_id"),
    )
    template = fields.get("tokenizer.chat_template")
    hf.chat_template = template if isinstance(template, str) else CHATML_TEMPLATE
    eos = [int(fields["tokenizer.ggml.eos_token_id"])] if fields.get("tokenizer.ggml.eos_token_id") is not None else []
    # ChatML models end a turn with <|im_end|>; accept <|endoftext|> too.
    for name in ("<|im_end|>", "<|endoftext|>"):
        if name in hf.get_vocab():
            eos.append(hf.convert_tokens_to_ids(name))
    return EngineTokenizer(hf, eos)


_TINY_CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Berlin is the capital of Germany. A tiered KV cache keeps blocks on device, host and "
    "storage; a radix tree finds the longest cached prefix. Numbers: 0 1 2 3 4 5 6 7 8 9 10 "
    "100 2048. Hello world! How are you today? I am fine, thank you. "
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,;:!?'\"()[]{}<>-_=+*/\\|@#$%^&~`\n"
)


def build_tiny_tokenizer(vocab_size: int = 512) -> EngineTokenizer:
    """A small byte-level BPE trained on a fixed text: same vocabulary on every run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    import_transformers()  # without its "PyTorch was not found" advice
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tk.train_from_iterator([_TINY_CORPUS] * 4, trainer=trainer)
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|im_start|>", pad_token="<|endoftext|>")
    hf.chat_template = CHATML_TEMPLATE
    return EngineTokenizer(hf, [hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")])


def build_synthetic_tokenizer(vocab_size: int) -> EngineTokenizer:
    """A byte-level tokenizer whose vocabulary fills ``vocab_size`` ids, for random-weight models.

    Text encodes one id per byte (ids 0-255, the byte-level alphabet; no merges), so a prompt's
    token count is its UTF-8 length.  Ids 256-258 are ``<|endoftext|>``, ``<|im_start|>`` and
    ``<|im_end|>``; every id above decodes to three letters or digits of its own, so whatever
    a random model samples reads back as text (three tokens when sent back in a later turn).
    Built in well under a second, nothing downloaded.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    import_transformers()  # without its "PyTorch was not found" advice
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size < len(alphabet) + len(specials):
        raise ValueError(f"vocab_size: needs at least {len(alphabet) + len(specials)} ids, got {vocab_size}")
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    for s in specials:
        vocab[s] = len(vocab)
    chars = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
    for i in range(len(vocab), vocab_size):
        j = i - 259
        vocab[chars[j % 62] + chars[j // 62 % 62] + chars[j // 3844 % 62]] = i
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    hf = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", bos_token="<|im_start|>",
                                 pad_token="<|endoftext|>")
    hf.add_special_tokens({"additional_special_tokens": specials})
    hf.chat_template = CHATML_TEMPLATE
    return EngineTokenizer(hf, [hf.convert_tokens_to_ids("<|im_end|>"), hf.convert_tokens_to_ids("<|endoftext|>")])
