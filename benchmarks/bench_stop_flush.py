"""How long a graceful stop takes when the store is smaller than the cache.

A real server (tiny-llama-random on the CPU, ``--write-policy write_through``, storage put
policy ``write_back``, so nothing is stored while it runs) computes a few prompts and is
stopped with SIGINT: its stop flush writes the cached blocks to a ``file`` store.  Two
configurations in the same run, on the same cache:

* **uncapped** -- the store holds every block (the in-run baseline);
* **capped** -- ``--kvcache-storage-size`` far below the cache (default 256 KiB).

Printed per configuration: the stop's wall time (SIGINT to exit), the flush's own log line
(blocks written, outcome) and the objects left in the store; then the ratio capped /
uncapped.  The target is a capped stop under 5 s (a stop that loops until
``--kvcache-storage-shutdown-flush`` runs out takes 20 s).

    python benchmarks/bench_stop_flush.py
    python benchmarks/bench_stop_flush.py --cap 2MiB --prompts 8
"""

from __future__ import annotations

import argparse
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess, stop_child  # noqa: E402

MODEL = "tiny-llama-random"
BASE = ["--model", MODEL, "--device", "cpu", "--block-size", "16", "--max-model-len", "1024",
        "--num-gpu-blocks-override", "64", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
        "--swap-space", "0.05", "--write-policy", "write_through"]


def one_stop(store: Path, cap: str, prompts: int) -> dict[str, Any]:
    import httpx

    args = [*BASE, "--kvcache-storage-backend", "file", "--kvcache-storage-path", str(store),
            "--kvcache-storage-min-free", "0", "--kvcache-storage-put-policy", "write_back"]
    if cap:
        args += ["--kvcache-storage-size", cap]
    server = ServerProcess(args, env={"ENABLE_V1_KVCACHE_MANAGER": "1"}).start()
    try:
        for seed in range(prompts):
            rng = random.Random(seed)
            body = {"model": MODEL, "prompt": [rng.randrange(10, 500) for _ in range(300)], "max_tokens": 2,
                    "temperature": 0, "ignore_eos": True}
            resp = httpx.post(server.base_url + "/v1/completions", json=body, timeout=120.0)
            resp.raise_for_status()
        time.sleep(0.5)  # the last backups settle
        cached = server.engine_stats()["cache"]["num_cached_nodes"]
    finally:
        assert server.proc is not None
        t0 = time.monotonic()
        rc = stop_child(server.proc, signal.SIGINT, wait_s=120)
        seconds = time.monotonic() - t0
    with open(server.log_path, errors="replace") as f:
        flush = [line.split("storage_pool: ", 1)[-1] for line in f if "storage flush at stop" in line]
    return {"cap": cap or "none", "cached_blocks": cached, "stop_s": seconds, "exit": rc,
            "objects": len(list(store.glob("*.kv"))), "flush": flush[-1].strip() if flush else "(no flush line)"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cap", default="256KiB", help="the capped store's --kvcache-storage-size")
    ap.add_argument("--prompts", type=int, default=4, help="300-token prompts computed before the stop")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-stop-flush-") as tmp:
        base = one_stop(Path(tmp) / "uncapped", "", a.prompts)
        capped = one_stop(Path(tmp) / "capped", a.cap, a.prompts)
    for r in (base, capped):
        print(f"{r['cap']:>8} cap: stop {r['stop_s']:.2f} s (exit {r['exit']}), {r['cached_blocks']} cached blocks, "
              f"{r['objects']} objects left; {r['flush']}")
    print(f"capped / uncapped stop time: {capped['stop_s'] / max(base['stop_s'], 1e-9):.2f}")


if __name__ == "__main__":
    main()
