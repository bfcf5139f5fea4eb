"""Importing the storage tier pulls in neither Paddle, CuPy nor Mooncake (the scheduler side
imports it to form keys and read flags)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_storage_imports_are_light() -> None:
    code = (
        "import sys, json\n"
        "import fastdeploy_kvcache.storage, fastdeploy_kvcache.storage.keys, fastdeploy_kvcache.storage.config\n"
        "import fastdeploy_kvcache.storage.file_backend, fastdeploy_kvcache.storage.mooncake_backend\n"
        "import fastdeploy_kvcache.storage.transfer, fastdeploy_kvcache.storage.mooncake_local\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('paddle', 'cupy', 'mooncake'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
