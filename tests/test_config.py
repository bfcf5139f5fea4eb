"""CacheConfig validation, derived sizes and CLI flags; env-var parsing."""

from __future__ import annotations

import argparse

import pytest

from fastdeploy_kvcache import envs
from fastdeploy_kvcache.config import GiB, CacheConfig, add_cli_args


def test_defaults_are_valid_and_sizes_follow_shape() -> None:
    cfg = CacheConfig(num_layers=4, num_kv_heads=8, head_dim=128, block_size=64, dtype="float16")
    assert cfg.bytes_per_layer_block == 8 * 64 * 128 * 2
    assert cfg.bytes_per_block == 2 * 4 * cfg.bytes_per_layer_block
    assert cfg.block_shape == (8, 64, 128)


def test_quantized_cache_counts_scales_and_extra_layers() -> None:
    cfg = CacheConfig(num_layers=2, num_extra_layers=1, num_kv_heads=2, head_dim=64,
                      block_size=16, dtype="uint8", kv_cache_quant="int8")
    assert cfg.total_layers == 3
    assert cfg.scale_bytes_per_layer_block == 2 * 16 * 4
    assert cfg.bytes_per_block == 2 * 3 * (2 * 16 * 64 + 2 * 16 * 4)


def test_host_blocks_from_swap_space_or_explicit_count() -> None:
    cfg = CacheConfig(num_layers=1, num_kv_heads=1, head_dim=64, block_size=64, dtype="bfloat16",
                      swap_space=1.0)
    assert cfg.host_block_count == GiB // cfg.bytes_per_block
    assert CacheConfig(swap_space=1.0, num_host_blocks=7).host_block_count == 7


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"block_size": 0}, "block_size"),
        ({"block_size": -4}, "block_size"),
        ({"write_policy": "write_sometimes"}, "write_policy"),
        ({"write_through_threshold": 0}, "write_through_threshold"),
        ({"dtype": "int4"}, "dtype"),
        ({"swap_space": -1.0}, "swap_space"),
        ({"num_gpu_blocks": -1}, "num_gpu_blocks"),
        ({"num_layers": 0}, "num_layers"),
        ({"kv_cache_quant": "int8"}, "kv_cache_quant"),
    ],
)
def test_bad_config_raises_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        CacheConfig(**kwargs)


def test_cli_flags_round_trip_into_config() -> None:
    parser = add_cli_args(argparse.ArgumentParser())
    args = parser.parse_args(
        ["--swap-space", "2", "--write-policy", "write_back", "--write-through-threshold", "3",
         "--block-size", "32", "--no-cache-output-tokens"]
    )
    cfg = CacheConfig.from_cli_args(args, num_layers=2)
    assert cfg.swap_space == 2.0
    assert cfg.write_policy == "write_back"
    assert cfg.write_through_threshold == 3
    assert cfg.block_size == 32
    assert cfg.cache_output_tokens is False
    assert cfg.num_layers == 2


def test_cli_rejects_unknown_policy() -> None:
    parser = add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit):
        parser.parse_args(["--write-policy", "nope"])


def test_env_switch_parses_booleans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1")
    assert envs.enable_v1_kvcache_manager() is True
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "0")
    assert envs.enable_v1_kvcache_manager() is False
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "maybe")
    with pytest.raises(ValueError, match="ENABLE_V1_KVCACHE_MANAGER"):
        envs.enable_v1_kvcache_manager()


def test_env_int_parsing_names_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FDKV_COPY_GRID", "x")
    with pytest.raises(ValueError, match="FDKV_COPY_GRID"):
        envs.get("FDKV_COPY_GRID")
    monkeypatch.setenv("FDKV_COPY_GRID", "4")
    assert envs.get("FDKV_COPY_GRID") == 4


def test_readme_lists_every_env_var_with_its_default() -> None:
    """The README's table is the user-facing list; it must not drift from envs.py."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for var in envs.ENV_VARS.values():
        row = f"| `{var.name}` | `{var.default or '(unset)'}` |"
        assert row in readme, f"README.md env-var table lacks or misstates {var.name}"
