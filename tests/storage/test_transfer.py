"""Host tier <-> storage objects through the native block-major gather/scatter.

Real pieces only: a CacheController's pinned (aligned) host tier on the CPU backend, the CPU
build of the C ABI, and a file backend in a temporary directory.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import numpy as np
import pytest

from fastdeploy_kvcache.config import CacheConfig
from fastdeploy_kvcache.storage import KeyNamespace, Status, StorageError
from fastdeploy_kvcache.storage.file_backend import FileBackend
from fastdeploy_kvcache.storage.file_format import HEADER
from fastdeploy_kvcache.storage.transfer import HostTierLayout, StorageTransfer
from skip_helpers import needs_cpu_capi

pytestmark = needs_cpu_capi()


def host_view(ptr: int, nbytes: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))


@pytest.fixture(params=["bfloat16", "uint8-int8"])
def controller(request):
    from fastdeploy_kvcache.worker.cache_controller import CacheController

    if request.param == "bfloat16":
        cfg = CacheConfig(block_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype="bfloat16", num_host_blocks=8)
    else:
        cfg = CacheConfig(block_size=4, num_layers=3, num_kv_heads=2, head_dim=8, dtype="uint8",
                          kv_cache_quant="int8", num_host_blocks=8)
    ctl = CacheController(cfg, backend="cpu", threaded=False)
    ctl.initialize_host_cache()
    rng = np.random.default_rng(7)
    layout = HostTierLayout.from_controller(ctl)
    for ptr, bb in zip(layout.ptrs, layout.block_bytes):
        host_view(ptr, bb * layout.num_blocks)[:] = rng.integers(0, 256, bb * layout.num_blocks, dtype=np.uint8)
    yield ctl
    ctl.close()


def block_bytes(layout: HostTierLayout, block: int) -> bytes:
    """One block's object as the layout defines it: every tensor's block, in order."""
    return b"".join(
        host_view(p + block * bb, bb).tobytes() for p, bb in zip(layout.ptrs, layout.block_bytes)
    )


def keys_for(layout: HostTierLayout, hashes: list[int]) -> list[str]:
    ns = KeyNamespace("test-model", "fp0", "bfloat16", 4, layout.describe())
    return ns.keys(hashes)


def test_layout_of_a_controller(controller) -> None:
    layout = HostTierLayout.from_controller(controller)
    assert layout.object_bytes == controller.config.bytes_per_block
    assert layout.num_layers == 3 and len(layout.ptrs) == 3 * (4 if controller.quantized else 2)


def test_put_then_get_moves_whole_blocks(controller, tmp_path: Path) -> None:
    layout = HostTierLayout.from_controller(controller)
    backend = FileBackend(tmp_path, min_free_bytes=0)
    transfer = StorageTransfer(layout, backend, staging_blocks=2)  # batches of 3 split in chunks
    keys = keys_for(layout, [11, 12, 13])
    expected = [block_bytes(layout, b) for b in (1, 3, 5)]
    assert transfer.put_blocks(keys, [1, 3, 5]) == [Status.OK] * 3
    # The object on disk is the block-major concatenation: [layer][K, V, (scales)].
    for k, exp in zip(keys, expected):
        raw = (tmp_path / (k.replace(":", "=") + ".kv")).read_bytes()
        assert raw[HEADER.size:] == exp
    # Load them into other host blocks: every layer of each arrives.
    assert transfer.get_blocks(keys, [0, 2, 4]) == [layout.object_bytes] * 3
    for b, exp in zip((0, 2, 4), expected):
        assert block_bytes(layout, b) == exp
    transfer.close()
    backend.close()


def test_a_missing_block_is_not_scattered(controller, tmp_path: Path) -> None:
    layout = HostTierLayout.from_controller(controller)
    backend = FileBackend(tmp_path, min_free_bytes=0)
    transfer = StorageTransfer(layout, backend, staging_blocks=4)
    k = keys_for(layout, [21, 22, 23])
    assert transfer.put_blocks([k[0], k[2]], [1, 2]) == [Status.OK] * 2
    before = block_bytes(layout, 6)
    results = transfer.get_blocks(k, [5, 6, 7])
    assert results == [layout.object_bytes, Status.MISSING, layout.object_bytes]
    assert block_bytes(layout, 6) == before  # untouched
    assert block_bytes(layout, 5) == block_bytes(layout, 1)
    assert block_bytes(layout, 7) == block_bytes(layout, 2)
    transfer.close()
    backend.close()


def test_async_and_bad_ids(controller, tmp_path: Path) -> None:
    layout = HostTierLayout.from_controller(controller)
    backend = FileBackend(tmp_path, min_free_bytes=0)
    transfer = StorageTransfer(layout, backend)
    k = keys_for(layout, [31, 32])
    assert transfer.submit_put_blocks(k, [0, 1]).result(10) == [Status.OK] * 2
    assert transfer.submit_get_blocks(k, [6, 7]).result(10) == [layout.object_bytes] * 2
    assert block_bytes(layout, 6) == block_bytes(layout, 0)
    with pytest.raises(StorageError, match=r"host_block_ids\[1\] = 8 is outside"):
        transfer.put_blocks(k, [0, 8])
    with pytest.raises(StorageError, match=r"host_block_ids\[1\] = 0 appears twice"):
        transfer.get_blocks(k, [0, 0])
    with pytest.raises(StorageError, match="2 keys but 1 host block ids"):
        transfer.submit_put_blocks(k, [0])
    transfer.close()
    with pytest.raises(StorageError):
        transfer.put_blocks(k, [0, 1])
    backend.close()


def test_object_of_another_size_is_invalid_and_not_scattered(controller, tmp_path: Path) -> None:
    """A key holding an object of the wrong size (e.g. a partial block) never reaches the tier."""
    layout = HostTierLayout.from_controller(controller)
    backend = FileBackend(tmp_path, min_free_bytes=0)
    transfer = StorageTransfer(layout, backend, staging_blocks=2)
    k = keys_for(layout, [41])
    small = np.arange(100, dtype=np.uint8)
    backend.register_buffer(int(small.ctypes.data), 100)
    assert backend.batch_put_from(k, [int(small.ctypes.data)], [100]) == [Status.OK]
    before = block_bytes(layout, 3)
    assert transfer.get_blocks(k, [3]) == [Status.INVALID]
    assert block_bytes(layout, 3) == before
    transfer.close()
    backend.close()
