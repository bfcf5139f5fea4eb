"""The router's command line: the two modes, --worker-events, and clear refusals of bad flags."""

from __future__ import annotations

import pytest

from fastdeploy_kvcache.entrypoints.router.cli import build_app_from_args, make_arg_parser, parse_worker_events


def _build(*argv: str):  # -> FastAPI
    return build_app_from_args(make_arg_parser().parse_args(list(argv)))


def test_worker_events_per_worker_with_star_hosts() -> None:
    urls = ["http://10.0.0.1:8188", "http://10.0.0.2:8188", "http://10.0.0.3:8188"]
    got = parse_worker_events(["tcp://*:5557,tcp://*:5558", "none", "ipc:///tmp/w2"], urls)
    assert (got[0].pub, got[0].replay) == ("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558")
    assert got[1] is None
    assert (got[2].pub, got[2].replay) == ("ipc:///tmp/w2", None)
    assert parse_worker_events(None, urls) == [None, None, None]


@pytest.mark.parametrize("argv, message", [
    (["--worker-urls", "http://a:1", "--worker-events", "tcp://*:1", "tcp://*:2"], "2 given for 1"),
    (["--worker-urls", "http://a:1", "--worker-events", "udp://x:1"], "not PUB"),
    (["--worker-urls", "a:1"], "must start with http"),
    (["--worker-urls", "http://a:1", "--prefill-url", "http://b:1", "--decode-url", "http://c:1"], "two modes"),
    (["--prefill-url", "http://b:1"], "both --prefill-url and --decode-url"),
    ([], "give --worker-urls"),
    (["--worker-urls", "http://a:1", "--model", "nope"], "neither a known model"),
    (["--worker-urls", "http://a:1", "--model", "tiny-llama-random", "--host-weight", "2"], "host weight"),
    (["--worker-urls", "http://a:1", "--model", "tiny-llama-random", "--balance-rel-threshold", "0.5"],
     "balance_rel_threshold"),
    (["--worker-urls", "http://a:1", "--graceful-shutdown-timeout", "-1"], "graceful-shutdown-timeout: must be"),
    (["--prefill-url", "http://b:1", "--decode-url", "http://c:1", "--graceful-shutdown-timeout", "nan"],
     "graceful-shutdown-timeout: must be"),
])
def test_bad_flags_are_refused_with_a_message(argv: list[str], message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        _build(*argv)


def test_both_modes_build() -> None:
    assert _build("--prefill-url", "http://b:1", "--decode-url", "http://c:1").title.endswith("PD router")
    app = _build("--worker-urls", "http://a:1", "http://b:1", "--model", "tiny-llama-random", "--policy",
                 "least_requests")
    assert app.state.router.config.policy.name == "least_requests"
