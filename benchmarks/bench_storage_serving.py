"""Storage tier through the HTTP server: the fourth configuration and the cold-server scenario.

A thin front of ``bench_serving.py``, which does all of it (one implementation):

* **device+host+storage** -- the multi-turn workload of ``bench_serving`` on a server with a
  ``file`` storage tier below the host tier, next to ``device+host`` in the same run, so the
  cost of writing every block to storage shows in the same-run TTFT ratio.
* **cold server** -- a server computes ``--probe-repeats`` documents of each prefix length
  and stores them, and is stopped; a *restarted* server in front of the same (warm) store
  then answers, for each document: first from storage (prefetch into host, then the
  layer-by-layer load), then -- after filler documents pushed it off the device -- from
  host; and a never-seen document of the same length is recomputed.  All three TTFTs come
  from the same server process in the same run.  ``file`` and ``mooncake`` backends.

Targets (same-run ratios of p50 TTFT): storage hit <= 1.3 x host hit (file), and
storage hit <= 0.25 x recompute at the largest prefix.  Also reported: each backend's GB/s as
the server saw it (bytes / seconds of its storage jobs) next to a plain file write and read of
the same bytes in the same run.

This script keeps its flags of before (three prefix lengths, both backends, only the two
configurations with a host tier, no docs update) and maps them onto ``bench_serving``'s;
any other ``bench_serving`` flag is passed through.  Output:
``bench_storage_serving_<tag>_<date>.json`` (``bench_serving``'s report format).

    python benchmarks/bench_storage_serving.py                  # CPU, tiny-llama-random
    python benchmarks/bench_storage_serving.py --quick          # smoke run
    python benchmarks/bench_serving.py --configs '' --cold-prefix-tokens 512,1024,2048   # the same probe
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_serving  # noqa: E402


def bench_serving_argv(argv: Optional[list[str]] = None) -> list[str]:
    """This script's flags as ``bench_serving`` flags (unknown flags are passed through)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny-llama-random")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--prefix-tokens", default="512,1024,2048", help="Prefix lengths of the cold-server probe.")
    ap.add_argument("--probe-repeats", type=int, default=15, help="Documents per backend and prefix length (see bench_serving --cold-repeats).")
    ap.add_argument("--backends", default="file,mooncake")
    ap.add_argument("--users", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=1024)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--swap-space", type=float, default=1.0)
    ap.add_argument("--workload", action=argparse.BooleanOptionalAction, default=True,
                    help="Run the multi-turn workload on device+host and device+host+storage.")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="cpu")
    ap.add_argument("--quick", action="store_true")
    args, rest = ap.parse_known_args(argv)
    out = ["--model", args.model, "--block-size", str(args.block_size),
           "--cold-server", "--cold-prefix-tokens", args.prefix_tokens, "--cold-repeats", str(args.probe_repeats),
           "--storage-backends", args.backends,
           "--users", str(args.users), "--rounds", str(args.rounds), "--doc-tokens", str(args.doc_tokens),
           "--output-tokens", str(args.output_tokens), "--concurrency", str(args.concurrency),
           "--swap-space", str(args.swap_space),
           "--configs", "device+host,device+host+storage" if args.workload else "",
           # The hit, miss and default-model probes belong to bench_serving's table.
           "--probe-repeats", "0", "--miss-repeats", "0", "--default-model-probe", "", "--docs", "",
           "--seed", str(args.seed), "--out-dir", args.out_dir, "--tag", args.tag,
           "--name", "bench_storage_serving"]
    if args.quick:
        out.append("--quick")
    return out + rest


def main(argv: Optional[list[str]] = None) -> int:
    return bench_serving.main(bench_serving_argv(argv))


if __name__ == "__main__":
    raise SystemExit(main())
