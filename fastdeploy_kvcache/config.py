"""Cache configuration and server flags, in one place.

``CacheConfig`` is shared by the scheduler side and the worker side, so it is plain
Python with no Paddle or CuPy import.  Engines build it from their server flags with
:func:`add_cli_args` / :meth:`CacheConfig.from_cli_args`.
"""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass, field, fields
from typing import Any, Optional

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

# Item size in bytes of every cache dtype the ops support.
DTYPE_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}

GiB = 1 << 30


@dataclass
class CacheConfig:
    """Shape of the KV cache and the policy knobs of the tiered manager.

    The per-layer cache tensor is ``[num_blocks, num_kv_heads, block_size, head_dim]``
    (the FastDeploy layout); one block of one layer of key (or value) is therefore
    ``num_kv_heads * block_size * head_dim * itemsize`` bytes.
    """

    block_size: int = 64
    num_layers: int = 2
    num_kv_heads: int = 1
    head_dim: int = 64
    dtype: str = "bfloat16"
    num_gpu_blocks: int = 0
    # Host tier size: either swap_space (GiB) or an explicit block count.
    swap_space: float = 0.0
    num_host_blocks: Optional[int] = None
    write_policy: str = "write_through_selective"
    write_through_threshold: int = 2
    enable_prefix_caching: bool = True
    # Insert a finished request's output tokens into the prefix tree too.
    cache_output_tokens: bool = True
    # Extra cache layers (e.g. speculative-decoding draft layers) beyond num_layers.
    num_extra_layers: int = 0
    # uint8 caches are quantized; they carry per-(block, head, token) fp32 scales.
    kv_cache_quant: Optional[str] = None
    tensor_parallel_size: int = 1
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the first bad field; called on construction."""
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"CacheConfig.block_size must be a positive int, got {self.block_size!r}")
        for name in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"CacheConfig.{name} must be a positive int, got {value!r}")
        if self.dtype not in DTYPE_ITEMSIZE:
            raise ValueError(
                f"CacheConfig.dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {self.dtype!r}"
            )
        if not isinstance(self.num_gpu_blocks, int) or self.num_gpu_blocks < 0:
            raise ValueError(f"CacheConfig.num_gpu_blocks must be an int >= 0, got {self.num_gpu_blocks!r}")
        if self.swap_space < 0:
            raise ValueError(f"CacheConfig.swap_space (GiB) must be >= 0, got {self.swap_space!r}")
        if self.num_host_blocks is not None and (
            not isinstance(self.num_host_blocks, int) or self.num_host_blocks < 0
        ):
            raise ValueError(f"CacheConfig.num_host_blocks must be an int >= 0, got {self.num_host_blocks!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"CacheConfig.write_policy must be one of {list(WRITE_POLICIES)}, got {self.write_policy!r}"
            )
        if not isinstance(self.write_through_threshold, int) or self.write_through_threshold < 1:
            raise ValueError(
                f"CacheConfig.write_through_threshold must be an int >= 1, got {self.write_through_threshold!r}"
            )
        if self.num_extra_layers < 0:
            raise ValueError(f"CacheConfig.num_extra_layers must be >= 0, got {self.num_extra_layers!r}")
        if self.kv_cache_quant not in (None, "int8", "fp8"):
            raise ValueError(f"CacheConfig.kv_cache_quant must be None, 'int8' or 'fp8', got {self.kv_cache_quant!r}")
        if self.kv_cache_quant is not None and self.dtype != "uint8":
            raise ValueError("CacheConfig.kv_cache_quant needs dtype='uint8' (quantized bytes)")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"CacheConfig.tensor_parallel_size must be >= 1, got {self.tensor_parallel_size!r}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def itemsize(self) -> int:
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def total_layers(self) -> int:
        """Model layers plus extra (draft) layers: the number of K/V cache pairs."""
        return self.num_layers + self.num_extra_layers

    @property
    def block_shape(self) -> tuple[int, int, int]:
        """Shape of one block of one layer's key (or value) cache, dim 0 excluded."""
        return (self.num_kv_heads, self.block_size, self.head_dim)

    @property
    def bytes_per_layer_block(self) -> int:
        """Bytes of one block of one layer's key cache (same for the value cache)."""
        return self.num_kv_heads * self.block_size * self.head_dim * self.itemsize

    @property
    def scale_bytes_per_layer_block(self) -> int:
        """Bytes of one block's fp32 scales for one layer's key (or value); 0 if unquantized."""
        if self.kv_cache_quant is None:
            return 0
        return self.num_kv_heads * self.block_size * 4

    @property
    def bytes_per_block(self) -> int:
        """Bytes one block occupies across all layers, keys, values and scales."""
        return 2 * self.total_layers * (self.bytes_per_layer_block + self.scale_bytes_per_layer_block)

    @property
    def host_block_count(self) -> int:
        """Host blocks: the explicit count if given, else what swap_space GiB holds."""
        if self.num_host_blocks is not None:
            return self.num_host_blocks
        return int(self.swap_space * GiB) // self.bytes_per_block

    # ------------------------------------------------------------------ CLI
    @classmethod
    def from_cli_args(cls, args: argparse.Namespace, **overrides: Any) -> "CacheConfig":
        """Build from the namespace produced by a parser that went through add_cli_args."""
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in vars(args).items() if k in names and v is not None}
        kwargs.update(overrides)
        return cls(**kwargs)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the cache server flags (``--swap-space``, ``--write-policy``, ...) to a parser."""
    group = parser.add_argument_group("KV cache (fastdeploy_kvcache)")
    group.add_argument("--block-size", dest="block_size", type=int, default=64,
                       help="Tokens per KV block (default: 64).")
    group.add_argument("--swap-space", dest="swap_space", type=float, default=0.0,
                       help="Host (pinned CPU) KV cache size in GiB per worker; 0 disables the host tier.")
    group.add_argument("--num-gpu-blocks", dest="num_gpu_blocks", type=int, default=0,
                       help="Device KV blocks (0: let the engine size it from free GPU memory).")
    group.add_argument("--write-policy", dest="write_policy", choices=WRITE_POLICIES,
                       default="write_through_selective",
                       help="When device blocks are copied to host: write_through (as soon as cached), "
                            "write_through_selective (after --write-through-threshold hits), "
                            "write_back (only when evicted from device).")
    group.add_argument("--write-through-threshold", dest="write_through_threshold", type=int, default=2,
                       help="Hits before write_through_selective backs a block up to host (>= 1).")
    group.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                       help="Disable prefix reuse (blocks are still allocated through the manager).")
    group.add_argument("--no-cache-output-tokens", dest="cache_output_tokens", action="store_false",
                       help="Insert only prompt blocks into the prefix tree on finish.")
    group.add_argument("--kv-cache-dtype", dest="dtype", choices=sorted(DTYPE_ITEMSIZE), default=None,
                       help="KV cache dtype (default: the model's).")
    return parser
