"""Other clients' latency while the server handles (and rejects) a huge prompt.

One real server (tiny-llama-random on the CPU, ``--max-model-len 4096``).  A prober
thread times ``GET /health`` and a small streamed completion (time to its first token)
over and over:

* **baseline** -- nothing else runs (the limit: what the machine gives when idle);
* **during** -- while a huge completion prompt is in flight, for each size in ``--sizes-mib``:
  the huge request's status and time to answer, and the probes' latencies meanwhile.

It prints, per case, the median and maximum probe latency and the ratio of the maximum to
the baseline's.  A server that tokenizes on its event loop freezes every client for as long
as the huge prompt takes; one that answers 413 (over ``--max-request-body-bytes``) or 400
(over the context, found before tokenizing) keeps the ratio near 1.

    python benchmarks/bench_huge_prompt.py                      # 1.9 MiB (under the default cap) and 10 MiB
    python benchmarks/bench_huge_prompt.py --sizes-mib 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any, Optional

import httpx
from tqdm import tqdm

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess  # noqa: E402

MODEL = "tiny-llama-random"
SERVER_ARGS = ["--model", MODEL, "--device", "cpu", "--max-model-len", "4096", "--num-gpu-blocks-override", "128",
               "--block-size", "16"]
WORDS = "cache block device host storage tier prefix radix tree layer stream copy token prompt engine".split()


def huge_text(mib: float) -> str:
    """Plain words, ``mib`` MiB of them (every word tokenizes; no special characters)."""
    unit = " ".join(WORDS) + " "
    return unit * (int(mib * (1 << 20)) // len(unit) + 1)


class Prober(threading.Thread):
    """Times /health and a small streamed completion, alternately, until stopped."""

    def __init__(self, base_url: str) -> None:
        super().__init__(daemon=True)
        self.base_url = base_url
        self.stop_event = threading.Event()
        self.health: list[float] = []
        self.first_token: list[float] = []
        self.errors = 0

    def run(self) -> None:
        body = {"model": MODEL, "prompt": "the quick brown fox", "max_tokens": 2, "stream": True,
                "temperature": 0, "ignore_eos": True}
        with httpx.Client(base_url=self.base_url, timeout=120.0) as client:
            while not self.stop_event.is_set():
                try:
                    t = time.perf_counter()
                    client.get("/health").raise_for_status()
                    self.health.append(time.perf_counter() - t)
                    t = time.perf_counter()
                    with client.stream("POST", "/v1/completions", json=body) as resp:
                        resp.raise_for_status()
                        seen = False
                        for line in resp.iter_lines():  # read to the end, time the first chunk
                            if not seen and line.startswith("data: {"):
                                self.first_token.append(time.perf_counter() - t)
                                seen = True
                except httpx.HTTPError:
                    self.errors += 1
                time.sleep(0.01)


def summary(xs: list[float]) -> dict[str, Optional[float]]:
    if not xs:
        return {"n": 0, "median_ms": None, "max_ms": None}
    return {"n": len(xs), "median_ms": round(statistics.median(xs) * 1e3, 2), "max_ms": round(max(xs) * 1e3, 2)}


def probe_while(server: ServerProcess, seconds: Optional[float], work: Any = None) -> tuple[dict[str, Any], Any]:
    """Probe for ``seconds`` (baseline) or while ``work()`` runs; (summaries, work's result)."""
    prober = Prober(server.base_url)
    prober.start()
    time.sleep(0.2)  # the prober's first round trip, so "during" starts with a probe in flight
    result = None
    if work is not None:
        result = work()
        time.sleep(0.2)
    else:
        time.sleep(seconds or 0)
    prober.stop_event.set()
    prober.join(120)
    return {"health": summary(prober.health), "first_token": summary(prober.first_token),
            "probe_errors": prober.errors}, result


def send_huge(server: ServerProcess, mib: float) -> dict[str, Any]:
    body = json.dumps({"model": MODEL, "prompt": huge_text(mib), "max_tokens": 4}).encode()
    t = time.perf_counter()
    try:
        resp = httpx.post(server.base_url + "/v1/completions", content=body,
                          headers={"content-type": "application/json"}, timeout=300.0)
        status, message = resp.status_code, resp.json().get("error", {}).get("message", "")[:160]
    except httpx.HTTPError as exc:  # a server that closes the connection on a 413
        status, message = None, f"{type(exc).__name__}: {exc}"[:160]
    return {"mib": mib, "body_bytes": len(body), "status": status, "seconds": round(time.perf_counter() - t, 3),
            "message": message}


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes-mib", default="1.9,10", help="Huge prompt sizes in MiB, comma-separated.")
    ap.add_argument("--baseline-s", type=float, default=5.0, help="Seconds of probing with nothing else running.")
    ap.add_argument("--server-arg", action="append", default=[],
                    help="Extra server flag (repeatable), e.g. --server-arg=--max-request-body-bytes=1048576.")
    ap.add_argument("--json", type=Path, default=None, help="Also write the report here.")
    args = ap.parse_args(argv)
    sizes = [float(s) for s in args.sizes_mib.split(",") if s]

    report: dict[str, Any] = {"machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
                              "date": time.strftime("%Y-%m-%d"), "server_args": SERVER_ARGS + args.server_arg}
    with ServerProcess(SERVER_ARGS + args.server_arg) as server:
        steps = tqdm(total=1 + len(sizes), desc="bench_huge_prompt", unit="case")
        base, _ = probe_while(server, args.baseline_s)
        report["baseline"] = base
        steps.update()
        report["cases"] = []
        for mib in sizes:
            during, huge = probe_while(server, None, lambda m=mib: send_huge(server, m))
            report["cases"].append({"huge": huge, "during": during})
            steps.update()
        steps.close()

    b = report["baseline"]
    print(f"baseline (nothing else running): /health median {b['health']['median_ms']} ms, max "
          f"{b['health']['max_ms']} ms; small stream first token median {b['first_token']['median_ms']} ms, max "
          f"{b['first_token']['max_ms']} ms")
    for case in report["cases"]:
        h, d = case["huge"], case["during"]
        ratio_h = (d["health"]["max_ms"] or 0) / max(b["health"]["max_ms"] or 1e-9, 1e-9)
        ratio_f = (d["first_token"]["max_ms"] or 0) / max(b["first_token"]["max_ms"] or 1e-9, 1e-9)
        case["ratio_health_max"] = round(ratio_h, 2)
        case["ratio_first_token_max"] = round(ratio_f, 2)
        # A stall hits whichever probe is in flight: the worst of both is the figure to watch.
        worst = max(d["health"]["max_ms"] or 0, d["first_token"]["max_ms"] or 0)
        worst_base = max(b["health"]["max_ms"] or 0, b["first_token"]["max_ms"] or 0)
        case["worst_probe_ms"] = worst
        case["ratio_worst_probe"] = round(worst / max(worst_base, 1e-9), 2)
        print(f"{h['mib']:g} MiB prompt: HTTP {h['status']} after {h['seconds']} s ({h['message']!r}); during it "
              f"/health median {d['health']['median_ms']} ms max {d['health']['max_ms']} ms "
              f"(max / baseline max = {ratio_h:.2f}), first token max {d['first_token']['max_ms']} ms "
              f"(x{ratio_f:.2f}), {d['health']['n']} probes, {d['probe_errors']} probe errors; worst probe "
              f"{case['worst_probe_ms']} ms = {case['ratio_worst_probe']:.2f} x the baseline's worst")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
