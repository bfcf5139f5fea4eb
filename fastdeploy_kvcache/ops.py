"""One Python API over the compiled KV swap ops: Paddle custom ops and a ctypes C ABI.

Both faces call the same C++ core (``custom_ops/csrc``), so validation, run merging and
path selection behave identically whichever one a caller uses:

* The **Paddle ops** (``swap_cache_per_layer`` and friends) take ``paddle.Tensor`` caches
  and are what an engine's worker calls.  They are built by ``setup_ops.py`` into
  ``build/paddle_ops`` and loaded lazily, so importing this module never imports Paddle.
* The **C ABI** (:func:`load_capi`) takes raw pointers, for callers without Paddle (CuPy
  or torch memory on the GPU; numpy memory with the CPU build), and for the GPU tests.

Every op validates its arguments before touching memory: ids are 1-D integers (no
floats, no 2-D arrays, nothing outside int64), in range, of equal lengths, with no
duplicate destination ids; tensors are contiguous; host ids are bounded by the host
buffer's size.  A violation raises :class:`SwapOpError` naming the op, the argument and
the index, and nothing has been written.  The C++ core hands those three over as values
(``fdkv_last_error_fields``), never as text to be parsed.

See ``docs/ops.md`` for semantics, stream behaviour and which copy path runs when.
"""

from __future__ import annotations

import ctypes
import logging
import numbers
import threading
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional, Sequence, Union

from fastdeploy_kvcache import envs, libpaths
from fastdeploy_kvcache.core.metadata import CopyDirection

logger = logging.getLogger(__name__)

__all__ = [
    "MODE_D2H",
    "MODE_H2D",
    "PATH_MEMCPY",
    "PATH_KERNEL",
    "PATH_DMA",
    "PATH_STAGED",
    "PATH_CPU",
    "COPY_PATH_PROCESS",
    "COPY_PATH_AUTO",
    "COPY_PATH_KERNEL",
    "COPY_PATH_DMA",
    "COPY_PATH_STAGED",
    "COPY_PATHS",
    "copy_path_code",
    "SwapOpError",
    "OpsNotBuiltError",
    "CApi",
    "load_capi",
    "paddle_ops_available",
    "paddle_ops_capi",
    "cuda_host_alloc",
    "cuda_host_free",
    "swap_cache_per_layer",
    "swap_cache_per_layer_async",
    "swap_cache_all_layers",
    "swap_cache_layout",
]

# NOTE: aliases kept for API compatibility; the one name for a copy's direction is
# CopyDirection, whose values are the ops' ``mode``.
MODE_D2H = CopyDirection.DEVICE_TO_HOST
"""``mode`` value 0: copy device blocks to host blocks (evict / back up)."""
MODE_H2D = CopyDirection.HOST_TO_DEVICE
"""``mode`` value 1: copy host blocks to device blocks (load / swap in)."""

# Bits of CApi.last_path(): which copy paths the calling thread's last op used.
PATH_MEMCPY = 1
PATH_KERNEL = 2
PATH_DMA = 4
PATH_CPU = 8
PATH_STAGED = 16
PATH_DMA_ROWS = 32
"""Set with PATH_DMA: the copies went as one 2D copy per run of blocks over tensors that sit
at one pitch (docs/ops.md, "Lanes at one pitch"), not a batch entry per tensor."""

# Per-call copy path (the ``path`` argument of every swap): which path this one call takes,
# whatever the process-wide ``copy_path`` option says.  See docs/ops.md, "Which path runs when".
COPY_PATH_PROCESS = -1
"""Follow the process-wide ``copy_path`` option (FDKV_COPY_PATH / ``set_option``); the default."""
COPY_PATH_AUTO = 0
"""The size rule: DMA batch for average copies >= dma_min_bytes, else the copy kernel."""
COPY_PATH_KERNEL = 1
"""The copy kernel (<= FDKV_COPY_GRID CTAs); merged runs >= merge_min_bytes still use memcpy."""
COPY_PATH_DMA = 2
"""The cudaMemcpyBatchAsync DMA batch: copy engines, no SMs (kernel on the legacy stream)."""
COPY_PATH_STAGED = 3
"""Device-side gather/scatter through a bounded device staging ring, plus one pipelined DMA per
contiguous host run (few SMs for microseconds per chunk); auto picks it when host ids form runs."""
COPY_PATHS: dict[str, int] = {
    "process": COPY_PATH_PROCESS, "auto": COPY_PATH_AUTO, "kernel": COPY_PATH_KERNEL, "dma": COPY_PATH_DMA,
    "staged": COPY_PATH_STAGED,
}
_ABI_VERSION = 6  # fdkv_abi_version() of libraries with error fields, recorded host sizes, read_files,
# swap_layer_groups, launch_layer_groups

_BUILD_HINT = "run `bash build.sh` (CPU) or `bash build.sh gpu` (CUDA C ABI) from the repository root"

IdsLike = Union[Sequence[int], Any]  # list/tuple/range of ints or a 1-D integer numpy array
StreamLike = Union[int, Any, None]


class SwapOpError(ValueError):
    """Bad arguments to a swap op.  Raised before anything is written.

    ``op``, ``argument`` and ``index`` name the offending op, argument and position
    (``index`` is ``None`` when the problem is not tied to one position, e.g. a bad mode).
    For an error found by the C++ core they are the values the core filled in
    (``fdkv_last_error_fields``); the message repeats them for people.  A bad ``FDKV_*``
    environment value read by the core has the variable's name as ``argument``.
    """

    def __init__(self, message: str, op: str = "", argument: str = "", index: Optional[int] = None):
        super().__init__(message)
        self.op = op
        self.argument = argument
        self.index = index


class OpsNotBuiltError(RuntimeError):
    """The compiled library is missing: the message says which build command makes it."""


# --------------------------------------------------------------------------- helpers
def _stream_handle(stream: StreamLike) -> int:
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


def copy_path_code(path: Union[int, str, None], op: str = "swap") -> int:
    """The C value of a per-call copy path: None or "process" -> -1, "auto" -> 0,
    "kernel" -> 1, "dma" -> 2, "staged" -> 3; an int is passed through for the core to check
    (it accepts -1..3 and names ``path`` otherwise).  Raises :class:`SwapOpError` naming ``path``.
    """
    if path is None:
        return COPY_PATH_PROCESS
    if isinstance(path, str):
        code = COPY_PATHS.get(path.strip().lower())
        if code is not None:
            return code
    elif isinstance(path, numbers.Integral) and not isinstance(path, bool):
        value = int(path)
        if -(1 << 31) <= value < (1 << 31):  # a C int; the core checks the range of values
            return value
    raise SwapOpError(
        f"{op}: path = {path!r} must be None/-1/'process' (the process-wide copy_path option), "
        f"0/'auto', 1/'kernel', 2/'dma' or 3/'staged'",
        op, "path", None,
    )


_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` as a block id is a bug, not block 1)."""
    # NOTE: the exact-int test first: the ABC check costs ~1 us, and an all-layer call checks
    # a few hundred pointers and sizes (host submit time, docs/benchmarks.md).
    return type(value) is int or (isinstance(value, numbers.Integral) and not isinstance(value, bool))


def _ids_error(op: str, name: str) -> Callable[..., SwapOpError]:
    """A maker of the SwapOpError for a bad id list ``name`` of ``op`` (index optional)."""

    def bad(detail: str, index: Optional[int] = None) -> SwapOpError:
        where = f"{name}[{index}]" if index is not None else name
        return SwapOpError(f"{op}: {where} {detail}", op, name, index)

    return bad


def _id_array(ids: IdsLike, op: str, name: str) -> Any:
    """Block ids as a 1-D contiguous int64 numpy array, or :class:`SwapOpError`.

    NOTE: strict on purpose.  ``int(1.7)`` would copy block 1, a 2-D array would be
    flattened into pairs nobody meant, and ``2**63`` wraps to -1 on its way into C: each
    of those used to copy the wrong blocks, so each is refused, with nothing copied.
    Accepted: a list/tuple/range of ints, or a 1-D integer numpy array or Paddle tensor.
    """
    import numpy as np  # numpy is a core dependency; imported here to keep import light

    bad = _ids_error(op, name)
    if isinstance(ids, (str, bytes)) or ids is None or _is_int(ids):
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
    return np.asarray(_checked_values(ids, bad), dtype=np.int64)


def _checked_values(ids: Any, bad: Callable[..., SwapOpError]) -> list[int]:
    """The elements of a Python sequence of ids, each checked to be an int within int64."""
    try:
        values = list(ids)
    except TypeError:
        raise bad(f"must be a 1-D sequence of integer block ids, got {type(ids).__name__}") from None
    # Fast path (C-speed builtins): only Python ints, all within int64.
    if not values or (set(map(type, values)) == {int} and _INT64_MIN <= min(values) and max(values) <= _INT64_MAX):
        return values
    for index, value in enumerate(values):
        if type(value) is not int and not _is_int(value):
            if isinstance(value, (list, tuple)) or getattr(value, "ndim", 0):
                raise bad("must be 1-D: an element is itself a sequence", index)
            raise bad(f"= {value!r} is not an integer", index)
        if not _INT64_MIN <= value <= _INT64_MAX:
            raise bad(f"= {value} does not fit in int64", index)
    return [int(v) for v in values]  # numpy integer scalars among them


def _id_list(ids: IdsLike, op: str, name: str) -> list[int]:
    """Validated ids as a list of Python ints (the Paddle attr type ``std::vector<int64_t>``).

    A list/tuple/range of Python ints skips the numpy round trip (the common case)."""
    if type(ids) in (list, tuple, range):
        return _checked_values(ids, _ids_error(op, name))
    return _id_array(ids, op, name).tolist()


def _int_arg(value: Any, op: str, name: str, bits: int = 64) -> int:
    """A scalar argument as an int, or :class:`SwapOpError` (no truncation of 2.5, no bools,
    nothing that would wrap on its way into a C ``int`` / ``int64_t``)."""
    if _is_int(value):
        v = int(value)
        if -(1 << (bits - 1)) <= v < (1 << (bits - 1)):
            return v
        raise SwapOpError(f"{op}: {name} = {v} does not fit in int{bits}", op, name, None)
    raise SwapOpError(f"{op}: {name} = {value!r} must be an integer", op, name, None)


def _ptr_arg(value: Any, op: str, name: str) -> int:
    """An address: an integer in ``[0, 2**64)`` (a negative one would wrap in ctypes)."""
    if type(value) is int and 0 <= value < (1 << 64):
        return value
    if _is_int(value) and 0 <= int(value) < (1 << 64):
        return int(value)
    raise SwapOpError(f"{op}: {name} = {value!r} is not an address (an integer in [0, 2**64))", op, name, None)


def _check_tensor(tensor: Any, op: str) -> Any:
    """The one cache tensor of a per-layer op (see :func:`_check_tensors`)."""
    is_contiguous = getattr(tensor, "is_contiguous", None)
    if is_contiguous is not None and not is_contiguous():
        raise SwapOpError(
            f"{op}: cache_gpu is not contiguous (a transposed or strided view); the op would write "
            f"a temporary copy, not your tensor: pass a contiguous tensor",
            op, "cache_gpu", None,
        )
    return tensor


def _check_tensors(tensors: Sequence[Any], op: str, name: str) -> list[Any]:
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


# --------------------------------------------------------------------------- C ABI
_ERR_OK, _ERR_INVALID, _ERR_CUDA, _ERR_OTHER, _ERR_NO_MEMORY = 0, 1, 2, 3, 4
_C_INT64_P = ctypes.POINTER(ctypes.c_int64)


def _find_capi(path: Optional[str], variant: Optional[str]) -> Path:
    """Locate the C ABI library: an explicit path, ``$FDKV_OPS_LIB``, then the CUDA build
    before the CPU build, in the installed package's ``_lib/`` and then a checkout's
    ``build/`` (see :mod:`fastdeploy_kvcache.libpaths`)."""
    if variant not in (None, "cuda", "cpu"):
        raise ValueError(f"variant must be None, 'cuda' or 'cpu', got {variant!r}")
    candidates: list[Path] = []
    if path:
        candidates.append(Path(path))
    # A bad FDKV_OPS_LIB (not a file) raises ValueError naming it; a good one wins for
    # every variant (load_capi checks the build is the one asked for).
    env_path = str(envs.get("FDKV_OPS_LIB"))
    if env_path and not path:
        candidates.append(Path(env_path))
    if not path:
        candidates += libpaths.capi_candidates(variant)
    for cand in candidates:
        if cand.is_file():
            return cand
    hint = libpaths.missing_hint("capi_cuda" if variant == "cuda" else "capi_cpu")
    raise OpsNotBuiltError(
        f"C ABI library not found (looked in {', '.join(str(c) for c in candidates)}); {hint}"
    )


def _declare_abi(lib: ctypes.CDLL) -> None:
    """Set argtypes/restype of every exported function (keeps ctypes from truncating)."""
    vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    pp = ctypes.POINTER(ctypes.c_void_p)
    lib.fdkv_last_error.restype = ctypes.c_char_p
    lib.fdkv_last_error.argtypes = []
    lib.fdkv_last_error_fields.restype = i32
    lib.fdkv_last_error_fields.argtypes = [ctypes.POINTER(ctypes.c_char_p), ctypes.POINTER(ctypes.c_char_p), _C_INT64_P]
    lib.fdkv_clear_error.restype = None
    lib.fdkv_clear_error.argtypes = []
    lib.fdkv_parse_env.restype = i32
    lib.fdkv_parse_env.argtypes = [ctypes.c_char_p, ctypes.c_char_p, _C_INT64_P]
    lib.fdkv_is_cuda.restype = i32
    lib.fdkv_is_cuda.argtypes = []
    lib.fdkv_abi_version.restype = i32
    lib.fdkv_abi_version.argtypes = []
    lib.fdkv_host_alloc.restype = i32
    lib.fdkv_host_alloc.argtypes = [ctypes.c_size_t, ctypes.c_uint, pp]
    lib.fdkv_host_free.restype = i32
    lib.fdkv_host_free.argtypes = [vp]
    swap_args = [
        pp, _C_INT64_P, _C_INT64_P, i64,  # dev ptrs, per-tensor dev blocks, block bytes, tensors
        pp, i64,                          # host ptrs (one for layout), host blocks
        _C_INT64_P, i64, _C_INT64_P, i64,  # dev ids, count, host ids, count
        i32, vp, i32, i32,                # mode, stream, sync, path (ABI version 2)
    ]
    for name in ("fdkv_swap_layers", "fdkv_swap_layout"):
        fn = getattr(lib, name)
        fn.restype = i32
        fn.argtypes = [ctypes.c_char_p] + swap_args
    lib.fdkv_swap_layer_groups.restype = i32
    lib.fdkv_swap_layer_groups.argtypes = [
        ctypes.c_char_p, pp, _C_INT64_P, _C_INT64_P, i64,  # op, dev ptrs, dev blocks, block bytes, tensors
        pp, i64, i64,                                      # host ptrs, host blocks, group size
        _C_INT64_P, i64, _C_INT64_P, i64,                  # dev ids, count, host ids, count
        i32, vp, pp, i64, vp, i32, i32,                    # mode, stream, events, count, progress, sync, path
    ]
    lib.fdkv_progress_create.restype = i32
    lib.fdkv_progress_create.argtypes = [pp]
    lib.fdkv_progress_destroy.restype = i32
    lib.fdkv_progress_destroy.argtypes = [vp]
    lib.fdkv_progress_wait.restype = i32
    lib.fdkv_progress_wait.argtypes = [vp, i64, i64, _C_INT64_P]
    i32p = ctypes.POINTER(ctypes.c_int)
    lib.fdkv_progress_wait_closed.restype = i32
    lib.fdkv_progress_wait_closed.argtypes = [vp, i64, i32p]
    lib.fdkv_progress_state.restype = i32
    lib.fdkv_progress_state.argtypes = [vp, _C_INT64_P, i32p, i32p, i32p, _C_INT64_P]
    lib.fdkv_progress_error.restype = ctypes.c_char_p
    lib.fdkv_progress_error.argtypes = [vp]
    lib.fdkv_progress_abandon.restype = i32
    lib.fdkv_progress_abandon.argtypes = [vp, ctypes.c_char_p]
    lib.fdkv_launcher_create.restype = i32
    lib.fdkv_launcher_create.argtypes = [pp]
    lib.fdkv_launcher_destroy.restype = i32
    lib.fdkv_launcher_destroy.argtypes = [vp]
    lib.fdkv_launcher_wait_idle.restype = i32
    lib.fdkv_launcher_wait_idle.argtypes = [vp, i64, i32p]
    lib.fdkv_launch_layer_groups.restype = i32
    lib.fdkv_launch_layer_groups.argtypes = [
        vp, ctypes.c_char_p, pp, _C_INT64_P, _C_INT64_P, i64,  # launcher, op, dev ptrs, dev blocks, block bytes, tensors
        pp, i64, i64,                                          # host ptrs, host blocks, group size
        _C_INT64_P, i64, _C_INT64_P, i64,                      # dev ids, count, host ids, count
        i32, vp, pp, i64, vp,                                  # mode, stream, events, count, progress
        pp, i64, vp, vp, i32, i64,                             # waits, count, start, done event, path, inline groups
    ]
    lib.fdkv_set_option.restype = i32
    lib.fdkv_set_option.argtypes = [ctypes.c_char_p, i64]
    lib.fdkv_get_option.restype = i32
    lib.fdkv_get_option.argtypes = [ctypes.c_char_p, _C_INT64_P]
    lib.fdkv_read_files.restype = i32
    lib.fdkv_read_files.argtypes = [ctypes.POINTER(ctypes.c_char_p), i64, pp, _C_INT64_P, vp, i64, _C_INT64_P]
    lib.fdkv_last_path.restype = i32
    lib.fdkv_last_path.argtypes = []
    lib.fdkv_stream_synchronize.restype = i32
    lib.fdkv_stream_synchronize.argtypes = [vp]


class CApi:
    """ctypes wrapper of ``libfdkv_capi.so`` (or of the Paddle extension, which exports
    the same ABI).  Pointers are Python ints; ids are sequences or int64 numpy arrays.

    With the CPU build (``is_cuda`` False) "device" pointers are ordinary host memory, so
    the whole ABI can be exercised with numpy arrays.
    """

    def __init__(self, lib: ctypes.CDLL, path: str):
        self._lib = lib
        self.path = path
        # NOTE: a library built from older sources would silently ignore the trailing `path`
        # argument of the swaps (ctypes passes it, the C function never reads it): refuse it.
        version = int(lib.fdkv_abi_version()) if hasattr(lib, "fdkv_abi_version") else 1
        if version < _ABI_VERSION:
            raise OpsNotBuiltError(
                f"{path} has C ABI version {version}, this package needs {_ABI_VERSION} "
                f"(error fields, recorded host sizes, read_files, layer groups, launched stacks); rebuild it: {_BUILD_HINT}"
            )
        _declare_abi(lib)
        self.is_cuda: bool = bool(lib.fdkv_is_cuda())

    # ---------------------------------------------------------------- errors
    def last_error(self) -> tuple[int, str, str, str, Optional[int]]:
        """The calling thread's last status: ``(code, message, op, argument, index)``.

        ``op`` / ``argument`` / ``index`` are the values the core filled in for an invalid
        argument (``index`` None when not tied to a position); the Paddle ops of the same
        library report through this too.
        """
        op, arg, index = ctypes.c_char_p(), ctypes.c_char_p(), ctypes.c_int64(-1)
        code = int(self._lib.fdkv_last_error_fields(ctypes.byref(op), ctypes.byref(arg), ctypes.byref(index)))
        message = (self._lib.fdkv_last_error() or b"").decode("utf-8", "replace")
        return (code, message, (op.value or b"").decode("utf-8", "replace"),
                (arg.value or b"").decode("utf-8", "replace"), index.value if index.value >= 0 else None)

    def clear_error(self) -> None:
        """Reset the calling thread's last status (done before each Paddle op)."""
        self._lib.fdkv_clear_error()

    def error_from_last(self) -> Optional[Exception]:
        """The exception for the calling thread's last failure; None if it succeeded."""
        code, message, op, arg, index = self.last_error()
        if code == _ERR_OK:
            return None
        if code == _ERR_INVALID:
            return SwapOpError(message, op, arg, index)
        if code == _ERR_NO_MEMORY:
            return MemoryError(message)
        return RuntimeError(message or "fdkv: unknown error")

    def _check(self, rc: int) -> None:
        if rc == _ERR_OK:
            return
        raise self.error_from_last() or RuntimeError(f"fdkv: status {rc} without an error message")

    def parse_env(self, name: str, raw: str) -> int:
        """Parse ``raw`` as the value of the FDKV_* variable ``name`` by the library's own
        rule (the one it applies to its environment); :class:`SwapOpError` naming ``name``
        if bad.  Copy path names come back as their COPY_PATH_* values."""
        out = ctypes.c_int64()
        self._check(self._lib.fdkv_parse_env(name.encode(), raw.encode("utf-8", "surrogateescape"),
                                             ctypes.byref(out)))
        return int(out.value)

    # ---------------------------------------------------------------- pinned memory
    def host_alloc(self, nbytes: int, flags: int = 0) -> int:
        """Pinned host memory (``cudaHostAlloc``), or 4 KiB-aligned memory without CUDA.

        The library records the size, so a swap given ``num_host_blocks=-1`` (or the
        Paddle layout op's default ``max_block_num_cpu=-1``) bounds host ids by it.
        """
        if not _is_int(nbytes) or not 0 < int(nbytes) < (1 << 64):
            raise SwapOpError(f"cuda_host_alloc: nbytes = {nbytes!r} must be an integer > 0",
                              "cuda_host_alloc", "nbytes", None)
        flags = _int_arg(flags, "cuda_host_alloc", "flags", 33)
        if flags < 0:
            raise SwapOpError(f"cuda_host_alloc: flags = {flags} must be >= 0", "cuda_host_alloc", "flags", None)
        out = ctypes.c_void_p()
        self._check(self._lib.fdkv_host_alloc(int(nbytes), flags, ctypes.byref(out)))
        return int(out.value or 0)

    def host_free(self, ptr: int) -> None:
        """Free memory from :meth:`host_alloc` (0 is a no-op; any other pointer this library
        did not hand out, or one already freed, is a :class:`SwapOpError`)."""
        ptr = _ptr_arg(ptr, "cuda_host_free", "ptr")
        self._check(self._lib.fdkv_host_free(ctypes.c_void_p(ptr)))

    # ---------------------------------------------------------------- options
    def set_option(self, name: str, value: int) -> None:
        """Set a process-wide copy option of this library (defaults come from the FDKV_*
        environment variables, see envs.py): ``copy_grid`` (kernel CTAs), ``copy_path``
        (0 auto, 1 kernel, 2 dma), ``dma_min_bytes``, ``merge_min_bytes``,
        ``dma_slice_bytes``, ``copy_kernel`` (0-3), ``kernel_tables`` (0/1).

        Staged path: ``staging_bytes``, ``staging_chunk_bytes``, ``staging_grid``,
        ``staged_min_bytes``, ``staging_mode``; DMA rows: ``dma_rows_min_lanes``,
        ``rows_d2h_min_bytes``; layer stacks: ``staged_stack_from_group``,
        ``stack_span_min_bytes`` (docs/ops.md, "Layer groups") and, for tests,
        ``stack_fail_group``.

        Meant for benchmarks and tests; an engine sets the environment instead.
        """
        value = _int_arg(value, "set_option", "value")  # ctypes would wrap 2**70 to 0
        self._check(self._lib.fdkv_set_option(name.encode(), value))

    def set_options(self, assignments: Sequence[str]) -> None:
        """:meth:`set_option` for each ``"name=value"`` string (the benchmarks' ``--option``
        flags); a malformed one raises SwapOpError naming it before any is set."""
        parsed = []
        for text in assignments:
            name, sep, value = str(text).partition("=")
            try:
                parsed.append((name.strip(), int(value.strip(), 0)))
            except ValueError:
                sep = ""
            if not sep or not name.strip():
                raise SwapOpError(f"set_option: {text!r} is not NAME=INTEGER", "set_option", "assignments", None)
        for name, value in parsed:
            self.set_option(name, value)

    def get_option(self, name: str) -> int:
        out = ctypes.c_int64()
        self._check(self._lib.fdkv_get_option(name.encode(), ctypes.byref(out)))
        return int(out.value)

    def read_files(self, paths: Sequence[bytes], dsts: Sequence[int], sizes: Sequence[int],
                   header_bytes: int) -> tuple[bytearray, list[int]]:
        """Read file i's header into the returned buffer and its payload into ``dsts[i]``.

        One call for the batch, with the GIL released (the file backend's prefetch read).
        Returns ``(headers, got)``: ``headers[i * header_bytes:]`` holds file i's first
        bytes, ``got[i]`` the bytes read (``header_bytes + sizes[i] + 1``: the file is longer
        than both) or ``-errno``.  Nothing is verified here.
        """
        n = len(paths)
        if len(dsts) != n or len(sizes) != n:
            raise SwapOpError(f"read_files: {n} paths, {len(dsts)} dsts, {len(sizes)} sizes; need equal",
                              "read_files", "dsts", None)
        c_paths = (ctypes.c_char_p * max(n, 1))(*paths)
        c_dsts = (ctypes.c_void_p * max(n, 1))(*dsts)
        c_sizes = (ctypes.c_int64 * max(n, 1))(*sizes)
        got = (ctypes.c_int64 * max(n, 1))()
        headers = bytearray(max(n * header_bytes, 1))
        hbuf = (ctypes.c_char * len(headers)).from_buffer(headers)
        self._check(self._lib.fdkv_read_files(c_paths, n, c_dsts, c_sizes, ctypes.addressof(hbuf), header_bytes, got))
        del hbuf  # release the export so the bytearray stays resizable for the caller
        return headers, list(got[:n])

    def last_path(self) -> int:
        """Bit mask (PATH_*) of the copy paths the calling thread's last swap used."""
        return int(self._lib.fdkv_last_path())

    def stream_synchronize(self, stream: StreamLike = 0) -> None:
        self._check(self._lib.fdkv_stream_synchronize(ctypes.c_void_p(_stream_handle(stream))))

    # ---------------------------------------------------------------- swaps
    @staticmethod
    def _ids(ids: IdsLike, op: str, name: str) -> tuple[Any, Any, int]:
        arr = _id_array(ids, op, name)
        return arr, arr.ctypes.data_as(_C_INT64_P), int(arr.size)

    @staticmethod
    def _per_tensor(value: Union[int, Sequence[int]], count: int, op: str, name: str) -> Any:
        if _is_int(value):
            values = [_int_arg(value, op, name)] * count
        else:
            values = [_int_arg(v, op, name) for v in value]
            if len(values) != count:
                raise SwapOpError(
                    f"{op}: {name} has {len(values)} entries but there are {count} tensors", op, name, None
                )
        return (ctypes.c_int64 * max(count, 1))(*values)

    def _swap(
        self,
        entry: str,
        op: str,
        dev_ptrs: Union[Sequence[int], "TensorTable"],
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        host_ptrs: Optional[Sequence[int]],
        num_host_blocks: int,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        mode: int,
        stream: StreamLike,
        sync: bool,
        path: Union[int, str, None] = None,
    ) -> None:
        a = self._swap_args(op, dev_ptrs, num_dev_blocks, block_bytes, host_ptrs, num_host_blocks, dev_ids, host_ids,
                            mode, path, host_per_tensor=entry != "fdkv_swap_layout")
        rc = getattr(self._lib, entry)(
            op.encode(), a.dev_ptrs, a.num_blocks, a.block_bytes, a.count, a.host_ptrs, a.num_host_blocks,
            a.dev_ids, a.num_dev_ids, a.host_ids, a.num_host_ids, a.mode,
            ctypes.c_void_p(_stream_handle(stream)), 1 if sync else 0, a.path,
        )
        self._check(rc)

    def _swap_args(
        self,
        op: str,
        dev_ptrs: Union[Sequence[int], "TensorTable"],
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        host_ptrs: Optional[Sequence[int]],
        num_host_blocks: int,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        mode: int,
        path: Union[int, str, None],
        host_per_tensor: bool = True,
    ) -> "_SwapArgs":
        """The C arguments every swap entry shares, checked and converted once.
        ``host_per_tensor``: one host pointer per tensor (every entry but the layout op's)."""
        t = self._table_args(op, dev_ptrs, num_dev_blocks, block_bytes, host_ptrs, num_host_blocks, mode, path,
                             host_per_tensor)
        d_keep, d_ptr, d_n = self._ids(dev_ids, op, "dev_ids")
        h_keep, h_ptr, h_n = self._ids(host_ids, op, "host_ids")
        return _SwapArgs(t.dev_ptrs, t.num_blocks, t.block_bytes, t.count, t.host_ptrs, t.num_host_blocks, d_ptr,
                         d_n, h_ptr, h_n, t.mode, t.path, (d_keep, h_keep))

    def _table_args(
        self,
        op: str,
        dev_ptrs: Union[Sequence[int], "TensorTable"],
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        host_ptrs: Optional[Sequence[int]],
        num_host_blocks: int,
        mode: int,
        path: Union[int, str, None],
        host_per_tensor: bool = True,
    ) -> "_TableArgs":
        """The id-independent part of :meth:`_swap_args` (what a :class:`LayerStackCall` keeps)."""
        code = copy_path_code(path, op)
        if host_per_tensor and host_ptrs is not None and len(host_ptrs) != len(dev_ptrs):
            raise SwapOpError(
                f"{op}: host_ptrs has {len(host_ptrs)} entries but dev_ptrs has {len(dev_ptrs)}", op, "host_ptrs", None,
            )
        if isinstance(dev_ptrs, TensorTable):
            # Converted and checked when the table was made (the caller's layout is fixed).
            count, dev_p, nblk, bbytes = dev_ptrs.count, dev_ptrs.dev_ptrs, dev_ptrs.num_blocks, dev_ptrs.block_bytes
        else:
            count = len(dev_ptrs)
            dev_p = ctypes.cast((ctypes.c_void_p * max(count, 1))(*[_ptr_arg(p, op, "dev_ptrs") for p in dev_ptrs]),
                                ctypes.POINTER(ctypes.c_void_p))
            nblk = self._per_tensor(num_dev_blocks, count, op, "num_dev_blocks")
            bbytes = self._per_tensor(block_bytes, count, op, "block_bytes")
        if host_ptrs is None:
            if not isinstance(dev_ptrs, TensorTable) or dev_ptrs.host_ptrs is None:
                raise SwapOpError(f"{op}: host_ptrs is None, and dev_ptrs is not a TensorTable made with host_ptrs",
                                  op, "host_ptrs", None)
            host_p = dev_ptrs.host_ptrs
        else:
            host_p = ctypes.cast(
                (ctypes.c_void_p * max(len(host_ptrs), 1))(*[_ptr_arg(p, op, "host_ptrs") for p in host_ptrs]),
                ctypes.POINTER(ctypes.c_void_p))
        return _TableArgs(dev_p, nblk, bbytes, count, host_p, _int_arg(num_host_blocks, op, "num_host_blocks"),
                          _int_arg(mode, op, "mode", 32), code)

    def group_progress(self) -> "GroupProgress":
        """A progress object for one :meth:`swap_layer_groups` or :meth:`launch_layer_groups` call."""
        return GroupProgress(self)

    def swap_layer_groups(
        self,
        dev_ptrs: Union[Sequence[int], "TensorTable"],
        host_ptrs: Optional[Sequence[int]],
        group_size: int,
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        num_host_blocks: int,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        mode: int,
        stream: StreamLike = 0,
        events: Optional[Sequence[int]] = None,
        sync: bool = False,
        path: Union[int, str, None] = None,
        progress: Optional["GroupProgress"] = None,
    ) -> None:
        """Layer-by-layer copies in one call: tensors ``[g * group_size, (g + 1) * group_size)``
        are group (layer) g, every tensor moves the same ids, and ``events[g]`` (a
        ``cudaEvent_t`` handle as an int, e.g. ``cupy.cuda.Event().ptr``; 0 for none) is
        recorded on ``stream`` right after group g's copies.

        Why: a layer-by-layer load issued from Python pays ctypes, argument checks and the
        GIL once per layer; a loader thread that shares the GIL with the forward pass's
        launches falls behind the link (docs/ops.md, "Layer groups").  Here the GIL is
        released once for the whole stack.  Everything is checked before the first copy; a
        CUDA failure in group g names it (earlier groups stay enqueued, later ones are not).
        The CPU build takes no events (pass None).  ``progress`` (from :meth:`group_progress`)
        lets another thread wait until group g's event is recorded before it waits on it.
        """
        op = "swap_layer_groups"
        group_size = _int_arg(group_size, op, "group_size")
        a = self._swap_args(op, dev_ptrs, num_dev_blocks, block_bytes, host_ptrs, num_host_blocks, dev_ids, host_ids,
                            mode, path)
        ev_arr, ev_n = self._handles(events, op, "events")
        rc = self._lib.fdkv_swap_layer_groups(
            op.encode(), a.dev_ptrs, a.num_blocks, a.block_bytes, a.count, a.host_ptrs, a.num_host_blocks, group_size,
            a.dev_ids, a.num_dev_ids, a.host_ids, a.num_host_ids, a.mode, ctypes.c_void_p(_stream_handle(stream)),
            ev_arr, ev_n, None if progress is None else progress.handle, 1 if sync else 0, a.path,
        )
        self._check(rc)

    def stack_launcher(self) -> "StackLauncher":
        """A launcher thread for :meth:`launch_layer_groups` (one per stream user)."""
        return StackLauncher(self)

    def launch_layer_groups(
        self,
        launcher: Optional["StackLauncher"],
        dev_ptrs: Union[Sequence[int], "TensorTable"],
        host_ptrs: Optional[Sequence[int]],
        group_size: int,
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        num_host_blocks: int,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        mode: int,
        progress: "GroupProgress",
        stream: StreamLike = 0,
        events: Union[None, Sequence[int], "HandleArray"] = None,
        waits: Union[Sequence[int], "HandleArray"] = (),
        start_event: int = 0,
        done_event: int = 0,
        path: Union[int, str, None] = None,
        inline_groups: int = 1,
    ) -> None:
        """:meth:`swap_layer_groups` without waiting for its copies to be enqueued.

        Everything is checked here (a bad argument raises and fails ``progress``; nothing is
        enqueued).  Then, in launch order on ``stream``: a wait on each event of ``waits``,
        ``start_event``, the groups with ``events[g]``, ``done_event`` (``cudaEvent_t``
        handles as ints, or a :class:`HandleArray` of them; 0 for none).  With an idle
        ``launcher`` this thread enqueues the fences and the first ``inline_groups`` groups
        itself, the launcher's thread the rest; a busy launcher queues the whole stack behind
        the ones it holds; ``launcher`` None enqueues everything here.  ``progress`` advances
        per group and is closed (:meth:`GroupProgress.wait_closed`) once ``done_event`` is
        recorded; a CUDA failure fails it (:meth:`GroupProgress.error` names the group) and
        still records ``done_event``.  Ids and handles are copied before this returns; the
        events themselves must live until ``progress`` is closed (the launcher may enqueue a
        wait or a record later).

        Why: a load's first copy waited for a Python launcher thread (its wake-up, the GIL
        it shares with the forward pass, the argument conversion): 0.5-0.9 ms on an H100
        host, where the copy itself took 0.3 (docs/benchmarks.md, "Load startup").
        """
        return self.layer_stack_call(launcher, dev_ptrs, host_ptrs, group_size, num_dev_blocks, block_bytes,
                                     num_host_blocks, mode, stream, path, inline_groups).launch(
            dev_ids, host_ids, progress, events, waits, start_event, done_event)

    def layer_stack_call(
        self,
        launcher: Optional["StackLauncher"],
        dev_ptrs: Union[Sequence[int], "TensorTable"],
        host_ptrs: Optional[Sequence[int]],
        group_size: int,
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        num_host_blocks: int,
        mode: int,
        stream: StreamLike = 0,
        path: Union[int, str, None] = None,
        inline_groups: int = 1,
    ) -> "LayerStackCall":
        """The arguments of :meth:`launch_layer_groups` that stay the same from one load to
        the next, checked and converted once; :meth:`LayerStackCall.launch` takes the rest.

        Why: a load's start-up is host time before its first copy, and on a GPU host the
        Python conversions of one launch cost ~100 us there (docs/benchmarks.md, "Sixth
        pass"); a worker launches every load with the same tensors, stream and launcher.
        """
        return LayerStackCall(self, launcher, dev_ptrs, host_ptrs, group_size, num_dev_blocks, block_bytes,
                              num_host_blocks, mode, stream, path, inline_groups)

    @staticmethod
    def _handles(handles: Union[None, Sequence[int], "HandleArray"], op: str, name: str) -> tuple[Any, int]:
        """A C array of handles (``void**``) and its length; (None, 0) for None."""
        if handles is None:
            return None, 0
        if type(handles) is not HandleArray:
            handles = HandleArray(handles, op, name)  # the cast pointer keeps its array alive
        return handles.pointer, handles.count

    def swap_per_layer(
        self,
        dev_ptr: int,
        num_dev_blocks: int,
        block_bytes: int,
        host_ptr: int,
        num_host_blocks: int,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        mode: int,
        stream: StreamLike = 0,
        sync: bool = False,
        path: Union[int, str, None] = None,
    ) -> None:
        """Copy blocks of one cache tensor: ``dev[dev_ids[i]] <-> host[host_ids[i]]``.

        ``num_host_blocks`` bounds ``host_ids``; -1 takes it from the size
        :meth:`host_alloc` recorded for ``host_ptr`` (other memory needs the count).
        ``mode`` 0 copies device to host, 1 host to device.  Asynchronous on ``stream``
        unless ``sync``.  ``path`` picks this call's copy path (None: the process-wide
        ``copy_path`` option; "auto", "kernel", "dma" or the COPY_PATH_* ints); the CPU
        build checks it and ignores it.
        """
        self._swap("fdkv_swap_layers", "swap_per_layer", [dev_ptr], num_dev_blocks, block_bytes,
                   [host_ptr], num_host_blocks, dev_ids, host_ids, mode, stream, sync, path)

    def swap_all_layers(
        self,
        dev_ptrs: Union[Sequence[int], "TensorTable"],
        host_ptrs: Optional[Sequence[int]],
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        num_host_blocks: int,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        mode: int,
        stream: StreamLike = 0,
        sync: bool = False,
        path: Union[int, str, None] = None,
    ) -> None:
        """Copy the same block ids of many cache tensors in one launch.

        ``host_ptrs[t]`` is tensor t's host cache (``num_host_blocks`` blocks of
        ``block_bytes[t]``).  ``block_bytes`` / ``num_dev_blocks`` may be one int or one
        per tensor, so K/V caches and their scale caches can go in one call.  ``path``: as
        in :meth:`swap_per_layer`.
        """
        self._swap("fdkv_swap_layers", "swap_all_layers", dev_ptrs, num_dev_blocks, block_bytes,
                   host_ptrs, num_host_blocks, dev_ids, host_ids, mode, stream, sync, path)

    def swap_layout(
        self,
        dev_ptrs: Sequence[int],
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        host_ptr: int,
        num_host_blocks: int,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        mode: int,
        stream: StreamLike = 0,
        sync: bool = False,
        path: Union[int, str, None] = None,
    ) -> None:
        """Gather (mode 0) device blocks into, or scatter (mode 1) from, a block-major host
        buffer ``[host_block][tensor][block_bytes[tensor]]``: one contiguous object per block.
        Pass tensors in ``[layer][k, v]`` order to get the ``[block][layer][k|v][...]`` layout.
        ``path``: as in :meth:`swap_per_layer` (the layout op never merges runs).
        """
        self._swap("fdkv_swap_layout", "swap_layout", dev_ptrs, num_dev_blocks, block_bytes,
                   [host_ptr], num_host_blocks, dev_ids, host_ids, mode, stream, sync, path)


class _SwapArgs(NamedTuple):
    """A swap's C arguments (``CApi._swap_args``), by name; ``keep`` holds the id buffers
    alive until the call returns."""

    dev_ptrs: Any
    num_blocks: Any
    block_bytes: Any
    count: int
    host_ptrs: Any
    num_host_blocks: int
    dev_ids: Any
    num_dev_ids: int
    host_ids: Any
    num_host_ids: int
    mode: int
    path: int
    keep: tuple[Any, Any]


class _TableArgs(NamedTuple):
    """A swap's id-independent C arguments (``CApi._table_args``)."""

    dev_ptrs: Any
    num_blocks: Any
    block_bytes: Any
    count: int
    host_ptrs: Any
    num_host_blocks: int
    mode: int
    path: int


class HandleArray:
    """Handles (``cudaEvent_t`` as ints) converted once into the C array (``void**``) that
    :meth:`CApi.launch_layer_groups` takes as ``events`` or ``waits``.

    Why: a worker passes the same set of layer events with many loads (it reuses them), and
    converting 48 handles per load was a measurable part of a load's start-up.
    """

    __slots__ = ("pointer", "count", "_array")

    def __init__(self, handles: Sequence[int], op: str = "handle_array", name: str = "handles") -> None:
        values = [_ptr_arg(h, op, name) for h in handles]
        self._array = (ctypes.c_void_p * max(len(values), 1))(*values)
        self.pointer = ctypes.cast(self._array, ctypes.POINTER(ctypes.c_void_p))
        self.count = len(values)

    def __len__(self) -> int:
        return self.count


class LayerStackCall:
    """:meth:`CApi.launch_layer_groups` with its load-independent arguments bound
    (:meth:`CApi.layer_stack_call`): each :meth:`launch` converts only the ids, the events
    and the progress."""

    _OP = "launch_layer_groups"
    _OP_NAME = _OP.encode()

    def __init__(
        self,
        capi: "CApi",
        launcher: Optional["StackLauncher"],
        dev_ptrs: Union[Sequence[int], "TensorTable"],
        host_ptrs: Optional[Sequence[int]],
        group_size: int,
        num_dev_blocks: Union[int, Sequence[int]],
        block_bytes: Union[int, Sequence[int]],
        num_host_blocks: int,
        mode: int,
        stream: StreamLike,
        path: Union[int, str, None],
        inline_groups: int,
    ) -> None:
        op = self._OP
        self._capi = capi
        self._group_size = _int_arg(group_size, op, "group_size")
        self._inline_groups = _int_arg(inline_groups, op, "inline_groups")
        if launcher is not None and (not isinstance(launcher, StackLauncher) or launcher.handle is None):
            raise SwapOpError(f"{op}: launcher must be None or an open StackLauncher, got {launcher!r}",
                              op, "launcher", None)
        self._launcher = launcher
        self._table = capi._table_args(op, dev_ptrs, num_dev_blocks, block_bytes, host_ptrs, num_host_blocks, mode,
                                       path)
        self._stream = ctypes.c_void_p(_stream_handle(stream))

    def launch(
        self,
        dev_ids: IdsLike,
        host_ids: IdsLike,
        progress: "GroupProgress",
        events: Union[None, Sequence[int], HandleArray] = None,
        waits: Union[Sequence[int], HandleArray] = (),
        start_event: int = 0,
        done_event: int = 0,
    ) -> None:
        """Launch one stack (see :meth:`CApi.launch_layer_groups` for what it enqueues)."""
        op, capi, t = self._OP, self._capi, self._table
        if not isinstance(progress, GroupProgress) or progress.handle is None:
            raise SwapOpError(f"{op}: progress must be an open GroupProgress (capi.group_progress()), got {progress!r}",
                              op, "progress", None)
        launcher = None
        if self._launcher is not None:
            launcher = self._launcher.handle
            if launcher is None:
                raise SwapOpError(f"{op}: the launcher is closed", op, "launcher", None)
        d_keep, d_ptr, d_n = capi._ids(dev_ids, op, "dev_ids")
        h_keep, h_ptr, h_n = capi._ids(host_ids, op, "host_ids")
        ev_arr, ev_n = capi._handles(events, op, "events")
        wait_arr, wait_n = capi._handles(waits, op, "waits")
        rc = capi._lib.fdkv_launch_layer_groups(
            launcher, self._OP_NAME, t.dev_ptrs, t.num_blocks, t.block_bytes, t.count, t.host_ptrs,
            t.num_host_blocks, self._group_size, d_ptr, d_n, h_ptr, h_n, t.mode, self._stream, ev_arr, ev_n,
            progress.handle, wait_arr, wait_n, _ptr_arg(start_event, op, "start_event"),
            _ptr_arg(done_event, op, "done_event"), t.path, self._inline_groups,
        )
        capi._check(rc)  # (d_keep and h_keep held the id buffers through the call)


class TensorTable:
    """Cache tensors' device addresses, block counts and block sizes as the C arrays a swap
    passes, checked and converted once.  Pass it as ``dev_ptrs`` of
    :meth:`CApi.swap_all_layers` / :meth:`CApi.swap_layer_groups` (their ``num_dev_blocks``
    and ``block_bytes`` are then ignored; with ``host_ptrs`` in the table, pass
    ``host_ptrs=None`` to the swap).

    Why: a worker's layout is fixed, and converting ~100 addresses and sizes on every
    all-layer call cost more host time (with the GIL held) than the native submit itself.
    The caller keeps the tensors alive for as long as it uses the table.
    """

    def __init__(self, dev_ptrs: Sequence[int], num_dev_blocks: Union[int, Sequence[int]],
                 block_bytes: Union[int, Sequence[int]], host_ptrs: Optional[Sequence[int]] = None,
                 op: str = "tensor_table") -> None:
        self.count = len(dev_ptrs)
        self._dev = (ctypes.c_void_p * max(self.count, 1))(*[_ptr_arg(p, op, "dev_ptrs") for p in dev_ptrs])
        self.dev_ptrs = ctypes.cast(self._dev, ctypes.POINTER(ctypes.c_void_p))
        self.num_blocks = CApi._per_tensor(num_dev_blocks, self.count, op, "num_dev_blocks")
        self.block_bytes = CApi._per_tensor(block_bytes, self.count, op, "block_bytes")
        # Optional: the tensors' host buffers too.  A swap given host_ptrs=None uses them.
        self.host_ptrs: Optional[Any] = None
        if host_ptrs is not None:
            if len(host_ptrs) != self.count:
                raise SwapOpError(f"{op}: host_ptrs has {len(host_ptrs)} entries but dev_ptrs has {self.count}", op,
                                  "host_ptrs", None)
            self._host = (ctypes.c_void_p * max(self.count, 1))(*[_ptr_arg(p, op, "host_ptrs") for p in host_ptrs])
            self.host_ptrs = ctypes.cast(self._host, ctypes.POINTER(ctypes.c_void_p))

    def __len__(self) -> int:
        return self.count


class GroupProgress:
    """How many groups of one :meth:`CApi.swap_layer_groups` or :meth:`CApi.launch_layer_groups`
    call are enqueued (their copies and event), for a thread that must wait on group g's
    event only once it is recorded; whether the call is closed, and how it failed.

    Waits release the GIL (a ctypes call), so a launcher thread issuing the stack and a
    forward pass waiting layer by layer never contend for it.  One object per call.
    """

    def __init__(self, capi: "CApi") -> None:
        self._capi = capi
        out = ctypes.c_void_p()
        capi._check(capi._lib.fdkv_progress_create(ctypes.byref(out)))
        self.handle: Optional[int] = out.value

    def wait(self, at_least: int, timeout_s: float) -> int:
        """Groups enqueued once ``at_least`` are (or the timeout passed); -1 if the call failed."""
        if self.handle is None:
            raise ValueError("GroupProgress.wait: the progress object is closed")
        done = ctypes.c_int64(0)
        self._capi._check(self._capi._lib.fdkv_progress_wait(
            self.handle, int(at_least), max(0, int(timeout_s * 1e6)), ctypes.byref(done)))
        return int(done.value)

    def _open_handle(self, what: str) -> int:
        if self.handle is None:
            raise ValueError(f"GroupProgress.{what}: the progress object is closed")
        return self.handle

    def wait_closed(self, timeout_s: float) -> bool:
        """Whether every stream operation of the call is enqueued (or it failed and nothing
        more will be), waiting up to ``timeout_s`` for it."""
        closed = ctypes.c_int(0)
        self._capi._check(self._capi._lib.fdkv_progress_wait_closed(
            self._open_handle("wait_closed"), max(0, int(timeout_s * 1e6)), ctypes.byref(closed)))
        return bool(closed.value)

    def is_closed(self) -> bool:
        return self.state().closed

    def state(self) -> "ProgressState":
        """A snapshot: groups done, failed, closed, the ``PATH_*`` bits used, the failed group."""
        done, failed, closed, paths, group = (ctypes.c_int64(0), ctypes.c_int(0), ctypes.c_int(0), ctypes.c_int(0),
                                              ctypes.c_int64(-1))
        self._capi._check(self._capi._lib.fdkv_progress_state(
            self._open_handle("state"), ctypes.byref(done), ctypes.byref(failed), ctypes.byref(closed),
            ctypes.byref(paths), ctypes.byref(group)))
        return ProgressState(int(done.value), bool(failed.value), bool(closed.value), int(paths.value),
                             int(group.value))

    def error(self) -> str:
        """The call's failure message ("" if it has not failed)."""
        return (self._capi._lib.fdkv_progress_error(self._open_handle("error")) or b"").decode("utf-8", "replace")

    def abandon(self, error: str) -> None:
        """Fail and close the progress of a call that will not be launched (no-op once closed)."""
        self._capi._check(self._capi._lib.fdkv_progress_abandon(self._open_handle("abandon"), error.encode()))

    def close(self) -> None:
        if self.handle is not None:
            self._capi._lib.fdkv_progress_destroy(self.handle)
            self.handle = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


class ProgressState(NamedTuple):
    """:meth:`GroupProgress.state`: groups enqueued, whether the call failed (at
    ``failed_group``, -1 before any group), whether it is closed, and its ``PATH_*`` bits."""

    done: int
    failed: bool
    closed: bool
    paths: int
    failed_group: int


class StackLauncher:
    """The C library's launcher thread of :meth:`CApi.launch_layer_groups`: it enqueues the
    stacks launched through it in launch order.  :meth:`close` enqueues what is still
    queued, then stops the thread."""

    def __init__(self, capi: "CApi") -> None:
        self._capi = capi
        out = ctypes.c_void_p()
        capi._check(capi._lib.fdkv_launcher_create(ctypes.byref(out)))
        self.handle: Optional[int] = out.value

    def wait_idle(self, timeout_s: float) -> bool:
        """Whether every stack launched so far is wholly enqueued, waiting up to ``timeout_s``."""
        if self.handle is None:
            return True
        idle = ctypes.c_int(0)
        self._capi._check(self._capi._lib.fdkv_launcher_wait_idle(self.handle, max(0, int(timeout_s * 1e6)),
                                                                 ctypes.byref(idle)))
        return bool(idle.value)

    def close(self) -> None:
        if self.handle is not None:
            handle, self.handle = self.handle, None
            self._capi._check(self._capi._lib.fdkv_launcher_destroy(handle))

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


_capi_lock = threading.Lock()
_capi_cache: dict[str, CApi] = {}


def load_capi(path: Optional[str] = None, variant: Optional[str] = None) -> CApi:
    """Load (once per path) the C ABI library and return its wrapper.

    ``variant`` picks a build: ``"cuda"`` (``build/libfdkv_capi.so``, real device
    memory), ``"cpu"`` (``build/libfdkv_capi_cpu.so``, host memory stands in for the
    device), or None: ``path``, then ``$FDKV_OPS_LIB``, then CUDA before CPU.  Raises
    :class:`OpsNotBuiltError` if nothing is found, or if ``path`` / ``$FDKV_OPS_LIB``
    names a build other than ``variant``; ValueError if ``$FDKV_OPS_LIB`` is not a file.
    """
    lib_path = str(_find_capi(path, variant).resolve())
    with _capi_lock:
        api = _capi_cache.get(lib_path)
        if api is None:
            api = CApi(ctypes.CDLL(lib_path), lib_path)
            logger.debug("loaded C ABI %s (cuda=%s)", lib_path, api.is_cuda)
            _capi_cache[lib_path] = api
    if variant is not None and api.is_cuda != (variant == "cuda"):
        source = "path" if path else "FDKV_OPS_LIB"
        raise OpsNotBuiltError(
            f"{lib_path} ({source}) is the {'CUDA' if api.is_cuda else 'CPU'} build of the C ABI, "
            f"but the {variant} build was asked for"
        )
    return api


# --------------------------------------------------------------------------- Paddle ops
_paddle_lock = threading.Lock()
_paddle_state: dict[str, Any] = {}


def _paddle_so_path() -> Path:
    """The Paddle ops library: the installed package's ``_lib/``, then a checkout's
    ``build/paddle_ops`` (the first candidate when neither exists, for the error message)."""
    return libpaths.find_paddle_ops() or libpaths.paddle_ops_candidates()[0]


def _load_paddle_ops() -> Any:
    """Register the custom ops with Paddle once and return ``paddle._C_ops``."""
    with _paddle_lock:
        if "c_ops" in _paddle_state:
            return _paddle_state["c_ops"]
        so_path = _paddle_so_path()
        if not so_path.is_file():
            raise OpsNotBuiltError(
                f"Paddle custom ops not found (looked in "
                f"{', '.join(str(p) for p in libpaths.paddle_ops_candidates())}); {libpaths.missing_hint('paddle_ops')}"
            )
        mismatch = libpaths.paddle_build_mismatch(so_path)
        if mismatch:
            logger.warning("%s", mismatch)
        with warnings.catch_warnings():
            # Importing Paddle (its extension builder) warns that ccache is missing: that only
            # matters to a compile, and loading prebuilt ops compiles nothing.
            warnings.filterwarnings("ignore", message="No ccache found")
            import paddle  # lazy: the scheduler side must not pay for Paddle
            from paddle.utils.cpp_extension.extension_utils import load_op_meta_info_and_register_op

        load_op_meta_info_and_register_op(str(so_path))
        from paddle import _C_ops

        _paddle_state["c_ops"] = _C_ops
        _paddle_state["capi"] = CApi(ctypes.CDLL(str(so_path)), str(so_path))
        logger.debug("registered Paddle ops from %s (paddle %s)", so_path, paddle.__version__)
        return _C_ops


def paddle_ops_capi() -> CApi:
    """The C ABI exported by the Paddle extension (registers the ops first).  Its
    ``last_path()`` reports the paths of the calling thread's last Paddle op."""
    _load_paddle_ops()
    return _paddle_state["capi"]


def paddle_ops_available() -> bool:
    """True if the Paddle extension is built (does not import Paddle)."""
    return _paddle_so_path().is_file()


def _run(name: str, *args: Any) -> Any:
    """Run a custom op; a failure the core reported becomes the matching Python error.

    NOTE: the op / argument / index of a validation error come from the extension's own
    C ABI error state (``fdkv_last_error_fields``, filled by the op on this thread), not
    from Paddle's rewrapped message text.  The state is cleared first, so an error Paddle
    raises before the op's code runs (a bad attribute type) is re-raised as Paddle's own.
    """
    c_ops = _load_paddle_ops()
    capi: CApi = _paddle_state["capi"]
    capi.clear_error()
    try:
        return c_ops._run_custom_op(name, *args)
    except Exception:  # Paddle reports C++ errors as OSError with the message
        error = capi.error_from_last()
        if error is None:
            raise
        raise error from None


def _host_api() -> CApi:
    """The ABI used for pinned memory: the Paddle extension's if built (it matches the
    installed Paddle, CUDA or not), else the standalone C ABI library."""
    if paddle_ops_available():
        _load_paddle_ops()
        return _paddle_state["capi"]
    return load_capi()


def cuda_host_alloc(nbytes: int, flags: int = 0) -> int:
    """Allocate ``nbytes`` of pinned host memory and return its address.

    With CUDA this is ``cudaHostAlloc(nbytes, flags)`` (pinned, so device copies run at
    full PCIe speed and the copy kernel can read it directly); without CUDA it is a
    4 KiB-aligned allocation, so the CPU paths and tests work unchanged.
    """
    return _host_api().host_alloc(nbytes, flags)


def cuda_host_free(ptr: int) -> None:
    """Free memory returned by :func:`cuda_host_alloc`."""
    _host_api().host_free(ptr)


def swap_cache_per_layer(
    cache_gpu: Any,
    cache_cpu_ptr: int,
    max_block_num_cpu: int,
    swap_block_ids_gpu: IdsLike,
    swap_block_ids_cpu: IdsLike,
    rank: int,
    mode: int,
    *,
    path: Union[int, str, None] = None,
) -> Any:
    """Copy blocks of one cache tensor between device and host, then wait for the copy.

    ``cache_gpu[swap_block_ids_gpu[i]]`` is paired with host block
    ``swap_block_ids_cpu[i]`` at ``cache_cpu_ptr`` (``max_block_num_cpu`` blocks of
    ``prod(cache_gpu.shape[1:]) * itemsize`` bytes; -1: the size :func:`cuda_host_alloc`
    recorded).  mode 0 (:attr:`MODE_D2H`): device to host; 1: host to device.  ``rank`` is
    the CUDA device ordinal ``cache_gpu`` lives on (-1: whichever; checked on GPU tensors,
    ignored on CPU ones).  ``cache_gpu`` must be contiguous.  In place: returns
    ``cache_gpu`` itself (same storage).  Runs on the tensor's current stream and
    synchronizes it, which is why engines use the async variant.

    ``path`` (keyword, every Paddle op): this call's copy path, as in
    :meth:`CApi.swap_per_layer`; None follows the process-wide option.  Passed as the op's
    optional trailing attribute ``path``; ignored on CPU tensors.
    """
    op = "swap_cache_per_layer"
    return _run(
        op, _check_tensor(cache_gpu, op), _int_arg(cache_cpu_ptr, op, "cache_cpu_ptr"),
        _int_arg(max_block_num_cpu, op, "max_block_num_cpu"), _id_list(swap_block_ids_gpu, op, "swap_block_ids_gpu"),
        _id_list(swap_block_ids_cpu, op, "swap_block_ids_cpu"), _int_arg(rank, op, "rank", 32),
        _int_arg(mode, op, "mode", 32), copy_path_code(path, op),
    )[0]


def swap_cache_per_layer_async(
    cache_gpu: Any,
    cache_cpu_ptr: int,
    max_block_num_cpu: int,
    swap_block_ids_gpu: IdsLike,
    swap_block_ids_cpu: IdsLike,
    rank: int,
    mode: int,
    stream: StreamLike = 0,
    *,
    path: Union[int, str, None] = None,
) -> Any:
    """Like :func:`swap_cache_per_layer` but never synchronizes: the copy is enqueued on
    ``stream`` (0: the tensor's current stream) so it overlaps compute on other streams.
    The caller tracks completion with an event recorded on ``stream``, and must keep the
    host buffer alive and untouched until then.
    """
    op = "swap_cache_per_layer_async"
    return _run(
        op, _check_tensor(cache_gpu, op), _int_arg(cache_cpu_ptr, op, "cache_cpu_ptr"),
        _int_arg(max_block_num_cpu, op, "max_block_num_cpu"), _id_list(swap_block_ids_gpu, op, "swap_block_ids_gpu"),
        _id_list(swap_block_ids_cpu, op, "swap_block_ids_cpu"), _int_arg(rank, op, "rank", 32),
        _int_arg(mode, op, "mode", 32), _stream_handle(stream), copy_path_code(path, op),
    )[0]


def swap_cache_all_layers(
    cache_gpu_tensors: Sequence[Any],
    cache_cpu_ptrs: Sequence[int],
    max_block_num_cpu: int,
    swap_block_ids_gpu: IdsLike,
    swap_block_ids_cpu: IdsLike,
    rank: int,
    mode: int,
    stream: StreamLike = 0,
    *,
    path: Union[int, str, None] = None,
) -> list[Any]:
    """Copy the same block ids of every tensor in ``cache_gpu_tensors`` in one launch
    (one pointer table on the device), asynchronously on ``stream`` (0: the first
    tensor's current stream).  ``cache_cpu_ptrs[t]`` is tensor t's host cache; tensors
    may have different block sizes (fp32 scale caches next to K/V).  In place.
    """
    op = "swap_cache_all_layers"
    return list(_run(
        op, _check_tensors(cache_gpu_tensors, op, "cache_gpu_tensors"),
        [_int_arg(p, op, "cache_cpu_ptrs") for p in cache_cpu_ptrs], _int_arg(max_block_num_cpu, op, "max_block_num_cpu"),
        _id_list(swap_block_ids_gpu, op, "swap_block_ids_gpu"), _id_list(swap_block_ids_cpu, op, "swap_block_ids_cpu"),
        _int_arg(rank, op, "rank", 32), _int_arg(mode, op, "mode", 32), _stream_handle(stream), copy_path_code(path, op),
    ))


def swap_cache_layout(
    cache_gpu_tensors: Sequence[Any],
    cache_cpu_ptr: int,
    cache_shape: Sequence[int],
    gpu_block_ids: IdsLike,
    cpu_block_ids: IdsLike,
    rank: int,
    mode: int,
    stream: StreamLike = 0,
    max_block_num_cpu: int = -1,
    *,
    path: Union[int, str, None] = None,
) -> list[Any]:
    """Gather device blocks into (mode 0), or scatter them from (mode 1), a block-major
    host buffer ``[cpu_block][tensor][block bytes]``; passing tensors as
    ``[k0, v0, k1, v1, ...]`` gives ``[block][layer][k|v][...]``: one contiguous object per
    block, for the storage tier and prefill/decode hand-off.

    ``cache_shape`` is the shape every tensor must have (empty: each tensor's own shape,
    which lets scale tensors join).  ``max_block_num_cpu`` is the host buffer's block
    count; the default -1 takes it from the size :func:`cuda_host_alloc` recorded for
    ``cache_cpu_ptr`` (other memory needs the count).  ``cpu_block_ids`` are always
    range-checked.  Asynchronous on ``stream`` (0: the first tensor's current stream).
    In place.
    """
    op = "swap_cache_layout"
    return list(_run(
        op, _check_tensors(cache_gpu_tensors, op, "cache_gpu_tensors"), _int_arg(cache_cpu_ptr, op, "cache_cpu_ptr"),
        [_int_arg(d, op, "cache_shape") for d in cache_shape], _id_list(gpu_block_ids, op, "gpu_block_ids"),
        _id_list(cpu_block_ids, op, "cpu_block_ids"), _int_arg(rank, op, "rank", 32), _int_arg(mode, op, "mode", 32),
        _stream_handle(stream), _int_arg(max_block_num_cpu, op, "max_block_num_cpu"), copy_path_code(path, op),
    ))
