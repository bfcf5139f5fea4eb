"""Prefix-cache timing attack: can one tenant tell from TTFT alone whether another one sent a
prompt?  And what do the isolation modes keep of cross-tenant sharing, at what cost?

ONE invocation starts three servers with the same keys file (a victim, two attacker keys,
``--gsp-tenants`` workload tenants) and flags, differing only in ``--tenant-isolation``:
``none``, ``salt`` and ``k-anonymity`` (``--k-anonymity-k``, default 2).  Then:

1. **The attack** (``--trials`` per configuration, half of them with the secret cached, in a
   seeded shuffled order).  Each trial draws a fresh secret prompt (``--secret-tokens`` token
   ids); in a "cached" trial the victim sends it first, in the others a decoy as long
   (so the server's load before the probe is the same in both).  The attacker then sends the secret
   itself (``max_tokens=1``, streamed) and keeps its TTFT: the only signal it has.  Score =
   -TTFT; the ROC AUC of the score against the truth is computed rank-based (ties count one
   half).  0.5 is a coin toss, 1.0 a perfect detector.  Configurations: ``none``;
   ``cache_salt`` (the ``none`` server, the victim sending a ``cache_salt`` of its own);
   ``salt`` (tenant salting); ``k-anonymity``.  Also reported for k-anonymity, outside its
   threat model: a second attacker key probing right after the first (two colluding
   tenants reach k = 2 together with the victim, so they see it).
2. **Sharing kept** (the generated-shared-prefix workload): ``--gsp-groups`` system prompts of
   ``--gsp-system-tokens`` tokens, each used by every one of the ``--gsp-tenants`` tenants with
   ``--gsp-questions`` questions of their own; all requests shuffled (seeded), sent with
   ``--concurrency`` in flight.  Reused tokens (``usage.prompt_tokens_details.cached_tokens``)
   per server, and each one's ratio to the ``none`` server's (target for k-anonymity at k = 2:
   >= 0.9).
3. **Cost**: a workload that shares nothing across tenants (each tenant its own document, a
   fresh suffix per request), so every server reuses the same tokens and only the mechanism
   differs: requests/s of each isolated server over the ``none`` server's, the three servers
   taking turns ``--cost-reps`` times in a shuffled order after one untimed turn that caches
   the documents (the median of the per-turn ratios; target >= 0.98).

Printed: the in-run baseline (the ``none`` server: its cold and cached TTFT of a secret, its
reuse, its requests/s) and each configuration's figure beside it.

Usage:
    python benchmarks/bench_timing_attack.py                  # CPU, tiny-llama-random, a few minutes on 2 cores
    python benchmarks/bench_timing_attack.py --quick          # smoke run; not for tables
    python benchmarks/bench_timing_attack.py --device gpu --model-impl transformers   # llama3-8b-random

Extra server flags go after ``--``.  Writes ``bench_timing_attack_<tag>_<date>.json`` under
``--out-dir``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Optional

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
for p in (ROOT, ROOT / "benchmarks"):
    if str(p) not in sys.path:
        sys.path.insert(0, str(p))

from bench_serving import machine, split_server_args, stream_completion  # noqa: E402

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess  # noqa: E402

logger = logging.getLogger("bench_timing_attack")

NAME = "bench_timing_attack"
MODES = ("none", "salt", "k-anonymity")
TARGET_ATTACK_AUC = 0.95  # none: the benchmark works
TARGET_ISOLATED_AUC = 0.6
TARGET_SHARING = 0.9
TARGET_COST = 0.98
DEFAULT_MODEL = {"gpu": "llama3-8b-random", "cpu": "tiny-llama-random"}
DEVICE_FLAGS = {
    # Three servers share one GPU: each gets a fixed KV pool (--gpu-memory-utilization counts the
    # whole device's use, so the second server would see the first's as its own).
    "gpu": ["--device", "gpu", "--swap-space", "4", "--kv-cache-memory-gib", "16"],
    "cpu": ["--device", "cpu", "--swap-space", "0.5", "--num-gpu-blocks-override", "1024",
            "--max-model-len", "2048", "--block-size", "16"],
}
DEFAULTS = {
    # GPU: eager servers take ~50 ms for any cached probe, so a 2048-token secret left only
    # 16 ms between cached and not (AUC 0.90 with no isolation); 4096 tokens double the
    # compute a hit saves.  100 trials a configuration: an isolated AUC's spread (about
    # 1 / sqrt(3 n)) is then 0.058.
    "gpu": dict(trials=100, secret_tokens=4096, gsp_tenants=16, gsp_groups=4, gsp_questions=2,
                gsp_system_tokens=2048, gsp_question_tokens=128, output_tokens=16, concurrency=16,
                cost_requests=32, cost_reps=3),
    "cpu": dict(trials=40, secret_tokens=512, gsp_tenants=16, gsp_groups=2, gsp_questions=2,
                gsp_system_tokens=512, gsp_question_tokens=32, output_tokens=4, concurrency=4,
                cost_requests=24, cost_reps=5),
    "quick": dict(trials=12, secret_tokens=256, gsp_tenants=16, gsp_groups=1, gsp_questions=1,
                  gsp_system_tokens=256, gsp_question_tokens=16, output_tokens=2, concurrency=4,
                  cost_requests=8, cost_reps=1),
}


# ---------------------------------------------------------------------- statistics
def roc_auc(scores: list[float], labels: list[bool]) -> float:
    """Area under the ROC curve of ``scores`` for ``labels`` (True: positive), rank-based
    (Mann-Whitney U over average ranks: ties count one half).  NaN without both classes."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(s, kind="mergesort")
    ranks = np.empty(len(s), dtype=np.float64)
    sorted_s = s[order]
    i = 0
    while i < len(s):  # average rank over each run of equal scores
        j = i
        while j + 1 < len(s) and sorted_s[j + 1] == sorted_s[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    u = ranks[y].sum() - n_pos * (n_pos + 1) / 2.0
    return float(u / (n_pos * n_neg))


def auc_interval(scores: list[float], labels: list[bool], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """A 95% bootstrap interval of :func:`roc_auc` (trials resampled with replacement, each
    class kept at its size): how far the AUC of this many trials moves by chance alone."""
    rng = np.random.default_rng(seed)
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    pos, neg = s[y], s[~y]
    if len(pos) == 0 or len(neg) == 0:
        return float("nan"), float("nan")
    vals = []
    for _ in range(draws):
        p = rng.choice(pos, len(pos))
        n = rng.choice(neg, len(neg))
        vals.append(roc_auc(list(p) + list(n), [True] * len(p) + [False] * len(n)))
    lo, hi = np.percentile(vals, [2.5, 97.5])
    return float(lo), float(hi)


# ---------------------------------------------------------------------- servers
def keys_for(gsp_tenants: int) -> dict[str, str]:
    keys = {"key-victim": "victim", "key-attacker": "attacker", "key-attacker-2": "attacker-2"}
    keys.update({f"key-g{i}": f"g{i}" for i in range(gsp_tenants)})
    return keys


def start_servers(flags: list[str], keys_file: Path, k: int) -> dict[str, ServerProcess]:
    servers: dict[str, ServerProcess] = {}
    try:
        for mode in MODES:
            more = ["--api-keys-file", str(keys_file), "--tenant-isolation", mode]
            if mode == "k-anonymity":
                more += ["--k-anonymity-k", str(k)]
            servers[mode] = ServerProcess([*flags, *more], env={"ENABLE_V1_KVCACHE_MANAGER": "1"},
                                          startup_timeout_s=1800)
        with ThreadPoolExecutor(len(servers)) as pool:  # start-ups overlap (each waits for its port)
            list(pool.map(lambda s: s.start(), servers.values()))
    except BaseException:
        for srv in servers.values():
            srv.stop()
        raise
    return servers


def client(server: ServerProcess, key: str) -> Any:
    from openai import AsyncOpenAI

    return AsyncOpenAI(base_url=server.base_url + "/v1", api_key=key, max_retries=0, timeout=1800)


async def ttft_of(server: ServerProcess, key: str, model: str, prompt: list[int], salt: Optional[str] = None,
                  max_tokens: int = 1) -> tuple[float, int]:
    """(TTFT seconds, cached tokens) of one streamed completion as ``key``."""
    c = client(server, key)
    start = time.perf_counter()
    ttft: Optional[float] = None
    cached = 0
    extra: dict[str, Any] = {"ignore_eos": True}
    if salt is not None:
        extra["cache_salt"] = salt
    stream = await c.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                        stream=True, stream_options={"include_usage": True}, extra_body=extra)
    async for chunk in stream:
        if chunk.choices and ttft is None:
            ttft = time.perf_counter() - start
        if chunk.usage is not None and chunk.usage.prompt_tokens_details is not None:
            cached = int(chunk.usage.prompt_tokens_details.cached_tokens or 0)
    await c.close()
    return (ttft if ttft is not None else time.perf_counter() - start), cached


# ---------------------------------------------------------------------- 1. the attack
async def attack(servers: dict[str, ServerProcess], model: str, trials: int, secret_tokens: int, seed: int,
                 progress: Any) -> dict[str, Any]:
    rng = random.Random(seed)
    truth = [True] * (trials // 2) + [False] * (trials - trials // 2)
    configs = [("none", "none", None), ("cache_salt", "none", "victim-own-salt"), ("salt", "salt", None),
               ("k-anonymity", "k-anonymity", None)]
    out: dict[str, Any] = {}
    for name, mode, salt in configs:
        order = truth[:]
        rng.shuffle(order)
        srv = servers[mode]
        ttfts: list[float] = []
        colluding: list[float] = []
        hits = {True: 0, False: 0}
        for cached in order:
            secret = [rng.randrange(10, 500) for _ in range(secret_tokens)]
            decoy = [rng.randrange(10, 500) for _ in range(secret_tokens)]
            # The victim sends a prompt in every trial (the secret, or another one as long), so
            # the two kinds of trial differ only in what is cached, not in the server's load.
            await ttft_of(srv, "key-victim", model, secret if cached else decoy, salt)
            t, got = await ttft_of(srv, "key-attacker", model, secret)
            ttfts.append(t)
            hits[cached] += got > 0
            if mode == "k-anonymity":
                colluding.append((await ttft_of(srv, "key-attacker-2", model, secret))[0])
            progress.update(1)
        scores = [-t for t in ttfts]
        res = {"auc": roc_auc(scores, order), "auc_95": auc_interval(scores, order), "trials": len(order),
               "ttft_ms": [round(t * 1e3, 2) for t in ttfts], "cached": order,
               "ttft_cached_median_s": statistics.median(t for t, c in zip(ttfts, order) if c),
               "ttft_uncached_median_s": statistics.median(t for t, c in zip(ttfts, order) if not c),
               "attacker_hits_when_cached": hits[True], "attacker_hits_when_not": hits[False]}
        if colluding:
            res["auc_two_colluding_keys"] = roc_auc([-t for t in colluding], order)
        out[name] = res
    return out


# ---------------------------------------------------------------------- 2. sharing kept
async def run_requests(server: ServerProcess, model: str, reqs: list[tuple[str, list[int]]], max_tokens: int,
                       concurrency: int, progress: Any) -> tuple[int, int, float]:
    """(reused tokens, prompt tokens, wall seconds) of ``reqs`` ((key, prompt)) in order."""
    sem = asyncio.Semaphore(concurrency)
    clients = {key: client(server, key) for key in {k for k, _ in reqs}}
    reused = 0

    async def one(key: str, prompt: list[int]) -> None:
        nonlocal reused
        async with sem:
            _, _, _, usage = await stream_completion(clients[key], model, prompt, max_tokens)
            reused += int(usage.prompt_tokens_details.cached_tokens or 0)
            progress.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(one(k, p) for k, p in reqs))
    wall = time.perf_counter() - start
    for c in clients.values():
        await c.close()
    return reused, sum(len(p) for _, p in reqs), wall


def gsp_requests(a: argparse.Namespace, seed: int) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    systems = [[rng.randrange(10, 500) for _ in range(a.gsp_system_tokens)] for _ in range(a.gsp_groups)]
    reqs = [(f"key-g{t}", systems[g] + [rng.randrange(10, 500) for _ in range(a.gsp_question_tokens)])
            for g in range(a.gsp_groups) for t in range(a.gsp_tenants) for _ in range(a.gsp_questions)]
    rng.shuffle(reqs)
    return reqs


def cost_requests(a: argparse.Namespace, seed: int) -> list[tuple[str, list[int]]]:
    """Each tenant its own document (no prefix shared across tenants), a fresh suffix each time."""
    rng = random.Random(seed)
    tenants = min(a.gsp_tenants, 4)
    docs = [[rng.randrange(10, 500) for _ in range(a.gsp_system_tokens)] for _ in range(tenants)]
    reqs = [(f"key-g{i % tenants}", docs[i % tenants] + [rng.randrange(10, 500) for _ in range(a.gsp_question_tokens)])
            for i in range(a.cost_requests)]
    rng.shuffle(reqs)
    return reqs


# ---------------------------------------------------------------------- main
def main(argv: Optional[list[str]] = None) -> int:
    argv, extra = split_server_args(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"))
    ap.add_argument("--model-impl", default=None, choices=("paddleformers", "transformers"),
                    help="Default: transformers on a GPU, paddleformers on the CPU.")
    ap.add_argument("--model", default="", help="Default: llama3-8b-random on a GPU, tiny-llama-random on the CPU.")
    ap.add_argument("--k-anonymity-k", type=int, default=2)
    for name in DEFAULTS["cpu"]:
        ap.add_argument("--" + name.replace("_", "-"), type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true", help="A smoke run (minutes less); not for tables.")
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--tag", default="")
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")  # not a line per HTTP request
    logger.setLevel(logging.INFO)
    defaults = DEFAULTS["quick" if a.quick else a.device]
    for name, value in defaults.items():
        if getattr(a, name) is None:
            setattr(a, name, value)
    impl = a.model_impl or ("transformers" if a.device == "gpu" else "paddleformers")
    model = a.model or DEFAULT_MODEL[a.device]
    flags = ["--model", model, "--model-impl", impl, *DEVICE_FLAGS[a.device], *extra]

    from tqdm import tqdm

    report: dict[str, Any] = {"bench": NAME, "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "machine": machine(a.device), "device": a.device, "model": model, "model_impl": impl,
                              "k": a.k_anonymity_k, "flags": flags,
                              "workload": {n: getattr(a, n) for n in defaults}}
    out_dir = Path(a.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tag = a.tag or a.device
    path = out_dir / f"{NAME}_{tag}_{dt.date.today().isoformat()}{'_quick' if a.quick else ''}.json"

    def save(phases_done: str) -> None:
        """(Re)write the JSON after each phase: a run stopped by a time limit keeps what ended."""
        report["phases_done"] = phases_done
        path.write_text(json.dumps(report, indent=2))

    with tempfile.TemporaryDirectory() as tmp:
        keys_file = Path(tmp) / "keys.json"
        keys_file.write_text(json.dumps(keys_for(a.gsp_tenants)))
        logger.info("starting %d servers (%s)", len(MODES), " ".join(flags))
        servers = start_servers(flags, keys_file, a.k_anonymity_k)
        try:
            async def run() -> None:
                rng = random.Random(a.seed + 7)
                for srv in servers.values():  # a fresh server's one-time costs, not measured
                    for _ in range(3):
                        await ttft_of(srv, "key-g0", model, [rng.randrange(10, 500) for _ in range(a.secret_tokens)])
                with tqdm(total=4 * a.trials, desc="attack", unit="trial", file=sys.stderr) as bar:
                    report["attack"] = await attack(servers, model, a.trials, a.secret_tokens, a.seed, bar)
                print("\n".join(attack_lines(report)), flush=True)  # each phase's figures as it ends
                save("attack")
                gsp = gsp_requests(a, a.seed + 1)
                report["sharing"] = {}
                with tqdm(total=len(MODES) * len(gsp), desc="gsp sharing", unit="req", file=sys.stderr) as bar:
                    for mode in MODES:
                        reused, prompt, wall = await run_requests(servers[mode], model, gsp, a.output_tokens,
                                                                  a.concurrency, bar)
                        report["sharing"][mode] = {"reused_tokens": reused, "prompt_tokens": prompt, "wall_s": wall}
                base_reuse = report["sharing"]["none"]["reused_tokens"]
                for s in report["sharing"].values():
                    s["ratio_to_none"] = s["reused_tokens"] / base_reuse if base_reuse else float("nan")
                print("\n".join(sharing_lines(report)), flush=True)
                save("attack, sharing")
                cost = cost_requests(a, a.seed + 2)
                rates: dict[str, list[float]] = {m: [] for m in MODES}
                reuse: dict[str, int] = {}
                with tqdm(total=(a.cost_reps + 1) * len(MODES) * len(cost), desc="cost", unit="req",
                          file=sys.stderr) as bar:
                    for rep in range(a.cost_reps + 1):  # rep 0 caches the documents: not timed
                        order = list(MODES)
                        random.Random(a.seed + 100 + rep).shuffle(order)
                        for mode in order:
                            # Fresh suffixes per repetition, the same documents (reused from rep 2 on).
                            reqs = [(k, p[:a.gsp_system_tokens] + [(t + rep * 7) % 490 + 10 for t in p[a.gsp_system_tokens:]])
                                    for k, p in cost]
                            reused, _, wall = await run_requests(servers[mode], model, reqs, a.output_tokens,
                                                                 a.concurrency, bar)
                            if rep:
                                rates[mode].append(len(reqs) / wall)
                                reuse[mode] = reuse.get(mode, 0) + reused
                # Paired per repetition (the servers took turns within it), then the median.
                report["cost"] = {m: {"req_per_s_median": statistics.median(r), "req_per_s": r,
                                      "ratio_to_none": statistics.median(x / y for x, y in zip(r, rates["none"])),
                                      "reused_tokens": reuse[m]} for m, r in rates.items()}

            asyncio.run(run())
            for mode, srv in servers.items():
                report.setdefault("k_anonymity_stats", {})[mode] = srv.engine_stats()["cache"].get("k_anonymity")
        finally:
            for srv in servers.values():
                srv.stop()

    print(format_console(report))
    save("attack, sharing, cost")
    print(f"wrote {path}")
    return 0


def attack_lines(r: dict[str, Any]) -> list[str]:
    """The attack phase's figures (printed as soon as it ends, so a run cut short keeps them)."""
    none = r["attack"]["none"]
    lines = [f"baseline (none): secret TTFT cached {none['ttft_cached_median_s'] * 1e3:.1f} ms, "
             f"uncached {none['ttft_uncached_median_s'] * 1e3:.1f} ms",
             "attack ROC AUC (attacker's TTFT; target none >= %.2f, isolated <= %.2f):"
             % (TARGET_ATTACK_AUC, TARGET_ISOLATED_AUC)]
    for name, res in r["attack"].items():
        more = f", two colluding keys {res['auc_two_colluding_keys']:.3f} (outside the model)" \
            if "auc_two_colluding_keys" in res else ""
        ci = res.get("auc_95")
        ci_s = f" [95% {ci[0]:.2f}-{ci[1]:.2f}]" if ci else ""
        lines.append(f"  {name:12s} AUC {res['auc']:.3f}{ci_s}  (n={res['trials']}; attacker hits when cached "
                     f"{res['attacker_hits_when_cached']}, when not {res['attacker_hits_when_not']}){more}")
    return lines


def sharing_lines(r: dict[str, Any]) -> list[str]:
    """The GSP sharing phase's figures."""
    lines = [f"GSP sharing ({r['workload']['gsp_tenants']} tenants): reused tokens, ratio to none "
             f"(target k-anonymity >= {TARGET_SHARING}):"]
    for mode, s in r["sharing"].items():
        lines.append(f"  {mode:12s} {s['reused_tokens']:8d} of {s['prompt_tokens']} prompt tokens  "
                     f"ratio {s['ratio_to_none']:.3f}")
    return lines


def format_console(r: dict[str, Any]) -> str:
    lines = [f"{NAME}: {r['model']} ({r['model_impl']}) on {r['device']}, k = {r['k']}, {r['date']}"]
    lines += attack_lines(r) + sharing_lines(r)
    lines.append(f"cost (nothing shared across tenants): req/s median, median of paired ratios to none "
                 f"(target >= {TARGET_COST}):")
    for mode, c in r["cost"].items():
        lines.append(f"  {mode:12s} {c['req_per_s_median']:.2f} req/s  ratio {c['ratio_to_none']:.3f}  "
                     f"(reused {c['reused_tokens']})")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
