"""Pinned host memory for the host tier: from the Paddle extension when it is built (it
matches the installed Paddle, CUDA or not), else from the standalone C ABI library."""

from __future__ import annotations

from typing import Sequence

from fastdeploy_kvcache.ops.capi import CApi, load_capi
from fastdeploy_kvcache.ops.paddle_ops import paddle_ops_available, paddle_ops_capi


def _host_api() -> CApi:
    """The ABI used for pinned memory: the Paddle extension's if built (it matches the
    installed Paddle, CUDA or not), else the standalone C ABI library."""
    if paddle_ops_available():
        return paddle_ops_capi()
    return load_capi()


def cuda_host_alloc(nbytes: int, flags: int = 0) -> int:
    """Allocate ``nbytes`` of pinned host memory and return its address.

    With CUDA the memory is pinned (device copies run at full PCIe speed and the copy
    kernel can read it directly): anonymous pages faulted in by several threads, then one
    ``cudaHostRegister``, several times faster than ``cudaHostAlloc``, which serves only
    write-combined ``flags``.  Without CUDA it is a 4 KiB-aligned resident allocation, so
    the CPU paths and tests work unchanged.  It reads as zero.
    """
    return _host_api().host_alloc(nbytes, flags)


def cuda_host_free(ptr: int) -> None:
    """Free memory returned by :func:`cuda_host_alloc`."""
    _host_api().host_free(ptr)



def cuda_host_reserve(nbytes: int) -> int:
    """Address space for ``nbytes`` of host memory, pinned later piece by piece with
    :func:`cuda_host_pin_ranges`; freed by :func:`cuda_host_free`."""
    return _host_api().host_reserve(nbytes)


def cuda_host_pin_ranges(base: int, ranges: Sequence[tuple[int, int]], threads: int = 0, device: int = -1) -> int:
    """Pin ``(offset, length)`` byte ranges of a :func:`cuda_host_reserve` buffer (see
    ``CApi.host_pin_ranges``); returns the bytes newly pinned."""
    return _host_api().host_pin_ranges(base, ranges, threads, device)
