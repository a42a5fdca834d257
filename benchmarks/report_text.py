"""What `embedfleet bench` prints at the end: the summary table, the CPU figures, the pair ratios,
the prefix-cache comparison and the goals, each read from the finished report
(``report.build_report``); the PNG chart is benchmarks/chart.py.
"""

from __future__ import annotations

import json
import math
from typing import Any

from .encodings_bench import encodings_lines
from .report import BASELINE, MIN_GOAL_REPEATS


def _fmt(x: float | None, spec: str = ",.1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _clip(text: str, width: int = 72) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def summary_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="embedfleet bench: median of repeats", show_lines=False)
    for col, just in (("workload", "left"), ("peer", "left"), ("texts/s", "right"),
                      ("tokens/s", "right"), ("p50 ms", "right"), ("p99 ms", "right"),
                      ("× vllm", "right"), ("CPU-s/1k", "right"), ("driver CPU-s/1k", "right"),
                      ("min cos", "right"), ("note", "left")):
        t.add_column(col, justify=just)
    checks = report["correctness"]
    skipped = {(s["workload"], s["peer"]): s["reason"] for s in report["skipped"]}
    for w in report["workloads"]:
        peers = list(report["peers"])
        for p in peers:
            s = report["summary"].get(w, {}).get(p)
            c = checks.get(w, {}).get(p, {})
            if s is None:
                reason = skipped.get((w, p)) or report["peers"][p].get("reason") or "no run"
                t.add_row(w, p, "-", "-", "-", "-", "-", "-", "-", "-",
                          _clip(f"skipped: {reason}"))
                continue
            cos = c.get("min_cosine")
            note = "" if c.get("ok") is not False else "[red]VECTORS DISAGREE[/red]"
            if w == "long" and p == "vllm":
                note = "pre-chunked client-side (engine-limit reference)"
            driver = ("in peer" if p == BASELINE and s.get("cpu_s_per_1k") is not None
                      else _fmt(s.get("driver_cpu_s_per_1k"), ".3f"))
            t.add_row(w, p, _fmt(s["texts_per_s"]), _fmt(s["tokens_per_s"], ",.0f"),
                      _fmt(s["p50_ms"]), _fmt(s["p99_ms"]), _fmt(s["ratio_to_vllm"], ".2f"),
                      _fmt(s.get("cpu_s_per_1k"), ".3f"), driver,
                      "ref" if p == BASELINE else _fmt(cos, ".5f"), note)
    return t


def goal_lines(goals: list[dict[str, Any]]) -> list[str]:
    """The issue's goals, one line each: value, target and met / NOT met (medians only)."""
    if not goals:
        return []
    lines = [f"goals (medians of alternating repeats; judged only with >= {MIN_GOAL_REPEATS}):"]
    for g in goals:
        unit = " ms" if g["metric"] == "p50_overhead_ms" else ""
        status = {"met": "met", "not met": "NOT met"}.get(g["status"], g["status"])
        value = "-" if g["value"] is None else f"{g['value']:.2f}{unit}"
        extra = f" ({g['reason']})" if g["reason"] and g["met"] is None else ""
        lines.append(f"  {g['goal']}: {value} (goal {g['op'].replace('>=', '≥').replace('<=', '≤')}"
                     f" {g['target']:g}{unit}; {g['repeats']} repeats): {status}{extra}")
    return lines


def cpu_lines(report: dict[str, Any]) -> list[str]:
    """Median CPU-s per 1,000 texts per workload and peer, the driver's share where separate."""
    lines = []
    for w, per_peer in report["summary"].items():
        parts = []
        for p, s in per_peer.items():
            if s.get("cpu_s_per_1k") is None:
                continue
            drv = s.get("driver_cpu_s_per_1k")
            parts.append(f"{p} {s['cpu_s_per_1k']:.3f}"
                         + (f" (+ driver {drv:.3f})" if drv is not None else ""))
        if parts:
            lines.append(f"  {w}: " + ", ".join(parts))
    if lines:
        lines.insert(0, "CPU-s per 1,000 texts (median; the peer's whole process tree, the load "
                        "driver in this process separately; vllm includes it):")
        cal = (report.get("cpu_accounting") or {}).get("in_process_driver")
        if cal:
            lines.append("  (inside vllm's figure: the load driver alone, measured on a no-op "
                         f"peer, costs {cal['cpu_s_per_1k_requests']:.3f} CPU-s per 1,000 "
                         "requests)")
    return lines


def closing_lines(report: dict[str, Any]) -> list[str]:
    lines = cpu_lines(report)
    for name, per_w in report["ratios"].items():
        if all(v is None for v in per_w.values()):
            lines.append(f"{name}: n/a (not both peers ran)")
            continue
        vals = ", ".join(f"{w} {_fmt(v, '.2f')}" for w, v in per_w.items())
        lines.append(f"{name} (texts/s): {vals}")
    pc = report.get("prefix_cache")
    if pc and pc.get("summary"):
        s = pc["summary"]
        lines.append(
            f"prefix-cache ({pc['model']}, {pc['workload_params'].get('prefix_tokens')}-token "
            f"shared prefix): on {_fmt(s['on']['texts_per_s'])} vs off "
            f"{_fmt(s['off']['texts_per_s'])} texts/s = ×{_fmt(s.get('on_over_off'), '.2f')} "
            f"(issue goal ≥ 3×: {'met' if (s.get('on_over_off') or 0) >= 3 else 'NOT met'}); "
            f"cached share of prompt tokens {_fmt(s['on'].get('cached_share'), '.1%')}")
        lines.append(
            "  the engine's own numbers, on / off: tokens computed per run "
            f"{_fmt(s['on'].get('computed_tokens'), ',.0f')} / "
            f"{_fmt(s['off'].get('computed_tokens'), ',.0f')}; per sequence: prefill "
            f"{_fmt(s['on'].get('prefill_ms_per_seq'), '.1f')} / "
            f"{_fmt(s['off'].get('prefill_ms_per_seq'), '.1f')} ms, queue "
            f"{_fmt(s['on'].get('queue_ms_per_seq'), '.1f')} / "
            f"{_fmt(s['off'].get('queue_ms_per_seq'), '.1f')} ms, end-to-end "
            f"{_fmt(s['on'].get('e2e_ms_per_seq'), '.1f')} / "
            f"{_fmt(s['off'].get('e2e_ms_per_seq'), '.1f')} ms")
    elif pc:
        lines.append(f"prefix-cache: {pc.get('status')}: {pc.get('reason')}")
    lines += affinity_lines(report.get("prefix_affinity"))
    lines += lanes_lines(report.get("lanes"))
    lines += encodings_lines(report.get("encodings"))
    lines += rerank_lines(report.get("rerank"))
    lines += goal_lines(report.get("goals") or [])
    lines.append("result: OK" if report["ok"]
                 else f"result: PROBLEMS {json.dumps(report['problems'])}")
    return lines


def affinity_lines(pa: dict[str, Any] | None) -> list[str]:
    """The prefix-affinity comparison (benchmarks/affinity_bench.py), medians of its repeats."""
    if not pa:
        return []
    s = pa.get("summary")
    if not s:
        return [f"prefix-affinity: {pa.get('status')}: {pa.get('reason')}"]
    a, d = s["affinity"], s["default"]
    goals = "; ".join(f"{k} {_fmt(g['value'], '.2f')} (goal {g['goal']}: "
                      f"{'met' if g['met'] else 'NOT met'})" for k, g in s["goals"].items())
    return [f"prefix-affinity ({a['repeats']} repeats, {pa['status']}): affinity "
            f"{_fmt(a['texts_per_s'])} vs default {_fmt(d['texts_per_s'])} texts/s; cached "
            f"share {_fmt(a['cached_ratio'], '.1%')} vs {_fmt(d['cached_ratio'], '.1%')}; "
            f"load max/mean {_fmt(a['max_load_over_mean'], '.2f')} vs "
            f"{_fmt(d['max_load_over_mean'], '.2f')}; CPU-s per 1k texts "
            f"{_fmt(a['cpu_s_per_1k'], '.1f')} vs {_fmt(d['cpu_s_per_1k'], '.1f')}",
            f"  {goals}"]


def lanes_lines(lanes: dict[str, Any] | None) -> list[str]:
    """Priority lanes under a bulk flood (benchmarks/lanes_bench.py), medians of its repeats."""
    if not lanes:
        return []
    s = lanes.get("summary")
    if not s:
        return [f"lanes: {lanes.get('status')}: {lanes.get('reason')}"]
    r, met = s["ratios"], s["goals"]["met"]
    return [f"lanes ({lanes['options']['repeats']} repeats): interactive p99 idle "
            f"{_fmt(s['idle']['interactive_p99_ms'], '.0f')} ms, under the bulk flood "
            f"{_fmt(s['mixed']['interactive_p99_ms'], '.0f')} ms = x"
            f"{_fmt(r['interactive_p99_mixed_over_idle'], '.2f')} (goal <= 2: "
            f"{'met' if met['interactive_p99'] else 'NOT met'}); bulk texts/s mixed / solo "
            f"{_fmt(r['bulk_texts_per_s_mixed_over_solo'], '.2f')} (goal >= 0.5: "
            f"{'met' if met['bulk_throughput'] else 'NOT met'}); interactive refused or failed: "
            f"{r['interactive_refused_or_failed']}"]


def rerank_lines(rr: dict[str, Any] | None) -> list[str]:
    """The rerank workload (benchmarks/rerank_bench.py): pairs/s and CPU per 1,000 pairs."""
    if not rr:
        return []
    if rr.get("status") != "ok":
        return [f"rerank: {rr.get('status')}: {rr.get('reason')}"]
    per_peer = "; ".join(
        f"{p} {_fmt(s['pairs_per_s'])} pairs/s, CPU {_fmt(s['cpu_s_per_1k_pairs'], '.3f')} s "
        f"per 1k pairs" for p, s in rr["summary"].items())
    agree = ", ".join(f"{p} {_fmt(c['max_abs_delta'], '.1e')}"
                      for p, c in rr["correctness"]["peers"].items())
    return [f"rerank ({rr['model']}, medians): {per_peer or 'no successful run'}",
            f"  scores vs {rr['correctness']['reference']}, max |Δ| (≤ "
            f"{rr['correctness']['max_abs_delta']:g}): {agree or 'not compared'}"]
