"""Generated monitoring files are up to date, and every name they use exists.

The rules, prometheus.yml, dashboard JSON and provisioning are generated from
monitoring/thresholds.py, queries.py, prometheus/rules.py and grafana/dashboard.py. If a test here
fails after editing those, run `python -m embedfleet.monitoring.generate` and commit the output.
"""

from __future__ import annotations

import doctest
import json
import re
from pathlib import Path

import pytest
import yaml

import embedfleet.monitoring as monitoring
from embedfleet.deployments.common import metrics
from embedfleet.deployments.engine.vllm_api import VLLM_METRICS
from embedfleet.monitoring import generate, queries, thresholds
from tests.support import monitoring_lint as lint
from embedfleet.monitoring.grafana import dashboard
from embedfleet.monitoring.prometheus import config, rules

MONITORING = Path(monitoring.__file__).resolve().parent


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


@pytest.fixture(scope="module")
def recording() -> dict:
    return _load(config.RULES_DIR / "embedfleet-recording.yml")


@pytest.fixture(scope="module")
def alerts() -> dict:
    return _load(config.RULES_DIR / "embedfleet-alerts.yml")


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(dashboard.DASHBOARD_FILE.read_text())


@pytest.mark.parametrize("path", sorted(generate.outputs()), ids=lambda p: p.name)
def test_checked_in_file_equals_generator_output(path):
    assert path.exists(), f"{path} missing: run `python -m embedfleet.monitoring.generate`"
    assert path.read_text() == generate.outputs()[path], \
        f"{path} is stale: run `python -m embedfleet.monitoring.generate`"


def test_check_mode_reports_a_stale_file(tmp_path):
    target = tmp_path / "x.yml"
    target.write_text("old\n")
    assert generate.prometheus.write_or_check({target: "new\n"}, check=True) == [target]
    assert target.read_text() == "old\n"  # --check writes nothing
    assert generate.prometheus.write_or_check({target: "new\n"}, check=False) == [target]
    assert generate.prometheus.write_or_check({target: "new\n"}, check=True) == []
    assert generate.main(["--check"]) == 0


# vLLM's engine metrics reach Prometheus through its Ray stat logger (``ray_vllm_*``); the ones
# embedfleet reads are listed, and checked against vLLM's sources, in ``embedfleet.deployments.engine.vllm_api``.
VLLM_NAMES = frozenset(VLLM_METRICS.values())


def test_every_metric_used_exists(recording, alerts, dash):
    known = metrics.EXPORTED_NAMES | VLLM_NAMES | lint.recorded_names(recording)
    exprs = lint.rule_exprs(recording) + lint.rule_exprs(alerts) + lint.dashboard_exprs(dash)
    used = set().union(*(lint.metric_names(e) for e in exprs))
    assert len(used) > 20  # the extractor finds names at all
    assert lint.unknown_metrics(exprs, known) == {}


def test_unknown_metric_is_reported():
    known = metrics.EXPORTED_NAMES | VLLM_NAMES
    expr = 'sum by (model) (rate(ray_embedfleet_request_total{job="ray"}[5m])) / card:x:ratio'
    assert lint.unknown_metrics([expr], known) == {
        expr: {"ray_embedfleet_request_total", "card:x:ratio"}}
    # A vLLM name must be one embedfleet lists (vLLM's `:` spelling is not what Ray exports).
    vllm = ('ray_vllm_kv_cache_usage_perc{job="ray"} + ray_vllm_gpu_cache_usage_perc{job="ray"}'
            ' + vllm:num_requests_running')
    assert lint.unknown_metrics([vllm], known) == {
        vllm: {"ray_vllm_gpu_cache_usage_perc", "vllm:num_requests_running"}}
    # Label values, functions, label names and Grafana variables are not metric names.
    assert lint.metric_names(
        'histogram_quantile(0.99, sum by (model, le) (rate(ray_embedfleet_engine_latency_seconds'
        '_bucket{model=~"embedfleet_x:y"}[$__rate_interval])))'
    ) == {"ray_embedfleet_engine_latency_seconds_bucket"}


def test_every_metric_is_shown_somewhere(recording, alerts, dash):
    """A metric that no rule, alert or panel reads is invisible: add it to the dashboard."""
    exprs = lint.rule_exprs(recording) + lint.rule_exprs(alerts) + lint.dashboard_exprs(dash)
    used = set().union(*(lint.metric_names(e) for e in exprs))
    unseen = [s.name for s in metrics.SPECS if not set(s.exported) & used]
    assert unseen == []
    assert VLLM_NAMES <= used, sorted(VLLM_NAMES - used)


def test_recording_rule_names_follow_level_metric_operation(recording):
    for name in lint.recorded_names(recording):
        assert re.fullmatch(r"[a-z_]+:embedfleet_[a-z_]+:[a-z0-9_]+", name), name


def test_queries_name_the_recorded_rules(recording):
    recorded = lint.recorded_names(recording)
    names = {v for k, v in vars(queries).items() if k.isupper() and isinstance(v, str)}
    assert names <= recorded, names - recorded
    assert queries.CARD_MEMORY_RATIO == "card:embedfleet_memory:ratio"


def test_governor_and_alert_read_the_same_memory_rule(alerts):
    """Design point 7: one PromQL definition of card memory ratio, at one threshold."""
    rule = next(r for g in alerts["groups"] for r in g["rules"]
                if r["alert"] == "EmbedfleetCardMemoryHigh")
    # The recorded ratio against the governor's own threshold per card (a card profile sets
    # it per model), the shared default where the governor reports none.
    assert rule["expr"] == (
        f"{queries.CARD_MEMORY_RATIO}\n>= on (node, device) (\n"
        f"  {queries.per_card(queries.ray_gauge('ray_embedfleet_governor_high'))}\n"
        f"  or\n  0 * {queries.CARD_MEMORY_RATIO} + {thresholds.CARD_MEMORY_HIGH}\n)")
    assert rule["for"] == thresholds.CARD_MEMORY_HIGH_FOR


def test_alerts_have_severity_and_annotations(alerts):
    assert lint.lint_alert_rules(alerts) == []
    broken = {"groups": [{"rules": [{"alert": "X", "expr": "1", "labels": {"severity": "page"},
                                      "annotations": {"summary": "s"}}]}]}
    assert len(lint.lint_alert_rules(broken)) == 4  # severity, description, runbook_url (x2)


def test_runbook_has_a_section_per_alert():
    headings = {line[3:].strip().lower()
                for line in (MONITORING / "runbook.md").read_text().splitlines()
                if line.startswith("## ")}
    for alert in rules.ALERTS:
        assert alert.name.lower() in headings, f"runbook.md lacks '## {alert.name}'"
        assert thresholds.runbook_url(alert.name).endswith("#" + alert.name.lower())


def test_threshold_band_is_consistent():
    assert 0 < thresholds.CARD_MEMORY_LOW < thresholds.CARD_MEMORY_HIGH <= 1
    assert 0 < thresholds.ERROR_RATIO_MAX < 1
    assert set(thresholds.EMBEDDING_APIS) <= set(metrics.APIS)


def test_queries_docstring_examples_run():
    result = doctest.testmod(queries)
    assert result.attempted > 0 and result.failed == 0
