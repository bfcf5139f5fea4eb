"""Worker side: owns the KV memory, the copy streams and the ops; carries out metadata.

Importing this package is cheap: Paddle and CuPy load only when a backend is built.
"""

from fastdeploy_kvcache.worker.cache_controller import CacheController
from fastdeploy_kvcache.worker.layer_done import LayerDoneCounter, LayerSwapError, LayerSwapTimeoutError
from fastdeploy_kvcache.worker.transfer_manager import (
    ORDERING_RULES,
    CacheLayout,
    ControllerClosedError,
    TransferManager,
)

__all__ = [
    "ORDERING_RULES",
    "CacheController",
    "CacheLayout",
    "ControllerClosedError",
    "LayerDoneCounter",
    "LayerSwapError",
    "LayerSwapTimeoutError",
    "TransferManager",
]
