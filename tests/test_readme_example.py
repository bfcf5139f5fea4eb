"""The README's engine example runs as written (small sizes, CPU backend)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest


def test_readme_engine_example_runs() -> None:
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = re.search(r"## Using it from an engine\n\n```python\n(.*?)```", readme, re.S)
    assert block, "README lost its engine example"
    code = block.group(1)
    # Shrink the model and pools so the example runs on a CI machine; the calls stay as written.
    code = code.replace("num_layers=32, num_kv_heads=8, head_dim=128", "num_layers=2, num_kv_heads=1, head_dim=16")
    code = code.replace("num_gpu_blocks=4096, swap_space=16", "num_gpu_blocks=8, num_host_blocks=8")
    code = code.replace('backend="auto"', 'backend="cpu"')
    code = code.replace("    ...\n", "    pass\n")
    namespace = {"prompt_token_ids": list(range(150)), "blocks_needed": 3}
    exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - our own README
    manager = namespace["manager"]
    assert not manager.is_running("r1")
    # The finished prompt's two full blocks (block size 64) are now a device prefix hit.
    again = namespace["Request"]("r2", list(range(150)))
    match = manager.match_prefix(again)
    assert match.num_matched_tokens == 128
    assert match.num_device_blocks == 2
    namespace["controller"].close()


if __name__ == "__main__":
    raise SystemExit(pytest.main([__file__]))
