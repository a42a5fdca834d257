"""The Grafana dashboard: lint (ids, queries, datasource, layout), content, provisioning."""

from __future__ import annotations

import copy
import json

import pytest
import yaml

from embedfleet.deployments.replica.canary import VERDICTS
from embedfleet.deployments.engine.vllm_api import VLLM_METRICS
from tests.support import monitoring_lint as lint
from embedfleet.monitoring import queries, thresholds
from embedfleet.monitoring.grafana import dashboard

UIDS = {dashboard.DATASOURCE_UID}


@pytest.fixture(scope="module")
def dash() -> dict:
    return json.loads(dashboard.DASHBOARD_FILE.read_text())


def _panels(dash: dict) -> list[dict]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def _panel(dash: dict, title: str) -> dict:
    return next(p for p in dash["panels"] if p["title"] == title)


def test_dashboard_lints_clean(dash):
    assert lint.lint_dashboard(dash, UIDS) == []
    assert len(_panels(dash)) >= 20


@pytest.mark.parametrize("breakage, expected", [
    (lambda d: d["panels"][2].__setitem__("id", d["panels"][1]["id"]), "duplicate id"),
    (lambda d: d["panels"][2]["gridPos"].__setitem__("x", d["panels"][1]["gridPos"]["x"]),
     "overlaps"),
    (lambda d: d["panels"][1]["targets"][0].__setitem__("expr", " "), "has no expr"),
    (lambda d: d["panels"][1].__setitem__("targets", []), "no query"),
    (lambda d: d["panels"][1].pop("datasource"), "datasource must be"),
    (lambda d: d["panels"][1]["gridPos"].__setitem__("w", 30), "outside the 24-column grid"),
    (lambda d: d["templating"]["list"].pop(0), "datasource must be"),
])
def test_lint_catches_breakage(dash, breakage, expected):
    broken = copy.deepcopy(dash)
    breakage(broken)
    problems = lint.lint_dashboard(broken, UIDS)
    assert any(expected in p for p in problems), problems


def test_card_memory_panel_draws_the_governor_thresholds(dash):
    panel = _panel(dash, "Card memory: pressure outside the KV pool")
    assert panel["targets"][0]["expr"] == queries.CARD_MEMORY_RATIO
    # The governor's signal is pressure outside the KV pool, and the panel says so (and why
    # neither raw used/total nor the pool's fill).
    assert "(used − KV pool − allocator cache free) / (total − KV pool)" in panel["description"]
    assert "filling it allocates nothing" in panel["description"]
    assert "raw used/total" in panel["description"]
    # Beside the recorded ratio: the replica's own reading, what the governor read, and the
    # governor's band per card (a card profile sets it per model).
    exprs = [tgt["expr"] for tgt in panel["targets"]]
    for name in ("card_memory_live_ratio", "governor_memory_ratio", "governor_high",
                 "governor_low"):
        assert any(f"ray_embedfleet_{name}{{" in e for e in exprs), (name, exprs)
    defaults = panel["fieldConfig"]["defaults"]
    assert defaults["custom"]["thresholdsStyle"]["mode"] == "line"
    steps = {s["value"]: s["color"] for s in defaults["thresholds"]["steps"]}
    assert steps[thresholds.CARD_MEMORY_HIGH] == "red"
    assert steps[thresholds.CARD_MEMORY_LOW] == "orange"
    assert "{{node}}/{{device}}" in panel["targets"][0]["legendFormat"]  # one line per card
    counters = " ".join(t["expr"] for t in _panel(dash, "Allocator retries and OOMs")["targets"])
    assert "ray_embedfleet_allocator_alloc_retries{" in counters
    assert "ray_embedfleet_allocator_ooms{" in counters


def test_dashboard_covers_the_embedding_views(dash):
    exprs = " ".join(lint.dashboard_exprs(dash))
    for name in (queries.REQUESTS_RATE, queries.REQUESTS_BY_CODE_RATE, queries.LATENCY_P50,
                 queries.LATENCY_P99, queries.INPUT_TOKENS_RATE, queries.BUDGET_FILL_RATIO,
                 queries.OVERLOAD_REJECTIONS_RATE, queries.PREFIX_CACHE_HIT_RATIO,
                 queries.REPLICAS_READY, "ray_embedfleet_engine_batch_size_bucket",
                 "ray_embedfleet_truncated_inputs_total", "ray_embedfleet_chunks_total",
                 "ray_embedfleet_governor_limit_tokens", "ray_embedfleet_canary_last_cosine",
                 "ray_embedfleet_prefix_cache_enabled", "ray_embedfleet_replica_ready"):
        assert name in exprs, name


def test_card_memory_terms_panel_shows_every_term(dash):
    panel = _panel(dash, "Card memory terms")
    assert panel["fieldConfig"]["defaults"]["unit"] == "bytes"
    exprs = " ".join(tgt["expr"] for tgt in panel["targets"])
    for metric in ("card_memory_used_bytes", "card_memory_total_bytes", "kv_cache_free_bytes",
                   "allocator_cache_free_bytes", "kv_cache_pool_bytes"):
        assert f"max by (node, device) (ray_embedfleet_{metric}{{" in exprs, metric
    peak = _panel(dash, "KV pool peak usage")
    assert "ray_embedfleet_kv_cache_usage_peak{" in peak["targets"][0]["expr"]
    assert peak["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_engine_section_reads_vllm_metrics_for_the_selected_models(dash):
    rows = [p["title"] for p in dash["panels"] if p["type"] == "row"]
    assert "Engine (vLLM)" in rows
    exprs = []
    for title in ("vLLM KV-cache usage", "vLLM requests running / waiting",
                  "vLLM prefix-cache hit rate"):
        for target in _panel(dash, title)["targets"]:
            names = {n for n in lint.metric_names(target["expr"]) if n.startswith("ray_vllm_")}
            assert names and names <= set(VLLM_METRICS.values()), target["expr"]
            for name in names:  # vLLM labels the model as model_name
                assert f'{name}{{{thresholds.SELECTOR}, model_name=~"$model"}}' in target["expr"]
            exprs.append(target["expr"])
    assert " ".join(exprs).count("ray_vllm_") >= len(VLLM_METRICS)
    # vLLM's KV usage reads ~0 under pooling load: the panel points at the in-step peak.
    assert "KV pool peak usage" in _panel(dash, "vLLM KV-cache usage")["description"]


def test_canary_verdict_stat_maps_every_verdict(dash):
    panel = _panel(dash, "Canary verdict")
    (mapping,) = panel["fieldConfig"]["defaults"]["mappings"]
    texts = {opt["text"] for opt in mapping["options"].values()}
    assert texts == set(VERDICTS)
    expr = panel["targets"][0]["expr"]
    for verdict in VERDICTS:
        assert f'verdict="{verdict}"' in expr


def test_raw_series_use_the_embedfleet_selector(dash):
    for expr in lint.dashboard_exprs(dash):
        for name in lint.metric_names(expr):
            if name.startswith("ray_"):
                assert f"{name}{{{thresholds.SELECTOR}" in expr, expr


def test_model_variable_filters_model_panels(dash):
    model_var = next(v for v in dash["templating"]["list"] if v["name"] == "model")
    assert model_var["includeAll"] and model_var["allValue"] == ".*"
    for panel in _panels(dash):
        for target in panel["targets"]:
            if "{{model}}" in target["legendFormat"] or "{{model_name}}" in target["legendFormat"]:
                assert '$model' in target["expr"], (panel["title"], target["expr"])


def test_provisioning_matches_the_dashboard(dash):
    files = {p.relative_to(dashboard.HERE / "provisioning").as_posix(): yaml.safe_load(text)
             for p, text in dashboard.outputs().items() if p.suffix == ".yml"}
    (ds,) = files["datasources/embedfleet.yml"]["datasources"]
    assert ds["uid"] == dashboard.DATASOURCE_UID and ds["type"] == "prometheus"
    assert ds["jsonData"]["timeInterval"] == thresholds.SCRAPE_INTERVAL
    current = next(v for v in dash["templating"]["list"] if v["type"] == "datasource")["current"]
    assert current["value"] == ds["uid"]
    (provider,) = files["dashboards/embedfleet.yml"]["providers"]
    assert provider["type"] == "file" and provider["options"]["path"]


def test_canary_cosine_panel_shows_the_floor_and_fails_red_below_the_failure_threshold(dash):
    panel = _panel(dash, "Canary: lowest cosine and floor")
    exprs = [tgt["expr"] for tgt in panel["targets"]]
    assert any("ray_embedfleet_canary_last_cosine{" in e for e in exprs), exprs
    assert any("ray_embedfleet_canary_floor{" in e for e in exprs), exprs
    steps = {s["value"]: s["color"] for s in panel["fieldConfig"]["defaults"]["thresholds"]["steps"]}
    assert steps == {None: "red", thresholds.CANARY_FAIL_COSINE: "green"}
    from embedfleet.deployments.replica.canary import FAIL_COSINE
    assert thresholds.CANARY_FAIL_COSINE == FAIL_COSINE  # one threshold, two spellings
