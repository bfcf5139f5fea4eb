"""Sampling parameters and the per-request sampler.

Sampling runs in numpy on the step's last-token logits (one row per request that produces a
token): it is a few hundred microseconds per request even for a 49k vocabulary, and numpy's
``Generator`` gives each seeded request its own reproducible stream, independent of which
other requests share its batch.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from fastdeploy_kvcache.engine.request_checks import check_token_ids

logger = logging.getLogger(__name__)

# Stop strings are matched in text; an absurd number of them is a client bug.
MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 256


@dataclass
class SamplingParams:
    """OpenAI-style sampling knobs.  ``temperature == 0`` means greedy; ``top_k=-1`` is off."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: Optional[int] = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: Optional[int] = None) -> None:
        """Raise ``ValueError("<field>: <what is wrong>")`` for the first bad field."""
        if not _is_int(self.max_tokens) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens: must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_number(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature: must be a finite number >= 0, got {self.temperature!r}")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or (self.top_k != -1 and self.top_k < 1):
            raise ValueError(f"top_k: must be -1 (off) or an integer >= 1, got {self.top_k!r}")
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed < 2**63)):
            raise ValueError(f"seed: must be an integer in [0, 2**63), got {self.seed!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise ValueError(f"stop: must be a string or a list of strings, got {self.stop!r}")
        if any(s == "" for s in self.stop):
            raise ValueError("stop: empty stop strings are not allowed")
        for i, s in enumerate(self.stop):
            try:
                s.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise ValueError(f"stop: string {i} is not valid Unicode text: a lone UTF-16 surrogate "
                                 f"U+{ord(s[exc.start]):04X} at character {exc.start}") from None
        if len(self.stop) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            _is_int(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids: must be a list of integers >= 0, got {self.stop_token_ids!r}")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS} ids, got {len(self.stop_token_ids)}")
        if vocab_size is not None:
            check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos: must be a boolean, got {self.ignore_eos!r}")


def _is_int(v: object) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float, np.floating, np.integer)) and not isinstance(v, bool)


class RequestSampler:
    """Draws one request's tokens: its own RNG, so a seeded request is reproducible.

    An unseeded request gets a seed from the engine's generator (itself seeded by
    ``EngineArgs.seed``), so a whole run is reproducible too.
    """

    def __init__(self, params: SamplingParams, fallback_seed: int) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed if params.seed is not None else fallback_seed)

    def sample(self, logits: np.ndarray) -> int:
        """One token id from a 1-D float logits row."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        x = logits.astype(np.float64) / p.temperature
        vocab = x.shape[0]
        if 0 < p.top_k < vocab:
            idx = np.argpartition(-x, p.top_k - 1)[: p.top_k]
        else:
            idx = np.arange(vocab)
        vals = x[idx]
        # Sorted descending (ties by id, so the order is deterministic) for top_p.
        order = np.lexsort((idx, -vals))
        idx, vals = idx[order], vals[order]
        probs = np.exp(vals - vals[0])
        probs /= probs.sum()
        if p.top_p < 1.0:
            cum = np.cumsum(probs)
            keep = int(np.searchsorted(cum, p.top_p, side="left")) + 1
            idx, probs = idx[:keep], probs[:keep]
            probs = probs / probs.sum()
        return int(idx[self.rng.choice(len(idx), p=probs)])
