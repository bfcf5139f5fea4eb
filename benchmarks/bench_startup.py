"""Time to "serving" with a host tier against the same server without one.

Starts the OpenAI server (``ENABLE_V1_KVCACHE_MANAGER=1``) as a child process and times
from the spawn to the first ``/health`` answer, for each configuration, interleaved over
``--repeats`` rounds (the model load varies between runs; interleaving spreads that over
all of them):

* ``none``: no host tier (the baseline);
* ``upfront``: ``--swap-space N`` pinned before serving (``FDKV_HOST_GROW_CHUNK_MIB=0``; the
  default with CPU copies): mmap, pages faulted in by threads, ``cudaHostRegister``;
* ``background`` (only with ``--configs``): ``--swap-space N`` pinned in the background
  (``FDKV_HOST_GROW_CHUNK_MIB=--grow-chunk-mib``: in pieces with CPU copies, as one piece
  with CUDA copies); its row also
  gives the seconds until the whole tier is pinned (``/metrics`` ``host_blocks_ready`` =
  ``host_blocks_total``), after "serving".

Prints the median per configuration and its ratio to ``none`` (target: <= 1.2).  Any other
server flags follow ``--``::

    python benchmarks/bench_startup.py --swap-space 32 --repeats 3 -- --model llama3-8b-random --device gpu
    python benchmarks/bench_startup.py --swap-space 1 --repeats 2 --configs none,upfront,background  # CPU

Writes ``bench_startup.json`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench_serving import split_server_args  # noqa: E402

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess  # noqa: E402

CPU_ARGS = ["--model", "tiny-llama-random", "--device", "cpu", "--num-gpu-blocks-override", "64"]


def run_once(args: list[str], env: dict[str, str], timeout_s: float, host_tier: bool) -> dict[str, Any]:
    server = ServerProcess(args, env=env, startup_timeout_s=timeout_s, wait_for_host_tier=False)
    t0 = time.perf_counter()
    server.start()
    serving = time.perf_counter() - t0
    complete: Optional[float] = None
    try:
        if host_tier:
            deadline = time.perf_counter() + timeout_s
            while time.perf_counter() < deadline:
                ready, total = server.host_tier_progress()
                if total and ready >= total:
                    complete = time.perf_counter() - t0
                    break
                time.sleep(0.05)
    finally:
        server.stop()
    return {"serving_s": serving, "host_complete_s": complete}


def main(argv: Optional[list[str]] = None) -> int:
    argv, extra = split_server_args(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--swap-space", type=float, default=1.0, help="host tier in GiB (default 1)")
    p.add_argument("--repeats", type=int, default=2, help="interleaved rounds (default 2)")
    p.add_argument("--configs", default="none,upfront",
                   help="which rows to run: none, upfront, background")
    p.add_argument("--grow-chunk-mib", type=float, default=256.0,
                   help="FDKV_HOST_GROW_CHUNK_MIB of the background row (default 256; CUDA copies pin one piece)")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds a start-up may take")
    p.add_argument("--out", default="benchmarks/results", help="directory for bench_startup.json")
    a = p.parse_args(argv)
    server_args = extra or CPU_ARGS
    base_env = {"ENABLE_V1_KVCACHE_MANAGER": "1"}
    configs = {
        "none": (server_args, base_env, False),
        "background": ([*server_args, "--swap-space", str(a.swap_space)],
                       dict(base_env, FDKV_HOST_GROW_CHUNK_MIB=f"{a.grow_chunk_mib:g}"), True),
        "upfront": ([*server_args, "--swap-space", str(a.swap_space)],
                    dict(base_env, FDKV_HOST_GROW_CHUNK_MIB="0"), True),
    }
    names = [c for c in a.configs.split(",") if c]
    for c in names:
        if c not in configs:
            p.error(f"unknown config {c!r}; expected some of {sorted(configs)}")
    runs: dict[str, list[dict[str, Any]]] = {c: [] for c in names}
    for r in range(a.repeats):
        for c in names:
            args, env, host = configs[c]
            res = run_once(args, env, a.timeout, host)
            runs[c].append(res)
            print(f"round {r + 1} {c:10s} serving {res['serving_s']:.2f} s"
                  + (f", host tier complete {res['host_complete_s']:.2f} s" if res["host_complete_s"] else ""),
                  flush=True)
    base = statistics.median(x["serving_s"] for x in runs["none"]) if "none" in runs else None
    print(f"\nhost tier {a.swap_space:g} GiB; server flags: {' '.join(server_args)}")
    print(f"{'config':10s} {'serving s':>10s} {'/ none':>8s} {'tier complete s':>16s}")
    summary: dict[str, Any] = {}
    for c in names:
        med = statistics.median(x["serving_s"] for x in runs[c])
        done = [x["host_complete_s"] for x in runs[c] if x["host_complete_s"] is not None]
        ratio = med / base if base else None
        summary[c] = {"serving_s": med, "ratio_to_none": ratio,
                      "host_complete_s": statistics.median(done) if done else None, "runs": runs[c]}
        print(f"{c:10s} {med:10.2f} {ratio if ratio is not None else float('nan'):8.3f} "
              f"{summary[c]['host_complete_s'] if done else float('nan'):16.2f}")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "bench_startup.json"), "w") as f:
        json.dump({"swap_space_gib": a.swap_space, "server_args": server_args, "repeats": a.repeats,
                   "results": summary}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
