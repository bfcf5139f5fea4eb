"""A new user's first run: a quiet start-up, one-line configuration errors, a true --help,
the README's example as printed, and a tokenizer a client can load.

Each test reads what a user would see: the real stderr of a server process, or the real
HTTP answer.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess, free_port

ROOT = Path(__file__).resolve().parents[2]
SERVER = [sys.executable, "-m", "fastdeploy_kvcache.entrypoints.openai.api_server"]
ENV = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
# Our log format (api_server.run_server): "2026-01-01 00:00:00,000 INFO name: message".
OWN_LINE = re.compile(r"^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} INFO fastdeploy_kvcache\.|^\d{4}-\d\d-\d\d .* INFO __main__: ")


def run_server_cmd(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*SERVER, *args], capture_output=True, text=True, env=ENV, timeout=timeout)


# ---------------------------------------------------------------------- configuration errors
@pytest.mark.parametrize("args, flag", [
    (["--model", "no-such-model"], "--model"),
    (["--model", "tiny-llama-random", "--device", "gpu"], "--device"),
    (["--kv-cache-dtype", "uint8"], "--kv-cache-dtype"),
    (["--quantization", '{"kv_cache_quant_type": "int4"}'], "--quantization"),
    (["--quantization", "wint8"], "--quantization"),  # weights: not this engine's
    (["--quantization", '{"quantization": "wint8", "kv_cache_quant_type": "block_wise_fp8"}'], "--quantization"),
    (["--model", "tiny-llama-random", "--kv-cache-dtype", "bfloat16", "--quantization",
      '{"kv_cache_quant_type": "block_wise_fp8"}'], "--quantization"),
    (["--model", "tiny-llama-random", "--max-num-seqs", "0"], "--max-num-seqs"),
    (["--model", "tiny-llama-random", "--max-model-len", "4097"], "--max-model-len"),  # 4096 positions
    (["--model", "llama3-8b-random", "--model-impl", "transformers", "--max-model-len", "32768"], "--max-model-len"),
    (["--model", "llama3-8b-random"], "--model"),  # the transformers runner's only
    (["--model", "tiny-llama-random", "--gpu-memory-utilization", "1.2"], "--gpu-memory-utilization"),
    (["--swap-space", "-1"], "--swap-space"),
    (["--model", str(ROOT / "docs")], "--model"),  # a directory that is not a checkpoint
    (["--model", "tiny-llama-random", "--kvcache-storage-backend", "file", "--kvcache-storage-path",
      str(ROOT / "no-such-store")], "--kvcache-storage-backend"),  # no host tier to stage through
])
def test_configuration_error_is_one_line_naming_the_flag(args: list[str], flag: str) -> None:
    if flag == "--device":
        import paddle

        if paddle.is_compiled_with_cuda():
            pytest.skip("needs a CPU build of Paddle (this one has CUDA, so --device gpu is valid)")
    out = run_server_cmd("--port", str(free_port()), *args)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and flag in lines[0] and "error" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("name, value", [("ENABLE_V1_KVCACHE_MANAGER", "maybe"),
                                         ("FDKV_LAYER_WAIT_TIMEOUT_S", "-3")])
def test_bad_environment_variable_is_one_line_before_the_model_loads(name: str, value: str) -> None:
    out = subprocess.run([*SERVER, "--port", str(free_port()), "--model", "tiny-llama-random"],
                         capture_output=True, text=True, env=dict(ENV, **{name: value}), timeout=120)
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{name}={value!r}" in lines[0] and "error" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


def test_busy_port_is_one_line_and_exit_2() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = run_server_cmd("--port", str(port), "--model", "tiny-llama-random")
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "--port" in lines[0] and "already in use" in lines[0], out.stderr
    assert "Errno" not in out.stderr and "Traceback" not in out.stderr


# ---------------------------------------------------------------------- --help
def test_help_shows_every_default_and_only_accepted_values() -> None:
    out = run_server_cmd("--help", timeout=60)
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    # One entry per option: a line indented by two spaces starts it, deeper lines continue it.
    entries: list[str] = []
    for line in out.stdout.split("options:", 1)[1].splitlines():
        if re.match(r"^  -", line):
            entries.append(line.strip())
        elif entries and line.startswith("   "):
            entries[-1] += " " + line.strip()
    flags = [e for e in entries if not e.startswith("-h, --help")]
    assert len(flags) > 25
    for entry in flags:
        assert "default" in entry.lower(), f"no default stated: {entry[:120]}"
    assert "uint8" not in text  # the engine rejects it
    assert "from free memory" not in text
    assert "--max-num-seqs sequences of --max-model-len tokens" in text


def _help_entry(help_text: str, flag: str) -> str:
    """The flag's entry of ``--help``, on one line."""
    entry: list[str] = []
    for line in help_text.split("options:", 1)[1].splitlines():
        if re.match(r"^  -", line):
            if entry:
                break
            if line.strip().startswith(flag + " "):
                entry.append(line.strip())
        elif entry and line.startswith("   "):
            entry.append(line.strip())
    return " ".join(entry)


def test_help_says_what_build_sh_serve_passes_for_the_host_tier() -> None:
    """`bash build.sh serve` and `serve-gpu` start with a host tier the flag's default does not
    give: --help says both, with the values build.sh really passes."""
    script = (ROOT / "build.sh").read_text()
    serve = re.search(r"\n  serve\)(.*?);;", script, re.S).group(1)
    serve_gpu = re.search(r"\n  serve-gpu\)(.*?);;", script, re.S).group(1)
    passed = re.search(r"--swap-space (\d+(?:\.\d+)?) ", serve).group(1)
    gpu_default = re.search(r'--swap-space "\$\{FDKV_SWAP_SPACE:-(\d+)\}"', serve_gpu).group(1)
    out = run_server_cmd("--help", timeout=60)
    entry = _help_entry(out.stdout, "--swap-space")
    assert "default: 0" in entry, entry
    assert f"`bash build.sh serve` gives {passed}" in entry, entry
    assert "FDKV_SWAP_SPACE" in entry and f"{gpu_default} unless set" in entry, entry


def _venv_python() -> Path:
    return ROOT / ".venv" / "bin" / "python"


def test_build_sh_serve_help_prints_help_only() -> None:
    if not _venv_python().exists():
        pytest.skip("needs the checkout's .venv (bash build.sh creates it)")
    out = subprocess.run(["bash", str(ROOT / "build.sh"), "serve", "--help"], capture_output=True, text=True,
                         env=ENV, timeout=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage:")
    assert "serving on" not in out.stdout + out.stderr


def _editable_install_is_this_checkout() -> bool:
    """build.sh's own test: else `build.sh serve` would reinstall the venv's package from here."""
    stamp = _venv_python().parent.parent / ".fdkv-editable"
    try:
        return stamp.read_text().split()[0] == str(ROOT)
    except (OSError, IndexError):
        return False


@pytest.mark.skipif(not _editable_install_is_this_checkout(),
                    reason="needs .venv's editable install to be this checkout (run `bash build.sh` here); "
                           "build.sh serve would otherwise reinstall it")
def test_build_sh_serve_honours_the_switch_and_starts_quietly() -> None:
    port = free_port()
    env = dict(ENV, ENABLE_V1_KVCACHE_MANAGER="0", FDKV_PORT=str(port))
    proc = subprocess.Popen(["bash", str(ROOT / "build.sh"), "serve", "--model", "tiny-llama-random"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines = _lines_until_serving(proc)
        assert any("v1 manager off" in line for line in lines), lines
        assert all(OWN_LINE.match(line) for line in lines), lines
    finally:
        proc.terminate()
        proc.wait(30)


# ---------------------------------------------------------------------- a real start-up
def _lines_until_serving(proc: subprocess.Popen, timeout_s: float = 600) -> list[str]:
    """stderr lines up to and including "serving ... on"; fails if the process ends first."""
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stderr is not None
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        if not line:
            raise AssertionError(f"server ended (rc {proc.wait(10)}) before serving:\n" + "".join(lines))
        lines.append(line.rstrip("\n"))
        if " serving " in line:
            return lines
    raise AssertionError("no 'serving' line in time:\n" + "\n".join(lines))


@pytest.fixture(scope="module")
def default_server() -> Iterator[tuple[str, list[str]]]:
    """The default model as `bash build.sh serve` starts it (v1 on, a host tier); its start-up lines."""
    port = free_port()
    proc = subprocess.Popen([*SERVER, "--port", str(port), "--swap-space", "0.05"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(ENV, ENABLE_V1_KVCACHE_MANAGER="1"))
    try:
        lines = _lines_until_serving(proc)
        # The line is logged once the port is bound: a connection succeeds right away.
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except (urllib.error.URLError, ConnectionError):
                assert time.monotonic() < deadline
                time.sleep(0.2)
        yield url, lines
    finally:
        proc.terminate()
        proc.wait(60)


def test_startup_log_is_ours_only(default_server: tuple[str, list[str]]) -> None:
    _, lines = default_server
    noisy = [line for line in lines if not OWN_LINE.match(line)]
    assert not noisy, "\n".join(lines)
    assert not any("\x1b[" in line for line in lines)
    assert sum(" serving " in line for line in lines) == 1
    # Model load, cache set-up, tokenizer, engine, serving (plus one line on a first conversion).
    assert len(lines) <= 10, "\n".join(lines)


def _readme_serve_example() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Serve a model", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, re.S)[0]


def test_readme_serve_example_prints_what_it_says(default_server: tuple[str, list[str]]) -> None:
    url, _ = default_server
    code = _readme_serve_example()
    assert "http://127.0.0.1:8188/v1" in code
    expected = [line[2:].split("  ")[0] for line in code.splitlines() if line.startswith("# ")]
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace("http://127.0.0.1:8188/v1", url + "/v1"), "README.md", "exec"), {})  # noqa: S102
    assert out.getvalue().splitlines() == expected
    first, repeat = (line.split() for line in expected[:2])
    assert first[2] == "0" and int(repeat[2]) > 0  # the repeat reuses the cached prefix


def test_missing_content_type_is_a_clear_400(default_server: tuple[str, list[str]]) -> None:
    import http.client

    url, _ = default_server
    host, port = url.rsplit("/", 1)[1].split(":")
    body = b'{"model": "smollm2-135m-instruct", "prompt": "hi", "max_tokens": 1}'
    for headers, shown in (({}, "none"), ({"Content-Type": "text/plain"}, "'text/plain'")):
        conn = http.client.HTTPConnection(host, int(port), timeout=30)  # sends no Content-Type of its own
        try:
            conn.request("POST", "/v1/completions", body=body, headers=headers)
            resp = conn.getresponse()
            message = resp.read().decode()
        finally:
            conn.close()
        assert resp.status == 400
        assert "Content-Type: must be application/json" in message and shown in message, message


# ---------------------------------------------------------------------- tokenizers for clients
def _client_tokenizer_path(lines: list[str]) -> str:
    found = [line.split("tokenizer for clients: ", 1)[1] for line in lines if "tokenizer for clients: " in line]
    assert len(found) == 1, lines
    return found[0]


def _check_client_tokenizer(url: str, model: str, path: str) -> None:
    from openai import OpenAI
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    text = "The quick brown fox jumps over the lazy dog, twice."
    ids = tok.encode(text, add_special_tokens=False)
    client = OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
    by_text = client.completions.create(model=model, prompt=text, max_tokens=4, temperature=0)
    by_ids = client.completions.create(model=model, prompt=ids, max_tokens=4, temperature=0)
    assert by_text.usage.prompt_tokens == len(ids)
    assert by_text.choices[0].text == by_ids.choices[0].text


def test_default_model_tokenizer_loads_in_a_client(default_server: tuple[str, list[str]]) -> None:
    url, lines = default_server
    _check_client_tokenizer(url, "smollm2-135m-instruct", _client_tokenizer_path(lines))


def test_tiny_model_tokenizer_loads_in_a_client(tmp_path: Path) -> None:
    server = ServerProcess(["--model", "tiny-llama-random", "--model-cache-dir", str(tmp_path)])
    with server:
        log = Path(server.log_path).read_text()
        path = _client_tokenizer_path(log.splitlines())
        assert path == str(tmp_path / "tokenizers" / "tiny-llama-random")
        _check_client_tokenizer(server.base_url, "tiny-llama-random", path)


# ---------------------------------------------------------------------- docs
def test_n_cap_is_documented() -> None:
    from fastdeploy_kvcache.entrypoints.openai import serving

    cap = serving.MAX_CHOICES
    assert f"at most {cap} choices" in (ROOT / "docs" / "usage.md").read_text()


# ---------------------------------------------------------------------- one converted model
def test_one_converted_copy_serves_every_checkout(tmp_path: Path) -> None:
    """The same GGUF at two paths (two clones' venvs) is converted once, into one directory."""
    from fastdeploy_kvcache.engine.model_loader import find_smollm2_gguf

    source = Path(find_smollm2_gguf())
    cache = tmp_path / "models"
    logs = []
    for clone in ("clone-a", "clone-b"):
        gguf = tmp_path / clone / source.name
        gguf.parent.mkdir()
        try:
            os.link(source, gguf)
        except OSError:
            gguf.write_bytes(source.read_bytes())
        server = ServerProcess(["--model", str(gguf), "--model-cache-dir", str(cache), "--max-model-len", "256"])
        with server:
            logs.append(Path(server.log_path).read_text())
    assert " converted " in logs[0] and " converted " not in logs[1], logs[1]
    assert len([p for p in cache.iterdir() if not p.name.startswith(".") and p.name != "tokenizers"]) == 1


# ---------------------------------------------------------------------- an unreachable store
def test_unreachable_mooncake_master_is_logged_within_seconds_and_in_health(tmp_path: Path) -> None:
    """MOONCAKE_MASTER_METRICS_ADDR pointing where no master listens: the tier stays off, and
    says so (naming the address it polled) in the log within seconds and in /health."""
    from fastdeploy_kvcache.storage.mooncake_backend import mooncake_available

    if mooncake_available() is not None:
        pytest.skip(f"needs the mooncake.store module ({mooncake_available()}): run `bash build.sh`")
    nowhere = f"127.0.0.1:{free_port()}"
    server = ServerProcess(
        ["--model", "tiny-llama-random", "--device", "cpu", "--swap-space", "0.02",
         "--kvcache-storage-backend", "mooncake"],
        env={"ENABLE_V1_KVCACHE_MANAGER": "1", "MOONCAKE_MASTER_SERVER_ADDR": f"127.0.0.1:{free_port()}",
             "MOONCAKE_MASTER_METRICS_ADDR": nowhere})
    with server:
        started = time.monotonic()
        health = server.get_json("/health")
        assert health["status"] == "ok"
        assert health["storage"]["available"] is False and nowhere in health["storage"]["detail"], health
        while "still off" not in server.log_tail() and time.monotonic() - started < 15:
            time.sleep(0.2)
        warning = [line for line in server.log_tail().splitlines() if "still off" in line]
        assert warning and nowhere in warning[0] and "MOONCAKE_MASTER_METRICS_ADDR" in warning[0], server.log_tail()
