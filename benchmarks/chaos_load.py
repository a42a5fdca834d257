"""The load of the chaos tool: seeded mixed requests, sent closed- or open-loop, tallied, and the
run's report (requests by outcome, latency percentiles, faults, memory growth).
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable

from embedfleet.benchmarks.throughput import WORDS

# Hard ceilings: a mistyped flag must not turn a test into an unbounded flood.
MAX_DURATION_S = 3600
MAX_REQUESTS = 1_000_000
MAX_CONCURRENCY = 256
MAX_RPS = 1000


# -- pure parts (unit-tested in tests/test_chaos_tool.py) ----------------------------------------
def percentile(values: Iterable[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    data = sorted(values)
    if not data:
        return None
    rank = max(1, math.ceil(q / 100 * len(data)))
    return data[min(rank, len(data)) - 1]


def classify(status: int, body: Any, n_inputs: int) -> str:
    """'ok' only for a 200 holding one vector per input; otherwise the status (or bad_200)."""
    if status == 200:
        data = body.get("data") if isinstance(body, dict) else None
        return "ok" if isinstance(data, list) and len(data) == n_inputs else "bad_200"
    return str(status)


def mixed_request(rng: random.Random, models: list[str]) -> tuple[dict[str, Any], int]:
    """A request body and its input count: one text, a batch of 2-16 texts, or token ids."""
    model = rng.choice(models)

    def text() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))

    shape = rng.random()
    if shape < 0.5:
        return {"model": model, "input": text()}, 1
    if shape < 0.85:
        n = rng.randint(2, 16)
        return {"model": model, "input": [text() for _ in range(n)]}, n
    # ids inside every served vocabulary (MiniLM's 30522 is the smallest here)
    return {"model": model, "input": [rng.randint(1000, 29999) for _ in range(rng.randint(4, 64))],
            "encoding_format": "base64"}, 1


@dataclass
class Tally:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)
    ok_latencies: list[float] = field(default_factory=list)
    all_latencies: list[float] = field(default_factory=list)
    # outcomes per model: a single-replica model's 503s while its engine is replaced are expected;
    # a two-replica model's are not
    by_model: dict[str, Counter] = field(default_factory=dict)

    def record(self, outcome: str, latency_s: float, model: str = "_all") -> None:
        self.outcomes[outcome] += 1
        self.by_model.setdefault(model, Counter())[outcome] += 1
        self.all_latencies.append(latency_s)
        if outcome == "ok":
            self.ok_latencies.append(latency_s)


# -- sending it ------------------------------------------------------------------------------
async def run_load(opts: dict[str, Any], models: list[str], tally: Tally,
                   deadline: float) -> None:
    import httpx

    rng = random.Random(opts["seed"])
    cap = opts["concurrency"] or min(MAX_CONCURRENCY, max(8, int(4 * opts["rps"])))
    limits = httpx.Limits(max_connections=cap, max_keepalive_connections=cap)
    async with httpx.AsyncClient(base_url=opts["url"], timeout=opts["request_timeout_s"],
                                 limits=limits) as client:

        async def one() -> None:  # the caller has counted it as sent
            body, n = mixed_request(rng, models)
            t = time.perf_counter()
            try:
                resp = await client.post("/v1/embeddings", json=body)
                try:
                    payload = resp.json()
                except ValueError:
                    payload = None
                outcome = classify(resp.status_code, payload, n)
            except httpx.TimeoutException:
                outcome = "timeout"
            except httpx.TransportError:
                outcome = "connection_error"
            tally.record(outcome, time.perf_counter() - t, body.get("model", "_all"))

        def more() -> bool:
            return time.monotonic() < deadline and tally.sent < opts["max_requests"]

        if opts["concurrency"]:  # closed loop: N workers, each sends when its last one returns
            async def worker() -> None:
                while more():
                    tally.sent += 1
                    await one()
            await asyncio.gather(*(worker() for _ in range(opts["concurrency"])))
            return
        # Open loop at a fixed rate. The in-flight cap keeps a stalled cluster from piling up
        # unbounded client-side work; the report shows the rate actually achieved.
        gate, tasks, start = asyncio.Semaphore(cap), set(), time.monotonic()

        async def gated() -> None:
            try:
                await one()
            finally:
                gate.release()
        while more():
            await asyncio.sleep(max(0.0, start + tally.sent / opts["rps"] - time.monotonic()))
            await gate.acquire()
            if not more():
                gate.release()
                break
            tally.sent += 1
            task = asyncio.create_task(gated())
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        await asyncio.gather(*tasks)


# -- the report ------------------------------------------------------------------------------
def memory_growth(start: dict[str, dict], end: dict[str, dict]) -> dict[str, float]:
    return {role: round(end[role]["rss_mb"] - start[role]["rss_mb"], 1)
            for role in sorted(set(start) & set(end))}


def build_report(opts: dict[str, Any], tally: Tally, wall_s: float, faults: list[dict],
                 mem_start: dict, mem_end: dict) -> dict[str, Any]:
    succeeded = tally.outcomes.get("ok", 0)
    failed = {k: v for k, v in sorted(tally.outcomes.items()) if k != "ok"}

    def ms(values: list[float], q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else round(1000 * v, 1)

    return {
        "tool": "embedfleet.benchmarks.chaos", "options": opts, "wall_s": round(wall_s, 1),
        "requests": {"sent": tally.sent, "succeeded": succeeded,
                     "failed": sum(failed.values()), "failed_by_status": failed,
                     "success_ratio": round(succeeded / tally.sent, 5) if tally.sent else None,
                     "achieved_rps": round(tally.sent / wall_s, 1) if wall_s > 0 else None,
                     "by_model": {m: dict(sorted(c.items())) for m, c in
                                  sorted(tally.by_model.items())}},
        "latency_ms": {"ok_p50": ms(tally.ok_latencies, 50), "ok_p99": ms(tally.ok_latencies, 99),
                       "all_p50": ms(tally.all_latencies, 50),
                       "all_p99": ms(tally.all_latencies, 99),
                       "all_max": ms(tally.all_latencies, 100)},
        "faults": faults,
        "memory": {"start": mem_start, "end": mem_end,
                   "growth_mb": memory_growth(mem_start, mem_end)},
    }


def summary(report: dict[str, Any]) -> str:
    r, lat, mem = report["requests"], report["latency_ms"], report["memory"]
    ratio = "n/a" if r["success_ratio"] is None else f"{100 * r['success_ratio']:.2f}%"
    lines = [f"chaos run: {report['wall_s']}s, {r['sent']} requests ({r['achieved_rps']}/s)",
             f"  succeeded {r['succeeded']}  failed {r['failed']} {r['failed_by_status'] or ''}"
             f"  success {ratio}",
             *(f"    {m}: {dict(c)}" for m, c in r.get("by_model", {}).items()),
             f"  latency ok p50 {lat['ok_p50']} ms  p99 {lat['ok_p99']} ms  "
             f"(all requests p99 {lat['all_p99']} ms, max {lat['all_max']} ms)",
             f"  faults injected: {len(report['faults'])}"]
    lines += [f"    t={f['t_s']:>6}s {f['kind']:<16} {'ok ' if f['ok'] else 'ERR'} "
              f"{f.get('target') or f.get('error', '')}" for f in report["faults"]]
    lines.append("  memory (RSS of process trees, MB): role  xprocesses  start -> end  (growth)")
    for role, growth in mem["growth_mb"].items():
        a, b = mem["start"][role], mem["end"][role]
        lines.append(f"    {role:<28} x{a['processes']}->{b['processes']} {a['rss_mb']:>8} -> "
                     f"{b['rss_mb']:>8}  ({growth:+})")
    return "\n".join(lines)
