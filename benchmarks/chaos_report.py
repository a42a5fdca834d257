"""The chaos run's report: the whole run, each fault's window and memory, by model; and its text.

The figures of record (what docs/benchmarks.md, "Chaos and soak", quotes for a soak) are under
``summary``.
"""

from __future__ import annotations

from typing import Any

from .chaos_load import Tally
from .chaos_memory import (MAX_SLOPE_MB_PER_H, MEMORY_EVERY_S, Trace, memory_lines,
                           memory_slopes, memory_verdict)
from .chaos_stats import (by_model, fault_windows, in_window, memory_growth, ms, process_growth,
                          role_memory, stats)
from .chaos_targets import FAULT_KINDS

VERDICT = "every_failure_503_or_429_with_retry_after"


def with_clients(log: list[dict[str, Any]], samples: list, wall_s: float) -> list[dict[str, Any]]:
    """The fault log with, on each fault, what clients saw by model in its window. Entries that
    undo a fault (restart-prometheus, resume-engine) open no window of their own."""
    faults = [e for e in log if e["kind"] in FAULT_KINDS]
    windows = fault_windows([e["t_s"] for e in faults], wall_s)
    seen = {id(e): {"window_s": [round(a, 1), round(b, 1)],
                    "clients": by_model(in_window(samples, a, b, last=i == len(faults) - 1))}
            for i, (e, (a, b)) in enumerate(zip(faults, windows))}
    return [{**e, **seen.get(id(e), {})} for e in log]


def build_report(opts: dict[str, Any], tally: Tally, wall_s: float, faults: list[dict],
                 mem_start: list[dict], mem_end: list[dict],
                 trace: Trace | None = None) -> dict[str, Any]:
    """``mem_start``/``mem_end``: one record per Serve actor process (Cluster.memory);
    ``trace``: such records through the run (chaos_memory), for the slopes."""
    samples = tally.samples
    outcomes = tally.outcomes
    succeeded = outcomes.get("ok", 0)
    failed = {k: v for k, v in sorted(outcomes.items()) if k != "ok"}
    overall, models = stats(samples), by_model(samples)
    first_fault = min((e["t_s"] for e in faults if e["kind"] in FAULT_KINDS), default=None)
    ok_lat = [s.latency_s for s in samples if s.outcome == "ok"]
    all_lat = [s.latency_s for s in samples]
    roles_start, roles_end = role_memory(mem_start), role_memory(mem_end)
    processes = process_growth(mem_start, mem_end)
    slopes = memory_slopes(trace or [], wall_s, opts.get("memory_every") or MEMORY_EVERY_S)
    verdict = memory_verdict(slopes, opts.get("max_slope") or MAX_SLOPE_MB_PER_H)
    return {
        "tool": "embedfleet.benchmarks.chaos", "options": opts, "wall_s": round(wall_s, 1),
        "summary": {
            "success_pct": overall["success_pct"],
            "success_pct_by_model": {m: s["success_pct"] for m, s in models.items()},
            "client_timeouts": overall["timeouts"],
            VERDICT: overall[VERDICT],
            "p50_ms": overall["p50_ms"], "p99_ms": overall["p99_ms"],
            "memory_growth_mb_by_process": {f"{g['role']}:{pid}": g["growth_mb"]
                                            for pid, g in processes["growth"].items()},
            "memory_slope_mb_per_h_by_process": {k: v["slope_mb_per_h"]
                                                 for k, v in slopes.items()},
            "memory_flat": verdict["flat"],
        },
        "requests": {"sent": tally.sent, "succeeded": succeeded,
                     "failed": sum(failed.values()), "failed_by_status": failed,
                     "success_ratio": round(succeeded / tally.sent, 5) if tally.sent else None,
                     "achieved_rps": round(tally.sent / wall_s, 1) if wall_s > 0 else None,
                     "timeouts": overall["timeouts"], VERDICT: overall[VERDICT],
                     "other_failures": overall["other_failures"], "by_model": models},
        "latency_ms": {"ok_p50": ms(ok_lat, 50), "ok_p99": ms(ok_lat, 99),
                       "all_p50": ms(all_lat, 50), "all_p99": ms(all_lat, 99),
                       "all_max": ms(all_lat, 100)},
        "before_faults": by_model(s for s in samples
                                  if first_fault is None or s.t_s < first_fault),
        "faults": with_clients(faults, samples, wall_s),
        "memory": {"start": roles_start, "end": roles_end,
                   "growth_mb": memory_growth(roles_start, roles_end),
                   "processes": processes, "slopes": slopes, "verdict": verdict,
                   "trace": [{"t_s": t, **{key: {f"{r['role']}:{r['pid']}": r[key]
                                                  for r in records}
                                            for key in ("tree_rss_mb", "rss_mb")}}
                             for t, records in trace or []]},
    }


def _seen(s: dict[str, Any]) -> str:
    """One model's figures in a line."""
    bad = f" other {s['other_failures']}" if s["other_failures"] else ""
    pct = "n/a" if s["success_pct"] is None else f"{s['success_pct']:.2f}%"
    return (f"{s['requests']} req {pct} ok {s['statuses']} timeouts {s['timeouts']}{bad} "
            f"p50 {s['p50_ms']} p99 {s['p99_ms']} ms")


def summary(report: dict[str, Any]) -> str:
    r, lat, mem, head = (report["requests"], report["latency_ms"], report["memory"],
                         report["summary"])
    ratio = "n/a" if r["success_ratio"] is None else f"{100 * r['success_ratio']:.2f}%"
    lines = [f"chaos run: {report['wall_s']}s, {r['sent']} requests ({r['achieved_rps']}/s)",
             f"  succeeded {r['succeeded']}  failed {r['failed']} {r['failed_by_status'] or ''}"
             f"  success {ratio}  client timeouts {r['timeouts']}",
             (f"  every failure a 503/429 with Retry-After: {'yes' if r[VERDICT] else 'NO'}"
              + (f" (others: {r['other_failures']})" if r["other_failures"] else "")),
             *(f"    {m}: {_seen(s)}" for m, s in r["by_model"].items()),
             (f"  latency ok p50 {lat['ok_p50']} ms  p99 {lat['ok_p99']} ms  "
              f"(all requests p99 {lat['all_p99']} ms, max {lat['all_max']} ms)"),
             f"  faults injected: {sum(f['kind'] in FAULT_KINDS for f in report['faults'])}"]
    for f in report["faults"]:
        lines.append(f"    t={f['t_s']:>6}s {f['kind']:<18} {'ok ' if f['ok'] else 'ERR'} "
                     f"{f.get('target') or f.get('error', '')}")
        lines += [f"        {m}: {_seen(s)}" for m, s in f.get("clients", {}).items()]
        if "burst" in f:
            lines += [f"        burst {m}: {_seen(s)}" for m, s in f["burst"].items()]
    lines.append("  memory (RSS of process trees, MB): role  xprocesses  start -> end  (growth)")
    for role, growth in mem["growth_mb"].items():
        a, b = mem["start"][role], mem["end"][role]
        lines.append(f"    {role:<28} x{a['processes']}->{b['processes']} {a['rss_mb']:>8} -> "
                     f"{b['rss_mb']:>8}  ({growth:+})")
    if head["memory_growth_mb_by_process"]:
        lines.append("  memory growth per process (own RSS, MB): "
                     + ", ".join(f"{k} {v:+}" for k, v in
                                 head["memory_growth_mb_by_process"].items()))
    lines += memory_lines(mem["slopes"], mem["verdict"])
    return "\n".join(lines)
