"""Import Paddle and paddleformers without the start-up notices that do not apply to this engine.

Importing Paddle warns that ccache is missing (it matters only to compiling an extension,
and loading prebuilt ops compiles nothing).  Importing paddleformers prints, every time: transformers' "PyTorch was not found" advice
(the engine never uses torch), paddleformers' own notice that it hides torch from
transformers, and setuptools' "replacing distutils" warning (paddleformers imports
distutils after setuptools).  paddleformers' logger also writes INFO chatter ("Using
download source: huggingface" when nothing is downloaded, "Loading configuration file")
with ANSI colour codes, whatever the stream.

Importing transformers alone (the router and the tokenizers load it without paddleformers)
prints the same "PyTorch was not found" advice: :func:`import_transformers` drops it.

Each of those is silenced where it is raised and nothing else is: the notices are
dropped by exact message, only while the import runs; paddleformers' logger keeps its
warnings and errors (at INFO and below only with ``--log-level debug``), and writes plain
text when stderr is not a terminal.
"""

from __future__ import annotations

import logging
import sys
import warnings
from types import ModuleType
from typing import Any, Optional

logger = logging.getLogger(__name__)

# (logger name, message prefix) of the notices logged while paddleformers imports.
_IMPORT_LOG_NOTICES = (
    ("transformers", "PyTorch was not found."),
    ("PaddleFormers", "Due to potential compatibility issues between PaddlePaddle and PyTorch"),
)
# Python warnings raised while paddleformers imports (regexes matched at the start).
_IMPORT_WARNINGS = (r"Setuptools is replacing distutils",)
_PADDLE_IMPORT_WARNINGS = (r"No ccache found",)
PADDLEFORMERS_LOGGER = "PaddleFormers"


class _DropNotices(logging.Filter):
    def __init__(self, prefixes: tuple[str, ...]) -> None:
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefixes)


def import_paddle() -> ModuleType:
    """``import paddle`` (once), without its ccache warning."""
    if "paddle" in sys.modules:
        return sys.modules["paddle"]
    with warnings.catch_warnings():
        for pattern in _PADDLE_IMPORT_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        import paddle
    return paddle


class _NoticeFilters:
    """The filters of ``_IMPORT_LOG_NOTICES`` on their loggers, while the ``with`` block runs."""

    def __init__(self, names: Optional[set[str]] = None) -> None:
        self.names = names
        self.filters: list[tuple[logging.Logger, logging.Filter]] = []

    def __enter__(self) -> "_NoticeFilters":
        for name in sorted({n for n, _ in _IMPORT_LOG_NOTICES if self.names is None or n in self.names}):
            flt = _DropNotices(tuple(p for n, p in _IMPORT_LOG_NOTICES if n == name))
            target = logging.getLogger(name)
            target.addFilter(flt)
            self.filters.append((target, flt))
        return self

    def __exit__(self, *exc: Any) -> None:
        for target, flt in self.filters:
            target.removeFilter(flt)


def import_transformers() -> ModuleType:
    """``import transformers`` (once), without its "PyTorch was not found" advice: what is
    used of it here without torch (tokenizers, the GGUF tokenizer converter) needs none."""
    if "transformers" in sys.modules:
        return sys.modules["transformers"]
    with _NoticeFilters({"transformers"}):
        import transformers
        # The advice is logged when the first submodule resolves torch's availability.
        from transformers import PreTrainedTokenizerFast  # noqa: F401
    return transformers


def import_paddleformers() -> ModuleType:
    """``import paddleformers`` (once), without its notices; its logger set up as above."""
    if "paddleformers" in sys.modules:
        return sys.modules["paddleformers"]
    import_paddle()
    with _NoticeFilters():
        with warnings.catch_warnings():
            for pattern in _IMPORT_WARNINGS:
                warnings.filterwarnings("ignore", message=pattern)
            import paddleformers
            # The parts the engine uses, imported lazily by paddleformers: distutils is
            # imported under the Llama model's modules.
            from paddleformers.nn.attention.interface import AttentionInterface  # noqa: F401
            from paddleformers.transformers import LlamaForCausalLM  # noqa: F401
    _plain_paddleformers_logger()
    return paddleformers


def _plain_paddleformers_logger() -> None:
    """paddleformers' logger: WARNING and up (unless ours is at DEBUG), no colour off a terminal."""
    pf = logging.getLogger(PADDLEFORMERS_LOGGER)
    ours = logging.getLogger("fastdeploy_kvcache")
    pf.setLevel(logging.DEBUG if ours.getEffectiveLevel() <= logging.DEBUG else logging.WARNING)
    for handler in pf.handlers:
        stream: Any = getattr(handler, "stream", None)
        isatty = getattr(stream, "isatty", None)
        if not (callable(isatty) and isatty()):
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s paddleformers: %(message)s"))
