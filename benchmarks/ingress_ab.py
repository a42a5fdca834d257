"""Alternated A/B of ``router.http_ingress`` (Serve's Python proxy vs its HAProxy mode).

The setting lives in every Ray node's environment at ``ray start``, so one cluster cannot switch
it: each run starts the default local cluster with one setting (``embedfleet up --detach
--config``), sends online traffic (one short text per request, ``--concurrency`` in flight,
base64, as the bench's online workload) and stops it. The settings alternate, ``--repeats``
times each. Each run reports texts/s, p50 and CPU-seconds per 1,000 texts of every process on
the machine by title (the load driver, here ``python``, included), read from the process table
before and after the timed requests.

    python -m embedfleet.benchmarks.ingress_ab --repeats 5 --out benchmarks/results/ingress-ab.json

It stops any Ray cluster on this machine (``embedfleet down``), as ``embedfleet up`` would join it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from embedfleet.benchmarks.process_cpu import process_table

MODES = ("serve_proxy", "haproxy")
CLI = str(Path(sys.executable).with_name("embedfleet"))
WORDS = ("the quick brown fox jumps over a lazy dog while searching for vector index query "
         "results").split()


def ingress_config(mode: str, base: Path | None = None) -> dict[str, Any]:
    """The bundled local config (or ``base``) with ``router.http_ingress: mode``, validated."""
    from embedfleet.deployments.config import DEFAULT_CONFIG_PATH, parse_config

    data = yaml.safe_load((base or DEFAULT_CONFIG_PATH).read_text())
    data.setdefault("router", {})["http_ingress"] = mode
    parse_config(data, f"ingress_ab:{mode}")  # what `embedfleet up --config` loads must validate
    return data


def queries(n: int, seed: int = 1) -> list[str]:
    rnd = random.Random(seed)
    return [" ".join(rnd.choice(WORDS) for _ in range(rnd.randint(3, 20))) for _ in range(n)]


def cpu_by_title(before: dict, after: dict) -> Counter:
    """CPU-s per process title between two process tables (new processes count in full)."""
    out: Counter = Counter()
    for pid, p in after.items():
        b = before.get(pid)
        same = b is not None and abs(b.create_time - p.create_time) < 1
        out[p.title] += p.total_s - (b.total_s if same else 0.0)
    return out


async def online_run(url: str, model: str, texts: list[str], concurrency: int) -> dict[str, Any]:
    import httpx

    body = {"model": model, "encoding_format": "base64"}
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=concurrency + 2)) as client:
        for t in texts[:20]:  # warm-up: connections, the engine's first steps
            (await client.post("/v1/embeddings", json={**body, "input": [t]})).raise_for_status()
        todo, lat = list(texts), []

        async def worker() -> None:
            while todo:
                t, t0 = todo.pop(), time.perf_counter()
                r = await client.post("/v1/embeddings", json={**body, "input": [t]})
                r.raise_for_status()
                lat.append(time.perf_counter() - t0)

        before, t0 = process_table(), time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds, after = time.perf_counter() - t0, process_table()
    cpu = cpu_by_title(before, after)
    per_1k = 1000 / len(texts)
    return {"texts_per_s": round(len(texts) / seconds, 2),
            "p50_ms": round(statistics.median(lat) * 1000, 1),
            "cpu_s_per_1k": round(sum(cpu.values()) * per_1k, 2),
            "cpu_by_title_s_per_1k": {k: round(v * per_1k, 2) for k, v in cpu.most_common(12)}}


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per mode: the medians of texts/s, p50 and CPU over its runs."""
    out = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        if mine:
            out[mode] = {k: round(statistics.median(r[k] for r in mine), 2)
                         for k in ("texts_per_s", "p50_ms", "cpu_s_per_1k")} | {"runs": len(mine)}
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/ingress-ab.json"))
    args = p.parse_args(argv)
    runs: list[dict[str, Any]] = []
    texts = queries(args.requests)
    configs = {}  # written once per mode: every repeat of a mode starts the same cluster
    for mode in MODES:
        data = ingress_config(mode)
        configs[mode] = args.out.with_name(f"ingress-ab-{mode}.yaml")
        configs[mode].parent.mkdir(parents=True, exist_ok=True)
        configs[mode].write_text(yaml.safe_dump(data, sort_keys=False))
    model = data["models"][0]["name"]
    port = data["router"].get("port", 8000)  # the modes differ only in http_ingress
    for repeat in range(args.repeats):
        for mode in MODES:
            subprocess.run([CLI, "up", "--detach", "--config", str(configs[mode])], check=True,
                           stdout=subprocess.DEVNULL)
            try:
                time.sleep(10)  # let start-up's own work (canary, first scrapes) settle
                r = asyncio.run(online_run(f"http://127.0.0.1:{port}", model, texts,
                                           args.concurrency))
            finally:
                subprocess.run([CLI, "down"], check=False, stdout=subprocess.DEVNULL)
            runs.append({"mode": mode, "repeat": repeat, **r})
            print(json.dumps(runs[-1]), flush=True)
    report = {"command": sys.argv, "requests": args.requests, "concurrency": args.concurrency,
              "runs": runs, "summary": summarize(runs)}
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps(report["summary"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
