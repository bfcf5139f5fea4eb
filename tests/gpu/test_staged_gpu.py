"""The staged copy path (device-side gather/scatter through the device staging ring, one
DMA per contiguous host run; custom_ops/csrc/swap_staged.cu) on a GPU.

* The byte matrix: every dtype, every id pattern of tests/swap_reference.py plus "host
  runs" (scattered device ids, consecutive host ids), per-layer / all-layers / layout,
  both directions, with chunks small enough that every call wraps the ring several times.
* auto picks it exactly where host ids merge into runs longer than the shared runs.
* Stream contract: it never synchronizes, it runs while another stream is busy, and 200
  calls queued behind a blocked stream keep their own ring slots and tables.
* Two threads (one per direction) at once, and the worker's ordering-rule race tests and
  random trace re-run with loads and evictions on the staged path.
* compute-sanitizer memcheck and racecheck on a staged smoke run and on the worker smoke.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import pytest

from fastdeploy_kvcache import ops
from fastdeploy_kvcache.worker.transfer_manager import TransferManager
from swap_reference import PATTERNS, expected_after_swap, id_patterns

pytestmark = pytest.mark.gpu

NUM_DEV, NUM_HOST = 40, 48
# (dtype name, per-block shape): K/V block shapes of several models, in bytes 4 KiB..256 KiB,
# plus odd sizes that force 8-, 4-, 2- and 1-byte accesses.
DTYPES = {
    "bfloat16": (np.uint16, (2, 16, 64)),     # CuPy has no bf16: same bytes, 2-byte elements
    "float16": (np.float16, (1, 64, 128)),
    "float32": (np.float32, (4, 16, 128)),
    "uint8": (np.uint8, (8, 64, 128)),
}
ODD_BYTES = [24, 6, 1, 4100, 12]
ALL_PATTERNS = PATTERNS + ["host_runs"]


@pytest.fixture
def options(capi):
    names = ("copy_path", "staging_chunk_bytes", "staging_bytes", "staging_grid", "staged_min_bytes", "staging_mode")
    saved = {k: capi.get_option(k) for k in names}
    yield capi.set_option
    for k, v in saved.items():
        capi.set_option(k, v)


def _patterns(seed: int) -> dict[str, tuple[list[int], list[int]]]:
    rng = np.random.default_rng(seed)
    pats = id_patterns(NUM_DEV, NUM_HOST, rng)
    n = 20
    pats["host_runs"] = (rng.choice(NUM_DEV, n, replace=False).tolist(), list(range(5, 5 + n)))
    return pats


def _arrays(cupy, pinned, dtype, shape, layers: int, seed: int):
    rng = np.random.default_rng(seed)
    bb = int(np.prod(shape)) * np.dtype(dtype).itemsize
    devs = [cupy.asarray(rng.integers(0, 256, (NUM_DEV, bb), dtype=np.uint8)).view(dtype).reshape((NUM_DEV,) + shape)
            for _ in range(layers)]
    hosts = [pinned(NUM_HOST * bb).reshape(NUM_HOST, bb) for _ in range(layers)]
    return devs, hosts, bb


def _check(cupy, devs, hosts, want_devs, want_hosts) -> None:
    for d, wd in zip(devs, want_devs):
        np.testing.assert_array_equal(cupy.asnumpy(d).view(np.uint8).reshape(wd.shape), wd)
    for h, wh in zip(hosts, want_hosts):
        np.testing.assert_array_equal(h, wh)


@pytest.mark.parametrize("dtype", list(DTYPES))
@pytest.mark.parametrize("pattern", ALL_PATTERNS)
@pytest.mark.parametrize("entry", ["per_layer", "all_layers"])
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_staged_matrix(cupy, capi, pinned, cuda_stream, options, dtype, pattern, entry, mode) -> None:
    options("staging_chunk_bytes", 64 << 10)  # many chunks per call: ring wrap-around, split blocks
    options("staging_bytes", 1 << 20)
    dt, shape = DTYPES[dtype]
    layers = 1 if entry == "per_layer" else 3
    devs, hosts, bb = _arrays(cupy, pinned, dt, shape, layers, seed=len(pattern) + mode)
    dev_ids, host_ids = _patterns(bb + mode)[pattern]
    flat = [d.view(np.uint8).reshape(NUM_DEV, bb) for d in devs]
    want = [expected_after_swap(cupy.asnumpy(f), h, dev_ids, host_ids, mode) for f, h in zip(flat, hosts)]
    s = cuda_stream()
    if entry == "per_layer":
        capi.swap_per_layer(devs[0].data.ptr, NUM_DEV, bb, hosts[0].ctypes.data, NUM_HOST, dev_ids, host_ids, mode,
                            stream=s, path="staged")
    else:
        capi.swap_all_layers([d.data.ptr for d in devs], [h.ctypes.data for h in hosts], NUM_DEV, bb, NUM_HOST,
                             dev_ids, host_ids, mode, stream=s, path="staged")
    used = capi.last_path()
    s.synchronize()
    _check(cupy, flat, hosts, [w[0] for w in want], [w[1] for w in want])
    assert used == (ops.PATH_STAGED if dev_ids else 0)


@pytest.mark.parametrize("block_bytes", ODD_BYTES)
@pytest.mark.parametrize("pattern", ["host_runs", "scattered", "reversed"])
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_staged_odd_block_sizes_mixed_lanes(cupy, capi, pinned, cuda_stream, options, block_bytes, pattern,
                                            mode) -> None:
    """K/V lanes plus smaller scale lanes in one call, block sizes that are not 16-byte
    multiples (narrower accesses), one tiny chunk so blocks straddle chunk boundaries."""
    options("staging_chunk_bytes", 64 << 10)
    options("staging_bytes", 1 << 20)  # 16 slots (a ring has at most 64)
    sizes = [block_bytes * 97, block_bytes * 97, block_bytes, block_bytes]
    rng = np.random.default_rng(block_bytes)
    devs = [cupy.asarray(rng.integers(0, 256, (NUM_DEV, b), dtype=np.uint8)) for b in sizes]
    hosts = [pinned(NUM_HOST * b).reshape(NUM_HOST, b) for b in sizes]
    dev_ids, host_ids = _patterns(block_bytes)[pattern]
    want = [expected_after_swap(cupy.asnumpy(d), h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts)]
    s = cuda_stream()
    capi.swap_all_layers([d.data.ptr for d in devs], [h.ctypes.data for h in hosts], NUM_DEV, sizes, NUM_HOST,
                         dev_ids, host_ids, mode, stream=s, path="staged")
    assert capi.last_path() == ops.PATH_STAGED
    s.synchronize()
    _check(cupy, devs, hosts, [w[0] for w in want], [w[1] for w in want])


@pytest.mark.parametrize("pattern", ALL_PATTERNS)
@pytest.mark.parametrize("block_bytes", [4096, 24, 64 << 10])
def test_staged_layout_round_trip(cupy, capi, pinned, cuda_stream, options, pattern, block_bytes) -> None:
    """The block-major layout op: a run of host blocks is one DMA across all tensors."""
    options("staging_chunk_bytes", 64 << 10)
    options("staging_bytes", 1 << 20)  # 16 slots (a ring has at most 64)
    sizes = [block_bytes] * 4 + [16, 16]
    rng = np.random.default_rng(len(pattern))
    devs = [cupy.asarray(rng.integers(0, 256, (NUM_DEV, b), dtype=np.uint8)) for b in sizes]
    host = pinned(NUM_HOST * sum(sizes)).reshape(NUM_HOST, sum(sizes))
    dev_ids, host_ids = _patterns(block_bytes)[pattern]
    want = host.copy()
    offsets = np.cumsum([0] + sizes[:-1])
    for d, off, b in zip(devs, offsets, sizes):
        want[host_ids, off:off + b] = cupy.asnumpy(d)[dev_ids]
    s = cuda_stream()
    capi.swap_layout([d.data.ptr for d in devs], NUM_DEV, sizes, host.ctypes.data, NUM_HOST, dev_ids, host_ids,
                     ops.CopyDirection.DEVICE_TO_HOST, stream=s, path="staged")
    s.synchronize()
    np.testing.assert_array_equal(host, want)
    fresh = [cupy.zeros((NUM_DEV, b), np.uint8) for b in sizes]
    capi.swap_layout([f.data.ptr for f in fresh], NUM_DEV, sizes, host.ctypes.data, NUM_HOST, dev_ids, host_ids,
                     ops.CopyDirection.HOST_TO_DEVICE, stream=s, sync=True, path="staged")
    for f, d in zip(fresh, devs):
        np.testing.assert_array_equal(cupy.asnumpy(f)[dev_ids], cupy.asnumpy(d)[dev_ids])


@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_staged_large_call_default_ring(cupy, capi, pinned, cuda_stream, options, mode) -> None:
    """Default ring and chunk sizes, a call larger than the ring (48 MiB x 2 lanes)."""
    bb, n_dev, n_host, n = 256 << 10, 200, 200, 192
    rng = np.random.default_rng(mode)
    devs = [cupy.asarray(rng.integers(0, 256, (n_dev, bb), dtype=np.uint8)) for _ in range(2)]
    hosts = [pinned(n_host * bb).reshape(n_host, bb) for _ in range(2)]
    dev_ids = rng.permutation(n_dev)[:n].tolist()
    host_ids = list(range(4, 4 + n))
    want = [expected_after_swap(cupy.asnumpy(d), h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts)]
    s = cuda_stream()
    capi.swap_all_layers([d.data.ptr for d in devs], [h.ctypes.data for h in hosts], n_dev, bb, n_host, dev_ids,
                         host_ids, mode, stream=s, path="staged")
    s.synchronize()
    _check(cupy, devs, hosts, [w[0] for w in want], [w[1] for w in want])


# ----------------------------------------------------------------------------- auto
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
@pytest.mark.parametrize(
    "pattern,block_bytes,lanes,want",
    [
        ("host_runs", 16 << 10, 64, ops.PATH_STAGED),  # 64 lanes x 20-block host run: 20 MiB
        ("host_runs", 16 << 10, 8, ops.PATH_KERNEL),   # the same runs in a 2.5 MiB call: too small
        ("scattered", 16 << 10, 16, ops.PATH_KERNEL),  # no host runs: the old size rule
        ("host_runs", 128 << 10, 32, ops.PATH_STAGED),  # big blocks, an all-layer call: 80 MiB
        ("host_runs", 128 << 10, 8, ops.PATH_DMA),      # the same blocks per layer (20 MiB): DMA batch
        ("scattered", 128 << 10, 2, ops.PATH_DMA),
        ("consecutive", 128 << 10, 2, ops.PATH_DMA),   # both sides run together: nothing to gain
    ],
)
def test_auto_picks_staged_where_host_runs_are_long(cupy, capi, pinned, cuda_stream, options, mode, pattern,
                                                    block_bytes, lanes, want) -> None:
    options("copy_path", ops.COPY_PATH_AUTO)
    rng = np.random.default_rng(3)
    devs = [cupy.asarray(rng.integers(0, 256, (NUM_DEV, block_bytes), dtype=np.uint8)) for _ in range(lanes)]
    hosts = [pinned(NUM_HOST * block_bytes).reshape(NUM_HOST, block_bytes) for _ in range(lanes)]
    dev_ids, host_ids = _patterns(5)[pattern]
    want_state = [expected_after_swap(cupy.asnumpy(d), h, dev_ids, host_ids, mode) for d, h in zip(devs, hosts)]
    s = cuda_stream()
    # Lanes 0 and 1 swapped: separate allocations can land at one pitch by chance, and
    # tensors at one pitch keep big blocks on DMA rows (test_dma_rows_gpu.py).
    order = [1, 0] + list(range(2, lanes)) if lanes > 2 else list(range(lanes))
    capi.swap_all_layers([devs[i].data.ptr for i in order], [hosts[i].ctypes.data for i in order], NUM_DEV,
                         block_bytes, NUM_HOST, dev_ids, host_ids, mode, stream=s)
    used = capi.last_path()
    s.synchronize()
    _check(cupy, devs, hosts, [w[0] for w in want_state], [w[1] for w in want_state])
    assert used == want, f"last_path()={used}, want {want}"


def test_staged_option_ranges(capi, options) -> None:
    for name, bad in (("staging_bytes", (1 << 20) - 1), ("staging_chunk_bytes", 1024), ("staging_grid", 0),
                      ("staged_min_bytes", -1), ("staging_mode", 2)):
        with pytest.raises(ops.SwapOpError):
            capi.set_option(name, bad)
    options("copy_path", ops.COPY_PATH_STAGED)
    assert capi.get_option("copy_path") == ops.COPY_PATH_STAGED


# ----------------------------------------------------------------------------- streams
@pytest.mark.parametrize("path,staging_mode", [("staged", 0), ("staged", 1), ("dma", 0)])
@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_staged_never_synchronizes_and_orders_after_the_stream(cupy, capi, pinned, cuda_stream, options, blocker,
                                                               mode, path, staging_mode) -> None:
    """Enqueued behind a blocked stream: the call returns with the stream busy, nothing
    moves before the stream's earlier work (the side stream waits for it), and the bytes
    land once it is released.  The DMA batch (cudaMemcpyBatchAsync, which the staged path
    uses for its DMAs) is held to the same rule.  Both staging modes: DMAs as one batch per
    chunk (0) or as cudaMemcpyAsync calls (1)."""
    options("staging_chunk_bytes", 64 << 10)
    options("staging_bytes", 1 << 20)  # 16 slots (a ring has at most 64)
    options("staging_mode", staging_mode)
    s = cuda_stream()
    bb = 32 << 10
    dev = cupy.asarray(np.random.default_rng(4).integers(0, 256, (NUM_DEV, bb), dtype=np.uint8))
    host = pinned(NUM_HOST * bb).reshape(NUM_HOST, bb)
    dev_ids, host_ids = _patterns(1)["host_runs"]
    want_dev, want_host = expected_after_swap(cupy.asnumpy(dev), host, dev_ids, host_ids, mode)
    before_dev, before_host = cupy.asnumpy(dev), host.copy()
    side, snap = cuda_stream(), cupy.empty_like(dev)  # made before the stream is blocked
    cupy.cuda.runtime.deviceSynchronize()
    blocker.block(s)
    try:
        capi.swap_per_layer(dev.data.ptr, NUM_DEV, bb, host.ctypes.data, NUM_HOST, dev_ids, host_ids, mode, stream=s,
                            path=path)
        assert not s.done, "the op returned with its stream still blocked: it did not synchronize"
        # NOTE: a plain device-to-device memcpy, not dev.copy(): a CuPy kernel's first launch
        # loads its module, which waits for the device to idle, i.e. for the blocker's
        # 10 s cap, after which this call's own copies run and the check below would fail
        # for a reason that has nothing to do with the op.
        cupy.cuda.runtime.memcpyAsync(snap.data.ptr, dev.data.ptr, dev.nbytes, cupy.cuda.runtime.memcpyDeviceToDevice,
                                      side.ptr)
        side.synchronize()
        np.testing.assert_array_equal(cupy.asnumpy(snap), before_dev)  # nothing scattered early
        np.testing.assert_array_equal(host, before_host)  # nothing gathered-and-written early
    finally:
        blocker.release()
    s.synchronize()
    np.testing.assert_array_equal(cupy.asnumpy(dev), want_dev)
    np.testing.assert_array_equal(host, want_host)


@pytest.mark.parametrize("mode", [ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE])
def test_staged_runs_while_another_stream_is_busy(cupy, capi, pinned, cuda_stream, options, blocker, mode) -> None:
    compute, transfer = cuda_stream(), cuda_stream()
    bb = 16 << 10
    dev = cupy.asarray(np.random.default_rng(5).integers(0, 256, (NUM_DEV, bb), dtype=np.uint8))
    host = pinned(NUM_HOST * bb).reshape(NUM_HOST, bb)
    dev_ids, host_ids = _patterns(2)["host_runs"]
    want_dev, want_host = expected_after_swap(cupy.asnumpy(dev), host, dev_ids, host_ids, mode)
    cupy.cuda.runtime.deviceSynchronize()
    blocker.block(compute)
    try:
        capi.swap_per_layer(dev.data.ptr, NUM_DEV, bb, host.ctypes.data, NUM_HOST, dev_ids, host_ids, mode,
                            stream=transfer, path="staged")
        transfer.record().synchronize()  # would hang (until the cap) if it waited for `compute`
        assert not compute.done
        np.testing.assert_array_equal(cupy.asnumpy(dev) if mode == ops.CopyDirection.HOST_TO_DEVICE else host,
                                      want_dev if mode == ops.CopyDirection.HOST_TO_DEVICE else want_host)
    finally:
        blocker.release()
    compute.synchronize()


def test_many_queued_staged_calls_keep_their_slots(cupy, capi, pinned, cuda_stream, options, blocker) -> None:
    """200 calls queued behind a blocked stream with a 2-slot ring: each slot is rewritten
    only after its previous reader finished, so every call's bytes arrive intact."""
    options("staging_bytes", 1 << 20)
    options("staging_chunk_bytes", 512 << 10)
    s = cuda_stream()
    bb = 8 << 10
    rng = np.random.default_rng(6)
    dev = cupy.asarray(rng.integers(0, 256, (NUM_DEV, bb), dtype=np.uint8))
    host = pinned(NUM_HOST * bb).reshape(NUM_HOST, bb)
    src = cupy.asnumpy(dev)
    expected = host.copy()
    cupy.cuda.runtime.deviceSynchronize()
    blocker.block(s)
    try:
        for _ in range(200):
            d = rng.choice(NUM_DEV, 12, replace=False)
            start = int(rng.integers(0, NUM_HOST - 12))
            h = np.arange(start, start + 12)
            expected[h] = src[d]
            capi.swap_per_layer(dev.data.ptr, NUM_DEV, bb, host.ctypes.data, NUM_HOST, d, h, 0, stream=s,
                                path="staged")
    finally:
        blocker.release()
    s.synchronize()
    np.testing.assert_array_equal(host, expected)


def test_two_threads_both_directions_at_once(cupy, capi, pinned) -> None:
    """The worker's shape: one thread evicts, one loads, each on its own stream, each
    direction on its own ring; 60 calls each with ring wrap-around."""
    bb = 64 << 10
    rng = np.random.default_rng(7)
    devs = [cupy.asarray(rng.integers(0, 256, (NUM_DEV, bb), dtype=np.uint8)) for _ in range(2)]
    hosts = [pinned(NUM_HOST * bb).reshape(NUM_HOST, bb) for _ in range(2)]
    dev_src, host_src = cupy.asnumpy(devs[0]), hosts[1].copy()
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    def worker(mode: int) -> None:
        try:
            cupy.cuda.Device(0).use()
            stream = cupy.cuda.Stream(non_blocking=True)
            k = 0 if mode == ops.CopyDirection.DEVICE_TO_HOST else 1
            start.wait()
            for i in range(60):
                d = list(range(i % 8, i % 8 + 24))[::-1]  # distinct, reversed: a scattered device side
                h = list(range(10, 34))
                capi.swap_per_layer(devs[k].data.ptr, NUM_DEV, bb, hosts[k].ctypes.data, NUM_HOST, d, h, mode,
                                    stream=stream, path="staged")
            stream.synchronize()
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(m,)) for m in (ops.CopyDirection.DEVICE_TO_HOST, ops.CopyDirection.HOST_TO_DEVICE)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    last = 59 % 8
    d = list(range(last, last + 24))[::-1]
    np.testing.assert_array_equal(hosts[0][10:34], dev_src[d])
    np.testing.assert_array_equal(cupy.asnumpy(devs[1])[d], host_src[10:34])


# ----------------------------------------------------------------------------- sanitizer
def _sanitize(tool: str, script: str, args: Sequence[str] = ()) -> str:
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        pytest.skip("needs compute-sanitizer (CUDA toolkit) on PATH or in /usr/local/cuda/bin")
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    cmd = [exe, "--tool", tool, "--error-exitcode", "99"]
    if tool == "memcheck":
        cmd += ["--leak-check", "no"]
    proc = subprocess.run(cmd + [sys.executable, str(Path(__file__).with_name(script)), *args], capture_output=True,
                          text=True, env=env, timeout=500)
    out = proc.stdout + proc.stderr
    log_dir = os.environ.get("FDKV_SANITIZER_LOG_DIR")
    if log_dir:
        Path(log_dir, f"staged_{script.removesuffix('.py')}_{tool}.log").write_text(out)
    assert proc.returncode == 0, out[-4000:]
    if tool == "memcheck":
        assert "ERROR SUMMARY: 0 errors" in out, out[-4000:]
    else:
        assert "RACECHECK SUMMARY: 0 hazards" in out or "hazard" not in out.lower(), out[-4000:]
    return out


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_staged_smoke(capi, tool: str) -> None:
    out = _sanitize(tool, "staged_smoke.py")
    assert "staged smoke: ok" in out


@pytest.mark.parametrize("tool", ["memcheck", "racecheck"])
def test_sanitizer_worker_on_the_staged_path(capi, tool: str) -> None:
    out = _sanitize(tool, "worker_sanitizer_smoke.py", ["--copy-path", "staged", "--d2h-copy-path", "staged"])
    assert "worker sanitizer smoke: ok" in out


# ----------------------------------------------------------------------------- the worker
# The ordering-rule race tests and the random trace, unchanged, re-run here with the
# worker's loads (process copy_path) and evictions/backups (the worker's d2h copy path) on the
# staged path: each still passes with its fence and fails with the fence switched off.
from test_worker_cupy import (  # noqa: E402,F401  (collected again under this module's fixture)
    compute,
    test_random_swaps_concurrent_with_compute_keep_data_correct,
    test_rule1_copy_waits_for_compute_that_wrote_the_block,
    test_rule2_compute_waits_for_the_eviction_reading_a_freed_block,
    test_rule2_load_waits_for_the_eviction_reading_its_destination,
    test_rule3_layer_compute_reads_after_its_load,
    test_rule4_host_block_read_by_a_load_is_not_overwritten,
    test_rule5_load_reads_host_blocks_after_the_eviction_into_them,
    test_short_run_for_sanitizers,
)


@pytest.fixture(autouse=True)
def _worker_on_staged(request: Any, monkeypatch) -> Any:
    """For the tests imported from test_worker_cupy: both directions on the staged path (the
    process-wide option for loads, the workers' default d2h path for evictions and backups)."""
    if request.function.__module__ != "test_worker_cupy":
        yield
        return
    capi = ops.load_capi(variant="cuda")
    saved = capi.get_option("copy_path")
    capi.set_option("copy_path", ops.COPY_PATH_STAGED)
    monkeypatch.setattr(TransferManager, "DEFAULT_D2H_COPY_PATH", "staged")
    yield
    capi.set_option("copy_path", saved)
