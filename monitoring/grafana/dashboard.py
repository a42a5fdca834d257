"""The embedfleet Grafana dashboard and its provisioning files, as code.

``python -m embedfleet.monitoring.generate`` writes ``embedfleet.json`` and ``provisioning/``; tests check
the checked-in files equal this output and lint the dashboard (unique ids, queries, datasource,
no overlapping panels). Panels prefer the recording rules (``embedfleet.monitoring.queries``), so the
dashboard shows exactly what the alerts and the governor judge.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml

from ...deployments.engine.vllm_api import VLLM_METRICS
from .. import queries as q
from .. import thresholds as t
from ..queries import series

HERE = Path(__file__).resolve().parent
DASHBOARD_FILE = HERE / "embedfleet.json"
DASHBOARD_UID = "embedfleet"
DATASOURCE_UID = "embedfleet-prometheus"
# Where `embedfleet up` runs Prometheus; provisioning points Grafana at it.
PROMETHEUS_URL = "http://localhost:9090"
# Where a Grafana host/container mounts monitoring/grafana/ (the provider watches this folder).
GRAFANA_DASHBOARD_DIR = "/var/lib/grafana/dashboards/embedfleet"

# Panels use the datasource variable so the dashboard also works on a Grafana whose Prometheus
# has another uid; it defaults to the provisioned one.
DS = {"type": "prometheus", "uid": "${datasource}"}
MODEL = 'model=~"$model"'
# vLLM's own engine metrics carry the embedfleet model name as ``model_name``.
MODEL_NAME = 'model_name=~"$model"'
GRID_WIDTH = 24

# Raw series (not recorded) that the dashboard reads.
RATE = "[$__rate_interval]"


def _raw(metric: str, *matchers: str) -> str:
    return series(f"ray_embedfleet_{metric}", *matchers)


def _target(expr: str, legend: str, ref: str) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": ref}


def _panel(kind: str, title: str, description: str, targets: list[tuple[str, str]], *,
           unit: str = "short", width: int = 8, height: int = 8, thresholds=None,
           min_=None, max_=None, decimals=None, mappings=None) -> dict:
    """One panel; ``targets`` are (expr, legend). Ids and positions are set by ``_layout``."""
    defaults: dict = {"unit": unit}
    if thresholds:
        defaults["thresholds"] = {"mode": "absolute", "steps": thresholds}
        if kind == "timeseries":
            # Draw the threshold as a line on the graph (e.g. 0.90 card memory).
            defaults["custom"] = {"thresholdsStyle": {"mode": "line"}}
    for key, value in (("min", min_), ("max", max_), ("decimals", decimals),
                       ("mappings", mappings)):
        if value is not None:
            defaults[key] = value
    return {
        "type": kind, "title": title, "description": description, "datasource": DS,
        "gridPos": {"w": width, "h": height},
        "targets": [_target(e, legend, chr(ord("A") + i)) for i, (e, legend) in enumerate(targets)],
        "fieldConfig": {"defaults": defaults, "overrides": []},
        "options": {"legend": {"displayMode": "list", "placement": "bottom"}}
        if kind == "timeseries" else {"reduceOptions": {"calcs": ["lastNotNull"]}},
    }


def _steps(*levels: tuple[str, float | None]) -> list[dict]:
    return [{"color": color, "value": value} for color, value in levels]


def _quantile(phi: float, histogram: str, by: str = "model") -> str:
    return (f"histogram_quantile({phi}, sum by ({by}, le) "
            f"(rate({_raw(histogram + '_bucket', MODEL)}{RATE})))")


def _sum_rate(metric: str, by: str = "model") -> str:
    return f"sum by ({by}) (rate({_raw(metric, MODEL)}{RATE}))"


def _counted_in(metric: str, window: str, by: str = "model") -> str:
    """How much the counter ``metric`` counted in the last ``window``, per ``by``.

    Ray exports a counter only from its first increment, so ``increase`` alone misses the first
    count of a series (no earlier sample: one failure reads 0). A series that did not exist
    ``window`` ago counted all of its value (its highest, should its worker have died) inside
    the window; an older one counted its increase."""
    c = _raw(metric, MODEL)
    return (f"sum by ({by}) (\n  (increase({c}[{window}]) and {c} offset {window})\nor\n"
            f"  (max_over_time({c}[{window}]) unless {c} offset {window})\n)")


def _vllm(key: str, *matchers: str) -> str:
    """One of vLLM's engine metrics (``embedfleet.deployments.engine.vllm_api.VLLM_METRICS``), for ``$model``."""
    return series(VLLM_METRICS[key], MODEL_NAME, *matchers)


def _per_card(metric: str) -> str:
    return f"max by (node, device) ({_raw(metric)})"


# The canary verdict as one number per model for a stat panel: the worst verdict any replica
# reports (the gauge is one-hot per replica: 1 for its last verdict).
VERDICT_CODES = {"passed": 1, "inconclusive": 2, "failed": 3}
VERDICT_COLORS = {"passed": "green", "inconclusive": "orange", "failed": "red"}


def _verdict_code(verdict: str) -> str:
    gauge = _raw("canary_verdict", MODEL, f'verdict="{verdict}"')
    return f"{gauge} * {VERDICT_CODES[verdict]}"


CANARY_VERDICT = ("max by (model) (\n  "
                  + "\nor\n  ".join(_verdict_code(v) for v in VERDICT_CODES) + "\n)")
# vLLM's prefix-cache hits / lookups (tokens); 0, not absent, before a model's first hit (Ray
# exports a counter only from its first increment).
VLLM_PREFIX_HIT_RATE = (
    f"(\n  sum by (model_name) (rate({_vllm('prefix_hits')}{RATE}))\nor\n"
    f"  0 * sum by (model_name) (rate({_vllm('prefix_queries')}{RATE}))\n)\n/\n"
    f"sum by (model_name) (rate({_vllm('prefix_queries')}{RATE}))")
# Inconclusive canary runs in the last hour; 0 (not absent) for a model whose canary runs.
INCONCLUSIVE_RUNS = (f"{_counted_in('canary_inconclusive_total', '1h')}\nor\n"
                     f"0 * max by (model) ({_raw('canary_verdict', MODEL)})")

CARD = "{{node}}/{{device}}"

SECTIONS: list[tuple[str, list[dict]]] = [
    ("Traffic", [
        _panel("timeseries", "Requests/s", "Requests answered by the router, per model.",
               [(f"{q.REQUESTS_RATE}{{{MODEL}}}", "{{model}}")], unit="reqps"),
        _panel("timeseries", "Errors by status code", "Non-2xx answers per model and code.",
               [(f'sum by (model, status_code) ({q.REQUESTS_BY_CODE_RATE}'
                 f'{{{MODEL}, status_code!~"2.."}})', "{{model}} {{status_code}}")],
               unit="reqps"),
        _panel("timeseries", "Server-error ratio", "5xx / all requests; the line is the alert.",
               [(f"{q.ERRORS_RATIO}{{{MODEL}}}", "{{model}}")], unit="percentunit", min_=0,
               thresholds=_steps(("green", None), ("red", t.ERROR_RATIO_MAX))),
    ]),
    ("Latency and throughput", [
        _panel("timeseries", "Latency p50 / p99", "Router latency on the embedding APIs.",
               [(f"{q.LATENCY_P50}{{{MODEL}}}", "p50 {{model}}"),
                (f"{q.LATENCY_P99}{{{MODEL}}}", "p99 {{model}}")], unit="s",
               thresholds=_steps(("green", None), ("red", t.LATENCY_P99_MAX_S))),
        _panel("timeseries", "Engine latency p99",
               "Time inside the engine replica per call (tokenize, wait for budget, embed).",
               [(_quantile(0.99, "engine_latency_seconds"), "{{model}}")], unit="s"),
        _panel("timeseries", "Tokens/s and inputs/s", "Prompt tokens and inputs embedded.",
               [(f"{q.INPUT_TOKENS_RATE}{{{MODEL}}}", "tokens {{model}}"),
                (_sum_rate("inputs_total"), "inputs {{model}}")], unit="short"),
    ]),
    ("Batching and admission", [
        _panel("timeseries", "Engine batch size", "Inputs per engine call: mean and p99.",
               [(f"{_sum_rate('engine_batch_size_sum')} / {_sum_rate('engine_batch_size_count')}",
                 "mean {{model}}"),
                (_quantile(0.99, "engine_batch_size"), "p99 {{model}}")]),
        _panel("timeseries", "Budget fill per card",
               "In flight / admission budget, the tighter of tokens and sequences.",
               [(q.BUDGET_FILL_RATIO, CARD)], unit="percentunit", min_=0, max_=1),
        _panel("timeseries", "Rejections/s", "Requests refused before any work: 429 when a "
               "budget or queue was full; 503 (reason no_ready_replica) when nothing can serve.",
               [(f"sum by (model, reason) ({q.OVERLOAD_REJECTIONS_RATE}{{{MODEL}}})",
                 "{{model}} {{reason}}")], unit="reqps"),
        _panel("timeseries", "In-flight tokens vs budget", "Per card, as the replicas enforce it.",
               [(f"max by (model, node, device) ({_raw('inflight_tokens', MODEL)})",
                 "in flight " + CARD),
                (f"max by (model, node, device) ({_raw('budget_tokens', MODEL)})",
                 "budget " + CARD)], width=12),
        _panel("timeseries", "In-flight sequences vs budget", "Per card.",
               [(f"max by (model, node, device) ({_raw('inflight_sequences', MODEL)})",
                 "in flight " + CARD),
                (f"max by (model, node, device) ({_raw('budget_sequences', MODEL)})",
                 "budget " + CARD)], width=12),
    ]),
    ("Long inputs", [
        _panel("timeseries", "Truncations", "Inputs truncated and tokens dropped by the policy.",
               [(_sum_rate("truncated_inputs_total"), "inputs {{model}}"),
                (_sum_rate("dropped_tokens_total"), "dropped tokens {{model}}")],
               unit="short", width=12),
        _panel("timeseries", "Chunks/s", "Chunks embedded for inputs split by the policy.",
               [(_sum_rate("chunks_total"), "{{model}}")], unit="short", width=12),
    ]),
    ("Card memory and governor", [
        _panel("timeseries", "Card memory: pressure outside the KV pool",
               "The governor's signal per card (card:embedfleet_memory:ratio) = (used − KV pool "
               "− allocator cache free) / (total − KV pool), total as the runtime reports it. "
               "vLLM preallocates the KV pool, so filling it allocates nothing and is not "
               "pressure (its use is the KV pool panel); raw used/total reads ~0.95 even at "
               "idle on the 910B. Also the replica's own reading, what the governor last read "
               "and the governor's band per card (its model's card profile, else the config: "
               f"{t.CARD_MEMORY_HIGH:.2f} red line, {t.CARD_MEMORY_LOW:.2f} orange).",
               [(q.CARD_MEMORY_RATIO, CARD),
                (_per_card("card_memory_live_ratio"), "replica read " + CARD),
                (_per_card("governor_memory_ratio"), "governor read " + CARD),
                (_per_card("governor_high"), "cut at " + CARD),
                (_per_card("governor_low"), "grow at " + CARD)],
               unit="percentunit", min_=0, max_=1, width=12, height=9,
               thresholds=_steps(("green", None), ("orange", t.CARD_MEMORY_LOW),
                                 ("red", t.CARD_MEMORY_HIGH))),
        _panel("timeseries", "Governor token limits", "Token budget the governor set per card.",
               [(f"max by (node, device) ({_raw('governor_limit_tokens')})", CARD)],
               width=6, height=9),
        _panel("timeseries", "Governor sequence limits", "Sequence budget per card.",
               [(f"max by (node, device) ({_raw('governor_limit_sequences')})", CARD)],
               width=6, height=9),
        _panel("timeseries", "Card memory terms",
               "The terms of the pressure per card, as the replicas export them: device used "
               "and total, the engine's KV pool (preallocated at start-up) and its free part at "
               "the interval's peak (saturation, not pressure), and memory the allocator caches "
               "in whole free segments.",
               [(_per_card("card_memory_used_bytes"), "used " + CARD),
                (_per_card("kv_cache_free_bytes"), "KV pool free " + CARD),
                (_per_card("allocator_cache_free_bytes"), "allocator cache free " + CARD),
                (_per_card("card_memory_total_bytes"), "total " + CARD),
                (_per_card("kv_cache_pool_bytes"), "KV pool " + CARD)],
               unit="bytes", min_=0, width=10),
        _panel("timeseries", "KV pool peak usage",
               "Highest share of the engine's KV pool in use over the replica's interval, "
               "in-step: it adds back the blocks of requests that finished in the step, which "
               "vLLM's own KV-cache usage has already freed. KV pool free = pool × (1 − peak).",
               [(_per_card("kv_cache_usage_peak"), CARD)],
               unit="percentunit", min_=0, max_=1, width=8),
        _panel("timeseries", "Allocator retries and OOMs",
               "The engine allocator's counters since the engine started: a retry freed its "
               "cache to fit an allocation (the card was full at that moment), an OOM failed "
               "even then. Any rise cuts the card's budget at once, whatever the ratio says.",
               [(_per_card("allocator_alloc_retries"), "retries " + CARD),
                (_per_card("allocator_ooms"), "OOMs " + CARD)],
               unit="short", min_=0, width=8),
        _panel("stat", "Governor", "Stale: holding last limits (no fresh memory reading).",
               [(f"max({_raw('governor_stale')})", "stale")], width=6, height=8,
               mappings=[{"type": "value", "options": {
                   "0": {"text": "steering", "color": "green"},
                   "1": {"text": "stale", "color": "red"}}}],
               thresholds=_steps(("green", None), ("red", 1))),
    ]),
    ("Engine (vLLM)", [
        _panel("timeseries", "vLLM KV-cache usage",
               "vLLM's own KV-cache usage per replica (vllm:kv_cache_usage_perc). vLLM samples it "
               "after each step has freed the blocks of the requests that finished in it, and a "
               "pooling request finishes in the step that prefills it, so under embedding load "
               "it reads ~0. Compare with KV pool peak usage (card memory), which adds those "
               "blocks back and is what the governor uses.",
               [(f"max by (model_name, ReplicaId) ({_vllm('kv_cache_usage')})",
                 "{{model_name}} {{ReplicaId}}")],
               unit="percentunit", min_=0, max_=1),
        _panel("timeseries", "vLLM requests running / waiting",
               "Requests inside vLLM's scheduler, per model: running in the current step, and "
               "waiting for a step (the replica's admission budget in front of vLLM keeps "
               "that short).",
               [(f"sum by (model_name) ({_vllm('running')})", "running {{model_name}}"),
                (f"sum by (model_name) ({_vllm('waiting')})", "waiting {{model_name}}")]),
        _panel("timeseries", "vLLM prefix-cache hit rate",
               "Prompt tokens vLLM found in its prefix cache / tokens it looked up (vLLM's "
               "count; 0, not empty, while a model has not hit yet). Compare with "
               "Prefix-cache hit ratio (embedfleet's count).",
               [(VLLM_PREFIX_HIT_RATE, "{{model_name}}")],
               unit="percentunit", min_=0, max_=1),
    ]),
    ("Prefix cache", [
        _panel("timeseries", "Prefix-cache hit ratio", "Prompt tokens served from the cache.",
               [(f"{q.PREFIX_CACHE_HIT_RATIO}{{{MODEL}}}", "{{model}}")],
               unit="percentunit", min_=0, max_=1),
        _panel("timeseries", "Prefix-cache hit ratio per replica",
               "Prompt tokens served from each card's own prefix cache. Prefix-affinity routing "
               "sends calls whose prompts start alike to the same replica, so every card "
               "should read about the same; one far below the others gets keys it does not own.",
               [(f"{q.CARD_PREFIX_CACHE_HIT_RATIO}{{{MODEL}}}", "{{model}} " + CARD)],
               unit="percentunit", min_=0, max_=1),
        _panel("timeseries", "Prefix-affinity routing",
               "Keyed calls per second by where they went: the replica that owns the key "
               "(preferred), or another because the owner was over its bounded load or full "
               "(spilled). Models routed by power-of-two choice have no series.",
               [(f"{q.AFFINITY_ROUTED_RATE}{{{MODEL}}}", "{{model}} {{outcome}}")],
               unit="reqps", min_=0),
        _panel("stat", "Prefix cache", "On/off per model (the policy or the canary decides).",
               [(f"max by (model) ({_raw('prefix_cache_enabled', MODEL)})", "{{model}}")],
               mappings=[{"type": "value", "options": {
                   "0": {"text": "off", "color": "orange"},
                   "1": {"text": "on", "color": "green"}}}]),
        _panel("stat", "Canary verdict",
               "Last canary verdict per model, the worst over its replicas. Inconclusive: the "
               "canary saw no cache hit, or its cosine fell between the floor and the failure "
               "threshold, so nothing is proven (never shown as passed); the replica reruns it "
               "and caching stays on.",
               [(CANARY_VERDICT, "{{model}}")],
               mappings=[{"type": "value", "options": {
                   str(code): {"text": verdict, "color": VERDICT_COLORS[verdict]}
                   for verdict, code in VERDICT_CODES.items()}}]),
        _panel("stat", "Canary: lowest cosine and floor",
               "Cache-hit vs cold vectors in the last canary, and the floor it had to reach "
               "(calibrated from two cold runs on each replica). Below the floor it is "
               f"inconclusive; below {t.CANARY_FAIL_COSINE} it fails.",
               [(f"min by (model) ({_raw('canary_last_cosine', MODEL)})", "{{model}}"),
                (f"max by (model) ({_raw('canary_floor', MODEL)})", "{{model}} floor")],
               decimals=6, width=6,
               thresholds=_steps(("red", None), ("green", t.CANARY_FAIL_COSINE))),
        _panel("stat", "Canary failures (1h)", "Canary runs whose vectors differed.",
               [(_counted_in("canary_failures_total", "1h"), "{{model}}")],
               width=6, decimals=0, thresholds=_steps(("green", None), ("red", 1))),
        _panel("stat", "Canary inconclusive runs (1h)",
               "Canary runs that proved nothing (no cache hit, or a cosine between the floor "
               "and the failure threshold), per model; 0 for models whose canary runs.",
               [(INCONCLUSIVE_RUNS, "{{model}}")],
               width=6, decimals=0, thresholds=_steps(("green", None), ("orange", 1))),
        _panel("stat", "Engine swaps by outcome (1h)",
               "Engine replacements after a failed canary (old engine shut down, one without "
               "prefix caching started); failed: the new engine did not start (retried).",
               [(_counted_in("engine_swaps_total", "1h", "model, outcome"),
                 "{{model}} {{outcome}}")],
               width=6, decimals=0, thresholds=_steps(("green", None), ("orange", 1))),
        _panel("stat", "Engine restarts by outcome (1h)",
               "Engines restarted in place after one died in a step (an OOM on a card): the "
               "governor cut the card and the step's calls ran again on the new engine; "
               "failed: the new engine did not start (retried, then Serve replaces the replica).",
               [(_counted_in("engine_restarts_total", "1h", "model, outcome"),
                 "{{model}} {{outcome}}")],
               width=6, decimals=0, thresholds=_steps(("green", None), ("orange", 1))),
    ]),
    ("Replicas", [
        _panel("timeseries", "Ready replicas per model", "Replicas whose engine is up and healthy.",
               [(f"{q.REPLICAS_READY}{{{MODEL}}}", "{{model}}")], width=12),
        _panel("stat", "Replica ready per card", "1 per healthy replica (one per card).",
               [(f"max by (model, node, device) ({_raw('replica_ready', MODEL)})",
                 "{{model}} " + CARD)], width=12,
               thresholds=_steps(("red", None), ("green", 1))),
    ]),
]


def _layout(sections: list[tuple[str, list[dict]]]) -> list[dict]:
    """Assign ids and gridPos: one row panel per section, panels flowing left to right."""
    panels: list[dict] = []
    y = 0
    for title, section in sections:
        panels.append({"type": "row", "title": title, "collapsed": False, "panels": [],
                       "gridPos": {"x": 0, "y": y, "w": GRID_WIDTH, "h": 1}})
        y += 1
        x, row_height = 0, 0
        for panel in section:
            w, h = panel["gridPos"]["w"], panel["gridPos"]["h"]
            if x + w > GRID_WIDTH:
                x, y, row_height = 0, y + row_height, 0
            panel["gridPos"] = {"x": x, "y": y, "w": w, "h": h}
            panels.append(panel)
            x += w
            row_height = max(row_height, h)
        y += row_height
    for i, panel in enumerate(panels, start=1):
        panel["id"] = i
    return panels


def build_dashboard() -> dict:
    return {
        "uid": DASHBOARD_UID,
        "title": "embedfleet",
        "description": "Embedding cluster: traffic, latency, batching, card memory (live "
                       "pressure) and governor, vLLM engine, prefix cache and canary, replicas.",
        "tags": ["embedfleet", "ray-serve", "vllm"],
        "timezone": "browser",
        "editable": True,
        "schemaVersion": 39,
        "version": 1,
        "refresh": "10s",
        "time": {"from": "now-1h", "to": "now"},
        "templating": {"list": [
            {"name": "datasource", "label": "Prometheus", "type": "datasource",
             "query": "prometheus",
             "current": {"text": DATASOURCE_UID, "value": DATASOURCE_UID}},
            {"name": "model", "label": "Model", "type": "query", "datasource": DS,
             "query": {"query": f"label_values({q.REPLICAS_READY}, model)",
                       "refId": "model"},
             "definition": f"label_values({q.REPLICAS_READY}, model)",
             "includeAll": True, "multi": True, "allValue": ".*", "refresh": 2,
             "current": {"text": "All", "value": "$__all"}},
        ]},
        "annotations": {"list": []},
        "panels": _layout(SECTIONS),
    }


def provisioning() -> dict[str, dict]:
    """Grafana provisioning files (relative path under provisioning/ -> YAML data)."""
    return {
        "datasources/embedfleet.yml": {"apiVersion": 1, "datasources": [{
            "name": "embedfleet Prometheus", "uid": DATASOURCE_UID, "type": "prometheus",
            "access": "proxy", "url": PROMETHEUS_URL, "isDefault": True,
            # = scrape interval, so $__rate_interval covers at least four scrapes.
            "jsonData": {"timeInterval": t.SCRAPE_INTERVAL}}]},
        "dashboards/embedfleet.yml": {"apiVersion": 1, "providers": [{
            "name": "embedfleet", "folder": "embedfleet", "type": "file",
            "disableDeletion": False, "allowUiUpdates": False,
            "updateIntervalSeconds": 30,
            "options": {"path": GRAFANA_DASHBOARD_DIR, "foldersFromFilesStructure": False}}]},
    }


HEADER = "# Generated by `python -m embedfleet.monitoring.generate` (monitoring/grafana/dashboard.py).\n"


def outputs() -> dict[Path, str]:
    """Every generated Grafana file and its content."""
    files = {DASHBOARD_FILE: json.dumps(build_dashboard(), indent=2) + "\n"}
    for rel, data in provisioning().items():
        files[HERE / "provisioning" / rel] = HEADER + yaml.safe_dump(data, sort_keys=False)
    return files
