"""``python -m fastdeploy_kvcache.storage.mooncake_local`` where Mooncake is not installed:
one line that says what to run, exit status 2, no traceback (docs/fleet.md's recipe starts
with it)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_without_mooncake_it_says_so_in_one_line(tmp_path: Path) -> None:
    # The same interpreter and packages, run from a directory without mooncake_master beside
    # it and with a PATH that has none either: what a checkout without Mooncake looks like.
    python = tmp_path / "python"
    python.symlink_to(sys.executable)
    env = dict(os.environ, PATH="/usr/bin:/bin",
               PYTHONPATH=os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"], *sys.path[1:]]))
    assert not any((Path(d) / "mooncake_master").exists() for d in ("/usr/bin", "/bin")), "Mooncake on PATH"
    out = subprocess.run([str(python), "-m", "fastdeploy_kvcache.storage.mooncake_local", "--segment", "1GB"],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip() == ("mooncake_local: mooncake_master not installed: run `bash build.sh` "
                                  "(or `bash build.sh serve`)"), out.stderr
    assert out.stdout == ""
