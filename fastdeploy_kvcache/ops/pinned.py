"""Pinned host memory for the host tier: from the Paddle extension when it is built (it
matches the installed Paddle, CUDA or not), else from the standalone C ABI library."""

from __future__ import annotations

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

    With CUDA this is ``cudaHostAlloc(nbytes, flags)`` (pinned, so device copies run at
    full PCIe speed and the copy kernel can read it directly); without CUDA it is a
    4 KiB-aligned allocation, so the CPU paths and tests work unchanged.
    """
    return _host_api().host_alloc(nbytes, flags)


def cuda_host_free(ptr: int) -> None:
    """Free memory returned by :func:`cuda_host_alloc`."""
    _host_api().host_free(ptr)

