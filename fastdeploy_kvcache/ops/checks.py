"""Argument checks shared by every face of the ops: the errors they raise, and the
conversions that refuse what would copy the wrong blocks (floats as ids, 2-D id arrays,
values that wrap on their way into C, strided tensors).

Everything here is pure Python (numpy imported lazily), so a check runs before any
library is loaded and before anything is written.
"""

from __future__ import annotations

import ctypes
import numbers
from typing import Any, Callable, Optional, Sequence, Union

IdsLike = Union[Sequence[int], Any]  # list/tuple/range of ints or a 1-D integer numpy array
StreamLike = Union[int, Any, None]


class SwapOpError(ValueError):
    """Bad arguments to a swap op.  Raised before anything is written.

    ``op``, ``argument`` and ``index`` name the offending op, argument and position
    (``index`` is ``None`` when the problem is not tied to one position, e.g. a bad mode).
    For an error found by the C++ core they are the values the core filled in
    (``fdkv_last_error_fields``); the message repeats them for people.
    """

    def __init__(self, message: str, op: str = "", argument: str = "", index: Optional[int] = None):
        super().__init__(message)
        self.op = op
        self.argument = argument
        self.index = index


class OpsNotBuiltError(RuntimeError):
    """The compiled library is missing: the message says which build command makes it."""


# --------------------------------------------------------------------------- helpers
def stream_handle(stream: StreamLike) -> int:
    """Raw ``cudaStream_t`` of an int, a CuPy stream (``.ptr``) or a Paddle stream."""
    if stream is None:
        return 0
    if isinstance(stream, int):
        return stream
    for attr in ("ptr", "cuda_stream"):
        value = getattr(stream, attr, None)
        if isinstance(value, int):
            return value
    base = getattr(stream, "stream_base", None)
    if base is not None:
        raw = getattr(base, "raw_stream", None) or getattr(base, "cuda_stream", None)
        if isinstance(raw, int):
            return raw
    raise TypeError(f"cannot get a CUDA stream handle from {type(stream).__name__}")


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` as a block id is a bug, not block 1)."""
    # NOTE: the exact-int test first: the ABC check costs ~1 us, and an all-layer call checks
    # a few hundred pointers and sizes (host submit time, docs/ops.md, "Measured costs").
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def ids_error(op: str, name: str) -> Callable[..., SwapOpError]:
    """A maker of the SwapOpError for a bad id list ``name`` of ``op`` (index optional)."""

    def bad(detail: str, index: Optional[int] = None) -> SwapOpError:
        where = f"{name}[{index}]" if index is not None else name
        return SwapOpError(f"{op}: {where} {detail}", op, name, index)

    return bad


def id_array(ids: IdsLike, op: str, name: str) -> Any:
    """Block ids as a 1-D contiguous int64 numpy array, or :class:`SwapOpError`.

    NOTE: strict on purpose.  ``int(1.7)`` would copy block 1, a 2-D array would be
    flattened into pairs nobody meant, and ``2**63`` wraps to -1 on its way into C: each
    of those used to copy the wrong blocks, so each is refused, with nothing copied.
    Accepted: a list/tuple/range of ints, or a 1-D integer numpy array or Paddle tensor.
    """
    import numpy as np  # numpy is a core dependency; imported here to keep import light

    bad = ids_error(op, name)
    if isinstance(ids, (str, bytes)) or ids is None or is_int(ids):
        raise bad(f"must be a 1-D sequence of integer block ids, got {type(ids).__name__}")
    if not isinstance(ids, np.ndarray) and hasattr(ids, "numpy") and callable(ids.numpy):
        ids = ids.numpy()  # a Paddle tensor (host copy of its values)
    if isinstance(ids, np.ndarray):
        arr = ids
        if arr.ndim != 1:
            raise bad(f"must be 1-D, got shape {tuple(arr.shape)}")
        if arr.size == 0:
            return np.zeros(0, dtype=np.int64)  # np.asarray([]) is float64: nothing to truncate
        if arr.dtype.kind == "u":
            if int(arr.max()) > _INT64_MAX:
                index = int(np.argmax(arr > _INT64_MAX))
                raise bad(f"= {int(arr[index])} does not fit in int64", index)
        elif arr.dtype.kind != "i":
            raise bad(f"must hold integers, got dtype {arr.dtype}")
        return np.ascontiguousarray(arr, dtype=np.int64)
    return np.asarray(checked_values(ids, bad), dtype=np.int64)


def id_buffer(ids: IdsLike, op: str, name: str) -> tuple[Any, Any, int]:
    """Checked ids as the C arguments of a call: ``(keep, pointer, count)``, where ``keep``
    (the int64 array) must stay referenced until the call returns."""
    arr = id_array(ids, op, name)
    return arr, arr.ctypes.data_as(ctypes.POINTER(ctypes.c_int64)), int(arr.size)


def checked_values(ids: Any, bad: Callable[..., SwapOpError]) -> list[int]:
    """The elements of a Python sequence of ids, each checked to be an int within int64."""
    try:
        values = list(ids)
    except TypeError:
        raise bad(f"must be a 1-D sequence of integer block ids, got {type(ids).__name__}") from None
    # Fast path (C-speed builtins): only Python ints, all within int64.
    if not values or (set(map(type, values)) == {int} and _INT64_MIN <= min(values) and max(values) <= _INT64_MAX):
        return values
    for index, value in enumerate(values):
        if type(value) is not int and not is_int(value):
            if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0):
                raise bad("must be 1-D: an element is itself a sequence", index)
            raise bad(f"= {value!r} is not an integer", index)
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise bad(f"= {value} does not fit in int64", index)
    return [int(v) for v in values]  # numpy integer scalars among them


def id_list(ids: IdsLike, op: str, name: str) -> list[int]:
    """Validated ids as a list of Python ints (the Paddle attr type ``std::vector<int64_t>``).

    A list/tuple/range of Python ints skips the numpy round trip (the common case)."""
    if type(ids) in (list, tuple, range):
        return checked_values(ids, ids_error(op, name))
    return id_array(ids, op, name).tolist()


def int_arg(value: Any, op: str, name: str, bits: int = 64) -> int:
    """A scalar argument as an int, or :class:`SwapOpError` (no truncation of 2.5, no bools,
    nothing that would wrap on its way into a C ``int`` / ``int64_t``)."""
    if is_int(value):
        v = int(value)
        if -(1 << (bits - 1)) <= v < (1 << (bits - 1)):
            return v
        raise SwapOpError(f"{op}: {name} = {v} does not fit in int{bits}", op, name, None)
    raise SwapOpError(f"{op}: {name} = {value!r} must be an integer", op, name, None)


def ptr_arg(value: Any, op: str, name: str) -> int:
    """An address: an integer in ``[0, 2**64)`` (a negative one would wrap in ctypes)."""
    if type(value) is int and 0 <= value < (1 << 64):
        return value
    if is_int(value) and 0 <= int(value) < (1 << 64):
        return int(value)
    raise SwapOpError(f"{op}: {name} = {value!r} is not an address (an integer in [0, 2**64))", op, name, None)


def check_tensor(tensor: Any, op: str) -> Any:
    """The one cache tensor of a per-layer op (see :func:`check_tensors`)."""
    is_contiguous = getattr(tensor, "is_contiguous", None)
    if is_contiguous is not None and not is_contiguous():
        raise SwapOpError(
            f"{op}: cache_gpu is not contiguous (a transposed or strided view); the op would write "
            f"a temporary copy, not your tensor: pass a contiguous tensor",
            op, "cache_gpu", None,
        )
    return tensor


def check_tensors(tensors: Sequence[Any], op: str, name: str) -> list[Any]:
    """The cache tensors of a Paddle op: a non-empty list of contiguous tensors.

    NOTE: Paddle hands a custom op a contiguous *copy* of a non-contiguous input, so the
    op would write the copy and the caller's tensor would silently stay unchanged:
    refused here, naming the tensor.  An empty list makes Paddle itself abort the process
    (std::out_of_range) before the op's code runs, so it never reaches Paddle.
    """
    tensors = list(tensors)
    if not tensors:
        raise SwapOpError(f"{op}: {name} is empty; pass at least one cache tensor", op, name, None)
    for index, tensor in enumerate(tensors):
        is_contiguous = getattr(tensor, "is_contiguous", None)
        if is_contiguous is not None and not is_contiguous():
            raise SwapOpError(
                f"{op}: {name}[{index}] is not contiguous (a transposed or strided view); the op "
                f"would write a temporary copy, not your tensor: pass a contiguous tensor",
                op, name, index,
            )
    return tensors


def per_tensor(value: Union[int, Sequence[int]], count: int, op: str, name: str) -> Any:
    """One int per tensor as a C ``int64_t`` array: ``value`` repeated, or a sequence of
    ``count`` ints (:class:`SwapOpError` naming ``name`` otherwise)."""
    if is_int(value):
        values = [int_arg(value, op, name)] * count
    else:
        values = [int_arg(v, op, name) for v in value]
        if len(values) != count:
            raise SwapOpError(
                f"{op}: {name} has {len(values)} entries but there are {count} tensors", op, name, None
            )
    return (ctypes.c_int64 * max(count, 1))(*values)
