"""The `prefix-affinity` comparison of `embedfleet bench`: prefix-affinity routing vs Serve's default
router, in one cluster, on the tiny causal Qwen3 (``benchmarks/tiny_qwen3.py``, LAST pooling).

    embedfleet bench --peers vllm --workloads prefix-affinity       # this comparison alone

The cluster (started with ``embedfleet up`` when nothing answers at ``--embedfleet-url``, stopped
afterwards) serves the same weights twice, each model on 2 replicas (4 cards): ``tiny-qwen3-
affinity`` with ``routing.policy: prefix_affinity`` and ``tiny-qwen3-p2c`` with ``power_of_two``
(Serve's default). The workload: 8 distinct ~4,000-token instructions (Qwen3-Embedding's
"Instruct:" style: a common opening, then the task), each request one short query under an
instruction picked at random, 8 in flight. Each card's KV pool holds 5.5 of the 8: as on a real
card, where the pool is what ``gpu_memory_utilization`` leaves after the weights, the cache cannot
keep every prefix everywhere. With affinity each replica keeps its own (about 4, up to 5 when the
ring splits the 8 keys unevenly) warm; with the default router both replicas see all 8 and evict
each other's.

Per run: texts/s, p50/p99, the share of prompt tokens served from the cache (the responses'
``usage.prompt_tokens_details.cached_tokens``), texts per replica (the ``x-embedfleet-replicas``
header) and CPU-s per 1,000 texts of the whole cluster. The variants alternate per repeat; the
summary is the median. Goals (issue 15): cached ratio >= 0.8 with affinity, texts/s >= 1.3x the
default, no replica above 1.5x the mean load.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

from .workloads import WORDS, instruction_prefix

VARIANTS = {"affinity": "tiny-qwen3-affinity", "default": "tiny-qwen3-p2c"}
POLICIES = {"affinity": "prefix_affinity", "default": "power_of_two"}
INSTRUCTIONS, INSTRUCTION_TOKENS = 8, 3968  # words, one token each (the MiniLM vocabulary)
QUERIES_PER_REQUEST, CONCURRENCY = 1, 8  # online traffic: one query per request
KV_BYTES_PER_TOKEN = 2 * 2 * 1 * 64 * 4  # layers x (K, V) x KV heads x head_dim x float32
KV_POOL_TOKENS = 21824  # 682 blocks of 32: 5.5 instructions (124 blocks each)
GOALS = {"cached_ratio_min": 0.8, "throughput_ratio_min": 1.3, "max_load_over_mean": 1.5}


def cluster_config(model_dir: Path, port: int) -> Any:
    from ..deployments.config.schema import parse_config

    def model(variant: str) -> dict[str, Any]:
        return {"name": VARIANTS[variant], "source": {"path": str(model_dir)},
                "max_model_len": 4096, "prefix_cache": "on", "canary_interval_s": 3600,
                "engine": {"kv_cache_memory_bytes": KV_POOL_TOKENS * KV_BYTES_PER_TOKEN},
                "replicas": {"min_replicas": 2, "max_replicas": 2},
                "routing": {"policy": POLICIES[variant]}}

    return parse_config({"platform": {"kind": "cpu"}, "cards": 4,
                         "models": [model(v) for v in VARIANTS],
                         "router": {"port": port}}, "prefix-affinity bench")


def instructions() -> list[str]:
    return [instruction_prefix(INSTRUCTION_TOKENS, seed=100 + k) for k in range(INSTRUCTIONS)]


def requests_for(n: int, seed: int) -> list[list[str]]:
    """``n`` requests: one random instruction each, with distinct short queries under it."""
    rng, instr = random.Random(seed), instructions()
    out = []
    for _ in range(n):
        head = instr[rng.randrange(INSTRUCTIONS)]
        out.append([f"{head} query " + " ".join(rng.choice(WORDS)
                                                 for _ in range(rng.randint(3, 12)))
                    for _ in range(QUERIES_PER_REQUEST)])
    return out


async def drive(client: httpx.AsyncClient, model: str, reqs: list[list[str]]) -> dict[str, Any]:
    """Send ``reqs`` with CONCURRENCY in flight; per-run figures."""
    lat: list[float] = []
    load: Counter[str] = Counter()
    prompt = cached = errors = 0
    queue = list(reversed(reqs))

    async def worker() -> None:
        nonlocal prompt, cached, errors
        while queue:
            texts = queue.pop()
            t0 = time.perf_counter()
            r = await client.post("/v1/embeddings", json={"model": model, "input": texts,
                                                          "encoding_format": "base64"})
            if r.status_code != 200:
                errors += 1
                continue
            lat.append((time.perf_counter() - t0) * 1000)
            usage = r.json()["usage"]
            prompt += usage["prompt_tokens"]
            cached += usage["prompt_tokens_details"]["cached_tokens"]
            for rid in r.headers["x-embedfleet-replicas"].split(","):
                load[rid] += len(texts) / len(r.headers["x-embedfleet-replicas"].split(","))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
    seconds = time.perf_counter() - t0
    texts = sum(len(x) for x in reqs) - errors * QUERIES_PER_REQUEST
    lat.sort()
    mean = sum(load.values()) / max(1, len(load))
    return {"texts": texts, "seconds": round(seconds, 3), "errors": errors,
            "texts_per_s": round(texts / seconds, 2),
            "p50_ms": round(lat[len(lat) // 2], 1) if lat else None,
            "p99_ms": round(lat[min(len(lat) - 1, int(0.99 * len(lat)))], 1) if lat else None,
            "cached_ratio": round(cached / prompt, 4) if prompt else None,
            "texts_per_replica": {k: round(v, 1) for k, v in sorted(load.items())},
            "max_load_over_mean": round(max(load.values()) / mean, 3) if load else None}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    def med(v: str, key: str) -> float | None:
        xs = [r[key] for r in runs if r["variant"] == v and r[key] is not None]
        return statistics.median(xs) if xs else None

    out: dict[str, Any] = {v: {k: med(v, k) for k in ("texts_per_s", "p50_ms", "p99_ms",
                                                      "cached_ratio", "max_load_over_mean",
                                                      "cpu_s_per_1k")} for v in VARIANTS}
    for v in VARIANTS:
        out[v]["repeats"] = sum(1 for r in runs if r["variant"] == v)
    a, d = out["affinity"], out["default"]
    out["throughput_ratio"] = (round(a["texts_per_s"] / d["texts_per_s"], 3)
                               if a["texts_per_s"] and d["texts_per_s"] else None)
    out["goals"] = {
        "cached_ratio": {"goal": f">= {GOALS['cached_ratio_min']}", "value": a["cached_ratio"],
                         "met": (a["cached_ratio"] or 0) >= GOALS["cached_ratio_min"]},
        "throughput_ratio": {"goal": f">= {GOALS['throughput_ratio_min']}",
                             "value": out["throughput_ratio"],
                             "met": (out["throughput_ratio"] or 0)
                             >= GOALS["throughput_ratio_min"]},
        "max_load_over_mean": {"goal": f"<= {GOALS['max_load_over_mean']}",
                               "value": a["max_load_over_mean"],
                               "met": a["max_load_over_mean"] is not None
                               and a["max_load_over_mean"] <= GOALS["max_load_over_mean"]}}
    return out


async def run_prefix_affinity(*, url: str, out: Path, cores: list[int], repeats: int,
                              quick: bool, seed: int, progress: Any) -> dict[str, Any]:
    """Start the two-model cluster if nothing answers at ``url``, run, stop what was started."""
    from urllib.parse import urlparse

    from .embedfleet_peer import EmbedfleetPeer, served_model
    from .prefix_cache_bench import TINY_QWEN3_DIR
    from .process_cpu import CpuMeter
    from .tiny_qwen3 import build_tiny_qwen3

    cfg = cluster_config(build_tiny_qwen3(TINY_QWEN3_DIR), urlparse(url).port or 8000)
    peer = EmbedfleetPeer(url, VARIANTS["affinity"], CONCURRENCY, cfg, out, cores)
    n_req = 16 if quick else 160
    section: dict[str, Any] = {
        "status": "ok", "models": VARIANTS, "policies": POLICIES,
        "workload": {"instructions": INSTRUCTIONS, "instruction_tokens": INSTRUCTION_TOKENS,
                     "queries_per_request": QUERIES_PER_REQUEST, "concurrency": CONCURRENCY,
                     "requests_per_run": n_req, "kv_pool_tokens_per_replica": KV_POOL_TOKENS,
                     "replicas_per_model": 2},
        "runs": []}
    try:
        progress.console.print("prefix-affinity: starting the two-model cluster (4 cards)")
        await peer.start()
        if peer.origin.startswith("already running"):
            body = await peer._models() or {}
            missing = [m for m in VARIANTS.values() if served_model(body, m) is None]
            if missing:
                return {**section, "status": "skipped", "summary": None,
                        "reason": f"a cluster already answers at {url} without {missing}: the "
                                  "comparison needs its own (stop it, or use another URL)"}
        section["cluster"] = peer.describe()
        scope = peer.cpu_scope([])
        async with httpx.AsyncClient(base_url=url, timeout=300) as client:
            for v, m in VARIANTS.items():  # untimed: both caches at their steady state
                await drive(client, m, requests_for(n_req // 2, seed + 1000))
            order = list(VARIANTS)
            for rep in range(repeats):
                for v in order[rep % 2:] + order[:rep % 2]:
                    meter = CpuMeter({"cluster": scope}).start()
                    res = await drive(client, VARIANTS[v], requests_for(n_req, seed + rep))
                    cpu = meter.stop()["scopes"]["cluster"]["cpu_s"]
                    res.update(variant=v, repeat=rep, cpu_s=cpu,
                               cpu_s_per_1k=round(1000 * cpu / res["texts"], 2)
                               if res["texts"] else None)
                    section["runs"].append(res)
                    progress.console.print(
                        f"prefix-affinity #{rep} {v}: {res['texts_per_s']} texts/s, cached "
                        f"{res['cached_ratio']}, load max/mean {res['max_load_over_mean']}")
        section["summary"] = summarize(section["runs"])
    except Exception as exc:  # noqa: BLE001 - reported, like a peer that failed
        section.update(status="failed", reason=f"{type(exc).__name__}: {exc}",
                       summary=summarize(section["runs"]) if section["runs"] else None)
    finally:
        await peer.stop()
    return section
