"""Running a check module under Triton's CPU interpreter, for the tests of the Triton kernels.

Why a subprocess: ``TRITON_INTERPRET=1`` must be in the environment before Triton is first
imported, and the test process may have imported it already (or must not be changed for the
tests after it).  The check module prints its results as one JSON line, last.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRITON_REASON = ("needs PyTorch and Triton, for Triton's CPU interpreter (pip install torch triton; Triton comes "
                 "with CUDA builds of torch)")


def run_in_interpreter(module: str, timeout_s: float = 900) -> dict[str, Any]:
    """``python -m module`` with ``TRITON_INTERPRET=1``; its last stdout line, parsed."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-m", module], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=timeout_s)
    assert out.returncode == 0, out.stderr[-4000:]
    return json.loads(out.stdout.strip().splitlines()[-1])
