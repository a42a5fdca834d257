"""`embedfleet calibrate`: the worst step it runs, its verdict, and what it writes.

The verdict and the command's plumbing are tested with a measurement handed in (no engine); one
`engine`-tier test runs the real command on MiniLM against the CPU card stand-in.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from embedfleet.cluster import calibrate
from embedfleet.cluster.calibrate import Measurement, default_margin, judge, worst_step
from embedfleet.deployments.engine.card_profile import WorstStep, load_profile
from embedfleet.deployments.common.settings import settings

ROOT = Path(__file__).resolve().parent.parent
GiB, MiB = 1 << 30, 1 << 20


def test_worst_step_is_full_length_sequences_bounded_by_the_step_budget():
    # The 910B config: 2 x 32K; MiniLM's local config: 64 x 256; at least one sequence.
    assert worst_step(128, 65536, 32768) == WorstStep(sequences=2, tokens=65536,
                                                      tokens_per_sequence=32768)
    assert worst_step(256, 16384, 256).sequences == 64
    assert worst_step(4, 16384, 256).sequences == 4  # max_num_seqs binds
    assert worst_step(8, 1000, 4096) == WorstStep(sequences=1, tokens=4096,
                                                  tokens_per_sequence=4096)


def test_default_margin():
    assert default_margin(65452113920, 37918111744) == GiB  # a 910B: capped at 1 GiB
    assert default_margin(512 * MiB, 128 * MiB) == int(0.1 * 384 * MiB)


def test_a_step_that_leaves_the_margin_fits():
    v = judge(card_total=64 * GiB, kv_pool=35 * GiB, worst_peak=27 * GiB, margin=GiB, ooms=0,
              gpu_memory_utilization=0.95, kv_cache_memory_bytes=None)
    assert v.fits and v.fit is None and "2048 MiB" in v.reason


def test_short_of_the_margin_by_gpu_memory_utilization_names_the_one_that_fits():
    # 512 MiB of headroom, 1 GiB wanted: the pool must give up 512 MiB = 0.0078 of the card.
    v = judge(card_total=64 * GiB, kv_pool=35 * GiB, worst_peak=28 * GiB + 512 * MiB,
              margin=GiB, ooms=0, gpu_memory_utilization=0.95, kv_cache_memory_bytes=None)
    assert not v.fits and v.fit == {"gpu_memory_utilization": 0.94}
    assert "gpu_memory_utilization: 0.94 would fit" in v.reason and "512 MiB" in v.reason
    # The suggestion really leaves the margin: the pool shrinks by what the setting gives up.
    assert 35 * GiB - (0.95 - 0.94) * 64 * GiB <= 35 * GiB - 512 * MiB


def test_short_of_the_margin_with_a_fixed_pool_names_the_pool_that_fits():
    v = judge(card_total=512 * MiB, kv_pool=128 * MiB, worst_peak=350 * MiB, margin=38 * MiB,
              ooms=0, gpu_memory_utilization=None, kv_cache_memory_bytes=128 * MiB)
    assert not v.fits and v.fit == {"kv_cache_memory_bytes": 124 * MiB}
    assert 512 * MiB - v.fit["kv_cache_memory_bytes"] - 350 * MiB >= 38 * MiB


def test_an_allocator_oom_refuses_whatever_the_headroom():
    v = judge(card_total=64 * GiB, kv_pool=30 * GiB, worst_peak=20 * GiB, margin=GiB, ooms=1,
              gpu_memory_utilization=0.95, kv_cache_memory_bytes=None)
    assert not v.fits and "allocator failed 1 time" in v.reason


def test_a_step_too_large_for_any_pool_says_to_shrink_the_step():
    v = judge(card_total=512 * MiB, kv_pool=64 * MiB, worst_peak=600 * MiB, margin=38 * MiB,
              ooms=0, gpu_memory_utilization=None, kv_cache_memory_bytes=64 * MiB)
    assert not v.fits and v.fit is None and "max_num_batched_tokens" in v.reason


@pytest.fixture(autouse=True)
def _fresh_settings():
    yield
    settings.cache_clear()  # later tests read the real environment again


def _measured(worst_peak: int) -> Measurement:
    return Measurement(card_total=4 * GiB, kv_pool=128 * MiB, weights=46 * MiB,
                       idle_outside=60 * MiB, worst_peak=worst_peak, retries=0, ooms=0,
                       step=WorstStep(sequences=64, tokens=16384, tokens_per_sequence=256),
                       engine_version="0.32.0", step_s=1.5, repeats=1)


def _run(monkeypatch, capsys, tmp_path, worst_peak: int, *extra: str) -> tuple[int, dict, Path]:
    async def fake_measure(cfg, m, **kw):
        return _measured(worst_peak)

    monkeypatch.setattr(calibrate, "measure", fake_measure)
    monkeypatch.setenv("EMBEDFLEET_STATE_DIR", str(tmp_path))
    settings.cache_clear()  # read once per process: read again with this state dir
    parser = argparse.ArgumentParser()
    calibrate.add_parser(parser.add_subparsers())
    args = parser.parse_args(["calibrate", "--config",
                              str(ROOT / "deployments/configs/local-cpu.yaml"), "--json", *extra])
    code = args.func(args)
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    return code, last, tmp_path / "profiles" / "embedfleet--all-minilm-l6-v2.json"


def test_command_writes_the_profile_where_the_governor_looks_and_prints_the_keys_last(
        monkeypatch, capsys, tmp_path):
    out = tmp_path / "p.json"
    code, last, _ = _run(monkeypatch, capsys, tmp_path, 700 * MiB, "--out", str(out))
    assert code == 0 and last["verdict"] == "fits" and last["profile"] == str(out)
    assert list(last)[-5:] == ["card_total_bytes", "kv_pool_bytes", "worst_step_peak_bytes",
                               "headroom_bytes", "verdict"]
    assert last["headroom_bytes"] == 4 * GiB - 128 * MiB - 700 * MiB
    p = load_profile(out)
    assert p.source == "measured" and p.fits and p.model == "all-minilm-l6-v2"
    assert p.worst_step_peak_bytes == 700 * MiB and p.safety_margin_bytes == last[
        "safety_margin_bytes"]


def test_command_refuses_writes_nothing_and_names_the_pool_that_fits(monkeypatch, capsys,
                                                                     tmp_path):
    code, last, default = _run(monkeypatch, capsys, tmp_path, 3600 * MiB)
    assert code == 2 and last["verdict"] == "refused" and last["profile"] is None
    assert "kv_cache_memory_bytes" in last["fit"] and not default.exists()


@pytest.mark.engine
def test_calibrate_runs_the_worst_step_on_the_cpu_card_stand_in(tmp_path):
    """The real command on MiniLM: a small step (4 x 128 tokens) keeps it to one engine start."""
    cfg = yaml.safe_load((ROOT / "deployments/configs/local-cpu.yaml").read_text())
    cfg["models"][0]["max_model_len"] = 128
    cfg["models"][0]["engine"].update(max_num_seqs=4, max_num_batched_tokens=512)
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "EMBEDFLEET_STATE_DIR": str(tmp_path / "state")}
    proc = subprocess.run([sys.executable, "-m", "embedfleet.cluster.cli", "calibrate",
                           "--config", str(path), "--json"], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["verdict"] == "fits" and last["worst_step"] == {
        "sequences": 4, "tokens": 512, "tokens_per_sequence": 128}
    written = tmp_path / "state" / "profiles" / "embedfleet--all-minilm-l6-v2.json"
    assert last["profile"] == str(written)
    p = load_profile(written)
    assert p.card_total_bytes == last["card_total_bytes"] > p.worst_step_peak_bytes
    assert p.weights_bytes > 20 * MiB  # MiniLM's 22.7 M parameters
    assert p.worst_step_peak_bytes >= p.idle_outside_pool_bytes >= p.weights_bytes


def test_an_engine_that_cannot_start_is_exit_1_with_the_reason(monkeypatch, capsys, tmp_path):
    async def busy_card(cfg, m, **kw):
        raise ValueError("Free memory on device (3.2/64.0 GiB) on startup is less than desired "
                         "GPU memory utilization (0.95, 60.8 GiB)")

    monkeypatch.setattr(calibrate, "measure", busy_card)
    monkeypatch.setenv("EMBEDFLEET_STATE_DIR", str(tmp_path))
    settings.cache_clear()
    parser = argparse.ArgumentParser()
    calibrate.add_parser(parser.add_subparsers())
    args = parser.parse_args(["calibrate", "--config",
                              str(ROOT / "deployments/configs/local-cpu.yaml")])
    assert args.func(args) == 1
    err = capsys.readouterr().err
    assert "Free memory on device" in err and "card to itself" in err
    assert not (tmp_path / "profiles").exists()
