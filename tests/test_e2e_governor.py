"""Memory governor end to end: stand-in npu-exporter -> real Prometheus -> MemoryGovernor ->
per-card admission budgets in the engine replicas."""

from __future__ import annotations

import concurrent.futures as cf
import time

import pytest
import requests

from deployments.config import load_config
from tests.conftest import BASELINE_MEMORY_RATIO, E2E_CONFIG, MINILM

pytestmark = pytest.mark.cluster
PROMETHEUS = "http://127.0.0.1:9090"


def cards(cluster) -> dict[str, dict]:
    data = requests.get(f"{cluster}/v1/models", timeout=10).json()["data"]
    return {c["device"]: {**c, "model": m["id"]} for m in data for c in m["replicas"]["cards"]}


def wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last}")


def ceiling(card) -> int:
    cfg = load_config(E2E_CONFIG)
    return cfg.model(card["model"]).budget_ceiling["max_tokens"]


def governor_metric(device: str) -> float | None:
    r = requests.get(f"{PROMETHEUS}/api/v1/query", params={
        "query": f'max(ray_embedfleet_governor_limit_tokens{{device="{device}"}})'}, timeout=10)
    result = r.json()["data"]["result"]
    return float(result[0]["value"][1]) if result else None


def test_pressure_on_card_1_lowers_only_card_1_then_recovers_step_by_step(
        cluster, standin_exporter, node_ip, cluster_status):
    before = cards(cluster)
    c0, c1 = ceiling(before["0"]), ceiling(before["1"])
    assert before["0"]["budget"]["max_tokens"] == c0 and before["1"]["budget"]["max_tokens"] == c1
    interval = load_config(E2E_CONFIG).governor.interval_s
    standin_exporter.set_ratio(node_ip, "1", 0.93)
    t0 = time.monotonic()
    lowered = wait_for(lambda: (b := cards(cluster)["1"]["budget"])["max_tokens"] < c1 and b,
                       30, "card 1's budget to drop")
    # governor ticks + the replica's pull + the registry heartbeat, each `interval` apart at most
    assert time.monotonic() - t0 <= 2 * interval + 1 + 2 * interval + 4
    assert "0.93" in lowered["reason"] or "≥" in lowered["reason"] or "high" in lowered["reason"]
    assert cards(cluster)["0"]["budget"]["max_tokens"] == c0  # card 0 untouched
    status = {c["device"]: c for m in cluster_status()["models"] for c in m["cards"]}
    assert status["1"]["budget"]["max_tokens"] < c1 and status["0"]["budget"]["max_tokens"] == c0
    wait_for(lambda: (v := governor_metric("1")) is not None and v < c1, 60,
             "the governor's limit for card 1 in Prometheus")

    standin_exporter.set_ratio(node_ip, "1", 0.70)
    seen = [lowered["max_tokens"]]
    deadline = time.monotonic() + 120
    while seen[-1] < c1 and time.monotonic() < deadline:
        v = cards(cluster)["1"]["budget"]["max_tokens"]
        if v != seen[-1]:
            seen.append(v)
        time.sleep(0.5)
    assert seen[-1] == c1, seen
    # A decrease already under way (cooldown elapsed while still at 0.93) may land first; from
    # the lowest point on, the budget climbs back in several additive steps, never down.
    climb = seen[seen.index(min(seen)):]
    assert len(climb) >= 3 and climb == sorted(climb), f"not step by step: {seen}"
    steps = {b - a for a, b in zip(climb, climb[1:])}
    assert max(steps) <= c1 // 4, f"jumped instead of stepping: {seen}"
    standin_exporter.set_ratio(node_ip, "1", BASELINE_MEMORY_RATIO)


def test_prometheus_down_holds_last_limits_stale_and_requests_succeed(
        cluster, standin_exporter, node_ip):
    from cluster.monitoring_stack import start_monitoring, stop_monitoring

    c1 = ceiling(cards(cluster)["1"])
    standin_exporter.set_ratio(node_ip, "1", 0.95)
    held = wait_for(lambda: (b := cards(cluster)["1"]["budget"])["max_tokens"] < c1 and b, 30,
                    "card 1's budget to drop")
    assert stop_monitoring()
    try:
        stale = wait_for(lambda: (b := cards(cluster)["1"]["budget"])["stale"] and b, 30,
                         "limits to be reported stale")
        assert stale["max_tokens"] <= held["max_tokens"]
        assert "rometheus" in stale["reason"]
        standin_exporter.set_ratio(node_ip, "1", 0.10)  # unseen: Prometheus is down
        for i in range(20):
            r = requests.post(f"{cluster}/v1/embeddings", json={
                "model": MINILM, "input": [f"still serving {i}", "with the governor blind"]},
                timeout=60)
            assert r.status_code == 200, r.text
        assert cards(cluster)["1"]["budget"]["max_tokens"] == stale["max_tokens"]
    finally:
        start_monitoring(load_config(E2E_CONFIG))
        standin_exporter.set_ratio(node_ip, "1", BASELINE_MEMORY_RATIO)
    wait_for(lambda: not cards(cluster)["1"]["budget"]["stale"], 60, "fresh limits again")


def test_burst_larger_than_budget_queues_then_succeeds_or_gets_429(cluster):
    # MiniLM's budget is 2048 tokens per card; each request carries ~3,300 tokens, so each runs
    # alone on its card and the rest queue (5 s bound) or are refused with Retry-After.
    texts = [f"request text {j} " + "lorem ipsum dolor sit amet " * 16 for j in range(32)]

    def one(i):
        r = requests.post(f"{cluster}/v1/embeddings", json={"model": MINILM, "input": texts},
                          timeout=120)
        return r.status_code, r.headers.get("Retry-After"), r.json()

    with cf.ThreadPoolExecutor(40) as pool:
        results = list(pool.map(one, range(40)))
    codes = [c for c, _, _ in results]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(200) >= 2
    for code, retry_after, body in results:
        if code == 200:
            assert len(body["data"]) == 32
        else:
            assert retry_after and int(retry_after) >= 1
            assert body["error"]["code"] == "overloaded"
            assert body["error"]["type"] == "rate_limit_error"
    assert codes.count(429) >= 1, "the burst never overflowed the budget"
