"""Serving benchmark over HTTP: multi-turn conversations with long shared prefixes.

The workload follows SGLang's multi-turn benchmark: each user has a long document (or
system prompt) of its own and asks several rounds of questions about it; every round
sends the whole conversation so far (document, earlier questions and answers) plus
the new question.  Users run concurrently, at most ``--concurrency`` requests in
flight; the semaphore is FIFO, so users take turns and, between two rounds of one
user, the others' documents pass through the device pool.

ONE invocation runs four configurations (``--configs``), each on a server it starts itself:

* ``recompute``   ENABLE_V1_KVCACHE_MANAGER=0: the plain block allocator, no reuse;
* ``device``      ENABLE_V1_KVCACHE_MANAGER=1, ``--swap-space 0``: device prefix cache;
* ``device+host`` ENABLE_V1_KVCACHE_MANAGER=1 and a host tier;
* ``device+host+storage`` the same plus a ``file`` storage tier in a temporary directory
  (every block is also written to storage; the host tier holds the working set, so the
  ratio to ``device+host`` is the cost of those writes).

The device pool (``--num-gpu-blocks-override``) is sized at about a third of the
working set, so the device prefix cache alone cannot keep the documents between
rounds while the host tier can.  A second phase, on the device+host server, measures
the time to first token of the same prefix length served from a device hit and from a
host hit (the prefix's device blocks evicted by filler requests in between).

A third phase, the **miss probe** (``--miss-repeats``, 0 to skip): round 1 of the workload
can reuse nothing, so there every configuration computes the same tokens and the cache
must cost nothing.  One server per configuration runs at once; each repetition sends the
same never-seen round-1 prompts (``--miss-requests`` of them, ``--concurrency`` in flight,
back to back, so later requests carry the write-through backups of earlier ones) to each
server in turn, in an order shuffled per repetition.  Load drifts on a shared machine then
reach every configuration alike; the figure is the median over repetitions of each
repetition's TTFT p50 over recompute's, with their p25-p75 as the spread (target:
device+host <= 1.05x recompute).

A fourth phase, the **cold server** (``--cold-server``, on by default): for each storage
backend (``--storage-backends``: ``file``, and ``mooncake`` where it imports and its
binaries are installed) and each prefix length (``--cold-prefix-tokens``), a server
computes documents and stores them and is stopped; a restarted server in front of the warm
store then answers, in rounds of ``--cold-group`` documents, each document of the round from
storage with a document of the round before (pushed off the device by filler documents) from
host right beside it, the order alternating, until ``--cold-repeats`` pairs; each round also
recomputes a never-seen document of the same length.  A pair is seconds apart, so load
drifts reach both.  Targets are same-run ratios of those TTFT p50s: storage
hit <= 1.2x host hit (file), storage hit <= 0.25x recompute at the largest prefix; the pairs'
median ratio and p25-p75 are reported beside it, and the engine's timings of each request
(``request_timings``: queued, fetch started / landed / in the tree, first step, prefill).
The backend's read/write GB/s are set against a plain file write and read of the same bytes.

Two more scenarios (``--cold-burst``, ``--queued-storage``, on by default; the code and their
description in ``benchmarks/serving_sharing.py``): a burst of simultaneous requests sharing an
uncached prefix, with in-batch prefix sharing on against off, and more queued requests than
``--max-num-seqs`` whose documents are in storage only, storage hit against host hit.
The **store-speed** scenario (``--store-speeds``, ``--store-cold``, ``--store-rate``; off by
default; ``benchmarks/serving_store_speeds.py``): fetch-all, the online fetch-or-recompute
plan and a sweep of forced splits (the offline oracle) against recompute-all, on a warm, a
cold and rate-limited stores, with the server's read GB/s against a plain parallel read.

The **KV-format** scenario (``--kv-formats``, off by default; ``benchmarks/serving_kv_formats.py``):
block_wise_fp8 against ``--kv-baseline-dtype`` (the model's by default) in the same run: host
blocks per GiB, a host hit's load time and TTFT, and a storage hit's TTFT on a store held to
``--kv-store-rate`` GB/s, each printed with the baseline's and the ratio.

With ``--interleave``, round 1 is also measured **interleaved, in pairs**: a recompute server
stays up while each other configuration's server is started beside it in turn (two servers at
once, where the miss probe's all at once does not fit a GPU), and the miss probe's bursts of
round-1 prompts go to the two servers alternately (``--miss-repeats`` bursts, 8 when 0, of
``--miss-requests`` each, order shuffled per burst); the figure is the median of the bursts'
TTFT p50 ratios (target: device+host <= 1.05x recompute; on the GPU it replaces the figure from
the configurations run one after another).

Reported: TTFT p50/p99 (all rounds, and rounds >= 2), TTFT per round (round 1 also as a
ratio to recompute's, one configuration after the other: see the miss probe and
``--interleave`` for the interleaved figure), throughput, the
fraction of prompt tokens served from each tier, the ratios to the recompute baseline
and to device+host measured in the same run, the miss probe and the cold-server table.  Outputs: a JSON
file, a PNG plot of TTFT per round per configuration, and a section of
docs/benchmarks.md (``--docs``; ``--quick`` writes none).

Usage:
    python benchmarks/bench_serving.py                 # tiny-llama-random, 9.3 minutes measured on an idle 2-core VM
    python benchmarks/bench_serving.py --quick         # smoke run (a few minutes); not for tables
    python benchmarks/bench_serving.py --configs device+host,device+host+storage --no-cold-server
    python benchmarks/bench_serving.py --model smollm2-135m-instruct --doc-tokens 512 ...
    # On a GPU with PyTorch (the transformers runner; docs/gpu_serving.md has the run):
    python benchmarks/bench_serving.py --model-impl transformers --device gpu --model llama3-8b-random \
        --users 32 --rounds 4 --doc-tokens 4096 --concurrency 10 --no-cold-server --fit-check --tag h100
    # ... and with decode steps replayed from CUDA graphs: add --use-cudagraph

On the GPU the report adds the in-run H2D limit (one contiguous pinned 1 GiB copy), a host
hit's ratio to its floor ``max(device-hit TTFT, KV bytes / H2D limit)``, round 1 with the
cache on over recompute, each configuration's per-step host time by phase (scheduler and
cache manager, worker submit, model launch, waiting for the GPU, copies completed, sampling;
and the GPU time the compute stream waited for loads), and with ``--fit-check`` output tokens/s
with the switch off and on when the device pool holds everything.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import logging
import math
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Optional

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))
if str(ROOT / "benchmarks") not in sys.path:
    sys.path.insert(0, str(ROOT / "benchmarks"))  # serving_sharing (the cold-burst and queued-storage scenarios)

from fastdeploy_kvcache.entrypoints.server_process import ServerProcess  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving_gpu  # noqa: E402  (the GPU figures: in-run H2D limit, floor, host-time split)

logger = logging.getLogger("bench_serving")

# Common English words: every tokenizer splits them into one to three tokens.
WORDS = (
    "the of and to in is was for on that with as by at from his her an they which or be are this had not "
    "but what all were when we there can been has more if will one would about their said time so up out "
    "them then she many some these two like other could into him make than first been its who now people "
    "my made over did down only way find use may water long little very after words called just where most "
    "know get through back much before go good new write our used me man too any day same right look think "
    "also around another came come work three word must because does part even place well such here take why "
    "things help put years different away again off went old number great tell men say small every found "
    "still between name should home big give air line set own under read last never us left end along while "
    "might next sound below saw something thought both few those always looked show large often together asked "
    "house world going want school important until form food keep children feet land side without boy once "
    "animals life enough took sometimes four head above kind began almost live page got earth need far hand "
    "high year mother light parts country father let night following picture being study second eyes soon "
    "times story boys since white days ever paper hard near sentence better best across during today others "
    "however sure means knew its try told young miles sun ways thing whole hear example heard several change "
    "answer room sea against top turned learn point city play toward five using himself usually"
).split()

CONFIGS = ("recompute", "device", "device+host", "device+host+storage")
STORAGE_BACKENDS = ("file", "mooncake")
LOADAVG_START = os.getloadavg()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile (q in [0, 100]); NaN for no values."""
    if not values:
        return float("nan")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def sse_events(resp: Any) -> AsyncIterator[dict[str, Any]]:
    """The JSON events of an OpenAI-style stream (an httpx response), without ``[DONE]``;
    an error event raises RuntimeError, so a benchmark never times a failed request."""
    async for line in resp.aiter_lines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        if "error" in ev:
            raise RuntimeError(f"stream error: {ev['error']}")
        yield ev


@dataclass
class Turn:
    """One request's outcome, as the client saw it."""

    user: int
    round: int
    ttft_s: float
    latency_s: float
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    cached_by_tier: dict[str, int]


@dataclass
class ConfigResult:
    name: str
    server_args: list[str]
    env: dict[str, str]
    wall_s: float = 0.0
    turns: list[Turn] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    engine_stats: dict[str, Any] = field(default_factory=dict)

    def ttfts(self, min_round: int = 1) -> list[float]:
        return [t.ttft_s for t in self.turns if t.round >= min_round]

    def summary(self) -> dict[str, Any]:
        prompt = sum(t.prompt_tokens for t in self.turns)
        out = sum(t.completion_tokens for t in self.turns)
        later = [t for t in self.turns if t.round >= 2]
        later_prompt = sum(t.prompt_tokens for t in later) or 1
        rounds = sorted({t.round for t in self.turns})
        tiers = ("device", "host", "storage")
        return {
            "requests": len(self.turns),
            "wall_s": self.wall_s,
            "ttft_p50_s": percentile(self.ttfts(), 50),
            "ttft_p99_s": percentile(self.ttfts(), 99),
            "ttft_p50_round2plus_s": percentile(self.ttfts(2), 50),
            "ttft_p99_round2plus_s": percentile(self.ttfts(2), 99),
            "ttft_p50_by_round_s": {r: percentile([t.ttft_s for t in self.turns if t.round == r], 50) for r in rounds},
            "requests_per_s": len(self.turns) / self.wall_s if self.wall_s else 0.0,
            "prompt_tokens_per_s": prompt / self.wall_s if self.wall_s else 0.0,
            "output_tokens_per_s": out / self.wall_s if self.wall_s else 0.0,
            "prompt_tokens": prompt,
            "output_tokens": out,
            "cached_fraction": sum(t.cached_tokens for t in self.turns) / prompt if prompt else 0.0,
            "cached_fraction_by_tier": {
                tier: sum(t.cached_by_tier.get(tier, 0) for t in self.turns) / prompt if prompt else 0.0
                for tier in tiers},
            "cached_fraction_round2plus_by_tier": {
                tier: sum(t.cached_by_tier.get(tier, 0) for t in later) / later_prompt for tier in tiers},
        }


# ---------------------------------------------------------------------- client
async def stream_completion(client: Any, model: str, prompt: "str | list[int]", max_tokens: int,
                            arrivals: Optional[list[float]] = None) -> tuple[float, float, str, Any]:
    """One streamed completion: (ttft_s, latency_s, text, usage).  ``arrivals``, if given,
    gets the ``perf_counter`` time of every streamed chunk (for the gaps between tokens)."""
    start = time.perf_counter()
    ttft: Optional[float] = None
    parts: list[str] = []
    usage = None
    stream = await client.completions.create(
        model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices:
            now = time.perf_counter()
            if ttft is None:
                ttft = now - start
            if arrivals is not None:
                arrivals.append(now)
            parts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage = chunk.usage
    latency = time.perf_counter() - start
    if usage is None:
        raise RuntimeError("the server sent no usage chunk (stream_options.include_usage)")
    return (ttft if ttft is not None else latency), latency, "".join(parts), usage


def tiers_of(usage: Any) -> dict[str, int]:
    details = usage.model_dump().get("prompt_tokens_details") or {}
    by_tier = details.get("cached_tokens_by_tier") or {}
    return {t: int(by_tier.get(t, 0)) for t in ("device", "host", "storage")}


@dataclass
class Workload:
    users: int
    rounds: int
    doc_words: int
    question_words: int
    output_tokens: int
    concurrency: int
    seed: int

    def document(self, user: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + user)
        return f"Document {user}. " + words(rng, self.doc_words)

    def question(self, user: int, rnd: int) -> str:
        rng = random.Random(self.seed * 1_000_003 + 7919 * (user + 1) + rnd)
        return words(rng, self.question_words) + "?"


async def run_workload(base_url: str, model: str, wl: Workload, progress: Any) -> tuple[list[Turn], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(wl.concurrency)
    turns: list[Turn] = []

    async def user(u: int) -> None:
        history = wl.document(u)
        for r in range(1, wl.rounds + 1):
            prompt = f"{history}\n\nQuestion {r}: {wl.question(u, r)}\nAnswer:"
            async with sem:
                ttft, latency, text, usage = await stream_completion(client, model, prompt, wl.output_tokens)
            turns.append(Turn(u, r, ttft, latency, usage.prompt_tokens, usage.completion_tokens,
                              usage.prompt_tokens_details.cached_tokens, tiers_of(usage)))
            history = prompt + text
            progress.update(1)

    start = time.perf_counter()
    await asyncio.gather(*(user(u) for u in range(wl.users)))
    wall = time.perf_counter() - start
    await client.close()
    return turns, wall


async def run_hit_probe(base_url: str, model: str, wl: Workload, filler_docs: int, repeats: int) -> dict[str, Any]:
    """TTFT of one prefix length from a device hit and from a host hit (device+host server).

    For each repeat: a fresh document is computed once (cold), asked again at once
    (device hit), then ``filler_docs`` other documents push its blocks off the device,
    and it is asked a third time (host hit).  Questions have the same length, so the
    three prompts have the same length up to tokenization of the question words.
    """
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    rows: list[dict[str, Any]] = []
    for k in range(repeats):
        doc = wl.document(10_000 + k)
        q = [wl.question(10_000 + k, i) for i in range(3)]
        cold = await stream_completion(client, model, f"{doc}\n\nQuestion: {q[0]}\nAnswer:", 1)
        # A one-token request first, so the write-through backups queued by the request
        # before are issued in its step, not in the measured one (same for both hits).
        await stream_completion(client, model, "x", 1)
        dev = await stream_completion(client, model, f"{doc}\n\nQuestion: {q[1]}\nAnswer:", 1)
        for f in range(filler_docs):
            await stream_completion(client, model, wl.document(20_000 + k * filler_docs + f) + "\nAnswer:", 1)
        await stream_completion(client, model, "x", 1)
        host = await stream_completion(client, model, f"{doc}\n\nQuestion: {q[2]}\nAnswer:", 1)
        rows.append({
            "cold_ttft_s": cold[0], "device_hit_ttft_s": dev[0], "host_hit_ttft_s": host[0],
            "prompt_tokens": [cold[3].prompt_tokens, dev[3].prompt_tokens, host[3].prompt_tokens],
            "device_hit_tiers": tiers_of(dev[3]), "host_hit_tiers": tiers_of(host[3]),
        })
    await client.close()
    valid = [r for r in rows if r["device_hit_tiers"]["device"] > 0 and r["device_hit_tiers"]["host"] == 0
             and r["host_hit_tiers"]["host"] > 0]
    dev_p50 = percentile([r["device_hit_ttft_s"] for r in valid], 50)
    host_p50 = percentile([r["host_hit_ttft_s"] for r in valid], 50)
    cold_p50 = percentile([r["cold_ttft_s"] for r in valid], 50)
    return {
        "repeats": repeats, "valid_repeats": len(valid), "filler_docs": filler_docs, "rows": rows,
        "cold_ttft_p50_s": cold_p50, "device_hit_ttft_p50_s": dev_p50, "host_hit_ttft_p50_s": host_p50,
        "device_hit_ttft_p25_p75_s": [percentile([r["device_hit_ttft_s"] for r in valid], q) for q in (25, 75)],
        "host_hit_ttft_p25_p75_s": [percentile([r["host_hit_ttft_s"] for r in valid], q) for q in (25, 75)],
        "host_over_device": host_p50 / dev_p50 if valid and dev_p50 > 0 else float("nan"),
        "host_cached_tokens_p50": percentile([r["host_hit_tiers"]["host"] + r["host_hit_tiers"]["device"]
                                              for r in valid], 50),
        "device_cached_tokens_p50": percentile([r["device_hit_tiers"]["device"] for r in valid], 50),
    }


def config_server(name: str, args: argparse.Namespace, store_dir: Path) -> tuple[list[str], dict[str, str]]:
    """The server flags (beyond the common ones) and the environment of one configuration."""
    env = {"ENABLE_V1_KVCACHE_MANAGER": "0" if name == "recompute" else "1", "PYTHONFAULTHANDLER": "1"}
    extra: list[str] = []
    if name == "device":
        extra = ["--swap-space", "0"]
    elif name.startswith("device+host"):
        extra = ["--swap-space", str(args.swap_space), "--write-policy", args.write_policy]
    if name == "device+host+storage":
        extra += ["--kvcache-storage-backend", "file", "--kvcache-storage-path", str(store_dir),
                  "--kvcache-storage-min-free", "0"]
    return extra, env


def round1_prompt(wl: Workload, user: int) -> str:
    """The first round's prompt of ``user``: its document and its first question."""
    return f"{wl.document(user)}\n\nQuestion 1: {wl.question(user, 1)}\nAnswer:"


async def miss_burst(base_url: str, model: str, prompts: list[str], concurrency: int,
                     max_tokens: int) -> list[tuple[float, int]]:
    """``prompts`` in order, ``concurrency`` in flight, each sent as soon as a slot frees.

    Returns (TTFT, cached tokens) per prompt, in prompt order.
    """
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    out: list[tuple[float, int]] = [(float("nan"), 0)] * len(prompts)
    todo = iter(range(len(prompts)))

    async def worker() -> None:
        for i in todo:  # one shared iterator: each prompt goes to exactly one worker
            ttft, _, _, usage = await stream_completion(client, model, prompts[i], max_tokens)
            out[i] = (ttft, usage.prompt_tokens_details.cached_tokens)

    await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
    await client.close()
    return out


def run_miss_probe(servers: dict[str, ServerProcess], model: str, wl: Workload, repeats: int, requests: int,
                   progress: Any = None) -> dict[str, Any]:
    """Round-1 TTFT (nothing to reuse) of each configuration, interleaved (see the module docstring).

    Repetition ``k`` sends the same ``requests`` never-seen round-1 prompts to every server,
    in an order shuffled per repetition (seeded), so no configuration always runs first or
    right after a given other one.  A server with a storage tier gets its puts settled
    before the next server runs, so they do not land on another configuration's time.
    """
    names = list(servers)
    samples: dict[str, list[float]] = {n: [] for n in names}
    per_rep: dict[str, list[float]] = {n: [] for n in names}
    cached_total: dict[str, int] = {n: 0 for n in names}
    for k in range(repeats):
        # Users no other phase sends (workload: 0.., hit probe: 10_000.., cold server: up to ~2M).
        prompts = [round1_prompt(wl, 7_000_000 + k * requests + i) for i in range(requests)]
        order = list(names)
        random.Random(k).shuffle(order)
        for name in order:
            got = asyncio.run(miss_burst(servers[name].base_url, model, prompts, wl.concurrency, wl.output_tokens))
            samples[name] += [t for t, _ in got]
            per_rep[name].append(percentile([t for t, _ in got], 50))
            cached_total[name] += sum(c for _, c in got)
            if name.endswith("+storage"):
                wait_storage_quiet(servers[name])
            if progress is not None:
                progress.update(1)
    out: dict[str, Any] = {"repeats": repeats, "requests_per_repeat": requests, "concurrency": wl.concurrency,
                           "configs": {}}
    base = samples.get("recompute")
    for name in names:
        row: dict[str, Any] = {
            "ttft_p50_s": percentile(samples[name], 50),
            "ttft_p25_p75_s": [percentile(samples[name], 25), percentile(samples[name], 75)],
            "cached_tokens": cached_total[name],  # 0: every request was a miss
            "samples_s": samples[name],
            "per_repeat_p50_s": per_rep[name],
        }
        if base:
            # Paired: each repetition's p50 over recompute's in the same repetition, seconds
            # apart; their median is the figure (a load burst moves both sides of a pair).
            ratios = [a / b for a, b in zip(per_rep[name], per_rep["recompute"])]
            row["per_repeat_over_recompute_p25_p50_p75"] = [percentile(ratios, q) for q in (25, 50, 75)]
            row["over_recompute"] = row["per_repeat_over_recompute_p25_p50_p75"][1]
            row["pooled_over_recompute"] = row["ttft_p50_s"] / percentile(base, 50)
        out["configs"][name] = row
    return out


def scrape_metrics(server: ServerProcess) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(server.get_text("/metrics")):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            if s.name.endswith("_bucket"):
                continue
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# ------------------------------------------------------------------ cold server
def wait_storage_quiet(server: ServerProcess, timeout_s: float = 300.0) -> dict[str, Any]:
    """Engine stats once no request runs and the storage tier has no queued or running work.

    Before a measured request, so that it does not share the two cores with the
    background puts of the requests before it.
    """
    deadline = time.monotonic() + timeout_s
    stats: dict[str, Any] = {}
    while time.monotonic() < deadline:
        stats = server.engine_stats()
        st = stats.get("storage") or {}
        if stats.get("num_requests_running") == 0 and st.get("pending_work") == 0:
            return stats
        time.sleep(0.1)
    raise TimeoutError(f"storage work not settled after {timeout_s} s")


def finished_count(server: ServerProcess, settle_s: float = 0.05) -> int:
    """Requests the engine finished so far, once two stats snapshots ``settle_s`` apart agree.

    NOTE: the snapshot is refreshed after the step that finished a request, which may be
    after its client got the last chunk; a count read too early misses that request, and the
    timings taken after the next probe would then be off by one.
    """
    last = -1
    while True:
        n = int(server.engine_stats().get("engine", {}).get("num_finished", 0))
        if n == last:
            return n
        last = n
        time.sleep(settle_s)


def request_timings_after(server: ServerProcess, before: int, n: int, timeout_s: float = 10.0) -> list[dict[str, Any]]:
    """The engine timings of the ``n`` requests finished after the first ``before``
    (:func:`finished_count`), once the stats snapshot counts them."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = server.engine_stats()
        done = int(stats.get("engine", {}).get("num_finished", 0))
        if done >= before + n or time.monotonic() >= deadline:
            timings = stats.get("request_timings") or []
            extra = done - (before + n)  # finished since (none in these probes)
            return timings[len(timings) - n - extra: len(timings) - extra] if done >= before + n else []
        time.sleep(0.01)


def engine_ratio(storage: list[Optional[dict[str, Any]]], host: list[Optional[dict[str, Any]]]) -> float:
    """Storage-hit over host-hit p50 of the engine's own time to first token (no HTTP)."""
    s = [t["ttft_s"] for t in storage if t and t.get("ttft_s") is not None]
    h = [t["ttft_s"] for t in host if t and t.get("ttft_s") is not None]
    return percentile(s, 50) / percentile(h, 50) if s and h else float("nan")


def timing_summary(timings: list[Optional[dict[str, Any]]]) -> dict[str, Any]:
    """Medians of the per-request timings (engine/request_timing.py) of one kind of probe."""
    ts = [t for t in timings if t]

    def med(get: Any) -> Optional[float]:
        xs = [x for x in (get(t) for t in ts) if x is not None]
        return percentile(xs, 50) if xs else None

    def fetch(key: str) -> Any:
        return lambda t: (t.get("fetch") or {}).get(key)

    step = lambda key: (lambda t: (t.get("first_step") or {}).get(key))  # noqa: E731
    return {"requests": len(ts), "queued_s": med(lambda t: t["queued_s"]), "prefill_s": med(lambda t: t["prefill_s"]),
            "engine_ttft_s": med(lambda t: t["ttft_s"]), "fetch_started_s": med(fetch("started_s")),
            "fetch_landed_s": med(fetch("landed_s")), "fetch_in_tree_s": med(fetch("in_tree_s")),
            "fetch_job_s": med(fetch("job_s")), "fetch_bytes": med(fetch("bytes")),
            "admit_after_fetch_s": med(lambda t: t.get("admit_after_fetch_s")),
            "first_step_schedule_s": med(step("schedule_s")), "first_step_submit_s": med(step("submit_s")),
            "first_step_forward_s": med(step("forward_s"))}


async def cold_probe(writer: ServerProcess, make_cold: Any, model: str, wl: Workload, doc_words: int,
                     repeats: int, filler_docs: int, tag: int, progress: Any = None, group: int = 3) -> dict[str, Any]:
    """Store documents through ``writer``, restart, measure storage hits against host hits.

    ``writer`` is stopped here; ``make_cold()`` returns the restarted (started) server on the
    same store.  Every TTFT comes from that one process.  The documents go in rounds of
    ``group``: a round sends each of its documents from storage and, right beside each (the
    order alternating), a document of the round before from host, then ``filler_docs`` other
    documents push the round's documents off the device (the host tier keeps them), then a
    never-seen document of the same length is recomputed.  A storage hit and its host-hit
    partner are thus seconds apart, so load drifts on a shared machine reach both; the first
    round's partners are a warm-up round fetched from storage unmeasured.  Each measured
    request's engine timings (queued, fetch, first step, prefill) are kept beside its TTFT.
    """
    from openai import AsyncOpenAI

    rounds = max(1, math.ceil(repeats / group))

    def doc(k: int) -> str:
        w = Workload(1, 1, doc_words, wl.question_words, 1, 1, wl.seed)
        return w.document(tag * 100_000 + k)

    stored = (rounds + 1) * group  # document 0..group-1: the warm-up round (host partners of round 0)
    try:
        client = AsyncOpenAI(base_url=writer.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for k in range(stored):
            await stream_completion(client, model, f"{doc(k)}\n\nQuestion: {wl.question(k, 0)}\nAnswer:", 1)
        await client.close()
        wstats = wait_storage_quiet(writer)["storage"]["store"]  # the backend's own call timings
    finally:
        writer.stop()
    cold = make_cold()  # started
    rows: list[dict[str, Any]] = []
    recompute: list[dict[str, Any]] = []
    try:
        client = AsyncOpenAI(base_url=cold.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)

        async def settle(c: Any) -> None:
            # NOTE: before each measured request: a one-token request (its step issues the
            # backups queued before), then wait until those backups and their storage puts
            # are done, so no measured request shares the CPU with earlier requests' writes.
            await stream_completion(c, model, "x", 1)
            await asyncio.to_thread(wait_storage_quiet, cold)

        async def probe(k: int, q: int) -> tuple[Any, Optional[dict[str, Any]]]:
            await settle(client)
            before = await asyncio.to_thread(finished_count, cold)
            out = await stream_completion(client, model, f"{doc(k)}\n\nQuestion: {wl.question(k, q)}\nAnswer:", 1)
            timings = await asyncio.to_thread(request_timings_after, cold, before, 1)
            return out, (timings[0] if timings else None)

        async def push_off(r: int) -> None:
            for f in range(filler_docs):
                await stream_completion(client, model, doc(50_000 + r * filler_docs + f) + "\nAnswer:", 1)

        for i in range(2):  # warm-up of the fresh process (kernels, allocator): not measured
            await stream_completion(client, model, doc(90_000 + i), 1)
        for k in range(group):  # the warm-up round: from storage, not measured
            await probe(k, 1)
        await push_off(0)
        for r in range(rounds):
            for i in range(group):
                s_doc, h_doc = (r + 1) * group + i, r * group + i
                if (r * group + i) % 2 == 0:
                    st, st_t = await probe(s_doc, 1)
                    host, host_t = await probe(h_doc, 2)
                else:
                    host, host_t = await probe(h_doc, 2)
                    st, st_t = await probe(s_doc, 1)
                rows.append({"storage_ttft_s": st[0], "host_ttft_s": host[0], "storage_tiers": tiers_of(st[3]),
                             "host_tiers": tiers_of(host[3]), "prompt_tokens": st[3].prompt_tokens,
                             "host_prompt_tokens": host[3].prompt_tokens, "storage_timing": st_t,
                             "host_timing": host_t})
                if progress is not None:
                    progress.update(1)
            await push_off(r + 1)
            rec, rec_t = await probe(70_000 + r, 3)
            recompute.append({"recompute_ttft_s": rec[0], "recompute_tiers": tiers_of(rec[3]), "timing": rec_t})
        await client.close()
        cstats = wait_storage_quiet(cold)["storage"]
    finally:
        cold.stop()
    valid = [r for r in rows if r["storage_tiers"]["storage"] > 0 and r["host_tiers"]["host"] > 0
             and r["host_tiers"]["storage"] == 0 and r["storage_tiers"]["device"] == 0
             and r["host_tiers"]["device"] == 0]
    rec_valid = [r["recompute_ttft_s"] for r in recompute if sum(r["recompute_tiers"].values()) == 0]
    p = {name: percentile([r[f"{name}_ttft_s"] for r in valid], 50) for name in ("storage", "host")}
    p["recompute"] = percentile(rec_valid, 50)
    pairs = [r["storage_ttft_s"] / r["host_ttft_s"] for r in valid]
    t = cstats["tier"]
    store = cstats["store"]
    return {
        "repeats": len(rows), "valid_repeats": len(valid), "group": group, "filler_docs": filler_docs, "rows": rows,
        "recompute_rows": recompute,
        "prompt_tokens_p50": percentile([r["prompt_tokens"] for r in rows], 50),
        "storage_cached_tokens_p50": percentile([r["storage_tiers"]["storage"] for r in valid], 50),
        "storage_ttft_p50_s": p["storage"], "host_ttft_p50_s": p["host"], "recompute_ttft_p50_s": p["recompute"],
        "storage_over_host": p["storage"] / p["host"] if valid else float("nan"),
        # Per pair (a storage hit and the host hit beside it): the median and spread of the ratio.
        "storage_over_host_pairs_p50": percentile(pairs, 50) if valid else float("nan"),
        "storage_over_host_pairs_p25_p75": ([percentile(pairs, 25), percentile(pairs, 75)] if valid else None),
        "storage_over_recompute": p["storage"] / p["recompute"] if valid and rec_valid else float("nan"),
        "storage_timing": timing_summary([r["storage_timing"] for r in valid]),
        "host_timing": timing_summary([r["host_timing"] for r in valid]),
        "engine_storage_over_host": engine_ratio([r["storage_timing"] for r in valid], [r["host_timing"] for r in valid]),
        # Backend calls (batch_get_into / batch_put_from) as timed by the backend itself.
        "server_read_gbps": store["read_bytes"] / store["read_seconds"] / 1e9 if store.get("read_seconds") else float("nan"),
        # Whole prefetch jobs (queue, get, scatter), from submission to the end of the copy.
        "prefetch_job_gbps": t["read_bytes"] / t["read_seconds"] / 1e9 if t["read_seconds"] else float("nan"),
        "server_write_gbps": wstats["write_bytes"] / wstats["write_seconds"] / 1e9 if wstats["write_seconds"] else float("nan"),
        "read_bytes": store["read_bytes"], "read_keys": store.get("read_keys", 0),
        "write_bytes": wstats["write_bytes"], "write_keys": wstats.get("write_keys", 0),
        "aborted_prefetches": t["aborted_prefetches"], "errors": t["errors"],
    }


def plain_file_gbps(write_bytes: int, read_bytes: int, object_bytes: int, directory: Path) -> dict[str, float]:
    """A plain write, then read (page cache warm), of the same bytes as one file per object.

    The server's figures set against what this machine's file system gives the same
    bytes in the same run (the load of a shared machine moves both).
    """
    import numpy as np

    n_write = max(1, write_bytes // object_bytes)
    n_read = min(n_write, max(1, read_bytes // object_bytes))
    data = np.random.default_rng(0).integers(0, 256, object_bytes, dtype=np.uint8).tobytes()
    directory.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    for i in range(n_write):
        with open(directory / f"{i}.bin", "wb") as f:
            f.write(data)
    w = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n_read):
        with open(directory / f"{i}.bin", "rb") as f:
            f.read()
    r = time.perf_counter() - t0
    shutil.rmtree(directory, ignore_errors=True)
    return {"plain_write_gbps": n_write * object_bytes / w / 1e9, "plain_read_gbps": n_read * object_bytes / r / 1e9,
            "plain_object_bytes": object_bytes, "plain_write_objects": n_write, "plain_read_objects": n_read}


def model_len_for(tokens: int, model: str) -> int:
    """``--max-model-len`` for sequences of ``tokens``: the next power of two, at most the
    model's positions (more is a start-up error)."""
    from fastdeploy_kvcache.engine.model_loader import model_positions

    return min(1 << math.ceil(math.log2(tokens)), model_positions(model))


def cold_server_args(args: argparse.Namespace, prefixes: list[int]) -> tuple[list[str], int]:
    """Server flags of the cold-server scenario (before the storage flags) and its device pool.

    The device pool holds about three documents of the longest prefix, so a few filler
    documents push one off the device while the 1 GiB host tier keeps it.
    """
    bs = args.block_size
    longest = max(prefixes)
    max_model_len = model_len_for(longest * 2 + 256, args.model)
    device_blocks = 3 * math.ceil((longest + 64) / bs) + 8
    common = ["--model", args.model, "--device", args.device, "--model-impl", args.model_impl, "--block-size", str(bs),
              "--max-model-len", str(max_model_len), "--max-num-seqs", str(args.concurrency), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--num-gpu-blocks-override", str(device_blocks), "--swap-space", str(args.swap_space),
              "--write-policy", "write_through", "--uvicorn-log-level", "warning", "--log-level", "warning"]
    return common + runner_flags(args), device_blocks


def runner_flags(args: argparse.Namespace) -> list[str]:
    """The model runner's flags every server of the run gets (``--use-cudagraph``)."""
    return ["--use-cudagraph"] if args.use_cudagraph else []


def usable_backends(requested: list[str]) -> tuple[list[str], dict[str, str]]:
    """The requested backends this machine can run, and why the others were left out."""
    usable: list[str] = []
    skipped: dict[str, str] = {}
    for backend in requested:
        if backend == "mooncake":
            from fastdeploy_kvcache.storage.mooncake_backend import mooncake_available
            from fastdeploy_kvcache.storage.mooncake_local import find_binary

            why = mooncake_available()
            if why is None and find_binary("mooncake_master") is None:
                why = "mooncake_master not installed"
            if why is not None:
                skipped[backend] = why
                logger.warning("[cold] mooncake left out: %s", why)
                continue
        usable.append(backend)
    return usable, skipped


def run_cold_server(args: argparse.Namespace, prefixes: list[int], backends: list[str], tokens_per_word: float,
                    wl: Workload, start_server: Any, work: Path) -> dict[str, Any]:
    """The cold-server scenario for each backend and prefix length (see the module docstring)."""
    from tqdm import tqdm

    common, device_blocks = cold_server_args(args, prefixes)
    env = {"ENABLE_V1_KVCACHE_MANAGER": "1", "PYTHONFAULTHANDLER": "1"}
    out: dict[str, Any] = {"device_blocks": device_blocks, "server_args": common, "prefix_tokens": prefixes,
                           "results": {}}
    bs = args.block_size
    for bi, backend in enumerate(backends):
        env_b = dict(env)
        local = None
        if backend == "mooncake":
            from fastdeploy_kvcache.storage.mooncake_local import LocalMooncake

            local = LocalMooncake(segment="1GB", log_dir=work / "mooncake").start()
            env_b.update(local.env())
        try:
            for pi, plen in enumerate(prefixes):
                sdir = work / f"store-{backend}-{plen}"
                storage = ["--kvcache-storage-backend", backend, "--kvcache-storage-prefetch-policy", "wait_complete"]
                if backend == "file":
                    storage += ["--kvcache-storage-path", str(sdir), "--kvcache-storage-min-free", "0"]
                writer = start_server(common + storage, env_b)
                filler = math.ceil(device_blocks * bs / plen) + 1
                group = max(1, min(args.cold_group, args.cold_repeats))
                bar = tqdm(total=math.ceil(args.cold_repeats / group) * group, desc=f"cold {backend} {plen}",
                           unit="pair", file=sys.stderr)
                res = asyncio.run(cold_probe(writer, lambda: start_server(common + storage, env_b), args.model, wl,
                                             max(1, round(plen / tokens_per_word)), args.cold_repeats, filler,
                                             pi + 10 * bi, bar, group))
                bar.close()
                object_bytes = (int(res["read_bytes"] // res["read_keys"]) if res.get("read_keys")
                                else int(res["write_bytes"] // res["write_keys"]) if res.get("write_keys") else 64 << 10)
                res.update(plain_file_gbps(int(res["write_bytes"]) or (1 << 20), int(res["read_bytes"]) or (1 << 20),
                                           object_bytes, work / "plain"))
                res["storage_args"] = storage
                out["results"][f"{backend}/{plen}"] = res
                logger.info("[cold %s %d] TTFT p50 storage %.1f ms, host %.1f ms, recompute %.1f ms: "
                            "storage/host %.2f (engine %.2f; pairs median %.2f), storage/recompute %.2f (%d/%d valid)",
                            backend, plen, 1e3 * res["storage_ttft_p50_s"], 1e3 * res["host_ttft_p50_s"],
                            1e3 * res["recompute_ttft_p50_s"], res["storage_over_host"],
                            res["engine_storage_over_host"], res["storage_over_host_pairs_p50"],
                            res["storage_over_recompute"], res["valid_repeats"], res["repeats"])
        finally:
            if local is not None:
                local.stop()
    return out


# ---------------------------------------------------------------------- driver
def calibrate_tokens_per_word(server: ServerProcess, model: str, wl: Workload) -> float:
    """Tokens per word of the served tokenizer, from one request's usage (not counted)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    text = words(random.Random(wl.seed + 99), 60)
    usage = client.completions.create(model=model, prompt=text, max_tokens=1, temperature=0).usage
    return usage.prompt_tokens / 60.0


def split_server_args(argv: Optional[list[str]]) -> tuple[list[str], list[str]]:
    """``argv`` (``sys.argv[1:]`` when None) split at its first ``--``: the benchmark's own
    arguments, then the flags passed through to every server it starts."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1:]


def machine(device: str = "cpu") -> dict[str, Any]:
    """The machine, for a report.  On a GPU, its GPUs from ``nvidia-smi`` and no Paddle import
    (the GPU machine has no Paddle, and the import costs seconds of a timed run)."""
    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    info: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(),
                            "platform": platform.platform()}
    if device == "gpu":
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                  "--format=csv,noheader"], capture_output=True, text=True, timeout=20)
            info["gpus"] = [line.strip() for line in out.stdout.splitlines() if line.strip()]
        except (OSError, subprocess.SubprocessError) as exc:
            info["gpus"] = f"nvidia-smi failed: {exc}"
        return info
    try:
        import paddle  # noqa: F401  (version only)

        info["paddle"] = paddle.__version__
    except Exception:  # noqa: BLE001
        info["paddle"] = "?"
    return info


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-llama-random")
    ap.add_argument("--model-impl", default="paddleformers", choices=("paddleformers", "transformers"),
                    help="The servers' model runner (transformers: the GPU path on PyTorch).")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="Where the servers run the model.")
    ap.add_argument("--use-cudagraph", action="store_true",
                    help="Servers replay decode-only steps from CUDA graphs (--model-impl transformers on a GPU; "
                         "the server's flag of the same name).")
    ap.add_argument("--fit-check", action="store_true",
                    help="Also run the workload with a device pool that holds all of it, switch off and on "
                         "(output tokens/s ratio).")
    ap.add_argument("--fit-concurrency", type=int, default=32,
                    help="Requests in flight (and --max-num-seqs) of the --fit-check runs: at 32 or more the "
                         "engine's per-step host time is also summed on its own (the busy split).")
    ap.add_argument("--users", type=int, default=9)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--doc-tokens", type=int, default=1024, help="Target document length in tokens.")
    ap.add_argument("--question-tokens", type=int, default=24)
    ap.add_argument("--output-tokens", type=int, default=16)
    ap.add_argument("--concurrency", type=int, default=3)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--device-fraction", type=float, default=1 / 3,
                    help="Device pool size as a fraction of the working set (default: a third).")
    ap.add_argument("--write-policy", default="write_through",
                    help="Write policy of the device+host configuration.")
    ap.add_argument("--swap-space", type=float, default=1.0,
                    help="Host tier of the device+host configuration, GiB (must hold the working set).")
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--probe-repeats", type=int, default=9)
    ap.add_argument("--configs", default=",".join(CONFIGS),
                    help=f"Subset of {','.join(CONFIGS)} for the multi-turn workload ('' for none).")
    ap.add_argument("--miss-repeats", type=int, default=8,
                    help="Repetitions of the miss probe (round-1 prompts sent to one server per configuration "
                         "in turn); 0 skips it.")
    ap.add_argument("--interleave", action="store_true",
                    help="Also measure round 1 interleaved with recompute, one configuration at a time beside a "
                         "recompute server (--miss-repeats bursts, 8 when 0; see the module docstring).")
    ap.add_argument("--miss-requests", type=int, default=0,
                    help="Never-seen round-1 prompts per configuration and repetition (default: twice "
                         "--concurrency, at least 3, so later ones carry earlier ones' backups).")
    ap.add_argument("--cold-server", action=argparse.BooleanOptionalAction, default=True,
                    help="Run the cold-server scenario (a restarted server in front of a warm store).")
    ap.add_argument("--cold-prefix-tokens", default="",
                    help="Prefix lengths of the cold-server scenario, comma-separated (default: twice "
                         "--doc-tokens, about the longest prompt a user of the workload sends and more).")
    ap.add_argument("--cold-repeats", type=int, default=24,
                    help="Storage-hit / host-hit pairs per backend and prefix length, rounded up to a multiple of "
                         "--cold-group (single TTFTs on a shared 2-core VM vary by +-15 ms, as much as a storage "
                         "hit adds: 5 repeats gave medians 1.18 and 1.34 apart).")
    ap.add_argument("--cold-group", type=int, default=3,
                    help="Documents per round of the cold-server scenario: one round of filler documents pushes "
                         "them all off the device, so more pairs fit the same time.")
    ap.add_argument("--storage-backends", default=",".join(STORAGE_BACKENDS),
                    help="Backends of the cold-server scenario: file, and mooncake where it imports and "
                         "its binaries are installed (left out with a warning otherwise).")
    ap.add_argument("--cold-burst", action=argparse.BooleanOptionalAction, default=True,
                    help="Run the cold-burst scenario (benchmarks/serving_sharing.py): simultaneous requests "
                         "sharing an uncached prefix, in-batch prefix sharing on against off.")
    ap.add_argument("--burst-size", type=int, default=8, help="Requests per burst (cold-burst).")
    ap.add_argument("--burst-prefix-tokens", type=int, default=1088, help="Shared prefix of a burst (cold-burst).")
    ap.add_argument("--burst-repeats", type=int, default=6, help="Bursts per server (cold-burst).")
    ap.add_argument("--queued-storage", action=argparse.BooleanOptionalAction, default=True,
                    help="Run the queued-storage scenario (benchmarks/serving_sharing.py): more requests than "
                         "--queued-max-num-seqs, documents in storage only, storage hit against host hit.")
    ap.add_argument("--queued-requests", type=int, default=8, help="Requests sent at once (queued-storage).")
    ap.add_argument("--queued-max-num-seqs", type=int, default=2, help="The server's --max-num-seqs (queued-storage).")
    ap.add_argument("--queued-prefix-tokens", type=int, default=2048, help="Document length (queued-storage).")
    ap.add_argument("--queued-repeats", type=int, default=10,
                    help="Pairs of bursts side by side (storage hits, host hits) per server (queued-storage).")
    ap.add_argument("--store-speeds", action=argparse.BooleanOptionalAction, default=False,
                    help="Run the store-speed scenario (benchmarks/serving_store_speeds.py): fetch-all, the online "
                         "plan and forced splits (the offline oracle) against recompute-all, at each store speed.")
    ap.add_argument("--store-cold", action="store_true",
                    help="Store speeds: add a cold store (fsync + POSIX_FADV_DONTNEED on its files before each "
                         "server). Implies --store-speeds.")
    ap.add_argument("--store-rate", default="", metavar="GBPS,...",
                    help="Store speeds: add stores held to these read rates in GB/s (e.g. 0.5,1,2,4), through "
                         "FDKV_STORAGE_THROTTLE_BYTES_PER_S in the servers' environment. Implies --store-speeds.")
    ap.add_argument("--store-prefix-tokens", type=int, default=0,
                    help="Store speeds: stored prefix per document (default: the largest cold-server prefix).")
    ap.add_argument("--store-docs", type=int, default=4,
                    help="Store speeds: documents stored; each server serves all, the first as a warm-up.")
    ap.add_argument("--store-split-points", type=int, default=5,
                    help="Store speeds: forced splits swept per speed, 0 to every block fetched (>= 2).")
    ap.add_argument("--store-read-threads", type=int, default=0,
                    help="Store speeds: --kvcache-storage-read-threads of every server and the threads of the plain "
                         "parallel read (0: the backend's default for this machine).")
    ap.add_argument("--kv-formats", action=argparse.BooleanOptionalAction, default=False,
                    help="Run the KV-format scenario (benchmarks/serving_kv_formats.py): the model's KV dtype against "
                         "block_wise_fp8 in the same run: host blocks per GiB, a host hit's load time, and a storage "
                         "hit's TTFT on a rate-limited store; prints each baseline and the ratio.")
    ap.add_argument("--kv-prefix-tokens", type=int, default=0,
                    help="Document length of the KV-format scenario (default: 8128 on a GPU, 1024 on the CPU; the "
                         "host tier must hold six such documents, --swap-space).")
    ap.add_argument("--kv-repeats", type=int, default=5, help="Host hits per format (KV-format scenario).")
    ap.add_argument("--kv-docs", type=int, default=4,
                    help="Documents stored per format; all but the first are measured (KV-format scenario).")
    ap.add_argument("--kv-baseline-dtype", default="auto", choices=("auto", "bfloat16", "float16", "float32"),
                    help="The KV dtype block_wise_fp8 is set against in the KV-format scenario ('auto': the model's, "
                         "bfloat16 on a GPU, float32 on the CPU).")
    ap.add_argument("--kv-store-rate", type=float, default=1.0, metavar="GBPS",
                    help="Read rate of the store in the KV-format scenario (FDKV_STORAGE_THROTTLE_BYTES_PER_S).")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--docs", default=str(ROOT / "docs" / "benchmarks.md"),
                    help="Markdown file whose Serving section is (re)written; '' to skip.")
    ap.add_argument("--tag", default="cpu", help="Name part of the output files.")
    ap.add_argument("--quick", action="store_true", help="Smoke run: 3 users, 3 rounds, short documents; cold server: file backend, one repeat; no docs update.")
    ap.add_argument("--default-model-probe", default="smollm2-135m-instruct",
                    help="Also time one prefill of this model (the server's default) in the same run, to say "
                         "why the benchmark uses a smaller one; '' to skip.")
    ap.add_argument("--render", metavar="JSON", default="",
                    help="Only rewrite the docs section (and the plot) from a JSON file of an earlier run.")
    ap.add_argument("--name", default="bench_serving", help=argparse.SUPPRESS)  # file stem (bench_storage_serving)
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    for name in ("httpx", "httpx2", "openai"):
        logging.getLogger(name).setLevel(logging.WARNING)  # one line per request otherwise
    if args.quick:
        args.users, args.rounds, args.doc_tokens, args.output_tokens = 3, 3, 256, 4
        args.probe_repeats = min(args.probe_repeats, 1)
        args.concurrency = 1
        args.cold_prefix_tokens, args.cold_repeats, args.storage_backends = "", 1, "file"
        args.burst_repeats, args.queued_requests, args.burst_prefix_tokens, args.queued_prefix_tokens = 1, 4, 256, 256
        args.queued_repeats = 1
        args.docs = ""
        args.default_model_probe = ""
    if args.render:
        json_path = Path(args.render)
        report = json.loads(json_path.read_text())
        png_path = json_path.with_name(json_path.stem + "_ttft.png")
        if report["summaries"]:
            plot(report, png_path)
        if args.docs:
            write_docs_section(Path(args.docs), report, json_path, png_path)
        print(format_console(report))
        return 0
    configs = [c for c in args.configs.split(",") if c]
    bad = [c for c in configs if c not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {bad}; choose from {CONFIGS}")
    if args.use_cudagraph and args.model_impl != "transformers":
        ap.error("--use-cudagraph: only with --model-impl transformers")
    requested_backends = [b for b in args.storage_backends.split(",") if b]
    bad = [b for b in requested_backends if b not in STORAGE_BACKENDS]
    if bad:
        ap.error(f"--storage-backends: unknown {bad}; choose from {STORAGE_BACKENDS}")
    cold_prefixes = [int(x) for x in args.cold_prefix_tokens.split(",") if x] or [2 * args.doc_tokens]
    try:
        args.store_rates = [float(x) for x in args.store_rate.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--store-rate: expected GB/s numbers separated by commas, got {args.store_rate!r}")
    if any(not (0 < r < float("inf")) for r in args.store_rates):
        ap.error(f"--store-rate: every rate must be a finite number of GB/s > 0, got {args.store_rate!r}")
    args.store_speeds = args.store_speeds or args.store_cold or bool(args.store_rates)
    args.store_prefix_tokens = args.store_prefix_tokens or max(cold_prefixes)
    if args.store_speeds and (args.store_prefix_tokens < args.block_size or args.store_docs < 2
                              or args.store_split_points < 2 or not 0 <= args.store_read_threads <= 256):
        ap.error("store speeds: --store-prefix-tokens must hold at least one block, --store-docs and "
                 "--store-split-points must be >= 2, --store-read-threads 0 to 256")
    # 8128: 127 blocks of 64, so the prompt (a few tokens more) fits llama3-8b-random's 8192 positions.
    args.kv_prefix_tokens = args.kv_prefix_tokens or (8128 if args.device == "gpu" else 1024)
    if args.kv_formats and (args.kv_prefix_tokens < args.block_size or args.kv_repeats < 1 or args.kv_docs < 2
                            or not 0 < args.kv_store_rate < float("inf")):
        ap.error("kv formats: --kv-prefix-tokens must hold at least one block, --kv-repeats >= 1, --kv-docs >= 2, "
                 "--kv-store-rate a finite number of GB/s > 0")
    if (not configs and not args.cold_server and not args.fit_check and not args.cold_burst and not args.queued_storage
            and not args.store_speeds and not args.kv_formats):
        ap.error("nothing to run: --configs is empty, --no-cold-server, --no-cold-burst, --no-queued-storage, "
                 "no --fit-check, no --store-speeds and no --kv-formats")

    from openai import OpenAI
    from tqdm import tqdm

    bs = args.block_size
    # Working set: every user's final conversation (document + rounds of question and answer).
    # NOTE: answers are resent as text; re-tokenized, a random model's output can take up
    # to about three times its token count (odd byte sequences), hence 3 * output_tokens.
    per_user_tokens = args.doc_tokens + args.rounds * (args.question_tokens + 3 * args.output_tokens + 16)
    working_set_blocks = args.users * math.ceil(per_user_tokens / bs)
    max_model_len = model_len_for(per_user_tokens + 64, args.model)
    # A third of the working set, but never less than the running batch needs.
    device_blocks = max(int(working_set_blocks * args.device_fraction),
                        args.concurrency * math.ceil(per_user_tokens / bs) + 2)
    common = ["--model", args.model, "--device", args.device, "--model-impl", args.model_impl, "--block-size", str(bs),
              "--max-model-len", str(max_model_len), "--max-num-seqs", str(args.concurrency),
              "--max-num-batched-tokens", str(args.max_num_batched_tokens),
              "--num-gpu-blocks-override", str(device_blocks), "--uvicorn-log-level", "warning",
              "--log-level", "warning"] + runner_flags(args)

    results: dict[str, ConfigResult] = {}
    probe: dict[str, Any] = {}
    tokens_per_word: Optional[float] = None
    wl: Optional[Workload] = None
    host_blocks: Optional[float] = None
    failed_starts: list[str] = []

    def start_server(server_args: list[str], server_env: dict[str, str]) -> ServerProcess:
        """Start a server; one retry if it dies during start-up (recorded in the report).

        A Mooncake server was once seen to die with SIGSEGV while starting (not reproduced);
        PYTHONFAULTHANDLER in the env puts the stack of such a crash in the server log.
        """
        try:
            return ServerProcess(server_args, env=server_env).start()
        except RuntimeError as exc:
            failed_starts.append(str(exc)[-4000:])
            logger.error("server died during start-up (retrying once): %s", str(exc)[-2000:])
            return ServerProcess(server_args, env=server_env).start()

    def make_workload(server: ServerProcess) -> Workload:
        nonlocal tokens_per_word
        tokens_per_word = calibrate_tokens_per_word(server, args.model, Workload(0, 0, 0, 0, 0, 1, args.seed))
        logger.info("tokenizer: %.2f tokens/word; device pool %d blocks (working set %d blocks)",
                    tokens_per_word, device_blocks, working_set_blocks)
        return Workload(args.users, args.rounds, max(1, round(args.doc_tokens / tokens_per_word)),
                        max(1, round(args.question_tokens / tokens_per_word)), args.output_tokens,
                        args.concurrency, args.seed)

    import serving_kv_formats
    import serving_sharing
    import serving_store_speeds

    store_speeds: dict[str, Any] = {}
    kv_formats: dict[str, Any] = {}

    work = Path(tempfile.mkdtemp(prefix="fdkv-bench-serving-"))
    cold: dict[str, Any] = {}
    fit: dict[str, Any] = {}
    h2d_gbps = serving_gpu.h2d_limit_gbps() if args.device == "gpu" else None
    if h2d_gbps:
        logger.info("H2D limit (one contiguous pinned 1 GiB copy): %.1f GB/s", h2d_gbps)
    sharing: dict[str, Any] = {}
    miss: dict[str, Any] = {}
    round1: dict[str, Any] = {}
    run_start = time.perf_counter()

    def run_one(server: ServerProcess, name: str, wl: Workload) -> tuple[list[Turn], float]:
        # Warm-up (not measured): the first requests of a fresh server pay one-time costs
        # (kernels and allocators); every configuration gets the same warm-up.
        warm = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
        for i in range(2):
            warm.completions.create(model=args.model, prompt=wl.document(90_000 + i), max_tokens=2,
                                    temperature=0)
        bar = tqdm(total=wl.users * wl.rounds, desc=name, unit="req", file=sys.stderr)
        turns, wall = asyncio.run(run_workload(server.base_url, args.model, wl, bar))
        bar.close()
        return turns, wall

    try:
        for name in configs:
            extra, env = config_server(name, args, work / "store-workload")
            logger.info("[%s] starting server: %s", name, " ".join(common + extra))
            server = start_server(common + extra, env)
            try:
                if wl is None:
                    wl = make_workload(server)
                turns, wall = run_one(server, name, wl)
                res = ConfigResult(name, server.args, env, wall, turns, scrape_metrics(server))
                if name == "device+host+storage":
                    # The background puts finish before the stats are read (their totals in the JSON).
                    wait_storage_quiet(server)
                res.engine_stats = server.engine_stats()  # preemptions, steps, evictions: for the JSON
                if name.startswith("device+host") and host_blocks is None:
                    host_blocks = _find_number(res.engine_stats, "host_blocks_total")
                results[name] = res
                s = res.summary()
                logger.info("[%s] %d requests in %.1f s: TTFT p50 %.1f ms, p99 %.1f ms; rounds>=2 p50 %.1f ms; "
                            "cached %.0f%% (by tier %s)", name, s["requests"], wall, 1e3 * s["ttft_p50_s"],
                            1e3 * s["ttft_p99_s"], 1e3 * s["ttft_p50_round2plus_s"], 100 * s["cached_fraction"],
                            {k: round(v, 3) for k, v in s["cached_fraction_by_tier"].items()})
                if name == "device+host" and args.probe_repeats > 0:
                    filler = math.ceil(device_blocks * bs / max(1, args.doc_tokens)) + 1
                    probe = asyncio.run(run_hit_probe(server.base_url, args.model, wl, filler, args.probe_repeats))
                    logger.info("[probe] device hit p50 %.1f ms, host hit p50 %.1f ms: host/device %.2f (%d/%d valid)",
                                1e3 * probe["device_hit_ttft_p50_s"], 1e3 * probe["host_hit_ttft_p50_s"],
                                probe["host_over_device"], probe["valid_repeats"], probe["repeats"])
            finally:
                server.stop()
        if args.fit_check:
            # Everything fits on the device: the cache can only cost, never save, on a miss
            # (a fresh seed: documents no server has seen).
            fit_args = list(common)
            fit_args[fit_args.index("--num-gpu-blocks-override") + 1] = str(working_set_blocks + 64)
            fit_args[fit_args.index("--max-num-seqs") + 1] = str(args.fit_concurrency)
            on_extra = ["--swap-space", str(args.swap_space), "--write-policy", args.write_policy]
            for switch in ("0", "1"):
                server = start_server(fit_args + (on_extra if switch == "1" else []),
                                      {"ENABLE_V1_KVCACHE_MANAGER": switch})
                fit_stats: dict[str, Any] = {}
                try:
                    if wl is None:
                        wl = make_workload(server)
                    fit_wl = Workload(wl.users, wl.rounds, wl.doc_words, wl.question_words, wl.output_tokens,
                                      args.fit_concurrency, wl.seed + 1000)
                    turns, wall = run_one(server, f"fit, switch {switch}", fit_wl)
                    fit_stats = server.engine_stats()
                finally:
                    server.stop()
                key = "off" if switch == "0" else "on"
                fit[f"{key}_output_tokens_per_s"] = sum(t.completion_tokens for t in turns) / wall
                fit[f"{key}_ttft_p50_s"] = percentile([t.ttft_s for t in turns], 50)
            fit["device_blocks"] = working_set_blocks + 64
            fit["concurrency"] = args.fit_concurrency
            fit["engine_stats_on"] = fit_stats
            logger.info("[fit] output tok/s switch off %.1f, on %.1f", fit["off_output_tokens_per_s"],
                        fit["on_output_tokens_per_s"])
        if configs and args.miss_repeats > 0:
            assert wl is not None
            miss = run_miss_phase(args, configs, common, wl, start_server, work)
        if args.interleave and "recompute" in configs and len(configs) > 1:
            assert wl is not None
            round1 = run_round1_interleaved(args, configs, common, wl, start_server, work)
        if args.cold_server:
            backends, skipped = usable_backends(requested_backends)
            if wl is None:  # no workload configuration ran: calibrate on a server of its own
                first = start_server(cold_server_args(args, cold_prefixes)[0], {"ENABLE_V1_KVCACHE_MANAGER": "1"})
                try:
                    wl = make_workload(first)
                finally:
                    first.stop()
            assert tokens_per_word is not None
            cold = run_cold_server(args, cold_prefixes, backends, tokens_per_word, wl, start_server, work)
            cold["skipped_backends"] = skipped
        if args.cold_burst:
            sharing["cold_burst"] = serving_sharing.run_cold_burst(args, start_server)
        if args.queued_storage:
            sharing["queued_storage"] = serving_sharing.run_queued_storage(args, start_server, work)
        if args.store_speeds:
            store_speeds = serving_store_speeds.run_store_speeds(args, start_server, work)
        if args.kv_formats:
            kv_formats = serving_kv_formats.run_kv_formats(args, start_server, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    default_probe: dict[str, Any] = {}
    if args.default_model_probe and args.default_model_probe != args.model:
        default_probe = probe_default_model(args.default_model_probe, args.doc_tokens // 2, args.seed)
    total_wall = time.perf_counter() - run_start

    report = build_report(args, results, probe, device_blocks, working_set_blocks, max_model_len,
                          tokens_per_word or 0.0, total_wall, cold, miss)
    report["host_blocks"] = int(host_blocks) if host_blocks is not None else None
    add_round1_interleaved(report, round1)
    report["machine"]["gpu"] = serving_gpu.gpu_name()
    serving_gpu.gpu_ratios(report, h2d_gbps, fit)
    report["default_model_probe"] = default_probe
    report["failed_server_starts"] = failed_starts
    report.update(sharing)
    report["store_speeds"] = store_speeds
    report["kv_formats"] = kv_formats
    report["loadavg_end"] = os.getloadavg()
    print(format_console(report))
    if store_speeds:
        print(serving_store_speeds.format_store_speeds(store_speeds))
    if kv_formats:
        print(serving_kv_formats.format_kv_formats(kv_formats))
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{args.name}_{args.tag}_{report['date']}" + ("_quick" if args.quick else "")
    json_path = out_dir / f"{stem}.json"
    json_path.write_text(json.dumps(report, indent=1, default=str))
    png_path = out_dir / f"{stem}_ttft.png"
    if results:
        plot(report, png_path)
        logger.info("wrote %s and %s", json_path, png_path)
    else:
        logger.info("wrote %s", json_path)
    if args.docs:
        write_docs_section(Path(args.docs), report, json_path, png_path)
        logger.info("updated %s", args.docs)
    return 0


def run_miss_phase(args: argparse.Namespace, configs: list[str], common: list[str], wl: Workload,
                   start_server: Any, work: Path) -> dict[str, Any]:
    """The miss probe: one server per configuration, all started before the first request."""
    from openai import OpenAI
    from tqdm import tqdm

    requests = args.miss_requests or max(3, 2 * args.concurrency)
    servers: dict[str, ServerProcess] = {}
    try:
        for name in configs:
            extra, env = config_server(name, args, work / "store-miss")
            servers[name] = start_server(common + extra, env)
        for name, server in servers.items():  # the workload's warm-up, not measured
            warm = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
            for i in range(2):
                warm.completions.create(model=args.model, prompt=wl.document(90_000 + i), max_tokens=2, temperature=0)
        bar = tqdm(total=args.miss_repeats * len(servers), desc="miss probe", unit="burst", file=sys.stderr)
        out = run_miss_probe(servers, args.model, wl, args.miss_repeats, requests, bar)
        bar.close()
    finally:
        for server in servers.values():
            server.stop()
    for name, row in out["configs"].items():
        q = row.get("per_repeat_over_recompute_p25_p50_p75")
        logger.info("[miss] %s: TTFT p50 %.1f ms%s", name, 1e3 * row["ttft_p50_s"],
                    f", {q[1]:.3f}x recompute (median over repetitions; p25-p75 {q[0]:.2f}-{q[2]:.2f})"
                    if q else "")
    return out


def run_round1_interleaved(args: argparse.Namespace, configs: list[str], common: list[str], wl: Workload,
                           start_server: Any, work: Path) -> dict[str, Any]:
    """Round 1 of each configuration interleaved with recompute's, in pairs (``--interleave``).

    One recompute server stays up; each other configuration's server starts beside it, both
    get the workload's warm-up, then :func:`run_miss_probe` sends the same round-1 bursts to
    the two alternately.  Two servers at a time: an 8B model's servers all at once do not fit
    one GPU.
    """
    from openai import OpenAI
    from tqdm import tqdm

    requests = args.miss_requests or max(3, 2 * args.concurrency)
    repeats = args.miss_repeats or 8  # --miss-repeats 0 skips the miss probe, not these pairs
    out: dict[str, Any] = {"repeats": repeats, "requests_per_repeat": requests, "configs": {}}
    rec_extra, rec_env = config_server("recompute", args, work / "store-round1")
    rec = start_server(common + rec_extra, rec_env)
    try:
        for name in [c for c in configs if c != "recompute"]:
            extra, env = config_server(name, args, work / f"store-round1-{name}")
            server = start_server(common + extra, env)
            try:
                for srv in ([rec] if not out["configs"] else []) + [server]:  # the workload's warm-up, once each
                    warm = OpenAI(base_url=srv.base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
                    for i in range(2):
                        warm.completions.create(model=args.model, prompt=wl.document(90_000 + i), max_tokens=2,
                                                temperature=0)
                bar = tqdm(total=2 * repeats, desc=f"round 1: {name} | recompute", unit="burst", file=sys.stderr)
                pair = run_miss_probe({"recompute": rec, name: server}, args.model, wl, repeats, requests, bar)
                bar.close()
            finally:
                server.stop()
            row = pair["configs"][name]
            row["recompute_ttft_p50_s"] = pair["configs"]["recompute"]["ttft_p50_s"]
            out["configs"][name] = row
            logger.info("[round 1, interleaved] %s: %.3fx recompute (median over %d bursts; p25-p75 %.2f-%.2f)", name,
                        row["over_recompute"], repeats, row["per_repeat_over_recompute_p25_p50_p75"][0],
                        row["per_repeat_over_recompute_p25_p50_p75"][2])
    finally:
        rec.stop()
    return out


def add_round1_interleaved(report: dict[str, Any], round1: dict[str, Any]) -> None:
    """The interleaved round-1 ratios (``--interleave``) and their target, into ``report``."""
    report["round1_interleaved"] = round1
    for name, row in (round1.get("configs") or {}).items():
        # A request that reused anything was no round 1: then the figure says nothing.
        key = f"round1_interleaved_over_recompute:{name}"
        report["ratios"][key] = row["over_recompute"] if row["cached_tokens"] == 0 else float("nan")
        if name == "device+host":
            report["targets"][key] = 1.05
    report["met"] = {k: (report["ratios"][k] <= v) for k, v in report["targets"].items()
                     if k in report["ratios"] and not math.isnan(report["ratios"][k])}


def probe_default_model(model: str, target_tokens: int, seed: int) -> dict[str, Any]:
    """Time one cold prefill of ``model`` (switch off): the reason the benchmark uses a smaller one."""
    from openai import OpenAI

    server = ServerProcess(["--model", model, "--device", "cpu", "--max-model-len", "4096", "--log-level", "warning",
                            "--uvicorn-log-level", "warning"], env={"ENABLE_V1_KVCACHE_MANAGER": "0"},
                           startup_timeout_s=900)
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        logger.warning("could not start %s for the default-model probe: %s", model, str(exc)[-500:])
        return {"model": model, "error": str(exc)[-500:]}
    try:
        client = OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=900)
        rng = random.Random(seed + 17)
        n = max(1, int(target_tokens / 1.3))  # common words are about 1.3 tokens each in a 49k vocabulary
        start = time.perf_counter()
        usage = client.completions.create(model=model, prompt=words(rng, n), max_tokens=1, temperature=0).usage
        seconds = time.perf_counter() - start
    finally:
        server.stop()
    out = {"model": model, "prompt_tokens": usage.prompt_tokens, "seconds": seconds,
           "prompt_tokens_per_s": usage.prompt_tokens / seconds}
    logger.info("[default model] %s: one cold prefill of %d tokens took %.1f s (%.0f tokens/s)", model,
                usage.prompt_tokens, seconds, out["prompt_tokens_per_s"])
    return out


def _find_number(stats: Any, key: str) -> Optional[float]:
    if isinstance(stats, dict):
        if isinstance(stats.get(key), (int, float)):
            return float(stats[key])
        for v in stats.values():
            found = _find_number(v, key)
            if found is not None:
                return found
    return None


# ---------------------------------------------------------------------- report
def build_report(args: argparse.Namespace, results: dict[str, ConfigResult], probe: dict[str, Any],
                 device_blocks: int, working_set_blocks: int, max_model_len: int, tokens_per_word: float,
                 total_wall: float, cold: Optional[dict[str, Any]] = None,
                 miss: Optional[dict[str, Any]] = None) -> dict[str, Any]:
    summaries = {name: r.summary() for name, r in results.items()}
    ratios: dict[str, Any] = {}
    base = summaries.get("recompute")
    dev = summaries.get("device")
    host = summaries.get("device+host")
    if host and dev:
        ratios["host_over_device_ttft_p50_round2plus"] = host["ttft_p50_round2plus_s"] / dev["ttft_p50_round2plus_s"]
    if host and base:
        ratios["host_over_recompute_ttft_p50_round2plus"] = host["ttft_p50_round2plus_s"] / base["ttft_p50_round2plus_s"]
    if dev and base:
        ratios["device_over_recompute_ttft_p50_round2plus"] = dev["ttft_p50_round2plus_s"] / base["ttft_p50_round2plus_s"]
    if probe:
        ratios["host_hit_over_device_hit_ttft_p50"] = probe["host_over_device"]
    if base:  # round 1 of the workload, configurations one after the other (no target: see the miss probe)
        for name, summ in summaries.items():
            if name != "recompute":
                ratios[f"round1_over_recompute:{name}"] = _round1(summ) / _round1(base)
    storage = summaries.get("device+host+storage")
    if storage and host:  # no target: the cost of writing every block to storage as well
        ratios["storage_over_host_ttft_p50"] = storage["ttft_p50_s"] / host["ttft_p50_s"]
        ratios["storage_over_host_ttft_p50_round2plus"] = (storage["ttft_p50_round2plus_s"]
                                                           / host["ttft_p50_round2plus_s"])
    if storage and base:
        ratios["storage_over_recompute_ttft_p50_round2plus"] = (storage["ttft_p50_round2plus_s"]
                                                                / base["ttft_p50_round2plus_s"])
    targets = {
        "host_over_device_ttft_p50_round2plus": 0.5,
        "host_over_recompute_ttft_p50_round2plus": 0.25,
        "host_hit_over_device_hit_ttft_p50": 1.15,
    }
    # A miss costs nothing: interleaved round-1 prompts (the miss probe).
    for name, row in ((miss or {}).get("configs") or {}).items():
        if "over_recompute" in row and name != "recompute":
            # A request that reused anything was no miss: then the figure says nothing.
            ratios[f"miss_over_recompute:{name}"] = row["over_recompute"] if row["cached_tokens"] == 0 else float("nan")
            if name == "device+host":
                targets[f"miss_over_recompute:{name}"] = 1.05
    # Cold server: storage hit <= 1.2x host hit with the file backend (every
    # prefix length measured), storage hit <= 0.25x recompute at the largest prefix (every backend).
    results_cold = (cold or {}).get("results", {})
    largest = max((int(k.split("/")[1]) for k in results_cold), default=0)
    for key, r in results_cold.items():
        backend, plen = key.split("/")
        ratios[f"cold_storage_over_host:{key}"] = r["storage_over_host"]
        ratios[f"cold_storage_over_recompute:{key}"] = r["storage_over_recompute"]
        if backend == "file":
            targets[f"cold_storage_over_host:{key}"] = 1.2
        if int(plen) == largest:
            targets[f"cold_storage_over_recompute:{key}"] = 0.25
    return {
        "date": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d"),
        "time_utc": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d %H:%M"),
        "machine": machine(args.device),
        "loadavg_start": LOADAVG_START,
        "args": vars(args),
        "tokens_per_word": tokens_per_word,
        "device_blocks": device_blocks,
        "working_set_blocks": working_set_blocks,
        "max_model_len": max_model_len,
        "total_wall_s": total_wall,
        "summaries": summaries,
        "turns": {name: [asdict(t) for t in r.turns] for name, r in results.items()},
        "server_args": {name: r.server_args for name, r in results.items()},
        "metrics": {name: r.metrics for name, r in results.items()},
        "engine_stats": {name: r.engine_stats for name, r in results.items()},
        "probe": probe,
        "cold": cold or {},
        "miss": miss or {},
        "ratios": ratios,
        "targets": targets,
        "met": {k: (ratios[k] <= v) for k, v in targets.items() if k in ratios and not math.isnan(ratios[k])},
    }


def _round1(summary: dict[str, Any]) -> float:
    """Round 1's TTFT p50 of a summary (JSON round trips turn the round keys into strings)."""
    by_round = summary["ttft_p50_by_round_s"]
    return by_round.get(1, by_round.get("1", float("nan")))


def _ms(x: float) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{1e3 * x:.1f}"


def _ratio(x: Optional[float], digits: int = 2) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def _gbps(x: Optional[float]) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.2f}"


def format_table(report: dict[str, Any]) -> str:
    s = report["summaries"]
    base = s.get("recompute")
    lines = ["| configuration | TTFT p50 (ms) | TTFT p99 (ms) | rounds ≥ 2: TTFT p50 (ms) | vs recompute | "
             "rounds ≥ 2: TTFT p99 (ms) | req/s | prompt tok/s | cached, all rounds: device / host / storage | "
             "cached, rounds ≥ 2: device / host / storage |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name in CONFIGS:
        if name not in s:
            continue
        r = s[name]
        ratio = (f"{r['ttft_p50_round2plus_s'] / base['ttft_p50_round2plus_s']:.2f}x" if base else "-")
        tiers = r["cached_fraction_by_tier"]
        later = r["cached_fraction_round2plus_by_tier"]
        lines.append(f"| {name} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p99_s'])} | "
                     f"{_ms(r['ttft_p50_round2plus_s'])} | {ratio} | {_ms(r['ttft_p99_round2plus_s'])} | "
                     f"{r['requests_per_s']:.2f} | {r['prompt_tokens_per_s']:.0f} | "
                     f"{100 * tiers['device']:.0f}% / {100 * tiers['host']:.0f}% / "
                     f"{100 * tiers.get('storage', 0.0):.0f}% | "
                     f"{100 * later['device']:.0f}% / {100 * later['host']:.0f}% / "
                     f"{100 * later.get('storage', 0.0):.0f}% |")
    return "\n".join(lines)


def format_storage_ratio(report: dict[str, Any]) -> str:
    """One line: the fourth configuration against device+host (no target), or '' without both."""
    r = report["ratios"]
    if "storage_over_host_ttft_p50" not in r:
        return ""
    return (f"device+host+storage / device+host, TTFT p50: all rounds {r['storage_over_host_ttft_p50']:.2f}x, "
            f"rounds ≥ 2 {r['storage_over_host_ttft_p50_round2plus']:.2f}x (same run, no target: the cost of "
            "writing every block to storage as well).")


def format_round_table(report: dict[str, Any]) -> str:
    """TTFT p50 / p99 per round and configuration (from the turns themselves)."""
    s = report["summaries"]
    turns = report["turns"]
    names = [n for n in CONFIGS if n in turns]
    rounds = sorted({t["round"] for n in names for t in turns[n]})
    lines = ["| round | " + " | ".join(f"{n}: p50 / p99 (ms)" for n in names) + " |",
             "|---|" + "---|" * len(names)]
    for r in rounds:
        cells = []
        for n in names:
            xs = [t["ttft_s"] for t in turns[n] if t["round"] == r]
            cells.append(f"{_ms(percentile(xs, 50))} / {_ms(percentile(xs, 99))}")
        lines.append(f"| {r} | " + " | ".join(cells) + " |")
    if "recompute" in s:
        base = _round1(s["recompute"])
        lines.append("| round 1 / recompute | " + " | ".join(f"{_round1(s[n]) / base:.2f}x" for n in names) + " |")
    return "\n".join(lines)


def format_miss_table(report: dict[str, Any]) -> str:
    """The miss probe: one row per configuration ('' if it did not run)."""
    m = report.get("miss") or {}
    if not m.get("configs"):
        return ""
    lines = ["| configuration | TTFT p50, all repetitions (ms) | p25-p75 (ms) | p50 / recompute's p50 | "
             "per repetition, vs recompute: p25 / **p50** / p75 | cached tokens |", "|---|---|---|---|---|---|"]
    for name, r in m["configs"].items():
        q = r.get("per_repeat_over_recompute_p25_p50_p75")
        lines.append(f"| {name} | {_ms(r['ttft_p50_s'])} | {_ms(r['ttft_p25_p75_s'][0])}-{_ms(r['ttft_p25_p75_s'][1])} | "
                     f"{_ratio(r.get('pooled_over_recompute'), 3)} | "
                     f"{' / '.join(_ratio(x, 3) for x in q) if q else '-'} | {r['cached_tokens']} |")
    return "\n".join(lines)


def miss_description(report: dict[str, Any]) -> str:
    """One sentence on how the miss probe ran ('' if it did not)."""
    m = report.get("miss") or {}
    if not m.get("configs"):
        return ""
    return (f"Miss probe (round 1, nothing to reuse): {len(m['configs'])} servers, one per configuration, ran at "
            f"once; each of {m['repeats']} repetitions sent the same {m['requests_per_repeat']} never-seen round-1 "
            f"prompts ({m['concurrency']} in flight, back to back) to each server in turn, in an order shuffled "
            "per repetition, so load drifts reach every configuration alike. The figure is the median of the "
            "per-repetition ratios (each repetition's TTFT p50 over recompute's in the same repetition, seconds "
            "apart), with their p25 and p75 as the spread; the p50 over all repetitions is shown beside it.")


def _pair_spread(r: dict[str, Any]) -> str:
    """The storage/host ratios of the pairs side by side: median (p25-p75) ('-' in reports without it)."""
    q = r.get("storage_over_host_pairs_p25_p75")
    med = r.get("storage_over_host_pairs_p50")
    if not q:
        return "-"
    return (f"{med:.2f} ({q[0]:.2f}-{q[1]:.2f})" if med is not None else f"{q[0]:.2f}-{q[1]:.2f}")


def _fetch_split(r: dict[str, Any]) -> str:
    """A storage hit's fetch, p50 ms since arrival: started / in the tree / admitted ('-' without timings)."""
    t = r.get("storage_timing") or {}
    if t.get("fetch_in_tree_s") is None:
        return "-"
    return f"{_ms(t['fetch_started_s'])} / {_ms(t['fetch_in_tree_s'])} / {_ms(t['queued_s'])}"


def format_cold_table(report: dict[str, Any]) -> str:
    """The cold-server scenario: one row per backend and prefix length ('' if it did not run)."""
    results = (report.get("cold") or {}).get("results") or {}
    if not results:
        return ""
    lines = ["| backend | prefix tokens (prompt tokens p50) | storage hit TTFT p50 (ms) | host hit TTFT p50 (ms) | "
             "recompute TTFT p50 (ms) | storage / host | pairs side by side: median (p25-p75) | "
             "storage hit, ms after arrival: fetch started / in tree / admitted | storage / recompute | "
             "server read GB/s | plain read GB/s | server write GB/s | plain write GB/s | valid pairs |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for key, r in results.items():
        backend, plen = key.split("/")
        lines.append(
            f"| {backend} | {plen} ({r['prompt_tokens_p50']:.0f}) | {_ms(r['storage_ttft_p50_s'])} | "
            f"{_ms(r['host_ttft_p50_s'])} | {_ms(r['recompute_ttft_p50_s'])} | {_ratio(r['storage_over_host'])} "
            f"(engine {_ratio(r.get('engine_storage_over_host'))}) | "
            f"{_pair_spread(r)} | {_fetch_split(r)} | {_ratio(r['storage_over_recompute'])} | {_gbps(r['server_read_gbps'])} | "
            f"{_gbps(r['plain_read_gbps'])} | {_gbps(r['server_write_gbps'])} | {_gbps(r['plain_write_gbps'])} | "
            f"{r['valid_repeats']}/{r['repeats']} |")
    return "\n".join(lines)


def _target_label(key: str, report: dict[str, Any]) -> str:
    if key.startswith("round1_interleaved_over_recompute:"):
        return (f"round 1, interleaved beside a recompute server, TTFT p50: {key.split(':', 1)[1]} / recompute "
                "(median over bursts)")
    if key.startswith("miss_over_recompute:"):
        return (f"round 1 (miss probe, interleaved), TTFT p50: {key.split(':', 1)[1]} / recompute "
                "(median over repetitions)")
    fixed = {
        "host_over_device_ttft_p50_round2plus": "rounds ≥ 2, TTFT p50: device+host / device",
        "host_over_recompute_ttft_p50_round2plus": "rounds ≥ 2, TTFT p50: device+host / recompute",
        "host_hit_over_device_hit_ttft_p50": "same prefix, TTFT p50: host hit / device hit",
    }
    if key in fixed:
        return fixed[key]
    if key in serving_gpu.TARGET_LABELS:
        return serving_gpu.TARGET_LABELS[key]
    kind, where = key.split(":", 1)
    backend, plen = where.split("/")
    tokens = report["cold"]["results"][where]["prompt_tokens_p50"]
    what = "storage hit / host hit" if kind == "cold_storage_over_host" else "storage hit / recompute"
    return f"cold server, {backend}, {plen}-token prefix ({tokens:.0f}-token prompts), TTFT p50: {what}"


def format_targets(report: dict[str, Any], cold: bool = False) -> str:
    """Targets of the workload, the hit probe and the miss probe or, with ``cold``, of the cold
    server."""
    keys = [k for k in report["targets"] if k.startswith("cold_") == cold and k in report["ratios"]]
    if not keys:
        return ""
    lines = ["| ratio | measured | target | met |", "|---|---|---|---|"]
    for k in keys:
        v = report["ratios"][k]
        met = ("no valid repeat" if isinstance(v, float) and math.isnan(v)
               else "yes" if report["met"].get(k) else "NO")
        lines.append(f"| {_target_label(k, report)} | {_ratio(v, 3)} | ≤ {report['targets'][k]} | {met} |")
    return "\n".join(lines)


def format_console(report: dict[str, Any]) -> str:
    p = report["probe"]
    parts = [f"\n{report['args'].get('name', 'bench_serving')} {report['time_utc']} UTC, {report['machine']['cpu']} ({report['machine']['cores']} cores), "
             f"model {report['args']['model']}"]
    if report["summaries"]:
        parts += [format_table(report), format_storage_ratio(report), "", "TTFT per round:",
                  format_round_table(report)]
    if p:
        parts.append(f"\nprobe (same prefix, {p['valid_repeats']}/{p['repeats']} valid): cold {_ms(p['cold_ttft_p50_s'])} ms, "
                     f"device hit {_ms(p['device_hit_ttft_p50_s'])} ms, host hit {_ms(p['host_hit_ttft_p50_s'])} ms")
    if report.get("floor"):
        f = report["floor"]
        parts.append(f"H2D limit {f['h2d_limit_gbps']:.1f} GB/s (same run): the host hit's {f['prefix_kv_bytes'] / 2**20:.0f} MiB "
                     f"of KV take {_ms(f['kv_load_at_limit_s'])} ms at the limit; floor {_ms(f['floor_s'])} ms")
    if report.get("fit"):
        f = report["fit"]
        parts.append(f"all on the device: output tok/s switch off {f['off_output_tokens_per_s']:.1f}, "
                     f"on {f['on_output_tokens_per_s']:.1f}")
    if serving_gpu.format_host_split(report):
        parts += ["", "Per-step host time by phase (ms per step, share of the step):",
                  serving_gpu.format_host_split(report)]
    if format_miss_table(report):
        parts += ["", miss_description(report), format_miss_table(report)]
    if format_targets(report):
        parts += ["", "Targets (same-run ratios):", format_targets(report)]
    if format_cold_table(report):
        skipped = report["cold"].get("skipped_backends") or {}
        parts += ["", "Cold server (restarted server, warm store):", format_cold_table(report)]
        parts += [f"({b} left out: {why})" for b, why in skipped.items()]
        parts += ["", "Targets (cold server):", format_targets(report, cold=True)]
    from serving_sharing import format_sharing

    if format_sharing(report):
        parts += ["", format_sharing(report)]
    return "\n".join(parts)


BEGIN = "<!-- bench_serving:begin (written by benchmarks/bench_serving.py) -->"
END = "<!-- bench_serving:end -->"


def write_docs_section(path: Path, report: dict[str, Any], json_path: Path, png_path: Path) -> None:
    """(Re)write the Serving section of docs/benchmarks.md between its markers (append if absent).

    Compact on purpose: the page is a reference with a line budget (tests/test_docs.py), so the
    section holds the run's facts and tables; how the phases work is in the script's docstring.
    """
    a = report["args"]
    m = report["machine"]
    p = report["probe"]
    rel = lambda q: os.path.relpath(q, path.parent)  # noqa: E731
    s = report["summaries"]
    cold = report.get("cold") or {}
    where = (f"one {m['gpu']}" if m.get("gpu") else f"{m['cpu']}, {m['cores']} cores, CPU only (Paddle {m['paddle']})")
    body = [
        BEGIN,
        "## Serving (`benchmarks/bench_serving.py`)",
        "",
        f"{report['date']} {report['time_utc'].split(' ')[-1]} UTC, {where}, Python {m['python']}; load average "
        f"{report['loadavg_start'][0]:.1f} to {report['loadavg_end'][0]:.1f} (absolute times are noisy, read the "
        f"same-run ratios). Model `{a['model']}`, block size {a['block_size']}; HTTP to uvicorn on 127.0.0.1 "
        "through the `openai` client, streamed; TTFT is the first streamed token as the client sees it.",
        "",
    ]
    if s:
        any_sum = next(iter(s.values()))
        mean_prompt = any_sum["prompt_tokens"] / max(1, any_sum["requests"])
        body += [
            f"Workload: {a['users']} users x {a['rounds']} rounds over their own ~{a['doc_tokens']}-token documents "
            f"(mean prompt {mean_prompt:.0f} tokens, {a['output_tokens']} output tokens, {a['concurrency']} in flight). "
            f"Device pool {report['device_blocks']} blocks = {report['device_blocks'] / report['working_set_blocks']:.2f} "
            f"of the working set; host tier {a['swap_space']} GiB holds all of it (`{a['write_policy']}`); "
            "`device+host+storage` adds a `file` tier. Configurations ran one after the other; `recompute` "
            "(the switch off) is the in-run baseline.",
            "",
            format_table(report),
            "",
        ]
        if format_storage_ratio(report):
            body += [format_storage_ratio(report), ""]
        body += ["TTFT per round, p50 / p99 (ms):", "", format_round_table(report), ""]
    if p:
        body += [
            f"Same prefix, device hit against host hit ({p['valid_repeats']}/{p['repeats']} repeats confirmed by "
            f"`cached_tokens_by_tier`): cold {_ms(p['cold_ttft_p50_s'])} ms, device hit "
            f"{_ms(p['device_hit_ttft_p50_s'])} ms, host hit {_ms(p['host_hit_ttft_p50_s'])} ms (p50s).",
            "",
        ]
    if format_miss_table(report):
        body += [miss_description(report), "", format_miss_table(report), ""]
    # The targets themselves are in the page's one Targets table (and in the console output).
    if format_cold_table(report):
        skipped = cold.get("skipped_backends") or {}
        left_out = "".join(f" `{b}` was left out: {why}." for b, why in skipped.items())
        body += [
            "### Cold server: a restarted server in front of a warm store",
            "",
            f"Per backend and prefix length, a server stored documents and stopped; a restarted server on the "
            f"same store answered, in rounds of {a.get('cold_group', 1)}, each document of a round from storage "
            "with a document of the round before (pushed off the device) from host right beside it, "
            f"{a['cold_repeats']} pairs, plus a never-seen document per round (recompute), all in one process. "
            "`engine` is the same ratio of the engine's own time to first token (`request_timings`: arrival "
            "to first token, without HTTP). `plain` is a plain file read or write of the same bytes in the "
            "same run." + left_out,
            "",
            format_cold_table(report),
            "",
        ]
    from serving_sharing import format_sharing

    if format_sharing(report):
        body += ["### Work in flight shared: a cold burst, and queued requests over storage", "",
                 format_sharing(report)]
    body += [f"Raw data: `{rel(json_path)}`" + (f"; plot: `{rel(png_path)}`." if s else ".")]
    if s:
        body += ["", f"![TTFT per round]({rel(png_path)})"]
    body += [END]
    section = "\n".join(body) + "\n"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    if BEGIN in text and END in text:
        head, rest = text.split(BEGIN, 1)
        _, tail = rest.split(END, 1)
        text = head + section.rstrip("\n") + tail
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def plot(report: dict[str, Any], png_path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    turns = report["turns"]
    for name in CONFIGS:
        if name not in turns:
            continue
        by_round: dict[int, list[float]] = {}
        for t in turns[name]:
            by_round.setdefault(t["round"], []).append(1e3 * t["ttft_s"])
        rounds = sorted(by_round)
        p50 = [percentile(by_round[r], 50) for r in rounds]
        p99 = [percentile(by_round[r], 99) for r in rounds]
        line, = ax.plot(rounds, p50, marker="o", label=f"{name} p50")
        ax.plot(rounds, p99, linestyle="--", color=line.get_color(), alpha=0.6, label=f"{name} p99")
    ax.set_xlabel("round")
    ax.set_ylabel("time to first token (ms)")
    ax.set_yscale("log")
    ax.set_xticks(sorted({t["round"] for ts in turns.values() for t in ts}))
    where = report["machine"].get("gpu") or f"{report['machine']['cores']} CPU cores"
    ax.set_title(f"bench_serving: {report['args']['model']}, {where}, {report['date']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
