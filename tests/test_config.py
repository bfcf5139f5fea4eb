"""CacheConfig validation, derived sizes and CLI flags; env-var parsing."""

from __future__ import annotations

import argparse

import pytest

from fastdeploy_kvcache import envs
from fastdeploy_kvcache.cli_flags import parser_actions
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
        # Defect 8: nonsense that used to be accepted.
        ({"swap_space": float("nan")}, "swap_space"),
        ({"swap_space": float("inf")}, "swap_space"),
        ({"swap_space": "4"}, "swap_space"),
        ({"swap_space": True}, "swap_space"),
        ({"num_extra_layers": 1.5}, "num_extra_layers"),
        ({"num_extra_layers": 1.0}, "num_extra_layers"),
        ({"tensor_parallel_size": 2.0}, "tensor_parallel_size"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size"),
        ({"enable_prefix_caching": "no"}, "enable_prefix_caching"),
        ({"enable_prefix_caching": 0}, "enable_prefix_caching"),
        ({"enable_output_caching": "yes"}, "enable_output_caching"),
        ({"block_size": True}, "block_size"),
        ({"num_layers": False}, "num_layers"),
        ({"head_dim": 8.0}, "head_dim"),
        ({"num_host_blocks": 3.0}, "num_host_blocks"),
        ({"num_host_blocks": True}, "num_host_blocks"),
        ({"num_gpu_blocks": 2.5}, "num_gpu_blocks"),
        ({"write_through_threshold": True}, "write_through_threshold"),
        ({"dtype": ["float16"]}, "dtype"),
        ({"write_policy": ["write_back"]}, "write_policy"),
        ({"kv_cache_quant": ["int8"]}, "kv_cache_quant"),
        ({"extra": []}, "extra"),
    ],
)
def test_bad_config_raises_naming_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=rf"CacheConfig\.{field}\b"):
        CacheConfig(**kwargs)


def test_integral_numbers_are_accepted_and_stored_as_python_ints() -> None:
    """numpy integers (e.g. from a model config) are fine; they are stored as int."""
    np = pytest.importorskip("numpy", reason="needs numpy (installed by `bash build.sh`)")
    cfg = CacheConfig(block_size=np.int64(16), num_layers=np.int32(3), swap_space=np.float32(0.5),
                      num_host_blocks=np.int64(4))
    assert type(cfg.block_size) is int and cfg.block_size == 16
    assert type(cfg.num_layers) is int and type(cfg.num_host_blocks) is int
    assert type(cfg.swap_space) is float and cfg.swap_space == 0.5
    assert CacheConfig(swap_space=2).swap_space == 2.0


def _cli(argv: list[str], parser: argparse.ArgumentParser | None = None) -> argparse.Namespace:
    return add_cli_args(parser or argparse.ArgumentParser(prog="serve")).parse_args(argv)


def test_cli_flags_round_trip_into_config() -> None:
    args = _cli(["--swap-space", "2", "--write-policy", "write_back", "--write-through-threshold", "3",
                 "--block-size", "32", "--no-enable-output-caching", "--no-enable-prefix-caching",
                 "--kv-cache-dtype", "float16", "--num-gpu-blocks-override", "100"])
    cfg = CacheConfig.from_cli_args(args, num_layers=2)
    assert cfg.swap_space == 2.0
    assert cfg.write_policy == "write_back"
    assert cfg.write_through_threshold == 3
    assert cfg.block_size == 32
    assert cfg.enable_output_caching is False
    assert cfg.enable_prefix_caching is False
    assert cfg.dtype == "float16"
    assert cfg.num_gpu_blocks == 100
    assert cfg.num_layers == 2


def test_cli_defaults_match_config_defaults_and_fastdeploy() -> None:
    """No flag given: the config's own defaults; prefix and output caching on, as in FastDeploy."""
    cfg = CacheConfig.from_cli_args(_cli([]))
    assert cfg == CacheConfig()
    assert cfg.enable_prefix_caching is True and cfg.enable_output_caching is True
    on = CacheConfig.from_cli_args(_cli(["--enable-prefix-caching", "--enable-output-caching"]))
    assert on.enable_prefix_caching is True and on.enable_output_caching is True
    assert CacheConfig.from_cli_args(_cli(["--kv-cache-dtype", "auto"]), dtype="float32").dtype == "float32"


def test_auto_dtype_stands_for_the_models_until_it_is_filled_in() -> None:
    """``--kv-cache-dtype auto`` or no flag: the caller's default dtype (the engine passes
    "auto", which it replaces with the model's); a dtype named on the CLI wins.  An "auto"
    config cannot be sized."""
    assert CacheConfig.from_cli_args(_cli([]), defaults={"dtype": "auto"}).dtype == "auto"
    assert CacheConfig.from_cli_args(_cli(["--kv-cache-dtype", "auto"]), defaults={"dtype": "auto"}).dtype == "auto"
    assert CacheConfig.from_cli_args(_cli(["--kv-cache-dtype", "float16"]), defaults={"dtype": "auto"}).dtype == "float16"
    with pytest.raises(ValueError, match="'auto'"):
        CacheConfig(dtype="auto").bytes_per_block


def test_block_wise_int8_is_the_same_layout_under_its_own_format() -> None:
    """block_wise_int8: either spelling gives the fp8 layout's bytes and scales, but another
    format: its storage keys and its file header's KV format differ from block_wise_fp8's, so
    neither store is ever read as the other (a conflicting pair of flags names both)."""
    from fastdeploy_kvcache.storage.file_format import describe_kv_format, kv_format_code

    shape = dict(num_layers=2, head_dim=128, num_kv_heads=8)
    want = CacheConfig(dtype="uint8", kv_cache_quant="block_wise_int8", **shape)
    for argv in (["--quantization", '{"kv_cache_quant_type": "block_wise_int8"}'],
                 ["--kv-cache-dtype", "block_wise_int8"]):
        assert CacheConfig.from_cli_args(_cli(argv), defaults={"dtype": "auto"}, **shape) == want, argv
    fp8 = CacheConfig(dtype="block_wise_fp8", **shape)
    assert want.bytes_per_block == fp8.bytes_per_block
    codes = {q: kv_format_code("uint8", q) for q in ("block_wise_fp8", "block_wise_int8")}
    assert codes["block_wise_fp8"] != codes["block_wise_int8"]
    assert describe_kv_format(codes["block_wise_int8"]).startswith("uint8/block_wise_int8 (")
    with pytest.raises(ValueError, match=r"^kv_cache_quant: "):
        CacheConfig.from_cli_args(_cli(["--kv-cache-dtype", "block_wise_fp8", "--quantization",
                                        '{"kv_cache_quant_type": "block_wise_int8"}']))


def test_block_wise_fp8_is_a_quantization_setting_or_a_kv_cache_dtype() -> None:
    """Either spelling gives uint8 K/V with fp32 scale lanes; a host server's own --quantization
    (a dict it parsed, or a weight-quantization name) is read for its kv_cache_quant_type only;
    a dtype that contradicts it names both flags."""
    want = CacheConfig(dtype="uint8", kv_cache_quant="block_wise_fp8", num_layers=2, head_dim=128, num_kv_heads=8)
    shape = dict(num_layers=2, head_dim=128, num_kv_heads=8)
    for argv in (["--quantization", '{"kv_cache_quant_type": "block_wise_fp8"}'],
                 ["--kv-cache-dtype", "block_wise_fp8"],
                 ["--kv-cache-dtype", "block_wise_fp8", "--quantization", '{"kv_cache_quant_type": "block_wise_fp8"}']):
        assert CacheConfig.from_cli_args(_cli(argv), defaults={"dtype": "auto"}, **shape) == want, argv
    assert CacheConfig.from_cli_args(_cli(["--quantization", '{"kv_cache_quant_type": null}'])) == CacheConfig()
    # bfloat16 of head_dim 128: 256 bytes per (head, token); fp8: 128 + a 4-byte scale.
    bf16 = CacheConfig(dtype="bfloat16", **shape)
    assert bf16.bytes_per_block / want.bytes_per_block == 256 / 132
    assert want.scale_bytes_per_layer_block == 8 * 64 * 4
    host = argparse.ArgumentParser()
    host.add_argument("--quantization", type=str, default=None)  # a host's flag: weights, or JSON
    for value, quant in (('{"quantization": "wint8", "kv_cache_quant_type": "block_wise_fp8"}', "block_wise_fp8"),
                         ("wint8", None)):
        cfg = CacheConfig.from_cli_args(_cli(["--quantization", value], host), **shape)
        assert cfg.kv_cache_quant == quant, value
    ns = argparse.Namespace(quantization={"kv_cache_quant_type": "block_wise_fp8"})
    assert CacheConfig.from_cli_args(ns).kv_cache_quant == "block_wise_fp8"
    with pytest.raises(ValueError, match=r"^kv_cache_quant: .*--kv-cache-dtype says float16"):
        CacheConfig.from_cli_args(_cli(["--kv-cache-dtype", "float16", "--quantization",
                                        '{"kv_cache_quant_type": "block_wise_fp8"}']))
    with pytest.raises(ValueError, match=r"^kv_cache_quant: kv_cache_quant_type must be one of"):
        CacheConfig.from_cli_args(argparse.Namespace(quantization={"kv_cache_quant_type": "int8"}))
    with pytest.raises(ValueError, match=r"^kv_cache_quant: --quantization is not valid JSON"):
        CacheConfig.from_cli_args(argparse.Namespace(quantization='{"kv_cache_quant_type": '))


def test_cli_rejects_unknown_policy() -> None:
    parser = add_cli_args(argparse.ArgumentParser())
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--write-policy", "nope"])
    assert info.value.code == 2


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--swap-space", "-1"], "--swap-space"),
        (["--swap-space", "nan"], "--swap-space"),
        (["--swap-space", "inf"], "--swap-space"),
        (["--swap-space", "lots"], "--swap-space"),
        (["--block-size", "0"], "--block-size"),
        (["--block-size", "1.5"], "--block-size"),
        (["--write-through-threshold", "0"], "--write-through-threshold"),
        (["--num-gpu-blocks-override", "0"], "--num-gpu-blocks-override"),
        (["--kv-cache-dtype", "int4"], "--kv-cache-dtype"),
        (["--quantization", "{"], "--quantization"),
        (["--quantization", "[1]"], "--quantization"),
        (["--quantization", '{"kv_cache_quant_type": "fp8"}'], "--quantization"),
        (["--quantization", '{"kv_cache_quant_type": "block_wise_fp8", "moe_quant_type": "wint4"}'], "--quantization"),
    ],
)
def test_cli_range_errors_are_usage_errors(argv: list[str], flag: str, capsys: pytest.CaptureFixture) -> None:
    """Defect 8: a bad value exits 2 with a usage message naming the flag, not a traceback."""
    with pytest.raises(SystemExit) as info:
        _cli(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: serve") and f"argument {flag}" in err and "Traceback" not in err


def test_cli_range_errors_exit_2_from_a_real_command_line() -> None:
    """The same through a real interpreter: exit status 2, a usage line, no traceback."""
    import subprocess
    import sys

    code = ("import argparse; from fastdeploy_kvcache.config import CacheConfig, add_cli_args; "
            "p = add_cli_args(argparse.ArgumentParser(prog='serve')); "
            "CacheConfig.from_cli_args(p.parse_args()); print('accepted')")
    for argv in (["--swap-space", "nan"], ["--block-size", "0"], ["--write-through-threshold", "0"]):
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
        assert proc.returncode == 2, (argv, proc.stdout, proc.stderr)
        assert "usage: serve" in proc.stderr and "Traceback" not in proc.stderr


def _fastdeploy_like_parser() -> argparse.ArgumentParser:
    """A parser that already defines some cache flags the way FastDeploy's does."""
    parser = argparse.ArgumentParser(prog="serve")
    parser.add_argument("--block-size", type=int, default=64, help="tokens per block")
    parser.add_argument("--swap-space", type=float, default=None, help="host GiB")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                        help="prefix caching")
    parser.add_argument("--enable-output-caching", action="store_true", default=False, help="output caching")
    parser.add_argument("--num-gpu-blocks-override", dest="gpu_blocks", type=int, default=None, help="blocks")
    return parser


def test_add_cli_args_skips_flags_the_parser_already_has() -> None:
    """Addable to FastDeploy's parser without option conflicts; its flags still configure us."""
    parser = add_cli_args(_fastdeploy_like_parser())
    args = parser.parse_args(["--block-size", "16", "--swap-space", "1.5", "--no-enable-prefix-caching",
                              "--num-gpu-blocks-override", "40", "--write-policy", "write_back"])
    cfg = CacheConfig.from_cli_args(args)
    assert (cfg.block_size, cfg.swap_space, cfg.enable_prefix_caching) == (16, 1.5, False)
    assert cfg.num_gpu_blocks == 40  # read from the existing flag's own dest
    assert cfg.write_policy == "write_back"  # ours, added
    # The parser had only --enable-output-caching (store_true, default off): its default holds, and
    # the missing negative form is added.
    assert CacheConfig.from_cli_args(parser.parse_args([])).enable_output_caching is False
    assert CacheConfig.from_cli_args(parser.parse_args(["--enable-output-caching"])).enable_output_caching is True
    off = parser.parse_args(["--enable-output-caching", "--no-enable-output-caching"])
    assert CacheConfig.from_cli_args(off).enable_output_caching is False
    # Adding twice is harmless too.
    add_cli_args(parser)
    assert CacheConfig.from_cli_args(parser.parse_args(["--block-size", "8"])).block_size == 8


def test_the_server_engine_and_storage_flags_keep_a_host_parsers_own_flags() -> None:
    """Each flag the host parser defines (FastDeploy's --port, one of the storage flags) keeps
    its own default there; every other flag is added, and adding all of them twice is harmless."""
    from fastdeploy_kvcache.cli_flags import add_flag, existing_flag
    from fastdeploy_kvcache.entrypoints.openai.api_server import add_server_cli_args

    parser = _fastdeploy_like_parser()
    own_port = parser.add_argument("--port", type=int, default=9999, help="the host's port")
    own_path = parser.add_argument("--kvcache-storage-path", dest="kvcache_storage_path", default="/host/kv",
                                   help="the host's storage directory")
    add_server_cli_args(parser)
    add_server_cli_args(parser)
    assert existing_flag(parser, "--port") is own_port
    assert existing_flag(parser, "--kvcache-storage-path") is own_path
    assert add_flag(parser, "--port", type=str) is own_port
    args = parser.parse_args(["--kvcache-storage-backend", "file", "--model", "tiny-llama-random"])
    assert (args.port, args.kvcache_storage_path, args.kvcache_storage_backend) == (9999, "/host/kv", "file")
    assert existing_flag(parser, "--no-such-flag") is None


def test_help_describes_every_flag() -> None:
    parser = add_cli_args(argparse.ArgumentParser(prog="serve"))
    text = " ".join(parser.format_help().split())
    flags = ["--block-size", "--swap-space", "--num-gpu-blocks-override", "--write-policy",
             "--write-through-threshold", "--enable-prefix-caching", "--no-enable-prefix-caching",
             "--enable-output-caching", "--no-enable-output-caching", "--kv-cache-dtype"]
    for flag in flags:
        assert flag in text, flag
    for action in parser_actions(parser):
        if action.option_strings and action.dest != "help":
            assert action.help and len(action.help) > 20, action.option_strings


def test_env_switch_parses_booleans(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "1")
    assert envs.enable_v1_kvcache_manager() is True
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "0")
    assert envs.enable_v1_kvcache_manager() is False
    monkeypatch.setenv("ENABLE_V1_KVCACHE_MANAGER", "maybe")
    with pytest.raises(ValueError, match="ENABLE_V1_KVCACHE_MANAGER"):
        envs.enable_v1_kvcache_manager()


def test_env_number_parsing_names_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FDKV_LAYER_WAIT_TIMEOUT_S", "x")
    with pytest.raises(ValueError, match="FDKV_LAYER_WAIT_TIMEOUT_S"):
        envs.get("FDKV_LAYER_WAIT_TIMEOUT_S")
    monkeypatch.setenv("FDKV_LAYER_WAIT_TIMEOUT_S", " 4 ")
    assert envs.get("FDKV_LAYER_WAIT_TIMEOUT_S") == 4.0


def test_readme_lists_every_env_var_with_its_default() -> None:
    """The README's table is the user-facing list; it must not drift from envs.py."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    for var in envs.ENV_VARS.values():
        row = f"| `{var.name}` | `{var.default or '(unset)'}` |"
        assert row in readme, f"README.md env-var table lacks or misstates {var.name}"
    section = readme.split("## Environment variables", 1)[1].split("\n## ", 1)[0]
    listed = {line.split("`")[1] for line in section.splitlines() if line.startswith("| `")}
    assert listed == set(envs.ENV_VARS), "README.md lists a variable the library does not read"
