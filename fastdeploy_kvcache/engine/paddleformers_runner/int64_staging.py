"""Int64 tensors from Python ints (token ids, positions, block tables) without ``paddle.to_tensor``.

On Paddle 3.3.1 (CPU build), every tensor built from host data keeps memory that is never
freed: measured per call, about 112 bytes for ``paddle.to_tensor``, 65 for the eager
constructor it calls (``paddle.Tensor(ndarray)``) and 80 for ``paddle.from_dlpack``.  The
engine builds a few such tensors per step
(the step's ids and positions, each request's block table), so the server grew by a few
KB per request (``benchmarks/bench_soak.py`` measures it).  Writing into an existing tensor
(``Tensor.set_value``) and slicing it keep nothing, so the values go through one
persistent buffer per :class:`Int64Staging`, and each call returns a copy of the filled
part that owns its memory (later calls do not change it).

NOTE: ``paddle.assign(ndarray)`` keeps nothing either, but takes ~0.3 ms per thousand
values (it goes through an op attribute list); the buffer takes ~25 us.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence, Union

import numpy as np

logger = logging.getLogger(__name__)

_MIN_CAPACITY = 256


class Int64Staging:
    """Makes int64 tensors on Paddle's current device from host values, through a reused buffer.

    Not thread-safe: one per model runner, used by the thread that runs its steps.
    """

    def __init__(self) -> None:
        import paddle

        self._paddle = paddle
        self._buffer: Optional[Any] = None  # paddle int64 [capacity]
        self._host: Optional[np.ndarray] = None  # numpy int64 [capacity], the buffer's source

    @property
    def capacity(self) -> int:
        return 0 if self._host is None else int(self._host.shape[0])

    def tensor(self, values: Union[Sequence[int], np.ndarray], shape: Optional[Sequence[int]] = None) -> Any:
        """A new int64 tensor holding ``values`` (flattened), reshaped to ``shape`` when given."""
        flat = np.asarray(values, dtype=np.int64).reshape(-1)
        n = int(flat.shape[0])
        if n == 0:
            out = self._paddle.zeros([0], dtype="int64")
        else:
            if n > self.capacity:
                capacity = max(_MIN_CAPACITY, 1 << (n - 1).bit_length())
                self._buffer = self._paddle.zeros([capacity], dtype="int64")
                self._host = np.zeros(capacity, dtype=np.int64)
                logger.debug("int64 staging buffer grown to %d values", capacity)
            self._host[:n] = flat
            self._buffer.set_value(self._host)
            # The slice may be a view of the buffer; clone so the next call cannot change it.
            out = self._buffer[:n].clone()
        return out if shape is None else out.reshape(list(shape))
