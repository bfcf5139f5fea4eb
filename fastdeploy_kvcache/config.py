"""Cache configuration and server flags, in one place.

``CacheConfig`` is shared by the scheduler side and the worker side, so it is plain
Python with no Paddle or CuPy import.  Engines build it from their server flags with
:func:`add_cli_args` / :meth:`CacheConfig.from_cli_args`.
"""

from __future__ import annotations

import argparse
import logging
import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from fastdeploy_kvcache.cli_flags import add_flag, existing_flag

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")

# Item size in bytes of every cache dtype the ops support.
DTYPE_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "uint8": 1}

# A dtype that stands for the model's: whoever loads the model puts its dtype in (the
# engine does, with dataclasses.replace); until then the sizes below are unknown.
AUTO_DTYPE = "auto"

# Quantized cache formats; None is an unquantized cache of ``dtype``.  An engine serves two,
# both uint8 K/V bytes with one fp32 scale per (block, head, token):
# * ``block_wise_fp8`` (FastDeploy's name): float8 e4m3 bytes, scale = amax over head_dim / FP8_E4M3_MAX;
# * ``block_wise_int8``: int8 bytes (two's complement), scale = amax over head_dim / INT8_MAX,
#   the value rounded to the nearest integer: 2-3x less error than e4m3 on K and V.
BLOCK_WISE_FP8 = "block_wise_fp8"
BLOCK_WISE_INT8 = "block_wise_int8"
KV_CACHE_QUANTS = (None, "int8", "fp8", BLOCK_WISE_FP8, BLOCK_WISE_INT8)
# The quantized formats an engine can serve (the others are layouts the copy ops carry).
SERVED_KV_CACHE_QUANTS = (BLOCK_WISE_FP8, BLOCK_WISE_INT8)
# Largest finite float8 e4m3fn value: a token's amax maps onto it.
FP8_E4M3_MAX = 448.0
# block_wise_int8: a token's amax maps onto 127 (symmetric: -128 is never written).
INT8_MAX = 127.0
# ``--kv-cache-dtype`` spelling of a quantized cache: dtype uint8 with this kv_cache_quant.
QUANTIZED_KV_DTYPES = {BLOCK_WISE_FP8: "uint8", BLOCK_WISE_INT8: "uint8"}

GiB = 1 << 30


def _show(value: Any) -> str:
    """``True (bool)``: a value and its type, for messages where the type is the problem."""
    return f"{value!r} ({type(value).__name__})"


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
    enable_output_caching: bool = True
    # Extra cache layers (e.g. speculative-decoding draft layers) beyond num_layers.
    num_extra_layers: int = 0
    # uint8 caches are quantized; they carry per-(block, head, token) fp32 scales.
    kv_cache_quant: Optional[str] = None
    tensor_parallel_size: int = 1
    # k-anonymous sharing across tenants (core/k_anonymity.py): a cached block is matched
    # by other tenants only once this many distinct tenants computed it.  0: off (every
    # block is shared at once, within its hash: salts still separate).
    k_anonymity_k: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Raise ValueError naming the first bad field; called on construction.

        Types are checked, not only ranges: ``True`` is not a block size (bool is an int
        subclass), ``1.0`` is not a layer count, and ``"no"`` is not a boolean.  Integral
        numbers of other types (numpy integers from a model config) are stored as ``int``.
        """
        for name in ("block_size", "num_layers", "num_kv_heads", "head_dim", "tensor_parallel_size"):
            self._check_int(name, minimum=1)
        self._check_int("num_gpu_blocks", minimum=0)
        self._check_int("num_extra_layers", minimum=0)
        self._check_int("write_through_threshold", minimum=1)
        if self.num_host_blocks is not None:
            self._check_int("num_host_blocks", minimum=0)
        self._check_int("k_anonymity_k", minimum=0)
        if self.k_anonymity_k == 1:
            raise ValueError("CacheConfig.k_anonymity_k must be 0 (off) or >= 2 (1 would share every block at once)")
        swap = self.swap_space
        if not isinstance(swap, numbers.Real) or isinstance(swap, bool) or not math.isfinite(swap) or swap < 0:
            raise ValueError(f"CacheConfig.swap_space (GiB) must be a finite number >= 0, got {_show(swap)}")
        self.swap_space = float(swap)
        if isinstance(self.dtype, str) and self.dtype in QUANTIZED_KV_DTYPES and self.kv_cache_quant in (None, self.dtype):
            # dtype="block_wise_fp8" (the --kv-cache-dtype spelling): the bytes and the format.
            self.dtype, self.kv_cache_quant = QUANTIZED_KV_DTYPES[self.dtype], self.dtype
        self._check_choice("dtype", (AUTO_DTYPE, *DTYPE_ITEMSIZE))
        self._check_choice("write_policy", WRITE_POLICIES)
        self._check_choice("kv_cache_quant", KV_CACHE_QUANTS)
        for name in ("enable_prefix_caching", "enable_output_caching"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"CacheConfig.{name} must be True or False, got {_show(value)}")
        if self.kv_cache_quant is not None and self.dtype != "uint8":
            raise ValueError(f"CacheConfig.kv_cache_quant {self.kv_cache_quant!r} needs dtype='uint8' "
                             f"(quantized bytes), got {self.dtype!r}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"CacheConfig.extra must be a dict, got {_show(self.extra)}")

    def _check_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"CacheConfig.{name} must be an int >= {minimum}, got {_show(value)}")
        setattr(self, name, int(value))

    def _check_choice(self, name: str, choices: tuple[Any, ...]) -> None:
        value = getattr(self, name)
        # The type is checked first, so a list or any other non-string names the field.
        if not (value is None or isinstance(value, str)) or value not in choices:
            raise ValueError(f"CacheConfig.{name} must be one of {list(choices)}, got {_show(value)}")

    # ------------------------------------------------------------------ derived sizes
    @property
    def itemsize(self) -> int:
        """Bytes of one cache element; ValueError while the dtype is still the model's (``auto``)."""
        if self.dtype == AUTO_DTYPE:
            raise ValueError("CacheConfig.dtype is 'auto' (the model's): put the model's dtype in before sizing the cache")
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
    def from_cli_args(cls, args: argparse.Namespace, defaults: Optional[dict[str, Any]] = None,
                      **overrides: Any) -> "CacheConfig":
        """Build from the namespace of a parser that went through :func:`add_cli_args`.

        Flags map onto fields through :data:`CLI_FLAGS` (``--num-gpu-blocks-override`` sets
        ``num_gpu_blocks``, ``--kv-cache-dtype auto`` leaves ``dtype`` at its default), read from
        the dest of the parser's own flag where it already had one.  A value of None means "not
        given".  ``defaults`` replace the class's defaults for flags not given (an engine that
        loads the model itself passes ``{"dtype": AUTO_DTYPE}``); ``overrides`` (the model's
        shape: num_layers, num_kv_heads, head_dim, ...) win over the flags.
        """
        values = vars(args)
        dests: dict[str, str] = dict(values.get(_DESTS_KEY) or {})
        kwargs: dict[str, Any] = dict(defaults or {})
        # NOTE: only the cache's own flags are read.  An engine parser has flags whose dests
        # happen to match a field but mean something else (a model --dtype of "auto"); the
        # model's shape comes in through ``overrides``.
        for spec in CLI_FLAGS:
            dest = dests.get(spec.field, spec.dest)
            value = values.get(dest)
            if value is None or (spec.field == "dtype" and value == AUTO_DTYPE):
                continue
            if spec.field == "kv_cache_quant":
                value = kv_cache_quant_of(value)
                if value is None:
                    continue
                dtype_flag = values.get(dests.get("dtype", "kv_cache_dtype"))
                if dtype_flag not in (None, AUTO_DTYPE, value, QUANTIZED_KV_DTYPES[value]):
                    raise ValueError(f"kv_cache_quant: kv_cache_quant_type {value} stores "
                                     f"{QUANTIZED_KV_DTYPES[value]} KV, but --kv-cache-dtype says {dtype_flag}; "
                                     "give one of the two")
                kwargs["dtype"] = value  # CacheConfig spells it out: uint8 bytes of that format
            kwargs[spec.field] = value
        kwargs.update(overrides)
        return cls(**kwargs)


# ---------------------------------------------------------------------- CLI flags
def _int_at_least(minimum: int) -> Callable[[str], int]:
    """argparse ``type=``: an integer >= ``minimum``; anything else is a usage error (exit 2)."""

    def parse(text: str) -> int:
        try:
            value = int(text, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
        return value

    parse.__name__ = f"int>={minimum}"
    return parse


def _finite_float_at_least(minimum: float) -> Callable[[str], float]:
    """argparse ``type=``: a finite number >= ``minimum`` (nan and inf are usage errors)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number >= {minimum:g}, got {text!r}") from None
        if not math.isfinite(value) or value < minimum:
            raise argparse.ArgumentTypeError(f"expected a finite number >= {minimum:g}, got {text!r}")
        return value

    parse.__name__ = f"float>={minimum:g}"
    return parse


def kv_cache_quant_of(value: Any) -> Optional[str]:
    """The KV cache format a quantization setting names: its ``kv_cache_quant_type``.

    ``value`` is what a ``--quantization`` flag left in its dest: a dict (this package's
    parser, or a host server's that parsed the JSON itself), JSON text, or a plain string
    (a host's weight-quantization name, which says nothing about the KV cache: None).
    ValueError, naming the flag, for a KV format no engine serves.
    """
    if isinstance(value, str):
        if not value.lstrip().startswith("{"):
            return None
        import json

        try:
            value = json.loads(value)
        except ValueError:
            raise ValueError(f"kv_cache_quant: --quantization is not valid JSON: {value!r}") from None
    if not isinstance(value, dict):
        raise ValueError(f"kv_cache_quant: --quantization must be a JSON object, got {_show(value)}")
    quant = value.get("kv_cache_quant_type")
    if quant is None or quant == "none":
        return None
    if quant not in SERVED_KV_CACHE_QUANTS:
        raise ValueError(f"kv_cache_quant: kv_cache_quant_type must be one of {list(SERVED_KV_CACHE_QUANTS)} "
                         f"(or null), got {quant!r}")
    return quant


def parse_quantization(text: str) -> dict[str, Any]:
    """argparse ``type=`` of ``--quantization``: a JSON object whose ``kv_cache_quant_type``
    picks the KV cache format (``"block_wise_fp8"`` or ``"block_wise_int8"``; null for none).

    NOTE: FastDeploy's flag of that name also selects weight quantization; this package
    quantizes no weights, so any other key is a usage error rather than silently ignored.
    """
    import json

    try:
        value = json.loads(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f'expected a JSON object such as \'{{"kv_cache_quant_type": "{BLOCK_WISE_FP8}"}}\', got {text!r}') from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    unknown = sorted(set(value) - {"kv_cache_quant_type"})
    if unknown:
        raise argparse.ArgumentTypeError(
            f"only kv_cache_quant_type is supported (this engine quantizes the KV cache, not weights), got {unknown}")
    quant = value.get("kv_cache_quant_type")
    if quant is not None and quant not in SERVED_KV_CACHE_QUANTS:
        raise argparse.ArgumentTypeError(
            f"kv_cache_quant_type must be one of {list(SERVED_KV_CACHE_QUANTS)} or null, got {quant!r}")
    return value


@dataclass(frozen=True)
class CliFlag:
    """One server flag: its FastDeploy spelling, the CacheConfig field it sets, argparse kwargs."""

    flag: str
    field: str
    kwargs: dict[str, Any]
    #: The ``--no-...`` form of a boolean flag (BooleanOptionalAction), else None.
    negative: Optional[str] = None

    @property
    def dest(self) -> str:
        """The dest argparse derives from the flag, so a parser that defined it agrees."""
        return self.flag.lstrip("-").replace("-", "_")


_DESTS_KEY = "_fdkv_cache_flag_dests"

#: The cache's server flags, spelled as FastDeploy spells them.
CLI_FLAGS: tuple[CliFlag, ...] = (
    CliFlag("--block-size", "block_size", dict(
        type=_int_at_least(1), default=None, metavar="TOKENS",
        help="Tokens per KV block (default: 64).")),
    CliFlag("--num-gpu-blocks-override", "num_gpu_blocks", dict(
        type=_int_at_least(1), default=None, metavar="N",
        help="Device KV blocks per worker; by default the engine sizes the device pool from free memory.")),
    CliFlag("--kv-cache-dtype", "dtype", dict(
        choices=(AUTO_DTYPE, *DTYPE_ITEMSIZE, *QUANTIZED_KV_DTYPES), default=None,
        help="KV cache element type; 'auto' (the default) uses the model's dtype; 'block_wise_fp8' "
             "(or 'block_wise_int8') is the same as --quantization "
             "'{\"kv_cache_quant_type\": \"block_wise_fp8\"}' (or \"block_wise_int8\").")),
    # After --kv-cache-dtype: from_cli_args checks the two agree.
    CliFlag("--quantization", "kv_cache_quant", dict(
        type=parse_quantization, default=None, metavar="JSON",
        help="Quantization, as a JSON object; '{\"kv_cache_quant_type\": \"block_wise_fp8\"}' stores K and V "
             "as float8 e4m3 bytes with one fp32 scale per (block, head, token): about half the bytes of a "
             "bfloat16 cache on every tier; \"block_wise_int8\": the same layout with int8 bytes "
             "(closer to bfloat16's outputs) (default: none).")),
    CliFlag("--swap-space", "swap_space", dict(
        type=_finite_float_at_least(0.0), default=None, metavar="GiB",
        help="Host (pinned CPU) KV cache size in GiB per worker; 0 (the default) disables the host tier.")),
    CliFlag("--write-policy", "write_policy", dict(
        choices=WRITE_POLICIES, default=None,
        help="When device blocks are copied to host: write_through (as soon as cached), "
             "write_through_selective (the default; after --write-through-threshold hits), "
             "write_back (only when evicted from the device).")),
    CliFlag("--write-through-threshold", "write_through_threshold", dict(
        type=_int_at_least(1), default=None, metavar="HITS",
        help="Hits before write_through_selective backs a block up to host (an integer >= 1; default: 2).")),
    CliFlag("--enable-prefix-caching", "enable_prefix_caching", dict(
        default=None,
        help="Reuse the KV of cached prompt prefixes (default: on). With the negative form every "
             "block is still allocated through the manager, but nothing is reused."),
        negative="--no-enable-prefix-caching"),
    # NOTE: FastDeploy's EngineArgs has enable_output_caching=True ("only valid in the V1
    # scheduler"), and so does CacheConfig.enable_output_caching: the default here is on.
    CliFlag("--enable-output-caching", "enable_output_caching", dict(
        default=None,
        help="Insert a finished request's generated tokens into the prefix tree too, so a "
             "follow-up turn reuses them (default: on, as in FastDeploy; the negative form "
             "caches prompt blocks only)."),
        negative="--no-enable-output-caching"),
)


def add_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the cache's server flags (``--swap-space``, ``--write-policy``, ...) to ``parser``.

    Safe on a parser that already defines some of them, as FastDeploy's does: a flag the
    parser has is left alone (its type, default and help stay), and
    :meth:`CacheConfig.from_cli_args` reads it from that flag's dest.  Of a boolean pair
    only the missing form is added.  Calling it twice is harmless.

    Every flag defaults to None ("not given"), so the CacheConfig defaults apply; the help
    text states them.  Range errors are argparse usage errors (exit status 2).
    """
    group = parser.add_argument_group(
        "KV cache (fastdeploy_kvcache)",
        "Tiered KV cache; a flag the server already defines keeps its own meaning there.",
    )
    dests: dict[str, str] = {}
    for spec in CLI_FLAGS:
        have = existing_flag(parser, spec.flag)
        have_negative = existing_flag(parser, spec.negative) if spec.negative else None
        if have is not None:
            dests[spec.field] = have.dest
        elif have_negative is not None:
            dests[spec.field] = have_negative.dest
        dest = dests.get(spec.field, spec.dest)
        if spec.negative is None:
            add_flag(group, spec.flag, dest=dest, **spec.kwargs)
            continue
        if have is None and have_negative is None:
            group.add_argument(spec.flag, dest=dest, action=argparse.BooleanOptionalAction, **spec.kwargs)
            continue
        # One form exists: add the other, writing the same dest and leaving its default alone.
        if have is None:
            group.add_argument(spec.flag, dest=dest, action="store_true", default=argparse.SUPPRESS,
                               help=spec.kwargs["help"])
        elif have_negative is None:
            group.add_argument(spec.negative, dest=dest, action="store_false", default=argparse.SUPPRESS,
                               help=f"Turn {spec.flag} off.")
    # Only a parser whose own flags use other dests gets the map (a hidden default), so a
    # plain namespace holds nothing but the flags.
    renamed = {field: dest for field, dest in dests.items() if dest != _spec(field).dest}
    if renamed:
        known = parser.get_default(_DESTS_KEY) or {}
        parser.set_defaults(**{_DESTS_KEY: {**known, **renamed}})
    return parser


def _spec(field_name: str) -> CliFlag:
    return next(spec for spec in CLI_FLAGS if spec.field == field_name)
