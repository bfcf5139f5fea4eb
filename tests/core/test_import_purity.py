"""The scheduler side must import without Paddle, CuPy or torch (it runs in a CPU-only process).

Every module of ``fastdeploy_kvcache.core`` is imported in a fresh interpreter; none of those
frameworks may be loaded afterwards.  (Where a framework is not installed at all the check
still runs, and an import of it would fail the import outright.)
"""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_core_imports_no_paddle_cupy_or_torch():
    code = (
        "import sys, json, importlib, pkgutil\n"
        "import fastdeploy_kvcache.core as core\n"
        "names = [m.name for m in pkgutil.iter_modules(core.__path__, 'fastdeploy_kvcache.core.')]\n"
        "for name in names:\n"
        "    importlib.import_module(name)\n"
        "print(json.dumps([len(names), sorted(m for m in sys.modules\n"
        "                  if m.split('.')[0] in ('paddle', 'paddleformers', 'cupy', 'torch'))]))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    count, loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert count >= 10, f"only {count} core modules found: the walk does not see the package"
    assert loaded == []
