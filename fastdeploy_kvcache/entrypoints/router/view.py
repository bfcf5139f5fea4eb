"""The router's picture of one worker's KV cache: which block hashes it holds, on which tier.

Built only from the worker's KV cache events (``BlockStored`` adds a medium to a hash,
``BlockRemoved`` takes it away, ``AllBlocksCleared`` empties the view), so every block in
a view is one the worker announced and has not withdrawn.  A hash may sit on several
tiers at once (write-through keeps a device block's copy on the host), hence a bit mask
per hash rather than one tier.

Scoring walks a request's chained block hashes from the first block and stops at the
first block the worker cannot supply from any tier, because a prefix cache reuses a
prefix and nothing after a gap.  Each matched block adds the weight of the best tier it
is on: reading it from device memory saves the most, from host memory a bit less (a
host-to-device copy), from storage less again (a read from the store).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from fastdeploy_kvcache.core.kv_events import MEDIUM_CPU, MEDIUM_DISK, MEDIUM_GPU, MEDIUM_MOONCAKE, MEDIUMS

logger = logging.getLogger(__name__)

# Tier bits.  The event mediums map onto three tiers; both storage mediums are one tier.
DEVICE, HOST, STORAGE = 1, 2, 4
MEDIUM_BITS = {MEDIUM_GPU: DEVICE, MEDIUM_CPU: HOST, MEDIUM_DISK: STORAGE, MEDIUM_MOONCAKE: STORAGE}
TIER_NAMES = {DEVICE: "device", HOST: "host", STORAGE: "storage"}


def medium_bit(medium: Optional[str]) -> int:
    """The tier bit of an event's ``medium``; ``None`` (vLLM's default) means the device."""
    if medium is None:
        return MEDIUM_BITS[MEDIUM_GPU]
    bit = MEDIUM_BITS.get(medium)
    if bit is None:
        raise ValueError(f"unknown medium {medium!r}; expected one of {', '.join(MEDIUMS)}")
    return bit


@dataclass(frozen=True)
class TierWeights:
    """How much one reused block is worth, by the tier it is read from (recompute = 0)."""

    device: float = 1.0
    host: float = 0.8
    storage: float = 0.5

    def __post_init__(self) -> None:
        for name in ("device", "host", "storage"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} weight must be in [0, 1], got {value}")

    def of_mask(self, mask: int) -> float:
        """The weight of the best tier in ``mask`` (0 for an empty mask)."""
        if mask & DEVICE:
            return self.device
        if mask & HOST:
            return self.host
        if mask & STORAGE:
            return self.storage
        return 0.0


@dataclass
class Match:
    """One worker's answer for one request: the reusable prefix and what it is worth.

    ``confirmed``: the leading blocks known from events alone (no pending request in
    them), which is what the worker is expected to reuse; ``blocks`` also counts the
    pending ones, which only steer placement (a prefix still being computed is not reused).
    """

    blocks: int = 0
    score: float = 0.0
    confirmed: int = 0


class WorkerView:
    """Block hash -> tier mask, for one worker; applied from its events in order."""

    __slots__ = ("blocks", "block_size")

    def __init__(self) -> None:
        self.blocks: dict[int, int] = {}
        self.block_size: Optional[int] = None  # learnt from BlockStored.block_size

    def __len__(self) -> int:
        return len(self.blocks)

    def store(self, hashes: Iterable[int], medium: Optional[str], block_size: Optional[int]) -> None:
        bit = medium_bit(medium)
        if block_size:
            if self.block_size not in (None, block_size):
                logger.warning("worker changed block size from %s to %s; its old blocks are dropped",
                               self.block_size, block_size)
                self.blocks.clear()
            self.block_size = int(block_size)
        blocks = self.blocks
        for h in hashes:
            blocks[h] = blocks.get(h, 0) | bit

    def remove(self, hashes: Iterable[int], medium: Optional[str]) -> None:
        keep = ~medium_bit(medium)
        blocks = self.blocks
        for h in hashes:
            mask = blocks.get(h)
            if mask is None:
                continue
            mask &= keep
            if mask:
                blocks[h] = mask
            else:
                del blocks[h]

    def clear(self) -> None:
        self.blocks.clear()

    def count(self, bit: int) -> int:
        """How many blocks the view has on the tier ``bit``."""
        return sum(1 for mask in self.blocks.values() if mask & bit)

    def hashes_on(self, bit: int) -> list[int]:
        return [h for h, mask in self.blocks.items() if mask & bit]

    def match(self, hashes: Sequence[int], weights: TierWeights, shared: Sequence["WorkerView"] = (),
              pending: Optional[dict[int, float]] = None, now: float = 0.0) -> Match:
        """The reusable prefix of ``hashes`` on this worker.

        ``shared``: the other workers' views, when the store is shared; a block this worker
        lacks but another one put in storage can still be read by this one (storage weight).
        ``pending``: hashes of requests just sent here, with the time they stop counting as
        device blocks (their events may not have arrived yet).
        """
        get = self.blocks.get
        m = Match()
        known = True
        for h in hashes:
            mask = get(h, 0)
            if not mask and shared:
                mask = STORAGE if any(v.blocks.get(h, 0) & STORAGE for v in shared) else 0
            if not mask and pending and pending.get(h, 0.0) > now:
                mask = DEVICE
                known = False
            if not mask:
                break
            m.blocks += 1
            m.confirmed += known
            m.score += weights.of_mask(mask)
        return m
