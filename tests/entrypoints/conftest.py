"""Real servers for the HTTP tests: uvicorn on 127.0.0.1, tiny-llama-random, CPU.

Each fixture starts ``python -m fastdeploy_kvcache.entrypoints.openai.api_server`` in a
child process on a free port (module scope: model loading costs seconds) and stops it
with SIGTERM, so the lifespan's engine shutdown runs too.
"""

from __future__ import annotations

import importlib.util
from typing import Iterator

import pytest

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess

MODEL = "tiny-llama-random"
BLOCK_SIZE = 16
MAX_MODEL_LEN = 4096
# Device pool small enough that ten 330-token prompts evict each other (host hits),
# large enough for 16 concurrent short requests.
NUM_GPU_BLOCKS = 128
# The host tier, in GiB (tiny-llama-random's blocks are small: this is hundreds of blocks).
SWAP_SPACE_GIB = 0.05

SERVER_ARGS = [
    "--model", MODEL, "--device", "cpu",
    "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
    "--num-gpu-blocks-override", str(NUM_GPU_BLOCKS), "--max-num-seqs", "16",
    "--max-num-batched-tokens", "256",
]

_missing = [m for m in ("fastapi", "uvicorn", "openai", "prometheus_client", "paddleformers")
            if importlib.util.find_spec(m) is None]
if _missing:
    pytest.skip(f"needs {', '.join(_missing)} (installed by `bash build.sh`)", allow_module_level=True)


def _server(args: list[str], switch: str) -> Iterator[ServerProcess]:
    server = ServerProcess(args, env={"ENABLE_V1_KVCACHE_MANAGER": switch})
    server.start()
    try:
        yield server
    finally:
        code = server.stop()
        assert code in (0, None), f"server exited with {code}:\n{server.log_tail()}"


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    """Switch on, device pool of NUM_GPU_BLOCKS and a host tier (write_through)."""
    yield from _server(SERVER_ARGS + ["--swap-space", str(SWAP_SPACE_GIB), "--write-policy", "write_through"], "1")


@pytest.fixture(scope="module")
def baseline_server() -> Iterator[ServerProcess]:
    """Switch off: the plain block allocator, no reuse between requests."""
    yield from _server(SERVER_ARGS, "0")
