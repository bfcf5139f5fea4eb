"""What a test does when the compiled ops it needs are missing: skip, saying which build
makes them, or fail when ``FDKV_REQUIRE_OPS=1`` (CI sets it), so that a broken build
cannot pass as a run of skips."""

from __future__ import annotations

import pytest

from skip_helpers import env_switch


def ops_missing(reason: str) -> None:
    """Skip the calling test for want of built ops, or fail it when FDKV_REQUIRE_OPS=1."""
    if env_switch("FDKV_REQUIRE_OPS"):
        pytest.fail(f"FDKV_REQUIRE_OPS=1 but the ops are not usable: {reason}", pytrace=False)
    pytest.skip(reason)
