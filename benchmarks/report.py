"""Numbers of `embedfleet bench`: per-run records, the summary (medians of repeats and ratios), the
issue's goals, the correctness check and the JSON report. What it prints from them is
benchmarks/report_text.py; the PNG chart is benchmarks/chart.py.

Pure functions of the runs, so tests/test_bench_unit.py can check the math and the schema without
an engine.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

SCHEMA = "embedfleet-bench/1"
BASELINE = "vllm"
PAIR_RATIOS = (("embedfleet", "vllm-serve"), ("embedfleet", "infinity"))
MIN_COSINE = 0.999  # vectors of one text from two peers must agree at least this well

# The report's shape, one place: tests check build_report's output against it.
REPORT_KEYS = ("schema", "command", "started_at", "finished_at", "machine", "settings",
               "workloads", "peers", "runs", "skipped", "correctness", "summary", "ratios",
               "goals", "cpu_accounting", "prefix_cache", "prefix_affinity", "lanes", "ok",
               "problems", "encodings", "rerank")
RUN_KEYS = ("repeat", "workload", "peer", "texts", "tokens", "requests", "seconds",
            "texts_per_s", "tokens_per_s", "p50_ms", "p99_ms", "latencies_ms", "cpu_s",
            "cpu_s_per_1k", "driver_cpu_s_per_1k", "cpu", "error")
SUMMARY_KEYS = ("repeats", "texts_per_s", "tokens_per_s", "p50_ms", "p99_ms", "ratio_to_vllm",
                "texts_per_s_runs", "p50_minus_vllm_ms", "cpu_s_per_1k", "cpu_s_per_1k_runs",
                "cpu_ratio_to_vllm", "driver_cpu_s_per_1k", "cpu_by_group_s_per_1k",
                "machine_other_cpu_s_per_1k")
GOAL_KEYS = ("goal", "workload", "peer", "reference", "metric", "op", "target", "value",
             "repeats", "status", "met", "reason")
MIN_GOAL_REPEATS = 5  # a goal is judged on medians of at least this many alternating repeats


@dataclass(frozen=True)
class Goal:
    """One figure the issue names, judged on the summary's medians."""

    name: str
    workload: str
    metric: str  # "texts_per_s_ratio": peer / reference; "p50_overhead_ms": peer - reference
    op: str  # ">=" or "<="
    target: float
    texts_per_request: int  # for the rerank workload: (query, document) pairs per request
    concurrency: int | None = None  # None: whatever --concurrency the run used
    peer: str = "embedfleet"
    reference: str = BASELINE


# Targets: issue 13's (online >= 1.1x `vllm serve` and >= 0.6x bare vLLM; 32 texts per request
# >= 0.95x bare vLLM; router overhead <= 3 ms) and issue 42's (rerank, a query + 32 documents a
# request, >= 1.1x `vllm serve` in pairs/s: its runs count pairs as texts). One place to change them.
GOALS = (
    Goal("online: embedfleet / vllm serve, texts/s", "online", "texts_per_s_ratio", ">=", 1.1,
         texts_per_request=1, concurrency=16, reference="vllm-serve"),
    Goal("online: embedfleet / bare vLLM, texts/s", "online", "texts_per_s_ratio", ">=", 0.6,
         texts_per_request=1, concurrency=16),
    Goal("short, 32 texts/request: embedfleet / bare vLLM, texts/s", "short",
         "texts_per_s_ratio", ">=", 0.95, texts_per_request=32),
    Goal("router overhead: p50 embedfleet - bare vLLM, 1 text, 1 in flight (ms)",
         "router-overhead", "p50_overhead_ms", "<=", 3.0, texts_per_request=1, concurrency=1),
    Goal("rerank, query + 32 documents/request: embedfleet / vllm serve, pairs/s", "rerank",
         "texts_per_s_ratio", ">=", 1.1, texts_per_request=32, reference="vllm-serve"),
)


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) - the same rule as benchmarks/throughput.py."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def per_1k(cpu_s: float | None, texts: int) -> float | None:
    return round(1000 * cpu_s / texts, 4) if cpu_s is not None and texts else None


def cpu_section(reading: dict[str, Any] | None) -> dict[str, Any] | None:
    """A run's CPU reading (``process_cpu.CpuMeter.stop()``) as the record's ``cpu`` field:
    the peer's processes, the load driver's (None when the driver runs inside the peer's
    processes: the in-process ``vllm`` peer) and what the rest of the machine used meanwhile."""
    if reading is None:
        return None
    scopes = reading["scopes"]
    peer, driver = scopes["peer"], scopes.get("driver")
    other = reading["machine_busy_cpu_s"] - peer["cpu_s"] - (driver["cpu_s"] if driver else 0)
    # No process found (a cluster that could not be located): unmeasured, never 0 CPU.
    return {"measured": peer["processes"] > 0, "peer": peer, "driver": driver,
            "driver_in_peer": driver is None,
            "machine_busy_cpu_s": reading["machine_busy_cpu_s"],
            "machine_other_cpu_s": round(other, 3), "machine_cores": reading["machine_cores"],
            "wall_s": reading["wall_s"]}


def run_record(*, repeat: int, workload: str, peer: str, latencies: list[float], seconds: float,
               texts: int, tokens: int, error: str | None = None,
               cpu: dict[str, Any] | None = None) -> dict[str, Any]:
    """One timed pass of one peer over one workload. ``tokens`` is the workload's token count
    from the model's tokenizer (the same for every peer), not what the peer reports. ``cpu``:
    the run's ``CpuMeter`` reading (scopes ``peer`` and, for peers outside this process,
    ``driver``), or None when CPU was not measured."""
    ok = error is None and seconds > 0 and latencies
    c = cpu_section(cpu) if ok else None
    cpu_s = c["peer"]["cpu_s"] if c and c["measured"] else None
    return {
        "repeat": repeat, "workload": workload, "peer": peer, "texts": texts, "tokens": tokens,
        "requests": len(latencies), "seconds": round(seconds, 4),
        "texts_per_s": round(texts / seconds, 3) if ok else None,
        "tokens_per_s": round(tokens / seconds, 1) if ok else None,
        "p50_ms": round(1000 * percentile(latencies, 0.50), 2) if ok else None,
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2) if ok else None,
        "latencies_ms": [round(1000 * x, 2) for x in latencies],
        "cpu_s": cpu_s,
        "cpu_s_per_1k": per_1k(cpu_s, texts),
        "driver_cpu_s_per_1k": per_1k(c["driver"]["cpu_s"], texts) if c and c["driver"]
        else None,
        "cpu": c,
        "error": error,
    }


def _median(xs: list[float | None], digits: int = 3) -> float | None:
    xs = [x for x in xs if x is not None]
    return round(statistics.median(xs), digits) if xs else None


def _group_medians(rs: list[dict[str, Any]]) -> dict[str, float] | None:
    """Median CPU-s per 1k texts of each process group (a group missing from a run counts 0)."""
    with_cpu = [r for r in rs if r.get("cpu") and r["cpu"]["measured"]]
    if not with_cpu:
        return None
    groups = {g for r in with_cpu for g in r["cpu"]["peer"]["by_group"]}
    med = {g: _median([per_1k(r["cpu"]["peer"]["by_group"].get(g, 0.0), r["texts"])
                       for r in with_cpu], 4) for g in groups}
    return dict(sorted(med.items(), key=lambda kv: -(kv[1] or 0)))


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{workload: {peer: medians over the successful repeats, and the ratios to ``vllm``}}:
    texts/s, tokens/s, p50/p99, CPU-s per 1k texts (the peer's processes; the load driver's
    separately where it is not inside them; per process group; the rest of the machine)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for r in runs:
        if r["error"] is None:
            per_peer = out.setdefault(r["workload"], {})
            per_peer.setdefault(r["peer"], {"_runs": []})["_runs"].append(r)
    for per_peer in out.values():
        for s in per_peer.values():
            rs = s.pop("_runs")
            s.update({
                "repeats": len(rs),
                "texts_per_s": _median([r["texts_per_s"] for r in rs]),
                "tokens_per_s": _median([r["tokens_per_s"] for r in rs], 1),
                "p50_ms": _median([r["p50_ms"] for r in rs], 2),
                "p99_ms": _median([r["p99_ms"] for r in rs], 2),
                "texts_per_s_runs": [r["texts_per_s"] for r in rs],
                "cpu_s_per_1k": _median([r.get("cpu_s_per_1k") for r in rs], 4),
                "cpu_s_per_1k_runs": [r.get("cpu_s_per_1k") for r in rs],
                "driver_cpu_s_per_1k": _median([r.get("driver_cpu_s_per_1k") for r in rs], 4),
                "cpu_by_group_s_per_1k": _group_medians(rs),
                "machine_other_cpu_s_per_1k": _median(
                    [per_1k(r["cpu"]["machine_other_cpu_s"], r["texts"])
                     for r in rs if r.get("cpu") and r["cpu"]["measured"]], 4),
            })
        base = per_peer.get(BASELINE, {})
        for s in per_peer.values():
            s["ratio_to_vllm"] = ratio(s["texts_per_s"], base.get("texts_per_s"))
            s["cpu_ratio_to_vllm"] = ratio(s["cpu_s_per_1k"], base.get("cpu_s_per_1k"))
            s["p50_minus_vllm_ms"] = (round(s["p50_ms"] - base["p50_ms"], 2)
                                      if s["p50_ms"] is not None
                                      and base.get("p50_ms") is not None else None)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def pair_ratios(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """{"embedfleet/vllm-serve": {workload: texts/s ratio}, ...}; None where a side is missing."""
    return {f"{a}/{b}": {w: ratio(p.get(a, {}).get("texts_per_s"),
                                  p.get(b, {}).get("texts_per_s"))
                         for w, p in summary.items()}
            for a, b in PAIR_RATIOS}


def evaluate_goals(summary: dict[str, dict[str, dict[str, Any]]],
                   workloads: dict[str, dict[str, Any]], goals: tuple[Goal, ...] = GOALS,
                   min_repeats: int = MIN_GOAL_REPEATS) -> list[dict[str, Any]]:
    """Each goal's value from the summary's medians, and its status: ``met``, ``not met``,
    ``needs >= 5 repeats`` (fewer successful repeats of either peer: never called met), or
    ``not measured`` (a peer or the workload did not run, or ran with another shape)."""
    out = []
    for g in goals:
        row: dict[str, Any] = {"goal": g.name, "workload": g.workload, "peer": g.peer,
                               "reference": g.reference, "metric": g.metric, "op": g.op,
                               "target": g.target, "value": None, "repeats": 0,
                               "status": "not measured", "met": None, "reason": None}
        out.append(row)
        info = workloads.get(g.workload)
        a = summary.get(g.workload, {}).get(g.peer)
        b = summary.get(g.workload, {}).get(g.reference)
        if info is None:
            row["reason"] = f"workload {g.workload} did not run"
            continue
        shape = (info.get("texts_per_request"), info.get("concurrency"))
        want = (g.texts_per_request, g.concurrency if g.concurrency is not None else shape[1])
        if shape != want:
            row["reason"] = (f"{g.workload} ran with {shape[0]} texts per request, {shape[1]} in "
                             f"flight; the goal is for {want[0]} and {want[1]}")
            continue
        if not a or not b:
            row["reason"] = f"needs successful runs of both {g.peer} and {g.reference}"
            continue
        if g.metric == "texts_per_s_ratio":
            value = ratio(a["texts_per_s"], b["texts_per_s"])
        else:
            value = (round(a["p50_ms"] - b["p50_ms"], 2)
                     if a["p50_ms"] is not None and b["p50_ms"] is not None else None)
        row["value"], row["repeats"] = value, min(a["repeats"], b["repeats"])
        if value is None:
            row["reason"] = "no value (a median is missing)"
        elif row["repeats"] < min_repeats:
            row["status"] = f"needs >= {min_repeats} repeats"
            row["reason"] = (f"medians of {row['repeats']} repeat(s); a goal is judged on "
                             f">= {min_repeats}")
        else:
            row["met"] = value >= g.target if g.op == ">=" else value <= g.target
            row["status"] = "met" if row["met"] else "not met"
    return out


def min_cosine(reference: list[np.ndarray], other: list[np.ndarray]) -> float:
    """Smallest cosine similarity between matching vectors of two peers."""
    if len(reference) != len(other) or not reference:
        raise ValueError(f"need matching non-empty vector lists, got {len(reference)} and "
                         f"{len(other)}")
    cos = []
    for a, b in zip(reference, other):
        a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
        if a.shape != b.shape:
            return float("-inf")  # different sizes cannot be the same embedding
        cos.append(float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b))))
    return min(cos)


def correctness(probes: dict[str, dict[str, list[np.ndarray]]], reference: str = BASELINE
                ) -> dict[str, dict[str, dict[str, Any]]]:
    """{workload: {peer: {min_cosine, texts, ok}}} against ``reference``'s vectors of the same
    probe texts. Workloads without reference vectors are reported as not checked."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for workload, per_peer in probes.items():
        ref = per_peer.get(reference)
        for peer, vecs in per_peer.items():
            if isinstance(vecs, str):  # the probe request itself failed
                out.setdefault(workload, {})[peer] = {"min_cosine": None, "texts": 0,
                                                      "ok": False, "note": vecs}
                continue
            if ref is None or isinstance(ref, str):
                out.setdefault(workload, {})[peer] = {
                    "min_cosine": None, "texts": len(vecs), "ok": None,
                    "note": f"no {reference} vectors to compare with"}
                continue
            # The reference is compared with itself too: 1.0 unless its vectors are degenerate
            # (NaN, zero), which would make every other comparison meaningless.
            c = min_cosine(ref, vecs)
            out.setdefault(workload, {})[peer] = {"min_cosine": round(c, 6), "texts": len(vecs),
                                                  "ok": c >= MIN_COSINE,
                                                  **({"reference": True} if peer == reference
                                                     else {})}
    return out


def build_report(*, command: list[str], started_at: str, finished_at: str,
                 machine: dict[str, Any], settings: dict[str, Any],
                 workloads: dict[str, Any], peers: dict[str, Any], runs: list[dict[str, Any]],
                 skipped: list[dict[str, Any]], probes: dict[str, dict[str, list[np.ndarray]]],
                 prefix_cache: dict[str, Any] | None,
                 cpu_accounting: dict[str, Any] | None = None,
                 prefix_affinity: dict[str, Any] | None = None,
                 lanes: dict[str, Any] | None = None,
                 encodings: dict[str, Any] | None = None,
                 rerank: dict[str, Any] | None = None) -> dict[str, Any]:
    summary = summarize(runs)
    checks = correctness(probes)
    failed_peers = [n for n, p in peers.items() if p.get("status") == "failed"]
    disagree = [f"{w}/{p}" for w, pp in checks.items() for p, c in pp.items() if c["ok"] is False]
    run_errors = [f"{r['workload']}/{r['peer']}#{r['repeat']}" for r in runs if r["error"]]
    pc_bad = bool(prefix_cache and prefix_cache.get("correctness", {}).get("ok") is False)
    pa_failed = bool(prefix_affinity and prefix_affinity["status"] == "failed")
    lanes_failed = bool(lanes and lanes["status"] == "failed")
    rerank_bad = bool(rerank and (rerank["status"] == "failed" or any(
        c["ok"] is False for c in rerank["correctness"]["peers"].values()) or any(
        p.get("status") == "failed" for p in rerank["peers"].values())))
    report = {
        "schema": SCHEMA, "command": command, "started_at": started_at,
        "finished_at": finished_at, "machine": machine, "settings": settings,
        "workloads": workloads, "peers": peers, "runs": runs, "skipped": skipped,
        "correctness": checks, "summary": summary, "ratios": pair_ratios(summary),
        "goals": evaluate_goals(summary, workloads),
        "cpu_accounting": cpu_accounting,
        "prefix_cache": prefix_cache,
        "prefix_affinity": prefix_affinity,
        "lanes": lanes,
        "encodings": encodings,  # bytes per vector of each encoding (encodings_bench.py)
        "rerank": rerank,  # the rerank phase's peers and score agreement (rerank_bench.py)
        "ok": not (failed_peers or disagree or run_errors or pc_bad or pa_failed or lanes_failed
                   or rerank_bad),
        "problems": {"failed_peers": failed_peers, "disagreeing": disagree,
                     "run_errors": run_errors, "prefix_cache_disagrees": pc_bad,
                     "prefix_affinity_failed": pa_failed, "lanes_failed": lanes_failed,
                     "rerank_failed_or_disagrees": rerank_bad},
    }
    return report


def check_schema(report: dict[str, Any]) -> list[str]:
    """What is missing from ``report`` (empty = it has the documented shape)."""
    problems = [f"missing top-level key {k!r}" for k in REPORT_KEYS if k not in report]
    for i, r in enumerate(report.get("runs", [])):
        problems += [f"runs[{i}] lacks {k!r}" for k in RUN_KEYS if k not in r]
    for w, per_peer in report.get("summary", {}).items():
        for p, s in per_peer.items():
            problems += [f"summary[{w}][{p}] lacks {k!r}" for k in SUMMARY_KEYS if k not in s]
    for i, g in enumerate(report.get("goals") or []):
        problems += [f"goals[{i}] lacks {k!r}" for k in GOAL_KEYS if k not in g]
    return problems


def write_json(report: dict[str, Any], path: Path) -> Path:
    def default(o: Any) -> Any:
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, Path):
            return str(o)
        raise TypeError(f"not JSON serialisable: {type(o).__name__}")

    path.write_text(json.dumps(report, indent=2, default=default, allow_nan=False) + "\n")
    return path
