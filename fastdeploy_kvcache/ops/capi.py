"""The ctypes binding of the C ABI (``libfdkv_capi.so``, or the Paddle extension, which
exports the same ABI): finding and loading the library, declaring its functions, and
:class:`CApi`, whose methods check their arguments (:mod:`.checks`) before the C call.

The layer-stack call lives in :mod:`.layer_stack`; :meth:`CApi.layer_stack_call` makes one.
"""

from __future__ import annotations

import array
import ctypes
import logging
import threading
from pathlib import Path
from typing import Any, NamedTuple, Optional, Sequence, Union

from fastdeploy_kvcache import envs, libpaths
from fastdeploy_kvcache.ops.checks import (
    IdsLike,
    OpsNotBuiltError,
    StreamLike,
    SwapOpError,
    id_buffer,
    int_arg,
    is_int,
    per_tensor,
    ptr_arg,
    stream_handle,
)
from fastdeploy_kvcache.ops.layer_stack import GroupProgress, LayerStackCall, StackLauncher, TableArgs
from fastdeploy_kvcache.ops.paths import copy_path_code

logger = logging.getLogger(__name__)

_ABI_VERSION = 7  # fdkv_abi_version() of libraries with error fields, recorded host sizes, read_files,
# layer groups (LayerStackCall.run), launched stacks (LayerStackCall.launch), piecewise pinning (host_reserve)

# CApi.pointer_location: where an address points (fdkv_pointer_location).
POINTER_HOST, POINTER_PINNED_HOST, POINTER_DEVICE, POINTER_MANAGED = 0, 1, 2, 3

_BUILD_HINT = "run `bash build.sh` (CPU) or `bash build.sh gpu` (CUDA C ABI) from the repository root"

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


def _abi_signatures() -> dict[str, tuple[Any, list[Any]]]:
    """Every exported function's ``(restype, argtypes)``, by name."""
    vp, i64, i32, cp = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_char_p
    pp, i32p = ctypes.POINTER(ctypes.c_void_p), ctypes.POINTER(ctypes.c_int)
    swap_args = [
        cp,                               # op name (for errors)
        pp, _C_INT64_P, _C_INT64_P, i64,  # dev ptrs, per-tensor dev blocks, block bytes, tensors
        pp, i64,                          # host ptrs (one for layout), host blocks
        _C_INT64_P, i64, _C_INT64_P, i64,  # dev ids, count, host ids, count
        i32, vp, i32, i32,                # mode, stream, sync, path (ABI version 2)
    ]
    return {
        "fdkv_last_error": (cp, []),
        "fdkv_last_error_fields": (i32, [ctypes.POINTER(cp), ctypes.POINTER(cp), _C_INT64_P]),
        "fdkv_clear_error": (None, []),
        "fdkv_is_cuda": (i32, []),
        "fdkv_abi_version": (i32, []),
        "fdkv_host_alloc": (i32, [ctypes.c_size_t, ctypes.c_uint, pp]),
        "fdkv_host_free": (i32, [vp]),
        "fdkv_host_reserve": (i32, [ctypes.c_size_t, pp]),
        "fdkv_host_pin_ranges": (i32, [vp, _C_INT64_P, _C_INT64_P, i64, i32, i32, _C_INT64_P]),
        "fdkv_host_pin_threads": (i32, []),
        "fdkv_swap_layers": (i32, swap_args),
        "fdkv_swap_layout": (i32, swap_args),
        "fdkv_swap_layer_groups": (i32, [
            cp, pp, _C_INT64_P, _C_INT64_P, i64,  # op, dev ptrs, dev blocks, block bytes, tensors
            pp, i64, i64,                         # host ptrs, host blocks, group size
            _C_INT64_P, i64, _C_INT64_P, i64,     # dev ids, count, host ids, count
            i32, vp, pp, i64, vp, i32, i32,       # mode, stream, events, count, progress, sync, path
        ]),
        "fdkv_progress_create": (i32, [pp]),
        "fdkv_progress_destroy": (i32, [vp]),
        "fdkv_progress_wait": (i32, [vp, i64, i64, _C_INT64_P]),
        "fdkv_progress_wait_closed": (i32, [vp, i64, i32p]),
        "fdkv_progress_state": (i32, [vp, _C_INT64_P, i32p, i32p, i32p, _C_INT64_P]),
        "fdkv_progress_error": (cp, [vp]),
        "fdkv_progress_abandon": (i32, [vp, cp]),
        "fdkv_launcher_create": (i32, [pp]),
        "fdkv_launcher_destroy": (i32, [vp]),
        "fdkv_launcher_wait_idle": (i32, [vp, i64, i32p]),
        "fdkv_launch_layer_groups": (i32, [
            vp, cp, pp, _C_INT64_P, _C_INT64_P, i64,  # launcher, op, dev ptrs, dev blocks, block bytes, tensors
            pp, i64, i64,                             # host ptrs, host blocks, group size
            _C_INT64_P, i64, _C_INT64_P, i64,         # dev ids, count, host ids, count
            i32, vp, pp, i64, vp,                     # mode, stream, events, count, progress
            pp, i64, vp, vp, i32, i64,                # waits, count, start, done event, path, inline groups
        ]),
        "fdkv_set_option": (i32, [cp, i64]),
        "fdkv_get_option": (i32, [cp, _C_INT64_P]),
        "fdkv_read_files": (i32, [ctypes.POINTER(cp), i64, pp, _C_INT64_P, vp, i64, _C_INT64_P]),
        "fdkv_last_path": (i32, []),
        "fdkv_stream_synchronize": (i32, [vp]),
    }


def _declare_abi(lib: ctypes.CDLL) -> None:
    """Set argtypes/restype of every exported function (keeps ctypes from truncating)."""
    for name, (restype, argtypes) in _abi_signatures().items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


class CApi:
    """ctypes wrapper of ``libfdkv_capi.so`` (or of the Paddle extension, which exports
    the same ABI).  Pointers are Python ints; ids are sequences or int64 numpy arrays.

    With the CPU build (``is_cuda`` False) "device" pointers are ordinary host memory, so
    the whole ABI can be exercised with numpy arrays.
    """

    def __init__(self, lib: ctypes.CDLL, path: str):
        self.lib = lib
        self.path = path
        # NOTE: a library built from older sources would silently ignore the trailing `path`
        # argument of the swaps (ctypes passes it, the C function never reads it): refuse it.
        version = int(lib.fdkv_abi_version()) if hasattr(lib, "fdkv_abi_version") else 1
        if version < _ABI_VERSION:
            raise OpsNotBuiltError(
                f"{path} has C ABI version {version}, this package needs {_ABI_VERSION} "
                f"(error fields, recorded host sizes, read_files, layer groups, launched stacks, piecewise pinning); rebuild it: {_BUILD_HINT}"
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
        code = int(self.lib.fdkv_last_error_fields(ctypes.byref(op), ctypes.byref(arg), ctypes.byref(index)))
        message = (self.lib.fdkv_last_error() or b"").decode("utf-8", "replace")
        return (code, message, (op.value or b"").decode("utf-8", "replace"),
                (arg.value or b"").decode("utf-8", "replace"), index.value if index.value >= 0 else None)

    def clear_error(self) -> None:
        """Reset the calling thread's last status (done before each Paddle op)."""
        self.lib.fdkv_clear_error()

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

    def check(self, rc: int) -> None:
        """Raise the calling thread's last error for a failed status ``rc`` (no-op on success)."""
        if rc == _ERR_OK:
            return
        raise self.error_from_last() or RuntimeError(f"fdkv: status {rc} without an error message")

    # ---------------------------------------------------------------- pinned memory
    def host_alloc(self, nbytes: int, flags: int = 0) -> int:
        """Pinned host memory, or resident 4 KiB-aligned memory without CUDA; it reads as zero.

        With CUDA: anonymous pages faulted in by several threads, then one
        ``cudaHostRegister`` (portable, mapped); ``cudaHostAlloc(nbytes, flags)`` only for
        write-combined ``flags``.

        The library records the size, so a swap given ``num_host_blocks=-1`` (or the
        Paddle layout op's default ``max_block_num_cpu=-1``) bounds host ids by it.
        """
        if not is_int(nbytes) or not 0 < int(nbytes) < (1 << 64):
            raise SwapOpError(f"cuda_host_alloc: nbytes = {nbytes!r} must be an integer > 0",
                              "cuda_host_alloc", "nbytes", None)
        flags = int_arg(flags, "cuda_host_alloc", "flags", 33)
        if flags < 0:
            raise SwapOpError(f"cuda_host_alloc: flags = {flags} must be >= 0", "cuda_host_alloc", "flags", None)
        out = ctypes.c_void_p()
        self.check(self.lib.fdkv_host_alloc(int(nbytes), flags, ctypes.byref(out)))
        return int(out.value or 0)

    def host_free(self, ptr: int) -> None:
        """Free memory from :meth:`host_alloc` (0 is a no-op; any other pointer this library
        did not hand out, or one already freed, is a :class:`SwapOpError`)."""
        ptr = ptr_arg(ptr, "cuda_host_free", "ptr")
        self.check(self.lib.fdkv_host_free(ctypes.c_void_p(ptr)))

    def host_reserve(self, nbytes: int) -> int:
        """Address space for ``nbytes`` of host memory that :meth:`host_pin_ranges` pins piece by
        piece; nothing is resident or pinned yet (instant).  Freed by :meth:`host_free`; the
        size is recorded as :meth:`host_alloc`'s is.  Its pages read as zero."""
        if not is_int(nbytes) or not 0 < int(nbytes) < (1 << 64):
            raise SwapOpError(f"cuda_host_reserve: nbytes = {nbytes!r} must be an integer > 0",
                              "cuda_host_reserve", "nbytes", None)
        out = ctypes.c_void_p()
        self.check(self.lib.fdkv_host_reserve(int(nbytes), ctypes.byref(out)))
        return int(out.value or 0)

    def host_pin_ranges(self, base: int, ranges: Sequence[tuple[int, int]], threads: int = 0,
                        device: int = -1) -> int:
        """Make ``(offset, length)`` byte ranges of the buffer at ``base`` (from
        :meth:`host_reserve` or :meth:`host_alloc`) resident and, with CUDA, pinned
        (``cudaHostRegister``); each is rounded out to whole pages and pages pinned before
        are skipped.  ``threads`` <= 0: :meth:`host_pin_threads`.  ``device`` >= 0: the
        calling thread's CUDA device is set first.  Returns the bytes newly pinned."""
        base = ptr_arg(base, "cuda_host_pin", "base")
        offsets = (ctypes.c_int64 * max(len(ranges), 1))(*[int(o) for o, _ in ranges])
        lengths = (ctypes.c_int64 * max(len(ranges), 1))(*[int(n) for _, n in ranges])
        pinned = ctypes.c_int64(0)
        self.check(self.lib.fdkv_host_pin_ranges(ctypes.c_void_p(base), offsets, lengths, len(ranges),
                                                 int(threads), int(device), ctypes.byref(pinned)))
        return int(pinned.value)

    def host_pin_threads(self) -> int:
        """Threads pinning faults pages in with by default (hardware threads, at most 16)."""
        return int(self.lib.fdkv_host_pin_threads())

    # ---------------------------------------------------------------- options
    def set_option(self, name: str, value: int) -> None:
        """Set a process-wide copy option of this library: the one way to change one
        (each starts at its measured default; the environment is not read; docs/ops.md,
        "Options").  ``copy_grid`` (kernel CTAs), ``copy_path`` (0 auto, 1 kernel, 2 dma,
        3 staged), ``dma_min_bytes``, ``merge_min_bytes``, ``dma_slice_bytes``,
        ``copy_kernel`` (0-3), ``kernel_tables`` (0/1).

        Staged path: ``staging_bytes``, ``staging_chunk_bytes``, ``staging_grid``,
        ``staged_min_bytes``, ``staging_mode``; DMA rows: ``dma_rows_min_lanes``,
        ``rows_d2h_min_bytes``; layer stacks: ``staged_stack_from_group``,
        ``stack_span_min_bytes``, ``launch_lead_bytes`` (docs/ops.md, "Layer groups") and, for tests,
        ``stack_fail_group``.

        Options are per library: the Paddle extension (:func:`paddle_ops_capi`) and the
        standalone C ABI library each hold their own.  Meant for benchmarks, tests and
        tuning; the defaults are what serving uses.
        """
        value = int_arg(value, "set_option", "value")  # ctypes would wrap 2**70 to 0
        self.check(self.lib.fdkv_set_option(name.encode(), value))

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
        self.check(self.lib.fdkv_get_option(name.encode(), ctypes.byref(out)))
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
        self.check(self.lib.fdkv_read_files(c_paths, n, c_dsts, c_sizes, ctypes.addressof(hbuf), header_bytes, got))
        del hbuf  # release the export so the bytearray stays resizable for the caller
        return headers, list(got[:n])

    @property
    def has_hashed_read(self) -> bool:
        """Whether :meth:`read_files_hashed` works: the library exports it (sources newer
        than ABI version 6 need not be: it is looked up by name) and was built with xxHash."""
        fn = getattr(self.lib, "fdkv_has_hashed_read", None)
        return fn is not None and hasattr(self.lib, "fdkv_read_files_hashed") and bool(fn())

    def read_files_hashed(self, paths: Sequence[bytes], dsts: Sequence[int], sizes: Sequence[int], header_bytes: int,
                          piece_bytes: int, step_bytes: int) -> tuple[bytearray, list[int], list[Optional[int]]]:
        """:meth:`read_files`, and each payload's checksum computed as it is read.

        Reads each payload ``step_bytes`` at a time and hashes each step right after it
        lands (still in the CPU cache): xxh3-64 over every ``piece_bytes`` of ``dsts[i]``,
        each piece seeded with the previous piece's hash.  The objects are spread over up to
        the ``read_threads`` option's threads inside the call (each with at least
        ``read_thread_min_bytes`` of payload); the results do not depend on how many.  Returns ``(headers, got, digests)``; ``digests[i]`` is None where the buffer was not filled.  Raises
        :class:`SwapOpError` for bad arguments or a library without the function, and
        RuntimeError where :attr:`has_hashed_read` is False (built without xxHash, or a CPU
        without AVX-512).
        """
        n = len(paths)
        if len(dsts) != n or len(sizes) != n:
            raise SwapOpError(f"read_files_hashed: {n} paths, {len(dsts)} dsts, {len(sizes)} sizes; need equal",
                              "read_files_hashed", "dsts", None)
        fn = getattr(self.lib, "fdkv_read_files_hashed", None)
        if fn is None:
            raise SwapOpError(f"{self.path} has no fdkv_read_files_hashed; rebuild it: {_BUILD_HINT}",
                              "read_files_hashed", "", None)
        fn.restype = ctypes.c_int32
        c_paths = (ctypes.c_char_p * max(n, 1))(*paths)
        c_dsts = (ctypes.c_void_p * max(n, 1))(*dsts)
        c_sizes = (ctypes.c_int64 * max(n, 1))(*sizes)
        got = (ctypes.c_int64 * max(n, 1))()
        digests = (ctypes.c_uint64 * max(n, 1))()
        hashed = (ctypes.c_int32 * max(n, 1))()
        headers = bytearray(max(n * header_bytes, 1))
        hbuf = (ctypes.c_char * len(headers)).from_buffer(headers)
        self.check(fn(c_paths, ctypes.c_int64(n), c_dsts, c_sizes, ctypes.c_void_p(ctypes.addressof(hbuf)),
                      ctypes.c_int64(header_bytes), ctypes.c_int64(piece_bytes), ctypes.c_int64(step_bytes), got,
                      digests, hashed))
        del hbuf  # release the export so the bytearray stays resizable for the caller
        return headers, list(got[:n]), [d if h else None for d, h in zip(digests[:n], hashed[:n])]

    @property
    def has_read_objects(self) -> bool:
        """Whether :meth:`read_objects` works: the library exports ``fdkv_read_objects``
        (looked up by name, like the hashed read) and :attr:`has_hashed_read` holds."""
        return hasattr(self.lib, "fdkv_read_objects") and self.has_hashed_read

    def read_objects(self, path_blob: bytes, n: int, segs: Sequence[int], seg_bytes: Sequence[int],
                     segs_per_object: int, shared_lengths: bool, header_bytes: int, piece_bytes: int,
                     step_bytes: int, check_version: int = 0,
                     size_first: bool = False) -> tuple[bytearray, list[int], list[int], list[int]]:
        """:meth:`read_files_hashed` with each payload scattered over ``segs_per_object`` segments.

        ``path_blob`` holds the ``n`` paths, each ending in a NUL byte (one bytes object: no
        per-path conversion).  Object i's payload fills ``segs[i * segs_per_object + k]``,
        ``seg_bytes[k]`` bytes each when ``shared_lengths`` (else
        ``seg_bytes[i * segs_per_object + k]``), in order; the checksum is that of the
        concatenated segments.  Returns ``(headers, got, digests, states)``: ``states[i]`` 0
        where the payload was not filled (``digests[i]`` meaningless), 1 filled and hashed, 2
        also a whole object whose header (format ``check_version``; 0 checks nothing) names
        exactly this payload and checksum, 3 (``size_first`` only: each file is fstat'ed
        first) the file is not a regular file of ``header_bytes`` + the payload's size, so
        nothing was read and the segments are untouched (``got[i]`` 0).  Raises :class:`SwapOpError` for bad arguments
        (nothing read) and RuntimeError where :attr:`has_read_objects` is False.
        """
        fn = getattr(self.lib, "fdkv_read_objects", None)
        if fn is None:
            raise SwapOpError(f"{self.path} has no fdkv_read_objects; rebuild it: {_BUILD_HINT}", "read_objects", "", None)
        if not isinstance(path_blob, bytes):
            raise SwapOpError(f"read_objects: path_blob must be bytes, got {type(path_blob).__name__}",
                              "read_objects", "paths", None)
        if is_int(segs_per_object) and is_int(n) and segs_per_object > 0 and n >= 0:
            if len(segs) != n * segs_per_object:
                raise SwapOpError(f"read_objects: {len(segs)} segs for {n} objects of {segs_per_object} segments",
                                  "read_objects", "segs", None)
            want = segs_per_object if shared_lengths else n * segs_per_object
            if len(seg_bytes) != want:
                raise SwapOpError(f"read_objects: {len(seg_bytes)} seg_bytes, need {want}", "read_objects", "seg_bytes",
                                  None)
        fn.restype = ctypes.c_int32
        c_segs = array.array("Q", segs) if segs else array.array("Q", [0])
        c_lens = array.array("q", seg_bytes) if seg_bytes else array.array("q", [0])
        slots = max(int(n), 1) if is_int(n) else 1
        got = array.array("q", bytes(8 * slots))
        digests = array.array("Q", bytes(8 * slots))
        states = array.array("i", bytes(4 * slots))
        headers = bytearray(max(slots * header_bytes, 1))
        hbuf = (ctypes.c_char * len(headers)).from_buffer(headers)
        vp, i64, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int32
        self.check(fn(ctypes.c_char_p(path_blob), i64(len(path_blob)), i64(n), vp(c_segs.buffer_info()[0]),
                      vp(c_lens.buffer_info()[0]), i64(segs_per_object), i32(1 if shared_lengths else 0),
                      vp(ctypes.addressof(hbuf)), i64(header_bytes), i64(piece_bytes), i64(step_bytes),
                      i32(check_version), i32(1 if size_first else 0), vp(got.buffer_info()[0]), vp(digests.buffer_info()[0]),
                      vp(states.buffer_info()[0])))
        del hbuf  # release the export so the bytearray stays resizable for the caller
        return headers, got[:n].tolist(), digests[:n].tolist(), states[:n].tolist()

    @property
    def has_pointer_location(self) -> bool:
        """Whether the library exports ``fdkv_pointer_location`` (looked up by name)."""
        return hasattr(self.lib, "fdkv_pointer_location")

    def pointer_location(self, ptr: int) -> int:
        """Where ``ptr`` points: :data:`POINTER_HOST` (ordinary host memory; every address on
        the CPU build), :data:`POINTER_PINNED_HOST` (cudaHostAlloc / cudaHostRegister),
        :data:`POINTER_DEVICE` or :data:`POINTER_MANAGED` (cudaPointerGetAttributes).  Raises
        :class:`SwapOpError` for a library without the function or a non-int address."""
        fn = getattr(self.lib, "fdkv_pointer_location", None)
        if fn is None:
            raise SwapOpError(f"{self.path} has no fdkv_pointer_location; rebuild it: {_BUILD_HINT}",
                              "pointer_location", "", None)
        if not is_int(ptr) or not 0 <= int(ptr) < (1 << 64):
            raise SwapOpError(f"pointer_location: ptr must be an address (int >= 0), got {ptr!r}",
                              "pointer_location", "ptr", None)
        fn.restype = ctypes.c_int32
        out = ctypes.c_int32(-1)
        self.check(fn(ctypes.c_void_p(int(ptr)), ctypes.byref(out)))
        return int(out.value)

    @property
    def has_files_exist(self) -> bool:
        """Whether the library exports ``fdkv_files_exist`` (looked up by name)."""
        return hasattr(self.lib, "fdkv_files_exist")

    def files_exist(self, path_blob: bytes, n: int) -> int:
        """How many of the ``n`` NUL-terminated paths in ``path_blob``, from the first, are
        regular files (a stat each in C, no GIL held; a directory or missing path ends the
        count).  Raises :class:`SwapOpError` for a malformed blob."""
        fn = getattr(self.lib, "fdkv_files_exist", None)
        if fn is None:
            raise SwapOpError(f"{self.path} has no fdkv_files_exist; rebuild it: {_BUILD_HINT}", "files_exist", "", None)
        if not isinstance(path_blob, bytes):
            raise SwapOpError(f"files_exist: path_blob must be bytes, got {type(path_blob).__name__}",
                              "files_exist", "paths", None)
        fn.restype = ctypes.c_int32
        count = ctypes.c_int64(0)
        self.check(fn(ctypes.c_char_p(path_blob), ctypes.c_int64(len(path_blob)), ctypes.c_int64(n),
                      ctypes.byref(count)))
        return int(count.value)

    def last_path(self) -> int:
        """Bit mask (PATH_*) of the copy paths the calling thread's last swap used."""
        return int(self.lib.fdkv_last_path())

    def stream_synchronize(self, stream: StreamLike = 0) -> None:
        self.check(self.lib.fdkv_stream_synchronize(ctypes.c_void_p(stream_handle(stream))))

    # ---------------------------------------------------------------- swaps
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
        a = self.swap_args(op, dev_ptrs, num_dev_blocks, block_bytes, host_ptrs, num_host_blocks, dev_ids, host_ids,
                            mode, path, host_per_tensor=entry != "fdkv_swap_layout")
        rc = getattr(self.lib, entry)(
            op.encode(), a.dev_ptrs, a.num_blocks, a.block_bytes, a.count, a.host_ptrs, a.num_host_blocks,
            a.dev_ids, a.num_dev_ids, a.host_ids, a.num_host_ids, a.mode,
            ctypes.c_void_p(stream_handle(stream)), 1 if sync else 0, a.path,
        )
        self.check(rc)

    def swap_args(
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
        t = self.table_args(op, dev_ptrs, num_dev_blocks, block_bytes, host_ptrs, num_host_blocks, mode, path,
                             host_per_tensor)
        d_keep, d_ptr, d_n = id_buffer(dev_ids, op, "dev_ids")
        h_keep, h_ptr, h_n = id_buffer(host_ids, op, "host_ids")
        return _SwapArgs(t.dev_ptrs, t.num_blocks, t.block_bytes, t.count, t.host_ptrs, t.num_host_blocks, d_ptr,
                         d_n, h_ptr, h_n, t.mode, t.path, (d_keep, h_keep))

    def table_args(
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
    ) -> TableArgs:
        """The id-independent part of :meth:`swap_args` (what a :class:`LayerStackCall` keeps)."""
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
            dev_p = ctypes.cast((ctypes.c_void_p * max(count, 1))(*[ptr_arg(p, op, "dev_ptrs") for p in dev_ptrs]),
                                ctypes.POINTER(ctypes.c_void_p))
            nblk = per_tensor(num_dev_blocks, count, op, "num_dev_blocks")
            bbytes = per_tensor(block_bytes, count, op, "block_bytes")
        if host_ptrs is None:
            if not isinstance(dev_ptrs, TensorTable) or dev_ptrs.host_ptrs is None:
                raise SwapOpError(f"{op}: host_ptrs is None, and dev_ptrs is not a TensorTable made with host_ptrs",
                                  op, "host_ptrs", None)
            host_p = dev_ptrs.host_ptrs
        else:
            host_p = ctypes.cast(
                (ctypes.c_void_p * max(len(host_ptrs), 1))(*[ptr_arg(p, op, "host_ptrs") for p in host_ptrs]),
                ctypes.POINTER(ctypes.c_void_p))
        return TableArgs(dev_p, nblk, bbytes, count, host_p, int_arg(num_host_blocks, op, "num_host_blocks"),
                          int_arg(mode, op, "mode", 32), code)

    def group_progress(self) -> GroupProgress:
        """A progress object for one :class:`LayerStackCall` run or launch."""
        return GroupProgress(self)

    def stack_launcher(self) -> StackLauncher:
        """A launcher thread for :meth:`LayerStackCall.launch` (one per stream user)."""
        return StackLauncher(self)

    def layer_stack_call(
        self,
        launcher: Optional[StackLauncher],
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
    ) -> LayerStackCall:
        """The one entry point of a layer-stack copy: tensors ``[g * group_size, (g + 1) *
        group_size)`` are group (layer) g, and every tensor moves the same ids.  What stays the
        same from one stack to the next (tensors, sizes, mode, stream, path, launcher) is
        checked and converted here, once; :meth:`LayerStackCall.run` (enqueue every group on
        the calling thread) or :meth:`LayerStackCall.launch` (hand the stack to ``launcher``)
        take the ids and events of each stack.

        Why: a load's start-up is host time before its first copy, and on a GPU host the
        Python conversions of one stack cost ~100 us there (docs/ops.md, "Measured costs");
        a worker issues every load with the same tensors, stream and launcher.
        """
        return LayerStackCall(self, launcher, dev_ptrs, host_ptrs, group_size, num_dev_blocks, block_bytes,
                              num_host_blocks, mode, stream, path, inline_groups)

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
    """A swap's C arguments (``CApi.swap_args``), by name; ``keep`` holds the id buffers
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


class TensorTable:
    """Cache tensors' device addresses, block counts and block sizes as the C arrays a swap
    passes, checked and converted once.  Pass it as ``dev_ptrs`` of
    :meth:`CApi.swap_all_layers` / :meth:`CApi.layer_stack_call` (their ``num_dev_blocks``
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
        self._dev = (ctypes.c_void_p * max(self.count, 1))(*[ptr_arg(p, op, "dev_ptrs") for p in dev_ptrs])
        self.dev_ptrs = ctypes.cast(self._dev, ctypes.POINTER(ctypes.c_void_p))
        self.num_blocks = per_tensor(num_dev_blocks, self.count, op, "num_dev_blocks")
        self.block_bytes = per_tensor(block_bytes, self.count, op, "block_bytes")
        # Optional: the tensors' host buffers too.  A swap given host_ptrs=None uses them.
        self.host_ptrs: Optional[Any] = None
        if host_ptrs is not None:
            if len(host_ptrs) != self.count:
                raise SwapOpError(f"{op}: host_ptrs has {len(host_ptrs)} entries but dev_ptrs has {self.count}", op,
                                  "host_ptrs", None)
            self._host = (ctypes.c_void_p * max(self.count, 1))(*[ptr_arg(p, op, "host_ptrs") for p in host_ptrs])
            self.host_ptrs = ctypes.cast(self._host, ctypes.POINTER(ctypes.c_void_p))

    def __len__(self) -> int:
        return self.count


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
