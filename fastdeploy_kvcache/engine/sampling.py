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

    Each sampled token takes exactly one uniform draw from the request's RNG (``draw``),
    and the token is the first candidate whose normalised cumulative probability passes it.
    That is what numpy's ``Generator.choice(n, p=...)`` does with one ``random()`` call, so
    the stream of tokens is the same whether a token is picked here on the host or by the
    runner on the device (``StepSampling``), up to float rounding at a boundary.  A draw
    stays pending until ``consume``: a step whose token is dropped (its loads failed and the
    step is redone) uses the same draw again, so a redone step does not shift the stream.
    """

    def __init__(self, params: SamplingParams, fallback_seed: int) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed if params.seed is not None else fallback_seed)
        self._pending_u: Optional[float] = None

    def draw(self) -> float:
        """The uniform in [0, 1) that picks the next token (drawn once, kept until consumed)."""
        if self._pending_u is None:
            self._pending_u = float(self.rng.random())
        return self._pending_u

    def consume(self) -> None:
        """The pending draw picked a token that was kept: the next token takes a new one."""
        self._pending_u = None

    def skip_draw(self) -> None:
        """Advance the stream past one token sampled elsewhere (a PD prefill server's)."""
        if not self.params.greedy:
            self.draw()
            self.consume()

    def sample(self, logits: np.ndarray) -> int:
        """One token id from a 1-D float logits row (consumes the pending draw)."""
        p = self.params
        if p.greedy:
            return int(np.argmax(logits))
        token = sample_row(logits, p.temperature, p.top_k, p.top_p, self.draw())
        self.consume()
        return token


def sample_row(logits: np.ndarray, temperature: float, top_k: int, top_p: float, u: float) -> int:
    """The token that uniform ``u`` picks from one logits row after temperature, top-k and top-p.

    Candidates are sorted by descending logit, ties by id, so the order (and the pick) is
    deterministic; ``StepSampling``'s device path sorts the same way.
    """
    x = logits.astype(np.float64) / temperature
    vocab = x.shape[0]
    if 0 < top_k < vocab:
        idx = np.argpartition(-x, top_k - 1)[:top_k]
    else:
        idx = np.arange(vocab)
    vals = x[idx]
    order = np.lexsort((idx, -vals))
    idx, vals = idx[order], vals[order]
    probs = np.exp(vals - vals[0])
    probs /= probs.sum()
    if top_p < 1.0:
        cum = np.cumsum(probs)
        keep = int(np.searchsorted(cum, top_p, side="left")) + 1
        idx, probs = idx[:keep], probs[:keep]
    cdf = np.cumsum(probs)
    cdf /= cdf[-1]
    return int(idx[min(int(cdf.searchsorted(u, side="right")), len(idx) - 1)])


@dataclass
class StepSampling:
    """One step's sampling rows, in the order the runner returns logits rows.

    Built on the host before the forward pass, so that a runner on a GPU can sample there and
    bring back only the token ids (one small copy, the step's one host sync) instead of the
    whole ``[rows, vocab]`` logits.  A greedy row has ``temperature`` 0; ``top_k`` 0 means
    off; ``u`` is each sampled row's pending draw (0 for greedy rows).
    """

    temperature: np.ndarray  # float64 [R]
    top_k: np.ndarray  # int64 [R]
    top_p: np.ndarray  # float64 [R]
    u: np.ndarray  # float64 [R]

    @classmethod
    def for_samplers(cls, samplers: list[RequestSampler]) -> "StepSampling":
        """The rows of ``samplers`` (each sampled row's draw is taken now and left pending)."""
        n = len(samplers)
        temperature = np.zeros(n, dtype=np.float64)
        top_k = np.zeros(n, dtype=np.int64)
        top_p = np.ones(n, dtype=np.float64)
        u = np.zeros(n, dtype=np.float64)
        for i, s in enumerate(samplers):
            p = s.params
            if p.greedy:
                continue
            temperature[i] = p.temperature
            top_k[i] = max(p.top_k, 0)
            top_p[i] = p.top_p
            u[i] = s.draw()
        return cls(temperature, top_k, top_p, u)

    def __len__(self) -> int:
        return len(self.u)

    @property
    def sampled_rows(self) -> np.ndarray:
        """Indices of the rows that sample (the others take the argmax)."""
        return np.flatnonzero(self.temperature > 0)

    @property
    def all_greedy(self) -> bool:
        return not bool((self.temperature > 0).any())

    def packed(self) -> np.ndarray:
        """The sampled rows as one int64 array for one upload: their indices, ``top_k``, then
        the float64 bits of ``temperature``, ``top_p`` and ``u`` (``torch_sampling``)."""
        rows = self.sampled_rows
        floats = np.concatenate([self.temperature[rows], self.top_p[rows], self.u[rows]])
        return np.concatenate([rows.astype(np.int64), self.top_k[rows], floats.view(np.int64)])

    def sample_host(self, logits: np.ndarray) -> np.ndarray:
        """The token ids for ``logits`` (``[R, vocab]``) on the host: the reference for the
        device path, and the path of a runner that returns logits."""
        if len(logits) != len(self):
            raise ValueError(f"logits: {len(logits)} rows for {len(self)} sampling rows")
        ids = np.argmax(logits, axis=1).astype(np.int64) if len(logits) else np.zeros(0, dtype=np.int64)
        for r in self.sampled_rows:
            ids[r] = sample_row(logits[r], float(self.temperature[r]), int(self.top_k[r]),
                                float(self.top_p[r]), float(self.u[r]))
        return ids
