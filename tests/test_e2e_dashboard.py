"""Every query of the generated Grafana dashboard, and every shipped rule, against the live
Prometheus of the session cluster.

The file runs after every other cluster test (marked ``late(2)``, which tests/conftest.py orders
by), when the other end-to-end files have produced the events some panels need (4xx, 429s,
truncations, chunks, a failed canary, governor decisions). It
sends a little traffic of its own so the rate() panels have fresh samples, substitutes the Grafana
variables the way Grafana would, and polls the whole set of queries together for a bounded time:
a query error fails at once; a query that never returns a series fails when the time is up, with
every missing query and the event it waits for listed.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests
import yaml

from embedfleet.monitoring import queries
from embedfleet.monitoring.grafana import dashboard
from embedfleet.monitoring.prometheus.config import RULE_FILES, RULES_DIR
from tests.conftest import FAULTY_QWEN3, MINILM, TINY_QWEN3

pytestmark = [pytest.mark.cluster, pytest.mark.late(2)]

PROMETHEUS = "http://127.0.0.1:9090"
DASH = json.loads(dashboard.DASHBOARD_FILE.read_text())
SERIES_WAIT_S = 90  # for the whole set: Ray exports every ~10 s, Prometheus scrapes every 1 s
POLL_S = 2


# -- what Grafana substitutes ----------------------------------------------------------------
def _seconds(duration: str) -> int:
    value, unit = re.fullmatch(r"(\d+)([smhd])", duration).groups()
    return int(value) * {"s": 1, "m": 60, "h": 3600, "d": 86400}[unit]


# The provisioned datasource's timeInterval (= the production scrape interval) is the floor of
# $__interval. Over the dashboard's default range (1 h) a panel 600-1800 px wide gets 1 h / width
# = 2-6 s, which Grafana rounds to 5 s or less, so the floor wins. $__rate_interval is then
# max($__interval + scrape interval, 4 x scrape interval), as Grafana defines it.
SCRAPE_S = _seconds(dashboard.provisioning()["datasources/embedfleet.yml"]
                    ["datasources"][0]["jsonData"]["timeInterval"])
RANGE_S = _seconds(DASH["time"]["from"].removeprefix("now-"))
INTERVAL_S = SCRAPE_S
BUILTINS = {
    "__interval": f"{INTERVAL_S}s",
    "__interval_ms": str(INTERVAL_S * 1000),
    "__rate_interval": f"{max(INTERVAL_S + SCRAPE_S, 4 * SCRAPE_S)}s",
    "__range": f"{RANGE_S}s",
    "__range_s": str(RANGE_S),
    "__range_ms": str(RANGE_S * 1000),
}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\[\[(\w+)\]\]|\$(\w+)")
MODEL_VAR = next(v for v in DASH["templating"]["list"] if v["name"] == "model")


def regex_value(values: list[str]) -> str:
    """A multi-value query variable inside a Prometheus regex, formatted as Grafana does: each
    value regex-escaped (backslashes doubled for the PromQL string), several joined as (a|b)."""
    escaped = [re.sub(r"([$^*{}\[\]'+?.()|\\])", r"\\\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else f"({'|'.join(escaped)})"


def substitute(expr: str, model: str) -> str:
    """``expr`` with every Grafana variable replaced; an unknown variable fails the test, so a
    variable added to the dashboard has to be taught here first."""
    values = {**BUILTINS, "model": model}

    def one(m: re.Match) -> str:
        name = next(g for g in m.groups() if g)
        if name not in values:
            raise AssertionError(f"dashboard uses ${name}, which this test cannot substitute: "
                                 f"{expr}")
        return values[name]
    return _VARIABLE.sub(one, expr)


# -- the queries -----------------------------------------------------------------------------
@dataclass(frozen=True)
class PanelQuery:
    panel: str
    ref: str
    expr: str       # as in the dashboard

    @property
    def name(self) -> str:
        return f"{self.panel!r} {self.ref}"


PANEL_QUERIES = [PanelQuery(p["title"], t["refId"], t["expr"])
                 for row in DASH["panels"] for p in (row, *row.get("panels", []))  # collapsed rows
                 for t in p.get("targets", [])]

# What makes each panel's series exist beyond plain traffic and running replicas, and who
# produces it; only used to make a "never appeared" failure say what to look at. Gauges matter
# here: Ray's metrics agent drops a gauge ~2 report intervals (~20 s) after its last set.
GAUGE_SET_PER_CALL = "a call on the card in the last ~20 s (the in-flight gauges are set per call)"
NEEDS_EVENT = {
    "In-flight tokens vs budget": GAUGE_SET_PER_CALL,
    "In-flight sequences vs budget": GAUGE_SET_PER_CALL,
    "Budget fill per card": GAUGE_SET_PER_CALL,
    "Prefix cache": "ray_embedfleet_prefix_cache_enabled set in the last ~20 s (replicas set it "
                    "at start-up and when the canary switches caching off)",
    "Errors by status code": "a non-2xx answer (tests/test_e2e_errors.py; this file sends a 400)",
    "Rejections/s": "a 429 (the burst in tests/test_e2e_governor.py)",
    "Truncations": "a truncated input (tests/test_e2e_long_input.py; this file sends one)",
    "Chunks/s": "a chunked input (tests/test_e2e_long_input.py; this file sends one)",
    "Canary: lowest cosine and floor": "a canary run (at start-up; the faulty model every 10 s)",
    "Canary failures (1h)": "a failed canary in the last hour "
                            "(tests/test_e2e_prefix_cache.py arms the fault injector)",
    "Card memory ratio": "card memory exported by the replicas / governor readings",
    "Prefix-affinity routing": "a tiny-qwen3 call routed by prefix affinity (its replica reports "
                               "its cache on to Serve's router every 5 s: record_routing_stats)",
}

# Panels that legitimately return no series in this session, with the reason. A query listed
# here is still run and must not error; if it does return series, the entry is stale and fails.
NO_DATA_IN_SESSION: dict[tuple[str, str], str] = {}


def instant(expr: str) -> list[dict]:
    """Result of an instant query; a query error or a PromQL warning raises AssertionError."""
    resp = requests.get(f"{PROMETHEUS}/api/v1/query", params={"query": expr}, timeout=10)
    try:
        body = resp.json()
    except ValueError:
        raise AssertionError(f"HTTP {resp.status_code} for {expr}: {resp.text[:300]}") from None
    if body.get("status") != "success":
        raise AssertionError(f"{body.get('errorType')}: {body.get('error')}\n  query: {expr}")
    if body.get("warnings"):
        raise AssertionError(f"warnings {body['warnings']}\n  query: {expr}")
    return body["data"]["result"]


# -- fixtures --------------------------------------------------------------------------------
def post(cluster: str, **body) -> requests.Response:
    return requests.post(f"{cluster}/v1/embeddings", json=body, timeout=120)


@pytest.fixture(scope="module")
def prometheus(cluster) -> str:
    deadline = time.monotonic() + 30
    while True:
        try:
            if requests.get(f"{PROMETHEUS}/-/ready", timeout=2).status_code == 200:
                return PROMETHEUS
        except requests.RequestException:
            pass
        assert time.monotonic() < deadline, f"Prometheus at {PROMETHEUS} is not ready"
        time.sleep(1)


@pytest.fixture(scope="module")
def traffic(cluster, prometheus) -> None:
    """A little traffic of this file's own: a few requests per served model, plus the cheap
    events (a truncation, a chunked input, a 400); 429s and canary failures come from the files
    that own those scenarios."""
    for model in (MINILM, TINY_QWEN3):
        for i in range(4):
            r = post(cluster, model=model, input=[f"dashboard probe {i}", f"for {model} {i}"])
            assert r.status_code == 200, r.text
    long_text = "court contract statute appeal remedy " * 80  # ~400 tokens > MiniLM's 256
    cut = post(cluster, model=MINILM, input=long_text, long_input="truncate")
    assert cut.status_code == 200 and cut.json()["embedfleet"]["inputs"][0]["truncated"], cut.text
    split = post(cluster, model=MINILM, input=long_text, long_input="chunk")
    assert split.status_code == 200 and split.json()["embedfleet"]["inputs"][0]["chunks"] > 1
    bad = post(cluster, model=MINILM, input="x", dimensions=64)  # MiniLM has no Matryoshka
    assert bad.status_code == 400, bad.text


@pytest.fixture(scope="module")
def served_models(prometheus) -> list[str]:
    """The values of the dashboard's ``$model`` variable, fetched as Grafana's label_values()
    does (the label-values API, matched on the variable's metric)."""
    definition = MODEL_VAR["definition"]
    metric, label = re.fullmatch(r"label_values\((\S+), (\w+)\)", definition).groups()
    now = time.time()
    body = requests.get(f"{PROMETHEUS}/api/v1/label/{label}/values", timeout=10, params={
        "match[]": metric, "start": now - RANGE_S, "end": now}).json()
    assert body["status"] == "success", body
    return sorted(body["data"])


# -- tests -----------------------------------------------------------------------------------
def test_dashboard_uses_only_variables_this_test_substitutes():
    for q in PANEL_QUERIES:
        substitute(q.expr, ".*")  # raises on an unknown variable
    assert "$__rate_interval" in " ".join(q.expr for q in PANEL_QUERIES)
    assert MODEL_VAR["allValue"] == ".*" and MODEL_VAR["multi"] and MODEL_VAR["includeAll"]
    assert MODEL_VAR["definition"] == f"label_values({queries.REPLICAS_READY}, model)"


def test_model_variable_lists_the_served_models(traffic, served_models):
    assert {MINILM, TINY_QWEN3, FAULTY_QWEN3} <= set(served_models), served_models


def test_every_panel_query_returns_series_with_all_models(cluster, traffic):
    """$model = All (the dashboard's default): every panel query returns at least one series
    within SERIES_WAIT_S for the whole set. One small request per model per round keeps the
    per-call gauges (in flight) fresh: Ray's agent drops a gauge ~2 report intervals after its
    last update."""
    exprs = {q: substitute(q.expr, MODEL_VAR["allValue"]) for q in PANEL_QUERIES}
    pending = dict(exprs)
    deadline = time.monotonic() + SERIES_WAIT_S
    while True:
        for q, expr in list(pending.items()):
            if instant(expr):
                del pending[q]
        missing = {q for q in pending if (q.panel, q.ref) not in NO_DATA_IN_SESSION}
        if not missing or time.monotonic() > deadline:
            break
        for model in (MINILM, TINY_QWEN3):
            post(cluster, model=model, input="keep the gauges fresh")
        time.sleep(POLL_S)
    assert not missing, f"no series after {SERIES_WAIT_S}s for:\n" + "\n".join(
        f"  {q.name}: {exprs[q]}\n    needs: {NEEDS_EVENT.get(q.panel, 'traffic / replicas')}"
        for q in sorted(missing, key=lambda q: q.name))
    stale = {q.name for q in exprs if (q.panel, q.ref) in NO_DATA_IN_SESSION and q not in pending}
    assert not stale, f"listed in NO_DATA_IN_SESSION but has data now: {sorted(stale)}"
    unknown = set(NO_DATA_IN_SESSION) - {(q.panel, q.ref) for q in PANEL_QUERIES}
    assert not unknown, f"NO_DATA_IN_SESSION names no panel query: {sorted(unknown)}"


def test_panel_queries_run_for_each_model_selection_and_keep_to_it(traffic, served_models):
    """One model, and several (Grafana's (a|b) form): no query errors, and no series of a model
    outside the selection (the $model matcher is on every per-model query)."""
    selections = [[m] for m in served_models] + [[MINILM, TINY_QWEN3]]
    for selected in selections:
        for q in PANEL_QUERIES:
            for series in instant(substitute(q.expr, regex_value(selected))):
                model = series["metric"].get("model")
                assert model is None or model in selected, (q.name, selected, series["metric"])


def test_prefix_affinity_keys_only_the_models_whose_replicas_cache(cluster, traffic):
    """The router class from the config runs in the Router replicas: tiny-qwen3 (cache on) has
    keyed calls, all to their preferred replica (it has one); MiniLM (cache off by policy) has
    the same router but no keyed call, since its replicas report their cache off."""
    routed = "ray_embedfleet_affinity_routed_total"
    deadline = time.monotonic() + SERIES_WAIT_S
    while not instant(f'{routed}{{model="{TINY_QWEN3}"}}') and time.monotonic() < deadline:
        post(cluster, model=TINY_QWEN3, input="a query routed by its prefix")
        time.sleep(POLL_S)
    by = {(s["metric"]["model"], s["metric"]["outcome"]): float(s["value"][1])
          for s in instant(f"sum by (model, outcome) ({routed})")}
    assert by.get((TINY_QWEN3, "preferred"), 0) > 0, by
    assert not any(m == MINILM for m, _ in by), by


def _rules() -> list[tuple[str, dict]]:
    return [(f, rule) for f in RULE_FILES
            for group in yaml.safe_load((RULES_DIR / f).read_text())["groups"]
            for rule in group["rules"]]


@pytest.mark.parametrize("rule_file, rule", _rules(),
                         ids=[r.get("record") or r["alert"] for _, r in _rules()])
def test_rule_expression_runs(prometheus, rule_file, rule):
    instant(rule["expr"])


def test_prometheus_evaluates_the_shipped_rules_without_error(traffic):
    """The Prometheus of `embedfleet up` loaded exactly these files, and none of their rules
    reports an evaluation error (health is 'unknown' only until a rule's first evaluation)."""
    expected = {((RULES_DIR / f).resolve(), r.get("record") or r["alert"]) for f, r in _rules()}
    deadline = time.monotonic() + 15
    while True:
        groups = requests.get(f"{PROMETHEUS}/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = {(Path(g["file"]).resolve(), r["name"]): r for g in groups for r in g["rules"]}
        unevaluated = [name for name, r in loaded.items() if r["health"] == "unknown"]
        if not unevaluated or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert set(loaded) == expected
    bad = {name: (r["health"], r.get("lastError")) for name, r in loaded.items()
           if r["health"] != "ok" or r.get("lastError")}
    assert not bad, bad
