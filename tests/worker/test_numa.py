"""worker/numa.py: the GPU's NUMA node from sysfs, page-placement policy, physical RAM size.

The sysfs tests build a real directory tree shaped like ``/sys/bus/pci/devices``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from fastdeploy_kvcache.worker import numa


def _pci_device(root: Path, bus_id: str, vendor: str, node: str) -> None:
    device = root / "bus" / "pci" / "devices" / bus_id
    device.mkdir(parents=True)
    (device / "vendor").write_text(vendor + "\n")
    (device / "numa_node").write_text(node + "\n")


@pytest.fixture
def sysfs(tmp_path: Path) -> Path:
    _pci_device(tmp_path, "0000:00:1f.0", "0x8086", "0")  # not a GPU
    _pci_device(tmp_path, "0000:3b:00.0", numa.NVIDIA_PCI_VENDOR, "0")
    _pci_device(tmp_path, "0000:d8:00.0", numa.NVIDIA_PCI_VENDOR, "1")
    _pci_device(tmp_path, "0000:e1:00.0", numa.NVIDIA_PCI_VENDOR, "-1")  # platform does not say
    return tmp_path


def test_node_of_a_known_bus_id(sysfs: Path) -> None:
    assert numa.numa_node_from_sysfs("0000:D8:00.0", str(sysfs)) == 1  # case-insensitive
    assert numa.numa_node_from_sysfs("0000:3b:00.0", str(sysfs)) == 0
    assert numa.numa_node_from_sysfs("0000:e1:00.0", str(sysfs)) is None


def test_unknown_bus_id_falls_back_to_the_first_nvidia_device(sysfs: Path) -> None:
    assert numa.numa_node_from_sysfs(None, str(sysfs)) == 0
    assert numa.numa_node_from_sysfs("0000:99:00.0", str(sysfs)) == 0


def test_no_nvidia_device_gives_none(tmp_path: Path) -> None:
    _pci_device(tmp_path, "0000:00:1f.0", "0x8086", "0")
    assert numa.numa_node_from_sysfs(None, str(tmp_path)) is None
    assert numa.numa_node_from_sysfs(None, str(tmp_path / "missing")) is None


@pytest.mark.parametrize(
    "smi, sysfs_id",
    [("00000000:3B:00.0", "0000:3b:00.0"), ("0000:d8:00.0", "0000:d8:00.0"), ("00000001:1A:00.1\n", "0001:1a:00.1")],
)
def test_bus_ids_are_normalized_to_the_sysfs_spelling(smi: str, sysfs_id: str) -> None:
    assert numa.sysfs_bus_id(smi) == sysfs_id


def test_a_host_thread_backend_has_no_gpu_node() -> None:
    from worker_helpers import capi_or_skip

    capi_or_skip()
    from fastdeploy_kvcache.worker.backends import make_backend

    backend = make_backend("cpu", 0, threaded=False)
    assert numa.gpu_numa_node(backend, 0) is None


def test_numa_binding_is_best_effort_and_never_raises() -> None:
    with numa.PreferredNumaNode(None) as binding:
        assert not binding.bound
    with numa.PreferredNumaNode(0) as binding:  # node 0 exists on any Linux host; may be refused
        data = bytearray(1 << 20)  # an allocation under the policy works either way
        assert len(data) == 1 << 20
    assert not binding.bound  # the default policy is back
    for node in (10_000, -1):  # outside the syscall's mask: skipped, logged
        with numa.PreferredNumaNode(node) as binding:
            assert not binding.bound


def test_physical_memory_is_known_on_linux() -> None:
    total = numa.physical_memory_bytes()
    assert total is not None and total == os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    assert total > 1 << 28
