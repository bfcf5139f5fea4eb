"""k-anonymous sharing on the GPU path (``--model-impl transformers --device gpu``): a real
server and the official ``openai`` client, tiny-llama-random in float32 so a reused block
must give the same greedy tokens as a recomputed one.

With ``--k-anonymity-k 2``: a prompt one tenant computed is a miss for a second tenant on the
device and on the host tier, the second tenant's computation reveals it, and a third tenant
then reuses it from the tier it is on, with the same text.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Iterator

import pytest

from tests.torch_engines import cuda_torch_or_skip

torch = cuda_torch_or_skip()
for _mod in ("fastapi", "uvicorn", "openai"):
    if importlib.util.find_spec(_mod) is None:
        pytest.skip(f"needs {_mod} (bring its wheel: docs/usage.md, 'On a GPU machine')", allow_module_level=True)

import openai  # noqa: E402

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess  # noqa: E402

MODEL = "tiny-llama-random"
BS = 16
P_LEN = 200
FULL = (P_LEN // BS) * BS
TENANTS = ("t0", "t1", "t2", "t3", "t4", "filler")


def _prompt(seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(10, 500) for _ in range(P_LEN)]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    keys = Path(tmp_path_factory.mktemp("kanon_gpu")) / "keys.txt"
    keys.write_text("".join(f"key-{t} {t}\n" for t in TENANTS))
    args = ["--model-impl", "transformers", "--model", MODEL, "--device", "gpu", "--model-dtype", "float32",
            "--block-size", str(BS), "--max-model-len", "1024", "--num-gpu-blocks-override", "64",
            "--swap-space", "0.05", "--write-policy", "write_through", "--api-keys-file", str(keys),
            "--tenant-isolation", "k-anonymity", "--k-anonymity-k", "2"]
    srv = ServerProcess(args, env={"ENABLE_V1_KVCACHE_MANAGER": "1"}).start()
    try:
        yield srv
    finally:
        code = srv.stop()
        assert code in (0, None, -15), f"server exited with {code}:\n{srv.log_tail()}"


def complete(server: ServerProcess, tenant: str, prompt: list[int], max_tokens: int = 8) -> tuple[str, dict]:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=f"key-{tenant}", max_retries=0, timeout=120.0)
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                    extra_body={"ignore_eos": True})
    return out.choices[0].text, out.model_dump()["usage"]["prompt_tokens_details"]["cached_tokens_by_tier"]


def test_k_anonymity_reveals_at_the_second_tenant_on_device_and_host(server: ServerProcess) -> None:
    q = _prompt(1)
    text, tiers = complete(server, "t0", q)
    assert sum(tiers.values()) == 0, tiers
    again, tiers = complete(server, "t1", q)  # t0's device copy is a miss for t1
    assert again == text and sum(tiers.values()) == 0, tiers
    again, tiers = complete(server, "t2", q)  # t0 and t1 computed it: revealed
    assert again == text and tiers["device"] == FULL, tiers

    h = _prompt(2)
    text, _ = complete(server, "t0", h)
    for seed in range(7):  # the 64-block device pool fills: h goes to the host tier
        complete(server, "filler", _prompt(100 + seed), max_tokens=1)
    again, tiers = complete(server, "t3", h)  # t0's host copy is a miss for t3
    assert again == text and sum(tiers.values()) == 0, tiers
    for seed in range(7, 14):
        complete(server, "filler", _prompt(100 + seed), max_tokens=1)
    again, tiers = complete(server, "t4", h)  # t0 and t3 computed it: a host hit for t4
    assert again == text and tiers["host"] == FULL and tiers["device"] == 0, tiers
