"""The card profile: its arithmetic is checked at load, an assumption names its sources, the
shipped 910B profile loads, and save/load round-trips atomically."""

from __future__ import annotations

import json

import pytest

from embedfleet.deployments.engine.card_profile import (NUMBERS, CardProfile,
                                                        default_profile_path, load_profile,
                                                        save_profile, shipped_profile_path)

GiB = 1 << 30
SHIPPED = shipped_profile_path("ascend-910b-qwen3-embedding-8b")


def _raw() -> dict:
    return json.loads(SHIPPED.read_text())


def test_shipped_910b_profile_is_an_assumption_with_the_runtime_total():
    p = load_profile(SHIPPED)
    assert p.source == "assumption"
    assert p.card_total_bytes == 65452113920  # vllm-ascend #4404, not 64 GiB
    assert all(p.notes[n].strip() for n in NUMBERS)
    # The plan fits inside the card with its margin, and the idle ratio sits well below it.
    assert p.fits and p.idle_ratio < p.operating_point_ratio < p.safe_ratio < 1.0


def test_headroom_must_be_the_cards_arithmetic():
    raw = _raw()
    raw["headroom_bytes"] += 1
    with pytest.raises(ValueError, match="headroom_bytes"):
        CardProfile.model_validate(raw)


def test_assumption_without_a_source_for_a_number_is_refused():
    raw = _raw()
    del raw["notes"]["card_total_bytes"]
    with pytest.raises(ValueError, match="card_total_bytes"):
        CardProfile.model_validate(raw)
    raw["source"] = "measured"  # a measurement needs no notes
    assert CardProfile.model_validate(raw).source == "measured"


def test_pool_as_large_as_the_card_is_refused():
    raw = _raw()
    raw["kv_pool_bytes"] = raw["card_total_bytes"]
    raw["headroom_bytes"] = -raw["worst_step_peak_bytes"]
    with pytest.raises(ValueError, match="leaves nothing"):
        CardProfile.model_validate(raw)


def test_save_load_round_trip_and_default_path(tmp_path):
    p = load_profile(SHIPPED)
    path = default_profile_path("embedfleet", "qwen3-embedding-8b", state_dir=tmp_path)
    assert path == tmp_path / "profiles" / "embedfleet--qwen3-embedding-8b.json"
    save_profile(p, path)
    assert load_profile(path) == p
    assert [f.name for f in path.parent.iterdir()] == [path.name]  # no temp file left


def test_a_broken_file_names_itself(tmp_path):
    bad = tmp_path / "p.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=str(bad)):
        load_profile(bad)


def test_not_fitting_when_headroom_below_margin():
    raw = _raw()
    raw["safety_margin_bytes"] = raw["headroom_bytes"] + 1
    assert not CardProfile.model_validate(raw).fits
