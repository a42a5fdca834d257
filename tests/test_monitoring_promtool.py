"""The Prometheus rules and config, checked by Prometheus' own tool.

`promtool test rules` runs monitoring/prometheus/tests/*.yml: alert boundaries, negative cases,
exact labels and annotations, and recording-rule values. promtool is part of `make setup`; its
absence is a failure, not a skip, so a broken rule cannot pass on a machine without it.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from embedfleet.monitoring.prometheus import config, rules

PROM_DIR = Path(config.__file__).resolve().parent
UNIT_TESTS = sorted((PROM_DIR / "tests").glob("*.yml"))


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.fail("promtool not found on PATH; `make setup` installs Debian's prometheus")
    return path


def run(promtool: str, *args: str, cwd: Path = PROM_DIR) -> subprocess.CompletedProcess:
    return subprocess.run([promtool, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_rule_files_are_valid(promtool):
    out = run(promtool, "check", "rules", *(str(config.RULES_DIR / f) for f in config.RULE_FILES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules.RECORDING_RULES)} rules found" in out.stdout
    assert f"SUCCESS: {len(rules.ALERTS)} rules found" in out.stdout


def test_rule_unit_tests_pass(promtool):
    assert len(UNIT_TESTS) >= 2
    out = run(promtool, "test", "rules", *(str(p.relative_to(PROM_DIR)) for p in UNIT_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr


def test_unit_tests_catch_a_wrong_threshold(promtool, tmp_path):
    """Mutation check: `>=` turned into `>` must fail the boundary case (card at 0.90)."""
    (tmp_path / "rules").mkdir()
    for name in config.RULE_FILES:
        text = (config.RULES_DIR / name).read_text()
        if name == "embedfleet-alerts.yml":
            assert "card:embedfleet_memory:ratio\n      >= on (node, device)" in text
            text = text.replace("card:embedfleet_memory:ratio\n      >= on (node, device)",
                                "card:embedfleet_memory:ratio\n      > on (node, device)")
        (tmp_path / "rules" / name).write_text(text)
    (tmp_path / "tests").mkdir()
    shutil.copy(PROM_DIR / "tests" / "alerts_test.yml", tmp_path / "tests")
    out = run(promtool, "test", "rules", "tests/alerts_test.yml", cwd=tmp_path)
    assert out.returncode != 0
    assert "EmbedfleetCardMemoryHigh" in out.stdout + out.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    cases: dict[str, list[list]] = {}
    for path in UNIT_TESTS:
        for test in yaml.safe_load(path.read_text())["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.setdefault(case["alertname"], []).append(case.get("exp_alerts") or [])
    for alert in rules.ALERTS:
        found = cases.get(alert.name, [])
        assert any(found), f"{alert.name}: no unit test where it fires"
        assert any(not c for c in found), f"{alert.name}: no unit test where it stays quiet"


def test_every_recording_rule_has_a_value_test():
    tested = {case["expr"] for path in UNIT_TESTS
              for test in yaml.safe_load(path.read_text())["tests"]
              for case in test.get("promql_expr_test", [])}
    missing = {r.record for r in rules.RECORDING_RULES} - tested
    assert not missing, f"recording rules without a promql_expr_test: {sorted(missing)}"


def test_rendered_config_is_valid_and_points_at_ray_and_rules(promtool, tmp_path):
    sd_file = tmp_path / config.RAY_SD_FILENAME
    sd_file.write_text('[{"labels": {"job": "ray"}, "targets": ["127.0.0.1:46569"]}]')
    text = config.render_prometheus_config(str(sd_file), ["10.0.0.5:8082", "10.0.0.6:8082"])
    cfg_path = tmp_path / "prometheus.yml"  # written away from the rules: paths are absolute
    cfg_path.write_text(text)
    out = run(promtool, "check", "config", str(cfg_path), cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr

    cfg = yaml.safe_load(text)
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["ray"]["file_sd_configs"] == [{"files": [str(sd_file)]}]
    assert jobs["npu-exporter"]["static_configs"] == [{"targets": ["10.0.0.5:8082",
                                                                   "10.0.0.6:8082"]}]
    assert [Path(p) for p in cfg["rule_files"]] == [config.RULES_DIR / f for f in config.RULE_FILES]


def test_npu_exporter_job_only_with_targets():
    cfg = yaml.safe_load(config.render_prometheus_config("/x/sd.json"))
    assert [j["job_name"] for j in cfg["scrape_configs"]] == ["ray"]


def test_checked_in_config_is_valid_from_its_directory(promtool):
    # `prometheus --config.file=monitoring/prometheus/prometheus.yml` must work as checked in.
    out = run(promtool, "check", "config", "prometheus.yml")
    assert out.returncode == 0, out.stdout + out.stderr
    cfg = yaml.safe_load((PROM_DIR / "prometheus.yml").read_text())
    assert cfg["scrape_configs"][0]["file_sd_configs"][0]["files"] == [config.DEFAULT_RAY_SD_FILE]


def test_ray_sd_file_path():
    assert config.ray_sd_file("/tmp/ray/session_x") == \
        "/tmp/ray/session_x/prom_metrics_service_discovery.json"
    assert config.DEFAULT_RAY_SD_FILE == "/tmp/ray/prom_metrics_service_discovery.json"
