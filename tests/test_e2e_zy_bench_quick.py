"""`embedfleet bench --quick` in `make test`: a smoke test of the harness, no speed assertion.

Every peer really runs — bare vLLM in-process, vLLM's own OpenAI server, Infinity from its own
venv (`make bench-setup`), and embedfleet over HTTP (the session cluster) — on the tiny seeded
workloads, and the run must write its JSON report and PNG chart. What would break if the harness
broke: a peer that did not run, vectors that disagree between peers, missing ratios, no chart.
"""

from __future__ import annotations

import json
import math

import pytest

from embedfleet.benchmarks import report as rpt
from embedfleet.benchmarks import workloads as wl
from tests.conftest import MINILM, run_cli

pytestmark = pytest.mark.cluster

PEERS = ("vllm", "vllm-serve", "infinity", "embedfleet")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_bench_quick_runs_every_peer_and_writes_json_and_png(cluster, tmp_path):
    proc = run_cli("bench", "--quick", "--embedfleet-url", cluster, "--embedfleet-model", MINILM,
                   "--out", str(tmp_path), timeout=1800, check=False)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    report = json.loads((tmp_path / "report.json").read_text())
    assert rpt.check_schema(report) == [] and report["ok"] is True, report.get("problems")
    assert {p: s["status"] for p, s in report["peers"].items()} == {p: "ok" for p in PEERS}
    ran = {(r["workload"], r["peer"]) for r in report["runs"]}
    for w in wl.NAMES:  # every peer runs every workload, except that only embedfleet chunks
        assert (w, "vllm") in ran and (w, "embedfleet") in ran
        for p in ("vllm-serve", "infinity"):
            assert ((w, p) in ran) != (w == "long"), f"{w}/{p}: run iff not the chunking case"
    for workload in ("short", "mixed", "shared-instruction"):
        summary = report["summary"][workload]
        for peer in PEERS:
            s = summary.get(peer)
            assert s and s["texts_per_s"] and s["texts_per_s"] > 0, (workload, peer, summary)
            assert s["p50_ms"] > 0 and s["p99_ms"] >= s["p50_ms"]
        assert summary["vllm"]["ratio_to_vllm"] == 1.0
        assert summary["embedfleet"]["ratio_to_vllm"] > 0
        for peer in PEERS:  # the same weights everywhere: the same vectors
            c = report["correctness"][workload][peer]
            assert c["ok"] and c["min_cosine"] >= 0.999, (workload, peer, c)
    for pair in ("embedfleet/vllm-serve", "embedfleet/infinity"):
        assert report["ratios"][pair]["mixed"] > 0, report["ratios"]
    # Long documents: embedfleet chunks them; the engine-limit reference embeds the same chunks.
    assert report["summary"]["long"]["embedfleet"]["texts_per_s"] > 0
    assert report["summary"]["long"]["vllm"]["texts_per_s"] > 0
    pc = report["prefix_cache"]
    assert pc["status"] == "ok" and pc["correctness"]["ok"]  # cache hits give the same vectors
    s = pc["summary"]
    assert math.isfinite(s["on_over_off"]) and s["on"]["texts_per_s"] > 0
    assert s["on"]["cached_share"] > 0.5 and s["off"]["cached_share"] == 0
    png = (tmp_path / "chart.png").read_bytes()
    assert png[:8] == PNG_MAGIC and len(png) > 5000
