"""Regressions of the ops' input defects: each bad input raises an error that names what is
wrong, copies nothing, and never takes the process down.

Inputs that used to crash the interpreter (SIGABRT inside Paddle, SIGSEGV in a copy, a
double free) run in a child process (:func:`run_child`), so a regression fails the test
instead of killing pytest.
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap
from typing import Any, Callable, Optional

import numpy as np
import pytest

from fastdeploy_kvcache import ops

NUM_DEV, NUM_HOST, BB = 6, 8, 32

# The child's prelude: `report(fn)` runs fn and prints one line the parent checks.
_PRELUDE = """
import ctypes, sys
import numpy as np
from fastdeploy_kvcache import ops

def report(fn):
    try:
        fn()
    except ops.SwapOpError as exc:
        print(f"SwapOpError|{exc.op}|{exc.argument}|{exc.index}|{exc}", flush=True)
    except Exception as exc:
        print(f"{type(exc).__name__}|{exc}", flush=True)
    else:
        print("OK", flush=True)
"""


def run_child(code: str, env: Optional[dict[str, str]] = None) -> list[str]:
    """Run ``code`` after the prelude in a fresh interpreter; returns its report lines.

    Fails the test with the child's stderr when the child dies (a signal, a non-zero exit).
    """
    full_env = dict(os.environ, **(env or {}))
    proc = subprocess.run([sys.executable, "-c", _PRELUDE + textwrap.dedent(code)], env=full_env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"child died with status {proc.returncode}:\n{proc.stderr[-3000:]}"
    return [line for line in proc.stdout.splitlines() if line]


def swap_op_fields(line: str) -> tuple[str, str, str]:
    kind, op, argument, index, _message = line.split("|", 4)
    assert kind == "SwapOpError", line
    return op, argument, index


# ------------------------------------------------------------------ defect 1: empty lists
@pytest.mark.parametrize("op_name", ["swap_cache_all_layers", "swap_cache_layout"])
def test_empty_tensor_list_raises_instead_of_aborting(paddle_ops, op_name: str) -> None:
    call = {
        "swap_cache_all_layers": "ops.swap_cache_all_layers([], [], 8, [0], [0], 0, 0)",
        "swap_cache_layout": "ops.swap_cache_layout([], ptr, [], [0], [0], 0, 0)",
    }[op_name]
    lines = run_child(f"""
        import paddle
        ops.paddle_ops_capi()  # registers the ops
        ptr = ops.cuda_host_alloc(4096)
        report(lambda: {call})
        ops.cuda_host_free(ptr)
    """)
    assert swap_op_fields(lines[-1]) == (op_name, "cache_gpu_tensors", "None")


# ------------------------------------------------------------------ defect 2: non-contiguous
VIEWS: dict[str, Callable[[Any], Any]] = {
    "transposed": lambda base: base.T,
    "strided_rows": lambda base: base[::2],
    "column_slice": lambda base: base[:, 8:24],
}


@pytest.mark.parametrize("view", sorted(VIEWS))
@pytest.mark.parametrize("op_name", ["swap_cache_per_layer", "swap_cache_per_layer_async",
                                     "swap_cache_all_layers", "swap_cache_layout"])
def test_non_contiguous_tensor_is_refused(paddle_ops, host_buffer, view: str, op_name: str) -> None:
    """Host-to-device into a view used to write a temporary copy and leave the caller's
    tensor (and its base) unchanged; now the op refuses it, naming the tensor."""
    base = paddle_ops.zeros([8, 32], dtype="uint8")
    tensor = VIEWS[view](base)
    assert not tensor.is_contiguous()
    host = host_buffer(NUM_HOST * 64 * 4)
    host[:] = 7
    ptr = host.ctypes.data
    with pytest.raises(ops.SwapOpError) as info:
        if op_name == "swap_cache_per_layer":
            ops.swap_cache_per_layer(tensor, ptr, 4, [0], [0], 0, ops.CopyDirection.HOST_TO_DEVICE)
        elif op_name == "swap_cache_per_layer_async":
            ops.swap_cache_per_layer_async(tensor, ptr, 4, [0], [0], 0, ops.CopyDirection.HOST_TO_DEVICE)
        elif op_name == "swap_cache_all_layers":
            ops.swap_cache_all_layers([paddle_ops.zeros([4, 8], dtype="uint8"), tensor], [ptr, ptr], 4, [0], [0], 0,
                                      ops.CopyDirection.HOST_TO_DEVICE)
        else:
            ops.swap_cache_layout([tensor], ptr, [], [0], [0], 0, ops.CopyDirection.HOST_TO_DEVICE, max_block_num_cpu=4)
    err = info.value
    if op_name.startswith("swap_cache_per_layer"):
        assert (err.op, err.argument, err.index) == (op_name, "cache_gpu", None)
    else:
        expected_index = 1 if op_name == "swap_cache_all_layers" else 0
        assert (err.op, err.argument, err.index) == (op_name, "cache_gpu_tensors", expected_index)
    assert "contiguous" in str(err)
    assert not base.numpy().any(), "nothing was written"


def test_contiguous_row_slice_is_accepted_and_written_in_place(paddle_ops, host_buffer) -> None:
    """A slice of whole blocks is contiguous: the op writes the caller's storage."""
    base = paddle_ops.zeros([8, 32], dtype="uint8")
    rows = base[2:6]
    assert rows.is_contiguous()
    host = host_buffer(4 * 32)
    host[:] = 9
    ops.swap_cache_per_layer(rows, host.ctypes.data, 4, [1], [3], 0, ops.CopyDirection.HOST_TO_DEVICE)
    got = base.numpy()
    assert (got[3] == 9).all() and not np.delete(got, 3, axis=0).any()


# ------------------------------------------------------------------ defect 5: host ids bounded
def test_layout_default_count_bounds_host_ids_by_the_allocation(paddle_ops) -> None:
    """swap_cache_layout's default max_block_num_cpu=-1 used to check nothing: 10**7 segfaulted."""
    lines = run_child("""
        import paddle
        ops.paddle_ops_capi()  # registers the ops
        cache = paddle.zeros([4, 16], dtype="uint8")
        ptr = ops.cuda_host_alloc(4 * 16)
        report(lambda: ops.swap_cache_layout([cache], ptr, [], [0], [10**7], 0, 0))
        report(lambda: ops.swap_cache_layout([cache], ptr, [], [0], [4], 0, 1))   # one past the end
        report(lambda: ops.swap_cache_layout([cache], ptr, [], [0], [3], 0, 0))   # the last block
        ops.cuda_host_free(ptr)
    """)
    assert swap_op_fields(lines[0]) == ("swap_cache_layout", "cpu_block_ids", "0")
    assert "out of range [0, 4)" in lines[0]
    assert swap_op_fields(lines[1]) == ("swap_cache_layout", "cpu_block_ids", "0")
    assert lines[2] == "OK"


def test_capi_count_minus_one_bounds_host_ids_by_the_allocation(capi_cpu: ops.CApi) -> None:
    lines = run_child("""
        capi = ops.load_capi(variant="cpu")
        dev = np.zeros((4, 16), np.uint8)
        ptr = capi.host_alloc(4 * 16)
        report(lambda: capi.swap_layout([dev.ctypes.data], 4, 16, ptr, -1, [0], [10**7], 0))
        report(lambda: capi.swap_per_layer(dev.ctypes.data, 4, 16, ptr, -1, [0], [4], 0))
        report(lambda: capi.swap_all_layers([dev.ctypes.data] * 2, [ptr, ptr + 32], 4, 16, -1, [0], [2], 0))
        report(lambda: capi.swap_per_layer(dev.ctypes.data, 4, 16, ptr, -1, [0], [3], 0))
        capi.host_free(ptr)
    """)
    assert swap_op_fields(lines[0]) == ("swap_layout", "host_ids", "0")
    assert swap_op_fields(lines[1]) == ("swap_per_layer", "host_ids", "0")
    # the second pointer starts 32 bytes in: only 2 blocks of 16 bytes fit after it
    assert swap_op_fields(lines[2]) == ("swap_all_layers", "host_ids", "0")
    assert "[0, 2)" in lines[2]
    assert lines[3] == "OK"


def test_unknown_host_memory_needs_an_explicit_count(paddle_ops, capi_cpu: ops.CApi) -> None:
    """Memory cuda_host_alloc did not make has no recorded size: -1 is an error, not 'unchecked'."""
    cache = paddle_ops.zeros([4, 16], dtype="uint8")
    host = np.full((4, 16), 5, np.uint8)
    with pytest.raises(ops.SwapOpError) as info:
        ops.swap_cache_layout([cache], host.ctypes.data, [], [0], [1], 0, ops.CopyDirection.HOST_TO_DEVICE)
    assert (info.value.op, info.value.argument, info.value.index) == ("swap_cache_layout", "cache_cpu_ptr", None)
    assert "max_block_num_cpu" in str(info.value)
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu.swap_all_layers([cache.data_ptr()], [host.ctypes.data], 4, 16, -1, [0], [1], ops.CopyDirection.HOST_TO_DEVICE)
    assert (info.value.argument, info.value.index) == ("host_ptrs", 0)
    assert not cache.numpy().any()
    # with the count it is the caller's word, as before
    ops.swap_cache_layout([cache], host.ctypes.data, [], [0], [1], 0, ops.CopyDirection.HOST_TO_DEVICE, max_block_num_cpu=4)
    assert (cache.numpy()[0] == 5).all()


@pytest.mark.parametrize("op_name", ["swap_cache_per_layer", "swap_cache_all_layers", "swap_cache_layout"])
def test_count_larger_than_the_allocation_is_refused(paddle_ops, host_buffer, op_name: str) -> None:
    cache = paddle_ops.zeros([4, 16], dtype="uint8")
    host = host_buffer(4 * 16)  # 4 blocks
    with pytest.raises(ops.SwapOpError) as info:
        if op_name == "swap_cache_per_layer":
            ops.swap_cache_per_layer(cache, host.ctypes.data, 5, [0], [4], 0, ops.CopyDirection.HOST_TO_DEVICE)
        elif op_name == "swap_cache_all_layers":
            ops.swap_cache_all_layers([cache], [host.ctypes.data], 5, [0], [4], 0, ops.CopyDirection.HOST_TO_DEVICE)
        else:
            ops.swap_cache_layout([cache], host.ctypes.data, [], [0], [4], 0, ops.CopyDirection.HOST_TO_DEVICE, max_block_num_cpu=5)
    assert (info.value.op, info.value.argument, info.value.index) == (op_name, "max_block_num_cpu", None)
    assert "do not fit" in str(info.value)
    assert not cache.numpy().any()


def test_double_free_is_an_error_not_heap_corruption(capi_cpu: ops.CApi) -> None:
    lines = run_child("""
        capi = ops.load_capi(variant="cpu")
        ptr = capi.host_alloc(4096)
        report(lambda: capi.host_free(ptr))
        report(lambda: capi.host_free(ptr))
        other = np.zeros(4096, np.uint8)
        report(lambda: capi.host_free(other.ctypes.data))
    """)
    assert lines[0] == "OK"
    assert swap_op_fields(lines[1]) == ("cuda_host_free", "ptr", "None")
    assert swap_op_fields(lines[2]) == ("cuda_host_free", "ptr", "None")


# ------------------------------------------------------------------ defect 6: huge sizes
@pytest.mark.parametrize("nbytes", [2**64 - 1, 2**63, -1, -4096, 2**64, 2.5, True])
def test_capi_host_alloc_rejects_sizes_that_cannot_be_allocated(capi_cpu: ops.CApi, nbytes: Any) -> None:
    """2**64-1 and negative sizes used to round to a 0-byte block and return a pointer."""
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu.host_alloc(nbytes)
    assert (info.value.op, info.value.argument) == ("cuda_host_alloc", "nbytes")


def test_core_rejects_a_wrapped_size_passed_straight_to_the_abi(capi_cpu: ops.CApi) -> None:
    """The check lives in C++ too: a caller of the raw ABI gets an error, not a pointer."""
    out = ctypes.c_void_p()
    rc = capi_cpu.lib.fdkv_host_alloc(2**64 - 1, 0, ctypes.byref(out))
    assert rc == 1 and not out.value
    code, _message, op, argument, index = capi_cpu.last_error()
    assert (code, op, argument, index) == (1, "cuda_host_alloc", "nbytes", None)


@pytest.mark.parametrize("nbytes", [2**64 - 1, -1])
def test_module_host_alloc_rejects_huge_and_negative_sizes(paddle_ops, nbytes: int) -> None:
    with pytest.raises(ops.SwapOpError) as info:
        ops.cuda_host_alloc(nbytes)
    assert info.value.argument == "nbytes"


def test_unallocatable_size_is_memory_error(capi_cpu: ops.CApi) -> None:
    with pytest.raises(MemoryError):
        capi_cpu.host_alloc(2**62)


# ------------------------------------------------------------------ defect 9: id types
def _bad_ids(paddle) -> dict[str, tuple[Any, Optional[int], str]]:
    """name -> (ids, offending index or None, message fragment)."""
    return {
        "float_in_list": ([0, 1.7], 1, "not an integer"),
        "float_array": (np.array([1.7, 0.0]), None, "dtype float64"),
        "nested_list": ([[0], [1]], 0, "1-D"),
        "2d_array": (np.array([[0, 1]]), None, "1-D"),
        "int64_overflow": ([2**63], 0, "int64"),
        "uint64_overflow": (np.array([0, 2**63], dtype=np.uint64), 1, "int64"),
        "bool_in_list": ([True], 0, "not an integer"),
        "bool_array": (np.array([True]), None, "dtype bool"),
        "string": ("01", None, "sequence"),
        "paddle_float": (paddle.to_tensor([1.5]), None, "dtype float32"),
        "paddle_2d": (paddle.to_tensor([[0, 1]]), None, "1-D"),
    }


BAD_ID_NAMES = ["float_in_list", "float_array", "nested_list", "2d_array", "int64_overflow", "uint64_overflow",
                "bool_in_list", "bool_array", "string", "paddle_float", "paddle_2d"]


@pytest.mark.parametrize("case", BAD_ID_NAMES)
@pytest.mark.parametrize("face", ["capi", "paddle"])
@pytest.mark.parametrize("side", ["dev", "host"])
def test_non_integer_ids_are_refused_and_nothing_is_copied(paddle_ops, capi_cpu: ops.CApi, host_buffer,
                                                          case: str, face: str, side: str) -> None:
    ids, index, fragment = _bad_ids(paddle_ops)[case]
    good = [0]  # ids are checked before lengths: the bad list is the one named
    dev_ids, host_ids = (ids, good) if side == "dev" else (good, ids)
    cache = paddle_ops.to_tensor(np.arange(NUM_DEV * BB, dtype=np.uint8).reshape(NUM_DEV, BB))
    host = host_buffer(NUM_HOST * BB).reshape(NUM_HOST, BB)
    before_dev, before_host = cache.numpy().copy(), host.copy()
    with pytest.raises(ops.SwapOpError) as info:
        if face == "capi":
            capi_cpu.swap_per_layer(cache.data_ptr(), NUM_DEV, BB, host.ctypes.data, NUM_HOST, dev_ids, host_ids,
                                    ops.CopyDirection.DEVICE_TO_HOST)
        else:
            ops.swap_cache_per_layer(cache, host.ctypes.data, NUM_HOST, dev_ids, host_ids, 0, ops.CopyDirection.DEVICE_TO_HOST)
    names = {("capi", "dev"): "dev_ids", ("capi", "host"): "host_ids",
             ("paddle", "dev"): "swap_block_ids_gpu", ("paddle", "host"): "swap_block_ids_cpu"}
    err = info.value
    assert (err.argument, err.index) == (names[face, side], index), str(err)
    assert fragment in str(err)
    np.testing.assert_array_equal(cache.numpy(), before_dev)
    np.testing.assert_array_equal(host, before_host)


@pytest.mark.parametrize("ids", [
    [2, 0], (2, 0), range(2, -1, -2), np.array([2, 0], np.int32), np.array([2, 0], np.uint8),
    [np.int64(2), np.int16(0)],
], ids=["list", "tuple", "range", "int32", "uint8", "numpy_scalars"])
def test_integer_id_containers_are_accepted(paddle_ops, capi_cpu: ops.CApi, host_buffer, ids: Any) -> None:
    cache = paddle_ops.to_tensor(np.arange(NUM_DEV * BB, dtype=np.uint8).reshape(NUM_DEV, BB))
    host = host_buffer(NUM_HOST * BB).reshape(NUM_HOST, BB)
    ops.swap_cache_per_layer(cache, host.ctypes.data, NUM_HOST, ids, [5, 6], 0, ops.CopyDirection.DEVICE_TO_HOST)
    np.testing.assert_array_equal(host[[5, 6]], cache.numpy()[[2, 0]])
    capi_cpu.swap_per_layer(cache.data_ptr(), NUM_DEV, BB, host.ctypes.data, NUM_HOST, ids, [1, 3], ops.CopyDirection.DEVICE_TO_HOST)
    np.testing.assert_array_equal(host[[1, 3]], cache.numpy()[[2, 0]])
    ops.swap_cache_per_layer(cache, host.ctypes.data, NUM_HOST, paddle_ops.to_tensor([2, 0]), [4, 7], 0,
                             ops.CopyDirection.DEVICE_TO_HOST)
    np.testing.assert_array_equal(host[[4, 7]], cache.numpy()[[2, 0]])


@pytest.mark.parametrize("argument", ["max_block_num_cpu", "mode", "rank", "cache_cpu_ptr"])
def test_non_integer_scalars_are_refused(paddle_ops, host_buffer, argument: str) -> None:
    cache = paddle_ops.zeros([NUM_DEV, BB], dtype="uint8")
    host = host_buffer(NUM_HOST * BB)
    kwargs: dict[str, Any] = {"cache_cpu_ptr": host.ctypes.data, "max_block_num_cpu": NUM_HOST, "rank": 0,
                              "mode": ops.CopyDirection.DEVICE_TO_HOST}
    # NOTE: a float that truncates to a valid value, so the old code copied without a crash
    kwargs[argument] = kwargs[argument] + 0.5
    with pytest.raises(ops.SwapOpError) as info:
        ops.swap_cache_per_layer(cache, kwargs["cache_cpu_ptr"], kwargs["max_block_num_cpu"], [0], [0],
                                 kwargs["rank"], kwargs["mode"])
    assert info.value.argument == argument


# ------------------------------------------------------------------ error fields as values
def test_capi_error_fields_cross_the_abi_as_values(capi_cpu: ops.CApi) -> None:
    """op / argument / index come from fdkv_last_error_fields: an op name that no message
    parser could split ("two words") still comes back intact."""
    dev = np.zeros((NUM_DEV, BB), np.uint8)
    host = np.zeros((NUM_HOST, BB), np.uint8)
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu._swap("fdkv_swap_layers", "two words: [7]", [dev.ctypes.data], NUM_DEV, BB, [host.ctypes.data],
                       NUM_HOST, [0, 1], [3, 3], ops.CopyDirection.DEVICE_TO_HOST, 0, False)
    assert (info.value.op, info.value.argument, info.value.index) == ("two words: [7]", "host_ids", 1)
    code, message, op, argument, index = capi_cpu.last_error()
    assert (code, op, argument, index) == (1, "two words: [7]", "host_ids", 1)
    assert message == str(info.value)
    capi_cpu.swap_per_layer(dev.ctypes.data, NUM_DEV, BB, host.ctypes.data, NUM_HOST, [0], [0], 0)
    assert capi_cpu.last_error()[0] == 0, "a successful call clears the error"


def test_paddle_error_fields_come_from_the_extension_abi(paddle_ops, host_buffer) -> None:
    cache = paddle_ops.zeros([NUM_DEV, BB], dtype="uint8")
    host = host_buffer(NUM_HOST * BB)
    with pytest.raises(ops.SwapOpError) as info:
        ops.swap_cache_per_layer(cache, host.ctypes.data, NUM_HOST, [0, 9], [0, 1], 0, ops.CopyDirection.DEVICE_TO_HOST)
    code, message, op, argument, index = ops.paddle_ops_capi().last_error()
    assert (code, op, argument, index) == (1, "swap_cache_per_layer", "swap_block_ids_gpu", 1)
    assert (info.value.op, info.value.argument, info.value.index) == (op, argument, index)
    assert str(info.value) == message


# ------------------------------------------------------------------ rank
def test_rank_is_range_checked(paddle_ops, host_buffer) -> None:
    """rank is the device ordinal (checked against the tensors' GPU there); -1 means 'the
    tensors' device', anything below is an error.  CPU tensors ignore the ordinal."""
    cache = paddle_ops.zeros([NUM_DEV, BB], dtype="uint8")
    host = host_buffer(NUM_HOST * BB)
    with pytest.raises(ops.SwapOpError) as info:
        ops.swap_cache_all_layers([cache], [host.ctypes.data], NUM_HOST, [0], [0], -2, ops.CopyDirection.DEVICE_TO_HOST)
    assert (info.value.op, info.value.argument, info.value.index) == ("swap_cache_all_layers", "rank", None)
    ops.swap_cache_all_layers([cache], [host.ctypes.data], NUM_HOST, [0], [0], -1, ops.CopyDirection.DEVICE_TO_HOST)
    ops.swap_cache_all_layers([cache], [host.ctypes.data], NUM_HOST, [0], [0], 3, ops.CopyDirection.DEVICE_TO_HOST)


def test_mode_aliases_are_the_copy_direction() -> None:
    from fastdeploy_kvcache.core.metadata import CopyDirection

    assert ops.CopyDirection.DEVICE_TO_HOST is CopyDirection.DEVICE_TO_HOST and ops.CopyDirection.DEVICE_TO_HOST == 0
    assert ops.CopyDirection.HOST_TO_DEVICE is CopyDirection.HOST_TO_DEVICE and ops.CopyDirection.HOST_TO_DEVICE == 1


def test_capi_pointers_must_be_addresses(capi_cpu: ops.CApi) -> None:
    """A negative or float pointer would wrap (or truncate) in ctypes: refused in Python."""
    host = np.zeros((NUM_HOST, BB), np.uint8)
    for bad in (-8, 2.0, 2**64):
        with pytest.raises(ops.SwapOpError) as info:
            capi_cpu.swap_per_layer(bad, NUM_DEV, BB, host.ctypes.data, NUM_HOST, [0], [0], ops.CopyDirection.DEVICE_TO_HOST)
        assert (info.value.op, info.value.argument) == ("swap_per_layer", "dev_ptrs")
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu.host_free(-1)
    assert info.value.argument == "ptr"


def test_errors_name_the_argument_each_face_was_given(paddle_ops, capi_cpu: ops.CApi, host_buffer) -> None:
    """The C ABI names its own arrays (not Paddle's names), and a per-layer op's one
    tensor is named without an index."""
    host = host_buffer(NUM_HOST * BB)
    dev = np.zeros((NUM_DEV, BB), np.uint8)
    cases = [
        (lambda: capi_cpu.swap_per_layer(0, NUM_DEV, BB, host.ctypes.data, NUM_HOST, [0], [0], 0), "dev_ptrs", 0),
        (lambda: capi_cpu.swap_per_layer(dev.ctypes.data, NUM_DEV, -BB, host.ctypes.data, NUM_HOST, [0], [0], 0),
         "block_bytes", 0),
        (lambda: capi_cpu.swap_all_layers([dev.ctypes.data] * 2, [host.ctypes.data] * 2, [NUM_DEV, -1], BB,
                                          NUM_HOST, [0], [0], 0), "num_dev_blocks", 1),
        (lambda: capi_cpu.swap_layout([dev.ctypes.data], NUM_DEV, BB, 0, NUM_HOST, [0], [0], 0), "host_ptr", None),
        (lambda: ops.swap_cache_per_layer(paddle_ops.zeros([NUM_DEV, BB], dtype="float64"), host.ctypes.data,
                                          NUM_HOST, [0], [0], 0, 0), "cache_gpu", None),
        (lambda: ops.swap_cache_all_layers([paddle_ops.zeros([NUM_DEV, BB], dtype="uint8"),
                                            paddle_ops.zeros([NUM_DEV, BB], dtype="int64")],
                                           [host.ctypes.data] * 2, NUM_HOST, [0], [0], 0, 0), "cache_gpu_tensors", 1),
    ]
    for call, argument, index in cases:
        with pytest.raises(ops.SwapOpError) as info:
            call()
        assert (info.value.argument, info.value.index) == (argument, index), str(info.value)
    with pytest.raises(ops.SwapOpError) as info:
        capi_cpu.set_option("copy_grid", 2**70)
    assert info.value.argument == "value"
