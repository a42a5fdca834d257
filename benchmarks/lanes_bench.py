"""Priority lanes under a bulk flood, against a running cluster:

    python -m embedfleet.benchmarks.lanes_bench --url http://127.0.0.1:8000 \\
        --model all-minilm-l6-v2 --repeats 5 --seconds 20
    embedfleet bench --peers vllm --workloads lanes     # the same, on a 2-replica cluster of its own

Three phases per repeat, their order rotated each repeat (the machine is noisy; peers are phases):
- ``idle``: interactive clients alone (one text per request): latency;
- ``bulk``: bulk clients alone (``--bulk-batch`` texts per request, lane ``bulk``): texts/s;
- ``mixed``: both at once: interactive latency and bulk texts/s.

The report gives the median over repeats of each figure and the ratios the design promises
(interactive p99 mixed / idle <= 2; bulk texts/s mixed / solo >= 0.5; no interactive refusal).
A bulk 429 is counted, never retried at once: bulk clients back off ``Retry-After`` as a corpus
job does. Each phase starts after a quiet pause longer than ``INTERACTIVE_RECENT_S``: a replica
caps bulk by time while queries came that recently, so a ``bulk`` phase right after a phase with
queries would start capped and not be bulk alone. Not part of ``make test`` (a timed figure
belongs to the bench).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from ..deployments.replica.admission import INTERACTIVE_RECENT_S

PHASES = ("idle", "bulk", "mixed")
GOALS = {"interactive_p99_ratio_max": 2.0, "bulk_throughput_ratio_min": 0.5}


@dataclass
class PhaseResult:
    phase: str
    seconds: float
    interactive_ms: list[float] = field(default_factory=list)
    interactive_refused: int = 0
    interactive_other: int = 0
    bulk_texts: int = 0
    bulk_429: int = 0
    bulk_other: int = 0

    def percentile(self, q: float) -> float | None:
        xs = sorted(self.interactive_ms)
        if not xs:
            return None
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    def summary(self) -> dict[str, Any]:
        return {"phase": self.phase, "interactive_requests": len(self.interactive_ms),
                "interactive_p50_ms": self.percentile(0.5),
                "interactive_p99_ms": self.percentile(0.99),
                "interactive_refused": self.interactive_refused,
                "interactive_other_failures": self.interactive_other,
                "bulk_texts_per_s": round(self.bulk_texts / self.seconds, 2),
                "bulk_429": self.bulk_429, "bulk_other_failures": self.bulk_other}


async def _phase(url: str, model: str, phase: str, seconds: float, interactive: int, bulk: int,
                 bulk_batch: int, bulk_lane: str = "bulk", encoding: str = "base64"
                 ) -> PhaseResult:
    res = PhaseResult(phase, seconds)
    stop = time.monotonic() + seconds
    texts = [f"corpus passage {i} on queues, lanes and the cards that serve them"
             for i in range(bulk_batch)]

    async def interactive_client(client: httpx.AsyncClient, k: int) -> None:
        i = 0
        while time.monotonic() < stop:
            t0 = time.perf_counter()
            r = await client.post("/v1/embeddings", json={
                "model": model, "input": f"query {k}-{i} where is the nearest station",
                "encoding_format": encoding})
            i += 1
            if r.status_code == 200:
                res.interactive_ms.append((time.perf_counter() - t0) * 1000)
            elif r.status_code in (429, 503):
                res.interactive_refused += 1
            else:
                res.interactive_other += 1

    async def bulk_client(client: httpx.AsyncClient) -> None:
        while time.monotonic() < stop:
            r = await client.post("/v1/embeddings", json={"model": model, "input": texts,
                                                          "lane": bulk_lane,
                                                          "encoding_format": encoding})
            if r.status_code == 200:
                if time.monotonic() <= stop:  # a call answered after the window is not counted
                    res.bulk_texts += len(texts)
            elif r.status_code == 429:
                res.bulk_429 += 1
                await asyncio.sleep(float(r.headers.get("retry-after", "1")))
            else:
                res.bulk_other += 1
                await asyncio.sleep(1)

    limits = httpx.Limits(max_connections=interactive + bulk + 4)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as client:
        tasks = []
        if phase in ("idle", "mixed"):
            tasks += [interactive_client(client, k) for k in range(interactive)]
        if phase in ("bulk", "mixed"):
            tasks += [bulk_client(client) for _ in range(bulk)]
        await asyncio.gather(*tasks)
    return res


def summarize(runs: list[list[PhaseResult]]) -> dict[str, Any]:
    """Medians over repeats, and the ratios of each repeat's mixed phase to its solo phases."""
    def med(phase: str, key: str) -> float | None:
        vals = [r.summary()[key] for rep in runs for r in rep if r.phase == phase]
        vals = [v for v in vals if v is not None]
        return round(statistics.median(vals), 2) if vals else None

    p99_ratios, bulk_ratios = [], []
    for rep in runs:
        by = {r.phase: r for r in rep}
        idle, mixed, solo = by["idle"].percentile(0.99), by["mixed"].percentile(0.99), by["bulk"]
        if idle and mixed:
            p99_ratios.append(mixed / idle)
        if solo.bulk_texts:
            bulk_ratios.append(by["mixed"].bulk_texts / solo.bulk_texts)
    out: dict[str, Any] = {p: {k: med(p, k) for k in (
        "interactive_p50_ms", "interactive_p99_ms", "bulk_texts_per_s", "bulk_429")}
        for p in PHASES}
    refused = sum(r.interactive_refused + r.interactive_other for rep in runs for r in rep)
    p99 = round(statistics.median(p99_ratios), 2) if p99_ratios else None
    bulk = round(statistics.median(bulk_ratios), 2) if bulk_ratios else None
    out["ratios"] = {"interactive_p99_mixed_over_idle": p99,
                     "bulk_texts_per_s_mixed_over_solo": bulk,
                     "interactive_refused_or_failed": refused}
    out["goals"] = {**GOALS, "met": {
        "interactive_p99": None if p99 is None else p99 <= GOALS["interactive_p99_ratio_max"],
        "bulk_throughput": None if bulk is None else bulk >= GOALS["bulk_throughput_ratio_min"],
        "no_interactive_refusal": refused == 0}}
    return out


async def run(args: argparse.Namespace) -> dict[str, Any]:
    runs: list[list[PhaseResult]] = []
    for rep in range(args.repeats):
        order = PHASES[rep % 3:] + PHASES[:rep % 3]
        results = []
        for phase in order:
            await asyncio.sleep(INTERACTIVE_RECENT_S + 1)
            r = await _phase(args.url, args.model, phase, args.seconds, args.interactive,
                             args.bulk, args.bulk_batch, args.bulk_lane, args.encoding_format)
            print(f"repeat {rep + 1}/{args.repeats} {phase}: {json.dumps(r.summary())}",
                  flush=True)
            results.append(r)
        runs.append(results)
    return {"tool": "lanes_bench", "options": vars(args), "summary": summarize(runs),
            "runs": [[{**asdict(r), "interactive_ms": None, **r.summary()} for r in rep]
                     for rep in runs]}


async def run_lanes(*, url: str, out: Path, cores: list[int], repeats: int, quick: bool,
                    progress: Any) -> dict[str, Any]:
    """The `lanes` section of `embedfleet bench`: a 2-replica cluster started for it when nothing
    answers at ``url`` (stopped afterwards), the three phases per repeat, their medians."""
    from .embedfleet_peer import EmbedfleetPeer, bench_config
    from ..deployments.config.schema import load_config

    cfg = bench_config(load_config(None), url, replicas=2)  # the shipped model on 2 cards
    model = cfg.models[0].name
    peer = EmbedfleetPeer(url, model, 10, cfg, out, cores)
    args = argparse.Namespace(url=url, model=model, repeats=repeats, seconds=5 if quick else 20,
                              interactive=2, bulk=8, bulk_batch=32, bulk_lane="bulk",
                              encoding_format="base64")
    section: dict[str, Any] = {"status": "ok", "options": vars(args)}
    try:
        progress.console.print("lanes: starting a 2-replica cluster (or using the one at the URL)")
        await peer.start()
        section["cluster"] = peer.describe()
        section.update(await run(args))
    except Exception as exc:  # noqa: BLE001 - reported, like a peer that failed
        section.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
    finally:
        await peer.stop()
    return section


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--model", required=True)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--seconds", type=float, default=20)
    p.add_argument("--interactive", type=int, default=2, help="interactive clients")
    p.add_argument("--bulk", type=int, default=8, help="bulk clients")
    p.add_argument("--bulk-batch", type=int, default=32, help="texts per bulk request")
    p.add_argument("--bulk-lane", choices=("bulk", "interactive"), default="bulk",
                   help="the lane the flood is sent on; interactive = the baseline without lanes")
    p.add_argument("--encoding-format", choices=("base64", "float"), default="base64",
                   help="what every client asks for; base64 is the OpenAI SDK's default "
                        "(benchmarks/results/lanes-2026-12-01*.json used float: JSON float "
                        "lists of the flood's vectors, encoded and decoded on the cores the "
                        "engines use)")
    p.add_argument("--out", type=Path, default=None, help="JSON report path")
    args = p.parse_args(argv)
    report = asyncio.run(run(args))
    print(json.dumps(report["summary"], indent=1))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
