"""The PNG chart of `embedfleet bench`: per workload, median texts/s per peer above and median
CPU-s per 1,000 texts below; the prefix-cache comparison in a panel of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def write_chart(report: dict[str, Any], path: Path) -> Path:
    """One column per workload: median texts/s per peer (ratio to vllm on each bar) above, median
    CPU-s per 1,000 texts of the peer's processes below (the load driver's share stacked and
    hatched for HTTP peers); one more panel for the prefix-cache comparison. Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = report["summary"]
    panels = list(summary)
    pc = (report.get("prefix_cache") or {}).get("summary")
    n = len(panels) + (1 if pc else 0)
    fig, axes = plt.subplots(2, max(n, 1), figsize=(4.2 * max(n, 1), 8.0), squeeze=False)
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
    for ax, workload in zip(axes[1], panels):
        _cpu_panel(ax, summary[workload], colors)
    for ax in axes[1][len(panels):]:
        ax.axis("off")
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


def _cpu_panel(ax: Any, per_peer: dict[str, dict[str, Any]], colors: dict[str, str]) -> None:
    peers = list(per_peer)
    own = [per_peer[p].get("cpu_s_per_1k") or 0 for p in peers]
    drv = [per_peer[p].get("driver_cpu_s_per_1k") or 0 for p in peers]
    ax.bar(peers, own, color=[colors.get(p, "#777777") for p in peers])
    ax.bar(peers, drv, bottom=own, color="white", edgecolor="#555555", hatch="//",
           label="load driver (bench process)")
    for i, p in enumerate(peers):
        r = per_peer[p].get("cpu_ratio_to_vllm")
        ax.annotate(f"{own[i]:.2f}" + (f"\n×{r:.2f}" if r is not None else ""),
                    (i, own[i] + drv[i]), ha="center", va="bottom", fontsize=8)
    if any(drv):
        ax.legend(fontsize=7, loc="upper left")
    ax.set_ylabel("CPU-s per 1,000 texts (median)")
    ax.set_ylim(0, max([o + d for o, d in zip(own, drv)] + [0.01]) * 1.35)
    ax.tick_params(axis="x", labelrotation=20, labelsize=8)
