"""Soak: does the server's memory stay flat over many requests?

Starts a real server (``tiny-llama-random`` on the CPU, the tiered cache on, a small host
tier), sends ``--rounds`` rounds of ``--requests`` completions each from ``--clients``
concurrent clients (prompts of random token ids; every fourth one repeats an earlier
prompt, so device hits, host hits and evictions all happen), and reads the server's
resident set size (RSS, ``/proc/<pid>/statm``) after each round.

Reported: RSS per round and the least-squares slope of RSS over requests served (bytes
per request), after a warm-up round that is not counted (allocator pools, the first
shapes of every op).  The in-run baseline is the leak this was written against:
``paddle.to_tensor`` on Paddle 3.3.1 CPU keeps about a hundred bytes per call, so a
child process times the RSS slope of a loop of bare ``paddle.to_tensor`` calls, and the
server's slope is printed as a number of such calls per request (the engine issued a few
per decode step before it stopped calling it on the request path).

    python benchmarks/bench_soak.py [--rounds 10] [--requests 200] [--clients 4] [--max-tokens 16]

Exits 1 when the slope is above ``--max-slope`` bytes per request (default 1024).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess, rss_bytes  # noqa: E402

MODEL = "tiny-llama-random"
SERVER_ARGS = [
    "--model", MODEL, "--device", "cpu", "--block-size", "16", "--max-model-len", "512",
    "--num-gpu-blocks-override", "96", "--max-num-seqs", "8", "--max-num-batched-tokens", "256",
    "--swap-space", "0.02", "--log-level", "warning",
]

# Runs in a child process: the RSS slope of bare paddle.to_tensor calls, bytes per call.
TO_TENSOR_PROBE = """
import gc, json, sys, numpy as np, paddle
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * {page}
calls = int(sys.argv[1])
ids = np.arange(64, dtype=np.int64)
for _ in range(2000):
    paddle.to_tensor(ids)
gc.collect(); before = rss()
for _ in range(calls):
    paddle.to_tensor(ids)
gc.collect()
print(json.dumps({{"bytes_per_call": (rss() - before) / calls, "paddle": paddle.__version__}}))
"""


def to_tensor_leak(calls: int) -> dict[str, float]:
    """Bytes of RSS per bare ``paddle.to_tensor`` call, measured in a fresh interpreter."""
    code = TO_TENSOR_PROBE.format(page=os.sysconf("SC_PAGE_SIZE"))
    out = subprocess.run([sys.executable, "-c", code, str(calls)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def make_prompts(seed: int, count: int, length: int, repeat_every: int = 4) -> list[list[int]]:
    """``count`` token-id prompts; every ``repeat_every``-th repeats an earlier one (a cache hit)."""
    rng = random.Random(seed)
    prompts: list[list[int]] = []
    for i in range(count):
        if prompts and i % repeat_every == repeat_every - 1:
            prompts.append(rng.choice(prompts))
        else:
            prompts.append([rng.randrange(10, 500) for _ in range(rng.randrange(length // 2, length))])
    return prompts


def run_round(client: object, prompts: list[list[int]], max_tokens: int, clients: int, progress: object) -> None:
    """Send ``prompts`` as completions from ``clients`` threads; raise on any failed request."""

    def one(prompt: list[int]) -> None:
        reply = client.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0)
        if not reply.choices:
            raise RuntimeError("a completion came back without choices")
        progress.update(1)

    with ThreadPoolExecutor(clients) as pool:
        for f in [pool.submit(one, p) for p in prompts]:
            f.result()


def slope_per_request(served: list[int], rss: list[int]) -> float:
    """Least-squares slope of RSS over requests served, bytes per request."""
    return statistics.linear_regression(served, rss).slope


def soak(server: ServerProcess, rounds: int, requests: int, clients: int, max_tokens: int, prompt_tokens: int,
         seed: int = 0, progress: Optional[object] = None) -> tuple[list[int], list[int]]:
    """Warm-up round, then ``rounds`` rounds; returns (requests served, RSS bytes) after each counted round."""
    from openai import OpenAI

    class _NoBar:
        def update(self, n: int) -> None:
            pass

    bar = progress or _NoBar()
    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    run_round(client, make_prompts(seed, requests, prompt_tokens), max_tokens, clients, bar)
    served, rss = [0], [rss_bytes(server.proc.pid)]
    for r in range(rounds):
        run_round(client, make_prompts(seed + 1 + r, requests, prompt_tokens), max_tokens, clients, bar)
        served.append(served[-1] + requests)
        rss.append(rss_bytes(server.proc.pid))
    return served, rss


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=10, help="counted rounds after the warm-up (default: 10)")
    p.add_argument("--requests", type=int, default=200, help="requests per round (default: 200)")
    p.add_argument("--clients", type=int, default=4, help="concurrent clients (default: 4)")
    p.add_argument("--max-tokens", type=int, default=16, help="tokens generated per request (default: 16)")
    p.add_argument("--prompt-tokens", type=int, default=96, help="longest prompt, in tokens (default: 96)")
    p.add_argument("--probe-calls", type=int, default=60000,
                   help="paddle.to_tensor calls of the in-run baseline (default: 60000)")
    p.add_argument("--max-slope", type=float, default=1024.0,
                   help="exit 1 above this many bytes of RSS per request (default: 1024)")
    args = p.parse_args(argv)
    from tqdm import tqdm

    leak = to_tensor_leak(args.probe_calls)
    print(f"baseline: bare paddle.to_tensor (Paddle {leak['paddle']}) grows RSS by "
          f"{leak['bytes_per_call']:.1f} B per call over {args.probe_calls} calls")
    env = {"ENABLE_V1_KVCACHE_MANAGER": "1"}
    t0 = time.monotonic()
    with ServerProcess(SERVER_ARGS, env=env) as server:
        try:
            with tqdm(total=(args.rounds + 1) * args.requests, desc="soak", unit="req", file=sys.stderr) as bar:
                served, rss = soak(server, args.rounds, args.requests, args.clients, args.max_tokens,
                                   args.prompt_tokens, progress=bar)
        except Exception:
            print(f"server log ({server.log_path}, exit code {server.proc.poll()}):\n{server.log_tail()}",
                  file=sys.stderr)
            raise
    print(f"{'round':>5} {'requests':>9} {'RSS MiB':>9} {'delta KiB':>10}")
    for i, (n, r) in enumerate(zip(served, rss)):
        delta = "" if i == 0 else f"{(r - rss[i - 1]) / 1024:10.0f}"
        print(f"{i:5d} {n:9d} {r / 2**20:9.1f} {delta}")
    slope = slope_per_request(served, rss)
    per_call = leak["bytes_per_call"]
    ratio = slope / per_call if per_call > 0 else float("nan")
    print(f"slope: {slope:.0f} B per request over {served[-1]} requests "
          f"({ratio:.1f} bare to_tensor calls' worth per request; limit {args.max_slope:.0f} B); "
          f"{time.monotonic() - t0:.0f} s")
    return 0 if slope <= args.max_slope else 1


if __name__ == "__main__":
    sys.exit(main())
