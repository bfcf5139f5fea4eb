"""Host memory topology for the pinned host cache: the GPU's NUMA node, page placement, RAM size.

Pinned host pages are placed by the allocating thread's memory policy.  A host cache on the
socket far from the GPU pays the inter-socket link on every host->device load, so the
controller allocates it with the GPU's node preferred.  Everything here is best effort: a
node that cannot be found or bound is logged and the allocation goes ahead unbound.

No libnuma: the GPU's node comes from sysfs (through its PCI bus id) and the policy is set
with the ``set_mempolicy`` system call.
"""

from __future__ import annotations

import ctypes
import glob
import logging
import os
import platform
import subprocess
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from fastdeploy_kvcache.worker.backends.base import Backend

logger = logging.getLogger(__name__)

NVIDIA_PCI_VENDOR = "0x10de"

_MPOL_DEFAULT = 0
_MPOL_PREFERRED = 1
_SYS_SET_MEMPOLICY = {"x86_64": 238, "aarch64": 237}
# set_mempolicy's maxnode argument: one more than the bits of the one-word mask we pass.
_MASK_BITS = 64


def gpu_numa_node(backend: "Backend", device_id: int, sysfs_root: str = "/sys") -> Optional[int]:
    """NUMA node of the backend's GPU ``device_id``, or None (no GPU, or not found)."""
    if not backend.is_cuda:
        return None
    try:
        return numa_node_from_sysfs(pci_bus_id(backend, device_id), sysfs_root)
    except Exception:  # noqa: BLE001 - best effort
        logger.warning("could not find the NUMA node of GPU %d", device_id, exc_info=True)
        return None


def numa_node_from_sysfs(bus_id: Optional[str], sysfs_root: str = "/sys") -> Optional[int]:
    """The ``numa_node`` sysfs reports for PCI device ``bus_id`` (``0000:3b:00.0``), or None.

    Without a bus id, the first NVIDIA PCI function's node is used.
    """
    devices = os.path.join(sysfs_root, "bus", "pci", "devices")
    if bus_id:
        path = os.path.join(devices, bus_id.lower(), "numa_node")
        if os.path.exists(path):
            return _read_node(path)
    # NOTE: right on single-socket and single-GPU hosts, a guess elsewhere (hence the log).
    for vendor in sorted(glob.glob(os.path.join(devices, "*", "vendor"))):
        with open(vendor) as fh:
            if fh.read().strip() != NVIDIA_PCI_VENDOR:
                continue
        logger.info("GPU bus id %s not found in sysfs; using the first NVIDIA device's NUMA node", bus_id)
        return _read_node(os.path.join(os.path.dirname(vendor), "numa_node"))
    return None


def _read_node(path: str) -> Optional[int]:
    with open(path) as fh:
        node = int(fh.read().strip())
    return node if node >= 0 else None  # -1: the platform does not say


def sysfs_bus_id(nvidia_smi_bus_id: str) -> str:
    """``00000000:3B:00.0`` (nvidia-smi, 8-digit domain) -> ``0000:3b:00.0`` (sysfs)."""
    domain, rest = nvidia_smi_bus_id.strip().split(":", 1)
    return f"{int(domain, 16):04x}:{rest.lower()}"


def pci_bus_id(backend: "Backend", device_id: int) -> Optional[str]:
    """Sysfs-style PCI bus id of the GPU, through CuPy or nvidia-smi; None if neither says."""
    if backend.name == "cupy":
        try:
            import cupy

            return sysfs_bus_id(str(cupy.cuda.runtime.deviceGetPCIBusId(device_id)))
        except Exception:  # noqa: BLE001
            logger.debug("cupy could not give the PCI bus id", exc_info=True)
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=pci.bus_id", "--format=csv,noheader", "-i", str(device_id)],
            capture_output=True, text=True, timeout=5, check=True,
        ).stdout.strip()
        if out:
            return sysfs_bus_id(out)
    except Exception:  # noqa: BLE001
        logger.debug("nvidia-smi could not give the PCI bus id", exc_info=True)
    return None


def physical_memory_bytes() -> Optional[int]:
    """Physical RAM of this machine in bytes, or None where the platform does not say.

    The controller refuses a pinned host cache larger than this before allocating: pinned
    pages cannot be swapped, so such a request can only fail (or take the machine down).
    """
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        page_size = os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):
        return None
    if pages <= 0 or page_size <= 0:
        return None
    return pages * page_size


class PreferredNumaNode:
    """Context manager: prefer ``node`` for this thread's new pages, then restore the default.

    ``bound`` says whether the policy was set.  Never raises: a node that is unknown, out of
    the mask's range, or refused by the kernel leaves the policy alone (logged).
    """

    def __init__(self, node: Optional[int]) -> None:
        self.node = node
        self.bound = False

    def __enter__(self) -> "PreferredNumaNode":
        if self.node is None:
            logger.info("NUMA binding skipped: the GPU's NUMA node is unknown")
            return self
        number = _SYS_SET_MEMPOLICY.get(platform.machine())
        if number is None or not 0 <= self.node < _MASK_BITS:
            logger.info("NUMA binding skipped on %s (node %d)", platform.machine(), self.node)
            return self
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            mask = ctypes.c_ulong(1 << self.node)
            if libc.syscall(number, _MPOL_PREFERRED, ctypes.byref(mask), _MASK_BITS + 1) != 0:
                logger.warning("set_mempolicy(node %d) failed: errno %d", self.node, ctypes.get_errno())
            else:
                self.bound = True
                logger.info("host cache pages preferred on NUMA node %d", self.node)
        except Exception:  # noqa: BLE001 - best effort
            logger.warning("NUMA binding to node %d failed", self.node, exc_info=True)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.bound:
            try:
                libc = ctypes.CDLL(None, use_errno=True)
                libc.syscall(_SYS_SET_MEMPOLICY[platform.machine()], _MPOL_DEFAULT, None, 0)
            except Exception:  # noqa: BLE001
                logger.warning("could not restore the default memory policy", exc_info=True)
            self.bound = False
