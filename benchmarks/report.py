"""Numbers and output of `embedfleet bench`: per-run records, the summary (medians of repeats and
ratios), the correctness check, the JSON report, the PNG chart and the closing table.

Pure functions of the runs, so tests/test_bench_unit.py can check the math and the schema without
an engine.
"""

from __future__ import annotations

import json
import math
import statistics
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
               "prefix_cache", "ok", "problems")
RUN_KEYS = ("repeat", "workload", "peer", "texts", "tokens", "requests", "seconds",
            "texts_per_s", "tokens_per_s", "p50_ms", "p99_ms", "latencies_ms", "error")
SUMMARY_KEYS = ("repeats", "texts_per_s", "tokens_per_s", "p50_ms", "p99_ms", "ratio_to_vllm",
                "texts_per_s_runs")


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) - the same rule as benchmarks/throughput.py."""
    if not values:
        raise ValueError("percentile of no values")
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_record(*, repeat: int, workload: str, peer: str, latencies: list[float], seconds: float,
               texts: int, tokens: int, error: str | None = None) -> dict[str, Any]:
    """One timed pass of one peer over one workload. ``tokens`` is the workload's token count
    from the model's tokenizer (the same for every peer), not what the peer reports."""
    ok = error is None and seconds > 0 and latencies
    return {
        "repeat": repeat, "workload": workload, "peer": peer, "texts": texts, "tokens": tokens,
        "requests": len(latencies), "seconds": round(seconds, 4),
        "texts_per_s": round(texts / seconds, 3) if ok else None,
        "tokens_per_s": round(tokens / seconds, 1) if ok else None,
        "p50_ms": round(1000 * percentile(latencies, 0.50), 2) if ok else None,
        "p99_ms": round(1000 * percentile(latencies, 0.99), 2) if ok else None,
        "latencies_ms": [round(1000 * x, 2) for x in latencies],
        "error": error,
    }


def _median(xs: list[float], digits: int = 3) -> float | None:
    return round(statistics.median(xs), digits) if xs else None


def summarize(runs: list[dict[str, Any]]) -> dict[str, dict[str, dict[str, Any]]]:
    """{workload: {peer: medians over the successful repeats, and the ratio to ``vllm``}}."""
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
            })
        base = per_peer.get(BASELINE, {}).get("texts_per_s")
        for s in per_peer.values():
            s["ratio_to_vllm"] = ratio(s["texts_per_s"], base)
    return out


def ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a and b else None


def pair_ratios(summary: dict[str, dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """{"embedfleet/vllm-serve": {workload: texts/s ratio}, ...}; None where a side is missing."""
    return {f"{a}/{b}": {w: ratio(p.get(a, {}).get("texts_per_s"),
                                  p.get(b, {}).get("texts_per_s"))
                         for w, p in summary.items()}
            for a, b in PAIR_RATIOS}


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
                 prefix_cache: dict[str, Any] | None) -> dict[str, Any]:
    summary = summarize(runs)
    checks = correctness(probes)
    failed_peers = [n for n, p in peers.items() if p.get("status") == "failed"]
    disagree = [f"{w}/{p}" for w, pp in checks.items() for p, c in pp.items() if c["ok"] is False]
    run_errors = [f"{r['workload']}/{r['peer']}#{r['repeat']}" for r in runs if r["error"]]
    pc_bad = bool(prefix_cache and prefix_cache.get("correctness", {}).get("ok") is False)
    report = {
        "schema": SCHEMA, "command": command, "started_at": started_at,
        "finished_at": finished_at, "machine": machine, "settings": settings,
        "workloads": workloads, "peers": peers, "runs": runs, "skipped": skipped,
        "correctness": checks, "summary": summary, "ratios": pair_ratios(summary),
        "prefix_cache": prefix_cache,
        "ok": not (failed_peers or disagree or run_errors or pc_bad),
        "problems": {"failed_peers": failed_peers, "disagreeing": disagree,
                     "run_errors": run_errors, "prefix_cache_disagrees": pc_bad},
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


# -- chart -------------------------------------------------------------------------------------
def write_chart(report: dict[str, Any], path: Path) -> Path:
    """One panel per workload (median texts/s per peer, ratio to vllm on each bar) and one for
    the prefix-cache comparison. Agg backend: no display needed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    panels = list(summary)
    pc = (report.get("prefix_cache") or {}).get("summary")
    n = len(panels) + (1 if pc else 0)
    fig, axes = plt.subplots(1, max(n, 1), figsize=(4.2 * max(n, 1), 4.2), squeeze=False)
    colors = {"vllm": "#4c72b0", "vllm-serve": "#55a868", "infinity": "#c44e52",
              "embedfleet": "#8172b2", "prefix cache on": "#4c72b0", "prefix cache off": "#999999"}
    for ax, workload in zip(axes[0], panels):
        peers = list(summary[workload])
        vals = [summary[workload][p]["texts_per_s"] or 0 for p in peers]
        bars = ax.bar(peers, vals, color=[colors.get(p, "#777777") for p in peers])
        for b, p in zip(bars, peers):
            r = summary[workload][p]["ratio_to_vllm"]
            ax.annotate(f"{b.get_height():.1f}" + (f"\n×{r:.2f}" if r is not None else ""),
                        (b.get_x() + b.get_width() / 2, b.get_height()), ha="center",
                        va="bottom", fontsize=8)
        missing = [p for p in report["peers"] if p not in summary[workload]]
        if missing:
            ax.text(0.98, 0.97, "not run: " + ", ".join(missing), transform=ax.transAxes,
                    ha="right", va="top", fontsize=7, color="#555555")
        ax.set_title(workload)
        ax.set_ylabel("texts/s (median of repeats)")
        ax.set_ylim(0, max(vals + [1]) * 1.3)
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    if pc:
        ax = axes[0][len(panels)]
        labels = ["prefix cache on", "prefix cache off"]
        vals = [pc["on"]["texts_per_s"] or 0, pc["off"]["texts_per_s"] or 0]
        for b in ax.bar(labels, vals, color=[colors[x] for x in labels]):
            ax.annotate(f"{b.get_height():.1f}", (b.get_x() + b.get_width() / 2,
                                                  b.get_height()), ha="center", va="bottom",
                        fontsize=8)
        r = pc.get("on_over_off")
        ax.set_title(f"prefix-cache (causal): on/off ×{r:.2f}" if r else "prefix-cache (causal)")
        ax.set_ylabel("texts/s (median of repeats)")
        ax.set_ylim(0, max(vals + [1]) * 1.2)
        ax.tick_params(axis="x", labelsize=8)
    m = report.get("machine", {})
    fig.suptitle(f"embedfleet bench - {m.get('cpu_model', '?')}, {m.get('cores_used', '?')} "
                 f"cores, {report['settings'].get('model', '')}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# -- table -------------------------------------------------------------------------------------
def _fmt(x: float | None, spec: str = ",.1f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def _clip(text: str, width: int = 72) -> str:
    return text if len(text) <= width else text[:width - 1] + "…"


def summary_table(report: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title="embedfleet bench: median of repeats", show_lines=False)
    for col, just in (("workload", "left"), ("peer", "left"), ("texts/s", "right"),
                      ("tokens/s", "right"), ("p50 ms", "right"), ("p99 ms", "right"),
                      ("× vllm", "right"), ("min cos", "right"), ("note", "left")):
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
                t.add_row(w, p, "-", "-", "-", "-", "-", "-", _clip(f"skipped: {reason}"))
                continue
            cos = c.get("min_cosine")
            note = "" if c.get("ok") is not False else "[red]VECTORS DISAGREE[/red]"
            if w == "long" and p == "vllm":
                note = "pre-chunked client-side (engine-limit reference)"
            t.add_row(w, p, _fmt(s["texts_per_s"]), _fmt(s["tokens_per_s"], ",.0f"),
                      _fmt(s["p50_ms"]), _fmt(s["p99_ms"]), _fmt(s["ratio_to_vllm"], ".2f"),
                      "ref" if p == BASELINE else _fmt(cos, ".5f"), note)
    return t


def closing_lines(report: dict[str, Any]) -> list[str]:
    lines = []
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
    lines.append("result: OK" if report["ok"]
                 else f"result: PROBLEMS {json.dumps(report['problems'])}")
    return lines
