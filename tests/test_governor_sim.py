"""The governor simulation drives the real governor, budget and limits follower (not copies of
them) on a simulated 910B with vLLM's reservation; its JSON is the issue's figure of record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_governor_sim_json():
    proc = subprocess.run([sys.executable, "-m", "embedfleet.benchmarks.governor_sim", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    # Ten idle minutes on the shipped 910B config: the reservation is not read as pressure.
    assert report["idle_ratio"] < 0.80
    assert report["idle_budget_fraction"] == 1.0
    # A surge of 32K inputs: OOMs without the governor, none with it; then back to the ceiling.
    assert report["ooms_without_governor"] > 0
    assert report["ooms_with_governor"] == 0
    assert report["recovered_s"] is not None and report["recovered_s"] < 300
    on = report["runs"][1]
    assert on["governor"] == "on" and on["min_budget_fraction"] < 1.0  # it did act
    assert on["requests_ok"] == 400
    # The abrupt surge is reported too, whatever it shows.
    assert set(report["abrupt_surge"]) == {"ooms_without_governor", "ooms_with_governor",
                                           "recovered_s"}
