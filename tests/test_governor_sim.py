"""The governor simulation drives the real governor, budget and limits follower (not copies of
them) on a card read from a card profile; its JSON is the issue's figure of record."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from embedfleet.benchmarks import governor_sim
from embedfleet.deployments.engine.card_profile import load_profile, save_profile

ROOT = Path(__file__).resolve().parent.parent
LAST_KEYS = ["card_profile", "idle_budget_fraction", "operating_point_budget_fraction",
             "overrun_ooms_without_governor", "overrun_ooms_with_governor", "recovered_s"]


@pytest.fixture(scope="module")
def report() -> dict:
    proc = subprocess.run([sys.executable, "-m", "embedfleet.benchmarks.governor_sim", "--json"],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_json_ends_with_the_issues_keys(report):
    assert list(report)[-len(LAST_KEYS):] == LAST_KEYS
    assert Path(report["card_profile"]) == governor_sim.PROFILE
    assert report["profile_source"] == "assumption"  # the shipped 910B numbers, not a card's


def test_idle_and_the_planned_operating_point_keep_the_ceiling(report):
    card = report["card"]
    assert report["idle_ratio"] == pytest.approx(card["idle_ratio"], abs=1e-3)
    assert report["idle_budget_fraction"] == 1.0
    # Full steps at max_model_len with the KV pool full: the budget stays at the ceiling. The
    # ratio is the profile's operating point (above the configured 0.90: the profile's band).
    assert report["operating_point_budget_fraction"] == 1.0
    assert report["operating_point_ratio"] == pytest.approx(card["operating_point_ratio"],
                                                            abs=1e-3)
    assert report["operating_point_ratio"] < card["cut_at_ratio"]
    for run in report["runs"]:
        assert run["operating_point_ooms"] == 0


def test_an_overrun_is_cut_within_an_interval_without_ooms_and_recovers(report):
    off, on = report["runs"]
    assert (off["governor"], on["governor"]) == ("off", "on")
    assert report["overrun_ooms_without_governor"] > 0
    assert report["overrun_ooms_with_governor"] == 0 and on["engine_ooms"] == 0
    # The first allocator retry is the overrun's first sign; the cut lands within an interval.
    assert report["overrun_first_retry_s"] is not None
    assert 0 <= report["overrun_cut_s"] - report["overrun_first_retry_s"] <= report["interval_s"]
    assert on["overrun_min_budget_fraction"] < 1.0
    assert report["recovered_s"] is not None and report["recovered_s"] < 300
    # An OOM re-queues its step (the simulated engine has no way to drop a request): without
    # the governor the card still serves between its restarts, fewer than with it.
    assert 0 < off["requests_served"] < on["requests_served"]


def test_every_card_number_comes_from_the_profile(tmp_path):
    """Another profile, another card: a bigger margin moves the cut; a worst step past the card
    is not a plan the budget can keep."""
    p = load_profile(governor_sim.PROFILE)
    card = governor_sim.Card(p)
    assert card.room == p.card_total_bytes - p.kv_pool_bytes - p.idle_outside_pool_bytes
    assert card.act_per_token * p.worst_step.tokens == pytest.approx(
        p.worst_step_peak_bytes - p.idle_outside_pool_bytes)
    # The worst step fits as profiled, with its headroom left; one headroom more does not.
    assert card.step(p.worst_step.tokens, 0.0) and card.retries == 0
    card.workspace = 2 * p.headroom_bytes / (card.act_per_token * p.worst_step.tokens)
    assert not card.step(p.worst_step.tokens, 1.0) and card.ooms == 1 and card.retries == 1
    # A profile whose plan exceeds its margin: the simulation runs it and the governor cuts at
    # the operating point (the plan itself is past the cut).
    tight = p.model_copy(update={"safety_margin_bytes": p.headroom_bytes + (1 << 30)})
    path = save_profile(tight, tmp_path / "tight.json")
    out = governor_sim.run_both(path)
    assert out["card_profile"] == str(path)
    assert out["operating_point_budget_fraction"] < 1.0
