"""The scheduler side must import without Paddle or CuPy (it runs in a CPU-only process)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_core_imports_no_paddle_or_cupy():
    code = (
        "import sys, json\n"
        "import fastdeploy_kvcache.core.metadata, fastdeploy_kvcache.core.hashing\n"
        "import fastdeploy_kvcache.core.block_pool, fastdeploy_kvcache.core.radix_tree\n"
        "import fastdeploy_kvcache.core.request, fastdeploy_kvcache.core.cache_manager\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in ('paddle', 'cupy'))))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []
