"""Suite-wide pytest hooks.

NOTE: the process leaves through ``os._exit`` with pytest's own exit status once the
summary is printed.  Native libraries loaded by the suite (Paddle, paddleformers' stack,
Mooncake's transfer engine) own background threads of their own; at interpreter shutdown
one of them was seen, rarely (about 1 run in 17 of tests/engine), to jump into a library
that had already been torn down, turning a green run into exit 139 after "N passed".
Every test has finished and reported by then, and every resource a test owns is released
by its own fixtures, so skipping the interpreter's final teardown loses nothing the suite
checks.  Set FDKV_TESTS_NORMAL_EXIT=1 to exit normally (to hunt that crash).
"""

from __future__ import annotations

import os
import sys

import pytest

_exit_status: int | None = None


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    global _exit_status
    _exit_status = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if _exit_status is None or os.environ.get("FDKV_TESTS_NORMAL_EXIT") == "1":
        return
    # Only the outermost pytest process (not pytester/xdist children) leaves early.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit_status)
