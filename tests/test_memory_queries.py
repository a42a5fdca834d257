"""Card memory presets and client against a REAL Prometheus, under the governor's live signal.

What this proves: the npu-exporter preset's PromQL, Prometheus' HTTP API and our parsing agree on
the ratio outside the KV pool (``embedfleet.deployments.engine.card_memory.live_pressure``: device
used from the exporter on the runtime's scale, the KV pool and the allocator's releasable cache
from the replicas through Ray), with the right node/device labels and the exporter sample's own
timestamp; a KV pool filling up moves nothing; a card without its replica terms gives no result;
failures surface as ``PrometheusUnavailable``. The DCGM / npu edge cases and
the PromQL ``live_ratio`` itself are checked with ``promtool test rules`` (PromQL over canned
series, no server), the latter against ``live_pressure`` point by point.

Two STAND-INs serve the series Prometheus scrapes: ``tests.support.standin_npu_exporter``
(job "npu") and ``tests.support.standin_ray_agent`` (job "ray", as Ray's service discovery
labels the metrics agents).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from embedfleet.deployments.config.governor import GovernorParams
from embedfleet.deployments.fleet.governor_law import CardState, step
from embedfleet.deployments.config.memory_queries import (PRESET_NAMES, PRESETS, CardMemoryQuery,
                                    PrometheusQueryError, PrometheusUnavailable,
                                    aquery_card_ratios, dcgm_query, npu_exporter_query,
                                    query_card_ratios)
from embedfleet.monitoring import thresholds
from embedfleet.cluster.prometheus_server import (PrometheusStartError, free_port, start_prometheus,
                                       stop_from_pidfile)
from embedfleet.deployments.engine.card_memory import live_pressure
from embedfleet.monitoring import queries
from embedfleet.monitoring.prometheus import rules
from tests.support.standin_npu_exporter import StandinNpuExporter
from tests.support.standin_ray_agent import SERIES, StandinRayAgent

ROOT = Path(__file__).resolve().parents[1]
NPU = PRESETS["npu-exporter"]
# The replica's engine terms as Prometheus scrapes them (``embedfleet.deployments.common.metrics`` after Ray's
# export); a test below checks that ``embedfleet.monitoring.queries.live_ratio`` reads exactly these.
KV_POOL_SERIES, CACHE_FREE = SERIES["kv_pool"], SERIES["cache_free"]
# Prometheus applies a new target list at most every 5 s, then scrapes every 1 s: 20 s is
# generous on a loaded 2-core machine and still bounds a broken setup.
WAIT_S = 20.0

# A 64 GiB card at gpu_memory_utilization 0.95 with a 24 GiB KV pool: npu-exporter reads the
# reservation, 0.95 of the card, whether the card is idle or busy. Filling the KV pool changes
# nothing outside it (POOL_FULL); what changes the ratio is a step's activations taking the
# allocator's cached memory (HOT). Exporter and runtime totals agree here (the scale test below
# has them differ).
GiB, MiB = 1 << 30, 1 << 20
TOTAL_MB = 65536.0
RESERVED_MB = 0.95 * TOTAL_MB
KV_POOL = 24 * GiB
IDLE = {"kv_pool": KV_POOL, "kv_free": KV_POOL, "cache_free": 8 * GiB}  # warm-up's cache idle
POOL_FULL = {**IDLE, "kv_free": 0}                                      # queued work in the pool
HOT = {"kv_pool": KV_POOL, "kv_free": 0, "cache_free": int(0.4 * GiB)}  # a step holds the cache
RUNTIME = {"total": TOTAL_MB * MiB}  # the replica's runtime total, which the preset's scale uses
PARAMS = GovernorParams()
# The raw value of the exporter's gauges, with the preset's node/device labels.
RAW = ('label_replace(npu_chip_info_hbm_used_memory / npu_chip_info_hbm_total_memory, '
       '"device", "$1", "id", "(.*)")')


def live(used_mb: float, total_mb: float, kv_pool: float, cache_free: float,
         kv_free: float = 0) -> float:
    """What the preset must answer for exporter MB values and replica byte terms (the free part
    of the pool is not in the formula)."""
    return live_pressure(used_mb * MiB, total_mb * MiB, kv_pool, cache_free)


IDLE_LIVE = live(RESERVED_MB, TOTAL_MB, **IDLE)
HOT_LIVE = live(RESERVED_MB, TOTAL_MB, **HOT)


def test_the_profile_spans_the_band():
    """The premise of the tests below: raw says "cut", idle says "grow", a full pool changes
    nothing, a step holding the cache says "cut"."""
    assert RESERVED_MB / TOTAL_MB >= PARAMS.high
    assert live(RESERVED_MB, TOTAL_MB, **POOL_FULL) == IDLE_LIVE
    assert IDLE_LIVE < PARAMS.low < PARAMS.high < HOT_LIVE < 1


def wait_for(fetch, done, timeout: float = WAIT_S, what: str = "condition"):
    """Poll ``fetch()`` until ``done(value)``; fail with the last value seen."""
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = fetch()
        if done(value):
            return value
        time.sleep(0.25)
    pytest.fail(f"{what} not reached in {timeout} s; last value: {value!r}")


@pytest.fixture(scope="module")
def exporter():
    with StandinNpuExporter() as ex:
        ex.set_card("node-a", 0, RESERVED_MB, TOTAL_MB)
        ex.set_card("node-a", 1, RESERVED_MB, TOTAL_MB)
        yield ex


@pytest.fixture(scope="module")
def agent():
    with StandinRayAgent() as ag:
        # The replicas' own device reading differs from npu-exporter's (another sampling
        # moment): the npu-exporter preset must take the device terms from the exporter only.
        for device in (0, 1):
            ag.set_card("node-a", device, used=0.5 * TOTAL_MB * MiB, total=TOTAL_MB * MiB,
                        **IDLE)
        yield ag


@pytest.fixture(scope="module")
def prometheus(exporter, agent, tmp_path_factory):
    config = json.dumps({  # JSON is YAML: no quoting surprises
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": job, "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                           for job, port in (("npu", exporter.port), ("ray", agent.port))],
    })
    handle = start_prometheus(config, tmp_path_factory.mktemp("prom"), free_port())
    try:
        yield handle
    finally:
        handle.stop()
        assert not handle.running()


def ratios(prometheus, query: CardMemoryQuery | str = NPU):
    return query_card_ratios(prometheus.url, query, timeout=5.0)


def scraped(prometheus, metric: str, node: str) -> dict:
    """The raw series of ``metric`` for ``node`` that Prometheus holds now, by card."""
    return ratios(prometheus, f'{metric}{{node="{node}"}}')


# --- the npu-exporter preset through real Prometheus ------------------------------------------

@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_a_reserved_card_reads_outside_its_pool_a_full_pool_moves_nothing_a_hot_step_cuts(
        exporter, agent, prometheus):
    cards = {("node-a", "0"), ("node-a", "1")}
    got = wait_for(lambda: ratios(prometheus), lambda r: cards <= set(r), what="both cards read")
    raw = ratios(prometheus, RAW)
    for card in cards:
        # npu-exporter says 0.95 (above high, a cut); the preset answers the live value.
        assert raw[card].ratio == pytest.approx(0.95) and raw[card].ratio >= PARAMS.high
        assert got[card].ratio == pytest.approx(IDLE_LIVE, rel=1e-12)
        assert got[card].ratio < PARAMS.low
    # Card 1's KV pool fills up: it was preallocated, nothing moves.
    agent.set_card("node-a", 1, **POOL_FULL)
    wait_for(lambda: scraped(prometheus, SERIES["kv_free"], "node-a"),
             lambda r: r.get(("node-a", "1"), (1,))[0] == 0, what="card 1's pool full")
    time.sleep(1.5)  # a scrape after it, for the ratio too
    got = ratios(prometheus)
    assert got[("node-a", "1")].ratio == pytest.approx(IDLE_LIVE, rel=1e-12)
    # A step's activations take the allocator's cache: same device reading, above high.
    agent.set_card("node-a", 1, **HOT)
    got = wait_for(lambda: ratios(prometheus),
                   lambda r: r.get(("node-a", "1"), (0,))[0] == pytest.approx(HOT_LIVE),
                   what="card 1 at its hot-step ratio")
    assert got[("node-a", "1")].ratio >= PARAMS.high
    assert got[("node-a", "0")].ratio == pytest.approx(IDLE_LIVE, rel=1e-12)  # untouched
    assert ratios(prometheus, RAW)[("node-a", "1")].ratio == pytest.approx(0.95)
    for reading in got.values():  # stamped with their scrape time, not long ago
        assert time.time() - reading.sample_ts < 10
    agent.set_card("node-a", 1, **IDLE)


def short_lookback_preset(monkeypatch) -> tuple[CardMemoryQuery, float]:
    """The npu-exporter preset built with an 8 s Ray-gauge lookback instead of the shipped 30 s
    (``thresholds.RAY_GAUGE_LOOKBACK``), for the tests that wait for a sample to age out of it:
    the same query, 22 s less waiting."""
    monkeypatch.setattr(thresholds, "RAY_GAUGE_LOOKBACK", "8s")
    query = npu_exporter_query()
    assert "[8s]" in query.ratio and "[30s]" in NPU.ratio
    return query, 8.0


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_a_card_without_its_replica_terms_gives_no_result(exporter, agent, prometheus,
                                                          monkeypatch):
    npu, lookback_s = short_lookback_preset(monkeypatch)
    exporter.set_card("node-bare", 0, RESERVED_MB, TOTAL_MB)  # no replica at all
    exporter.set_card("node-part", 0, RESERVED_MB, TOTAL_MB)
    agent.set_card("node-part", 0, kv_pool=IDLE["kv_pool"],   # no allocator term yet
                   total=TOTAL_MB * MiB)                      # (the runtime's card total)
    wait_for(lambda: (ratios(prometheus, RAW), scraped(prometheus, KV_POOL_SERIES,
                                                       "node-part")),
             lambda r: {("node-bare", "0"), ("node-part", "0")} <= set(r[0]) and r[1],
             what="exporter and replica series scraped")
    got = ratios(prometheus, npu)
    # Not a raw 0.95 (saturated by the reservation): nothing, and the governor holds it stale.
    assert ("node-bare", "0") not in got and ("node-part", "0") not in got
    agent.set_card("node-part", 0, cache_free=IDLE["cache_free"])
    got = wait_for(lambda: ratios(prometheus, npu), lambda r: ("node-part", "0") in r,
                   what="card with both replica terms")
    assert got[("node-part", "0")].ratio == pytest.approx(IDLE_LIVE, rel=1e-12)
    agent.drop("node-part", 0, "kv_pool")
    t_drop = time.monotonic()
    # Ray-exported gauges are read through last_over_time (a missed report must not drop a card),
    # so the card leaves once its last KV sample is older than that lookback, and not before.
    wait_for(lambda: ratios(prometheus, npu), lambda r: ("node-part", "0") not in r,
             timeout=WAIT_S + lookback_s, what="card gone with its KV pool term")
    assert time.monotonic() - t_drop >= lookback_s - 1.5  # 1 s scrapes: its last sample's age
    assert ("node-bare", "0") not in ratios(prometheus, npu)


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_old_exporter_timestamps_come_back_and_the_law_calls_them_stale(exporter, agent,
                                                                        prometheus):
    # npu-exporter stamps samples itself; a stuck one keeps serving an old stamp. Prometheus
    # still returns the series for 5 minutes, so only the sample time reveals it.
    stamp = round(time.time() - 120, 3)
    exporter.set_card("node-old", 3, RESERVED_MB, TOTAL_MB, timestamp=stamp)
    agent.set_card("node-old", 3, **HOT, **RUNTIME)  # fresh replica terms: a cut, were the reading fresh
    got = wait_for(lambda: ratios(prometheus), lambda r: ("node-old", "3") in r,
                   what="old-stamped card")
    reading = got[("node-old", "3")]
    assert reading.ratio == pytest.approx(HOT_LIVE, rel=1e-12) and reading.ratio >= PARAMS.high
    assert reading.sample_ts == pytest.approx(stamp, abs=0.002)
    ceiling = type("Ceiling", (), {"max_sequences": 64, "max_tokens": 65536})()
    state = step(PARAMS, ceiling, CardState.initial(ceiling), reading.ratio,
                 reading.sample_ts, time.time())
    assert state.stale and state.limits.max_sequences == 64  # held, not cut
    assert "old" in state.reason


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_a_card_that_stops_reporting_disappears(exporter, agent, prometheus):
    exporter.set_card("node-gone", 0, RESERVED_MB, TOTAL_MB)
    agent.set_card("node-gone", 0, **IDLE, **RUNTIME)
    wait_for(lambda: ratios(prometheus), lambda r: ("node-gone", "0") in r, what="card seen")
    exporter.remove("node-gone")
    # Prometheus writes a staleness marker on the next scrape: the governor sees "no series",
    # even though the replica still reports its terms.
    wait_for(lambda: ratios(prometheus), lambda r: ("node-gone", "0") not in r,
             what="card gone")
    assert scraped(prometheus, KV_POOL_SERIES, "node-gone")


@pytest.fixture(scope="module")
def one_node_exporter(agent, tmp_path_factory):
    """npu-exporter as deployed: one per node, each chip id once; and its own Prometheus, since
    the module's stand-in serves several nodes' chips under the same ids from one target."""
    with StandinNpuExporter() as ex:
        config = json.dumps({
            "global": {"scrape_interval": "1s"},
            "scrape_configs": [{"job_name": job,
                                "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                               for job, port in (("npu", ex.port), ("ray", agent.port))]})
        handle = start_prometheus(config, tmp_path_factory.mktemp("prom-one"), free_port())
        try:
            yield ex, handle
        finally:
            handle.stop()


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_node_from_the_scrape_target_when_the_exporter_has_no_node_label(one_node_exporter,
                                                                         agent):
    exporter, prometheus = one_node_exporter
    # Whatever node label the exporter serves, node_label="instance" takes the target's host,
    # which is the node name the replica on that host reports.
    exporter.set_card("exporter-name", 0, RESERVED_MB, TOTAL_MB)
    exporter.set_card("exporter-name", 7, RESERVED_MB, TOTAL_MB)
    agent.set_card("127.0.0.1", 7, **HOT, **RUNTIME)  # chip 0's replica is not reporting
    by_instance = npu_exporter_query(node_label="instance")
    got = wait_for(lambda: ratios(prometheus, by_instance), lambda r: ("127.0.0.1", "7") in r,
                   what="card by instance")
    assert set(got) == {("127.0.0.1", "7")}
    assert got[("127.0.0.1", "7")].ratio == pytest.approx(HOT_LIVE, rel=1e-12)
    assert time.time() - got[("127.0.0.1", "7")].sample_ts < 10
    assert ratios(prometheus) == {}  # the default node label joins no replica


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_async_client_gives_the_same_answer(prometheus):
    wait_for(lambda: ratios(prometheus), lambda r: ("node-a", "0") in r, what="scraped")
    now = time.time()
    sync = query_card_ratios(prometheus.url, NPU, at=now)
    assert sync and asyncio.run(aquery_card_ratios(prometheus.url, NPU, at=now)) == sync


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_node_aliases_join_the_replica_node_name_inside_the_query(exporter, agent, prometheus):
    exporter.set_card("npu-host.7", 0, RESERVED_MB, TOTAL_MB)
    # A decoy a regex "." would also rename; its higher reading would then win the max.
    exporter.set_card("npu-hostx7", 0, TOTAL_MB, TOTAL_MB)
    agent.set_card("10.0.0.7", 0, **HOT, **RUNTIME)  # the replica reports its node IP
    aliased = npu_exporter_query(aliases={"npu-host.7": "10.0.0.7"})
    got = wait_for(lambda: ratios(prometheus, aliased), lambda r: ("10.0.0.7", "0") in r,
                   what="aliased card")
    assert got[("10.0.0.7", "0")].ratio == pytest.approx(HOT_LIVE, rel=1e-12)
    assert not {("npu-host.7", "0"), ("npu-hostx7", "0")} & set(got)
    # Without the alias the exporter's name finds no replica terms: no result at all (renaming
    # after the query, as before, could not have found any).
    plain = ratios(prometheus)
    assert not {("npu-host.7", "0"), ("npu-hostx7", "0"), ("10.0.0.7", "0")} & set(plain)


# --- failures ---------------------------------------------------------------------------------

def test_closed_port_is_prometheus_unavailable():
    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(PrometheusUnavailable, match="cannot reach Prometheus"):
        query_card_ratios(url, NPU, timeout=2.0)
    with pytest.raises(PrometheusUnavailable, match="cannot reach Prometheus"):
        asyncio.run(aquery_card_ratios(url, NPU, timeout=2.0))
    assert time.monotonic() - start < 5


def test_non_200_is_prometheus_unavailable(exporter):
    # The stand-in has no /api/v1/query: a 404 from something that is not Prometheus.
    with pytest.raises(PrometheusUnavailable, match="HTTP 404") as err:
        query_card_ratios(exporter.url, NPU, timeout=2.0)
    assert not isinstance(err.value, PrometheusQueryError)


@pytest.mark.parametrize("status, body, needle", [
    (200, "<html>proxy login</html>", "not JSON"),
    (503, "overloaded", "not JSON"),
    (503, '{"status": "error", "errorType": "unavailable"}', "HTTP 503"),
    (200, '{"status": "success", "data": {"resultType": "vector", "result": [{"value": 1}]}}',
     "malformed series"),
])
def test_unusable_answers_are_prometheus_unavailable(status, body, needle):
    client = httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(status,
                                                                                   text=body)))
    with pytest.raises(PrometheusUnavailable, match=needle):
        query_card_ratios("http://prom.invalid:9090", NPU, client=client)


def test_hand_written_query_keeps_the_highest_duplicate_and_the_evaluation_time():
    result = [{"metric": {"node": "n", "device": "0", "job": j}, "value": [1700000000.5, v]}
              for j, v in (("a", "NaN"), ("b", "0.5"), ("c", "0.91"), ("d", "0.7"))]
    body = {"status": "success", "data": {"resultType": "vector", "result": result}}
    client = httpx.Client(transport=httpx.MockTransport(lambda req: httpx.Response(200,
                                                                                   json=body)))
    got = query_card_ratios("http://prom.invalid:9090", "my_ratio", client=client)
    assert got == {("n", "0"): (0.91, 1700000000.5)}


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
@pytest.mark.parametrize("expr, needle", [
    ("sum(", "bad_data"),
    ("1", "expected an instant vector"),
    ("vector(1)", "without node/device labels"),
])
def test_bad_queries_are_query_errors(prometheus, expr, needle):
    with pytest.raises(PrometheusQueryError, match=needle):
        ratios(prometheus, expr)


# --- the presets and live_ratio, with promtool ------------------------------------------------

def _promtool_test(tmp_path: Path, series: dict[str, str], checks: list[tuple[str, list]],
                   *, expect_pass: bool = True) -> str:
    """Evaluate each expression at 2m over ``series`` (1 m interval) and compare samples.

    promtool compares values exactly, so expected values are the float64 that Python computes
    (json writes the shortest repr that reads back to the same float)."""
    test = {"rule_files": [], "evaluation_interval": "1m", "tests": [{
        "interval": "1m",
        "input_series": [{"series": s, "values": v} for s, v in series.items()],
        "promql_expr_test": [{"expr": expr, "eval_time": "2m",
                              "exp_samples": [{"labels": lab, "value": val} for lab, val in exp]}
                             for expr, exp in checks],
    }]}
    path = tmp_path / "presets_test.yml"
    path.write_text(json.dumps(test, indent=1))
    proc = subprocess.run(["promtool", "test", "rules", str(path)], capture_output=True,
                          text=True, timeout=60)
    assert (proc.returncode == 0) == expect_pass, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


def _replica(node: str, device: str | int, kv_pool: int, cache_free: int, total_mib: int, *,
             job: str = "ray", worker: str = "w1") -> dict[str, str]:
    """The engine terms of one replica and its runtime's card total, as Ray exports them
    (bytes, three samples)."""
    labels = (f'job="{job}", instance="{node}:46569", WorkerId="{worker}", '
              f'node="{node}", device="{device}"')
    return {f"{KV_POOL_SERIES}{{{labels}}}": f"{kv_pool}x2",
            f"{CACHE_FREE}{{{labels}}}": f"{cache_free}x2",
            f"{rules.MEM_TOTAL}{{{labels}}}": f"{total_mib * MiB}x2"}


def test_dcgm_preset(tmp_path):
    q = PRESETS["dcgm"]
    aliased = dcgm_query(aliases={"gpu-host": "10.0.0.9"})
    gpu = 'gpu="{g}", Hostname="gpu-host", UUID="GPU-{g}", modelName="H100", job="dcgm"'
    _promtool_test(tmp_path, {
        f'DCGM_FI_DEV_FB_USED{{{gpu.format(g=0)}}}': "16384x2",
        f'DCGM_FI_DEV_FB_FREE{{{gpu.format(g=0)}}}': "49152x2",
        f'DCGM_FI_DEV_FB_USED{{{gpu.format(g=1)}}}': "75000 _ _",  # stuck since t=0
        f'DCGM_FI_DEV_FB_FREE{{{gpu.format(g=1)}}}': "5000 _ _",
        # Replicas that report DCGM's host name as their node (ray start --node-name).
        # Card 0's runtime counts 1 GiB DCGM leaves out of used + free (what the driver
        # reserves): the preset moves it to used (the runtime's scale).
        **_replica("gpu-host", 0, 8 * GiB, GiB, 65536 + 1024),
        **_replica("gpu-host", 1, 2 * GiB, 0, 80000),
        # Replicas that report the node IP: only card 0 has one; reached through the alias.
        **_replica("10.0.0.9", 0, 0, 0, 65536),
    }, [
        (q.ratio, [('{node="gpu-host", device="0"}',
                    live_pressure((16384 + 1024) * MiB, (65536 + 1024) * MiB, 8 * GiB, GiB)),
                   ('{node="gpu-host", device="1"}',
                    live_pressure(75000 * MiB, 80000 * MiB, 2 * GiB, 0))]),
        (q.sample_time, [('{node="gpu-host", device="0"}', 120),
                         ('{node="gpu-host", device="1"}', 0)]),
        # No KV pool, no cache, the same total: the ratio is the raw one; card 1 has no replica
        # terms under 10.0.0.9, so no result.
        (aliased.ratio, [('{node="10.0.0.9", device="0"}', 0.25)]),
        (aliased.sample_time, [('{node="10.0.0.9", device="0"}', 120),
                               ('{node="10.0.0.9", device="1"}', 0)]),
    ])


def test_npu_preset_edge_cases(tmp_path):
    by_instance = npu_exporter_query(node_label="instance")
    npu = 'npu_chip_info_hbm_{}_memory{{id="{}", instance="{}:9101", job="{}"}}'
    series = {
        npu.format("used", 0, "10.0.0.5", "a"): "58982x2",
        npu.format("total", 0, "10.0.0.5", "a"): "65536x2",
        # The same card scraped by a second job reads higher: the preset keeps the higher one.
        npu.format("used", 0, "10.0.0.5", "b"): "61000x2",
        npu.format("total", 0, "10.0.0.5", "b"): "65536x2",
        # Zero capacity (and no KV pool free): no series, not +Inf (which would read as full).
        npu.format("used", 1, "[fd00::7]", "a"): "100x2",
        npu.format("total", 1, "[fd00::7]", "a"): "0x2",
        # An IPv6 target keeps its brackets in the node name.
        npu.format("used", 2, "[fd00::7]", "a"): "30000x2",
        npu.format("total", 2, "[fd00::7]", "a"): "65536x2",
        # Exporter series, but its replica's terms only come from another job: no result.
        npu.format("used", 3, "10.0.0.5", "a"): "30000x2",
        npu.format("total", 3, "10.0.0.5", "a"): "65536x2",
        # Card 0's runtime reports 60.96 GiB (62,420 MiB) where npu-smi says 65,536 MB: the
        # preset takes the 3,116 MiB npu-smi counts as used and the runtime never hands out
        # off the exporter's used.
        **_replica("10.0.0.5", 0, 3 * GiB, GiB // 4, 62420),
        # A restarted replica: the old worker's terms are lower; per card, the max is kept.
        **_replica("10.0.0.5", 0, GiB, 0, 62000, worker="w0"),
        **_replica("[fd00::7]", 1, 0, 0, 0),
        **_replica("[fd00::7]", 2, 20 * GiB, 3 * GiB, 65536),
        **_replica("10.0.0.5", 3, GiB, GiB, 65536, job="other"),
    }
    _promtool_test(tmp_path, series, [
        (by_instance.ratio, [
            ('{node="10.0.0.5", device="0"}',
             live_pressure((61000 - 3116) * MiB, 62420 * MiB, 3 * GiB, GiB // 4)),
            ('{node="[fd00::7]", device="2"}',
             live_pressure(30000 * MiB, 65536 * MiB, 20 * GiB, 3 * GiB))]),
        (by_instance.sample_time, [('{node="10.0.0.5", device="0"}', 120),
                                   ('{node="[fd00::7]", device="1"}', 120),
                                   ('{node="[fd00::7]", device="2"}', 120),
                                   ('{node="10.0.0.5", device="3"}', 120)]),
    ])


def _live_points() -> list[tuple[int, int, int, int]]:
    """(used, total, kv_pool, cache_free) in bytes: the cases that matter, then random ones."""
    total = 64 * GiB
    reserved = int(0.95 * total)
    points = [
        (reserved, total, KV_POOL, 8 * GiB),          # idle at the 0.95 reservation
        (reserved, total, KV_POOL, int(0.4 * GiB)),   # a step holding the allocator's cache
        (40 * GiB, total, 0, 3 * GiB),                # no pool, allocator cache > 0
        (40 * GiB, total, 0, 0),                      # both 0: the raw ratio
        (10 * GiB, total, 8 * GiB, 4 * GiB),          # cache + pool > used: clamped at 0
        (total, total, 0, 0),                         # a card exactly full
        (20 * GiB, 16 * GiB, 16 * GiB, 0),            # pool = total: no capacity, no result
        (20 * GiB, 16 * GiB, 17 * GiB, 0),            # pool > total: no result
    ]
    rng = random.Random(910)
    for _ in range(10):
        t = rng.randrange(8 * GiB, 96 * GiB)
        points.append((rng.randrange(0, t + 1), t, rng.randrange(0, t), rng.randrange(0, 8 * GiB)))
    return points


def test_promql_live_ratio_equals_live_pressure(tmp_path):
    points = _live_points()
    expected = [live_pressure(*p) for p in points]
    assert sum(math.isfinite(e) for e in expected) >= 8
    assert any(p[2] == 0 and p[3] > 0 for p in points)
    assert any(p[0] - p[2] - p[3] < 0 and e == 0 for p, e in zip(points, expected))
    assert not all(math.isfinite(e) for e in expected)

    used, total = rules.MEM_USED, rules.MEM_TOTAL
    expr = queries.live_ratio(queries.per_card(queries.series(used)),
                              queries.per_card(queries.series(total)))
    series: dict[str, str] = {}
    for i, (u, t, k, c) in enumerate(points):
        labels = f'job="ray", WorkerId="w{i}", node="n{i}", device="{i % 8}"'
        for name, value in ((used, u), (total, t), (KV_POOL_SERIES, k),
                            (CACHE_FREE, c)):
            series[f"{name}{{{labels}}}"] = f"{value}x2"
    # Replicas that miss a term give no result, whatever their device reading.
    for j, missing in enumerate((KV_POOL_SERIES, CACHE_FREE)):
        labels = f'job="ray", node="missing-{j}", device="0"'
        for name in (used, total, KV_POOL_SERIES, CACHE_FREE):
            if name != missing:
                series[f"{name}{{{labels}}}"] = f"{GiB}x2"
    exp = [(f'{{node="n{i}", device="{i % 8}"}}', e)
           for i, e in enumerate(expected) if math.isfinite(e)]
    _promtool_test(tmp_path, series, [(expr, exp)])

    # The comparison is sharp: one point off by the last bit of its float fails.
    i, e = next((i, e) for i, e in enumerate(exp) if e[1] > 0)
    off = exp[:i] + [(e[0], math.nextafter(e[1], 2.0))] + exp[i + 1:]
    _promtool_test(tmp_path, series, [(expr, off)], expect_pass=False)


def test_embedfleet_preset_reads_the_recording_rule(tmp_path):
    q = PRESETS["embedfleet"]
    assert q.ratio == "card:embedfleet_memory:ratio"
    _promtool_test(tmp_path, {'card:embedfleet_memory:ratio{node="n0", device="1"}': "0.5 0.93 _"},
                   [(q.ratio, [('card:embedfleet_memory:ratio{node="n0", device="1"}', 0.93)]),
                    (q.sample_time, [('{node="n0", device="1"}', 60)])])


def test_preset_names_are_the_literal():
    assert set(PRESETS) == set(PRESET_NAMES)
    assert dcgm_query().ratio == PRESETS["dcgm"].ratio


# --- the stand-ins themselves -----------------------------------------------------------------

def test_standin_http_api_and_loud_banner():
    with StandinNpuExporter() as ex, httpx.Client(base_url=ex.url, timeout=5) as c:
        assert c.post("/set", json={"node": "n", "device": 2, "used": 10, "total": 40}).is_success
        assert c.post("/ratio", json={"node": "n", "device": 3, "ratio": 0.75,
                                      "total": 100}).is_success
        text = c.get("/metrics").text
        assert 'npu_chip_info_hbm_used_memory{id="2",node="n"} 10.0' in text
        assert 'npu_chip_info_hbm_used_memory{id="3",node="n"} 75.0' in text
        assert 'npu_chip_info_hbm_total_memory{id="3",node="n"} 100.0' in text
        help_lines = [ln for ln in text.splitlines() if ln.startswith("# HELP")]
        assert help_lines and all("STAND-IN" in ln for ln in help_lines)
        bad = c.post("/set", json={"node": "n", "device": 2, "used": 1})
        assert bad.status_code == 400 and "total" in bad.json()["error"]
        assert c.post("/set", json={"node": "n", "device": 2, "used": 1,
                                    "total": 0}).status_code == 400
        assert c.post("/remove", json={"node": "n", "device": "2"}).json() == {"removed": 1}
        assert [card["device"] for card in c.get("/cards").json()] == ["3"]


def test_standin_runs_as_a_module():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "tests.support.standin_npu_exporter",
                             "--port", str(port), "--card", "n0:1:0.93"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        def scrape():
            try:
                return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).text
            except httpx.HTTPError:
                return ""
        text = wait_for(scrape, lambda t: "npu_chip_info_hbm_total_memory" in t, timeout=15,
                        what="stand-in serving")
        assert 'npu_chip_info_hbm_used_memory{id="1",node="n0"} 60948.48' in text
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=10)
    assert proc.returncode == 0, out
    assert "STAND-IN" in out


def _samples(text: str) -> dict[str, dict[tuple[str, str], tuple[dict[str, str], float]]]:
    """{metric: {(node, device): (labels, value)}} from exposition text."""
    out: dict = {}
    for line in text.splitlines():
        if line.startswith("#") or "{" not in line:
            continue
        name, rest = line.split("{", 1)
        body, value = rest.rsplit("} ", 1)
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', body))
        if "node" in labels:
            out.setdefault(name, {})[(labels["node"], labels["device"])] = (labels, float(value))
    return out


def test_standin_ray_agent_serves_the_replica_terms_as_ray_exports_them():
    # The names are the replica's gauges after Ray's export, and the ones the queries read.
    assert (SERIES["used"], SERIES["total"]) == (rules.MEM_USED, rules.MEM_TOTAL)
    KV_FREE = SERIES["kv_free"]
    assert KV_POOL_SERIES == "ray_embedfleet_kv_cache_pool_bytes"
    assert KV_FREE == "ray_embedfleet_kv_cache_free_bytes"
    assert CACHE_FREE == "ray_embedfleet_allocator_cache_free_bytes"
    expr = queries.live_ratio("u", "t")
    assert f"max by (node, device) ({queries.ray_gauge(KV_POOL_SERIES)})" in expr
    assert f"max by (node, device) ({queries.ray_gauge(CACHE_FREE)})" in expr
    assert KV_FREE not in expr  # the pool's fill is not pressure
    with StandinRayAgent() as ag, httpx.Client(base_url=ag.url, timeout=5) as c:
        assert c.post("/set", json={"node": "10.0.0.1", "device": 2, "used": 60e9,
                                    "total": 64e9, "kv_free": 30e9}).is_success
        ag.set_card("10.0.0.1", 3, kv_free=0, cache_free=5, worker_id="w-old")
        text = c.get("/metrics").text
        got = _samples(text)
        labels, value = got[rules.MEM_USED][("10.0.0.1", "2")]
        assert value == 60e9 and labels["NodeAddress"] == "10.0.0.1" and labels["WorkerId"]
        assert set(labels) == {"node", "device", "WorkerId", "NodeAddress", "Component",
                               "SessionName", "Version"}
        assert got[KV_FREE][("10.0.0.1", "2")][1] == 30e9
        assert got[KV_FREE][("10.0.0.1", "3")][1] == 0
        assert got[CACHE_FREE][("10.0.0.1", "3")][0]["WorkerId"] == "w-old"
        # A term never set is not exported: card 2 has no allocator term, card 3 no device ones.
        assert ("10.0.0.1", "2") not in got[CACHE_FREE]
        assert ("10.0.0.1", "3") not in got[rules.MEM_USED]
        help_lines = [ln for ln in text.splitlines() if ln.startswith("# HELP")]
        assert len(help_lines) == 6 and all("STAND-IN" in ln for ln in help_lines)
        assert 'standin_ray_agent_info{warning="STAND-IN' in text
        # Setting one term keeps the others; dropping one term leaves the rest.
        assert c.post("/set", json={"node": "10.0.0.1", "device": 2,
                                    "cache_free": 1e9}).json()["kv_free"] == 30e9
        assert c.post("/drop", json={"node": "10.0.0.1", "device": 2,
                                     "terms": ["kv_free"]}).json()["kv_free"] is None
        got = _samples(c.get("/metrics").text)
        assert ("10.0.0.1", "2") not in got[KV_FREE]
        assert got[CACHE_FREE][("10.0.0.1", "2")][1] == 1e9
        assert got[rules.MEM_TOTAL][("10.0.0.1", "2")][1] == 64e9
        # The caller's mistakes are 400s that say what is wrong.
        for path, body in (("/set", {"node": "n", "device": 0, "used": -1}),
                           ("/set", {"node": "n"}),
                           ("/drop", {"node": "10.0.0.1", "device": 2, "terms": ["bogus"]}),
                           ("/drop", {"node": "nope", "device": 0, "terms": ["used"]})):
            assert c.post(path, json=body).status_code == 400, (path, body)
        assert c.post("/remove", json={"node": "10.0.0.1", "device": "2"}).json() == {
            "removed": 1}
        assert [card["device"] for card in c.get("/cards").json()] == ["3"]
        assert ag.remove() == 1 and "standin_ray_agent_info" in ag.metrics_text()


# --- the Prometheus process helper ------------------------------------------------------------

@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_bad_config_fails_start_with_the_log(tmp_path):
    start = time.monotonic()
    with pytest.raises(PrometheusStartError, match="exited") as err:
        start_prometheus("scrape_configs: [{job_name: x, bogus_key: 1}]", tmp_path, free_port(),
                         ready_timeout=15)
    assert "bogus_key" in str(err.value)
    assert time.monotonic() - start < 15


@pytest.mark.prometheus  # a real Prometheus, waited on: not in `make test-unit`
def test_detached_prometheus_is_stopped_through_its_pid_file(tmp_path):
    handle = start_prometheus("global: {scrape_interval: 1m}", tmp_path, free_port(), detach=True)
    try:
        assert httpx.get(f"{handle.url}/-/ready", timeout=5).status_code == 200
        assert stop_from_pidfile(tmp_path, timeout=10)
        handle.process.wait(10)
        assert not handle.running()
        assert not stop_from_pidfile(tmp_path)  # nothing left to stop
    finally:
        handle.stop()
