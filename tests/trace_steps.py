"""The scheduler side of the random traces shared by tests/worker (one process) and tests/tp
(tensor-parallel ranks): one step of finish / preempt, admit and decode over a ``CacheManager``.

Both traces must draw from their ``random.Random`` in exactly this order, so the same seed
gives the same trace; keeping the step in one place keeps the two drivers in step.
"""

from __future__ import annotations

import hashlib
import random
from typing import Any, Callable

import numpy as np


def partial_block_key(request_id: str, block: int, end: int) -> int:
    """Pattern key of a partial block: the same in every process (``hash()`` of a str is not)."""
    digest = hashlib.blake2b(f"{request_id}/{block}/{end}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


class ArrayIO:
    """Block writes/reads of one backend's device arrays, on the current stream.

    CuPy accesses run under the array's own device, so a rank's model reads and writes the
    GPU its controller lives on whatever device is current.
    """

    def __init__(self, backend: str) -> None:
        self.backend = backend
        if backend == "paddle":
            import paddle

            self._paddle = paddle
        elif backend == "cupy":
            import cupy

            self._cp = cupy

    def write(self, array: Any, block: int, data: np.ndarray) -> None:
        if self.backend == "paddle":
            array[block] = self._paddle.to_tensor(data, dtype=array.dtype)
        elif self.backend == "cupy":
            with array.device:
                array[block] = self._cp.asarray(data, dtype=array.dtype)
        else:
            array[block] = data

    def read(self, array: Any, block: int) -> np.ndarray:
        if self.backend == "paddle":
            return array[block].numpy()
        if self.backend == "cupy":
            with array.device:
                return self._cp.asnumpy(array[block])  # synchronous on the current stream
        return np.array(array[block])


def compute_layers(batch: Any, counter: Any, num_layers: int, block_size: int,
                   check: Callable[[Any, int, int, str], None],
                   write: Callable[[int, int, int], None]) -> bool:
    """The trace models' forward: per layer, wait for its load, check what compute reads,
    write what it writes.  False if a load failed (nothing is written after it)."""
    from fastdeploy_kvcache.worker import LayerSwapError

    for layer in range(num_layers):
        if counter is not None:
            try:
                counter.wait_for_layer(layer)
            except LayerSwapError:
                return False
        for req in batch:
            check(req, layer, req.num_computed_tokens, "before compute")
            for block, key in written_blocks(req, block_size):
                write(block, key, layer)
    return True


def blocks_for(req: Any, block_size: int) -> int:
    """Device blocks a request's tokens fill (the last one partly)."""
    return -(-req.num_total_tokens // block_size)


def written_blocks(req: Any, block_size: int) -> list[tuple[int, int]]:
    """(device block, pattern key) of each block a step's compute writes for ``req``.

    A full block's key is its chained hash; a partial block's depends on how far it is filled.
    """
    start, end = req.num_computed_tokens, req.num_total_tokens
    hashes = req.block_hashes(block_size, end)
    out = []
    for i in range(start // block_size, (end - 1) // block_size + 1):
        full = (i + 1) * block_size <= end
        key = hashes[i] if full else partial_block_key(req.request_id, i, end)
        out.append((req.block_tables[i], key))
    return out


def scheduler_step(mgr: Any, rng: random.Random, families: list[list[int]], running: list[Any],
                   next_id: int, block_size: int) -> int:
    """Finish or preempt some running requests, admit up to three new ones, decode one token.

    ``running`` is updated in place; returns the next request id to use.
    """
    from fastdeploy_kvcache.core.block_pool import NoFreeBlocksError
    from fastdeploy_kvcache.core.request import Request

    for req in list(running):
        r = rng.random()
        if r < 0.12:
            mgr.request_finish(req)
            running.remove(req)
        elif r < 0.17:
            mgr.preempt_request(req)
            running.remove(req)
    for _ in range(rng.randint(0, 3)):
        fam = rng.choice(families)
        prompt = fam[: rng.randint(2, 20)] + [rng.randrange(1000) for _ in range(rng.randint(0, 6))]
        req = Request(f"r{next_id}", prompt)
        next_id += 1
        match = mgr.match_prefix(req)
        need = blocks_for(req, block_size) - match.num_device_blocks
        if not mgr.can_allocate_device_blocks(need):
            continue
        try:
            mgr.allocate_device_blocks(req, need)
        except NoFreeBlocksError:
            continue
        running.append(req)
    for req in list(running):
        if req.num_computed_tokens < req.num_total_tokens:
            continue  # still has tokens to compute (new, or redone after a failure)
        req.output_token_ids.append(rng.randrange(1000))
        if req.num_total_tokens > len(req.block_tables) * block_size:
            try:
                mgr.allocate_device_blocks(req, 1)
            except NoFreeBlocksError:
                req.output_token_ids.pop()
                mgr.preempt_request(req)
                running.remove(req)
    return next_id
