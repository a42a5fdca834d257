"""Card memory presets and client against a REAL Prometheus scraping the stand-in npu-exporter.

What this proves: the npu-exporter preset's PromQL, Prometheus' HTTP API and our parsing agree
(values, node/device labels, the sample's own timestamp), failures surface as
``PrometheusUnavailable``, and the DCGM / embedfleet presets compute the right thing (checked
with ``promtool test rules``, which evaluates PromQL over canned series without a server).
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from cluster.governor_law import CardState, GovernorParams, step
from cluster.memory_queries import (PRESET_NAMES, PRESETS, CardMemoryQuery,
                                    PrometheusQueryError, PrometheusUnavailable,
                                    aquery_card_ratios, dcgm_query, npu_exporter_query,
                                    query_card_ratios)
from cluster.prometheus_server import (PrometheusStartError, free_port, start_prometheus,
                                       stop_from_pidfile)
from monitoring.exporters.standin_npu_exporter import StandinNpuExporter

ROOT = Path(__file__).resolve().parents[1]
NPU = PRESETS["npu-exporter"]
# Prometheus applies a new target list at most every 5 s, then scrapes every 1 s: 20 s is
# generous on a loaded 2-core machine and still bounds a broken setup.
WAIT_S = 20.0


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
        ex.set_ratio("node-a", 0, 0.42)
        ex.set_ratio("node-a", 1, 0.50)
        yield ex


@pytest.fixture(scope="module")
def prometheus(exporter, tmp_path_factory):
    config = json.dumps({  # JSON is YAML: no quoting surprises
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "npu",
                            "static_configs": [{"targets": [f"127.0.0.1:{exporter.port}"]}]}],
    })
    handle = start_prometheus(config, tmp_path_factory.mktemp("prom"), free_port())
    try:
        yield handle
    finally:
        handle.stop()
        assert not handle.running()


def ratios(prometheus, query: CardMemoryQuery | str = NPU):
    return query_card_ratios(prometheus.url, query, timeout=5.0)


# --- the npu-exporter preset through real Prometheus ------------------------------------------

def test_card_at_93_percent_is_read_back_and_the_other_card_is_untouched(exporter, prometheus):
    wait_for(lambda: ratios(prometheus), lambda r: ("node-a", "0") in r and ("node-a", "1") in r,
             what="both cards scraped")
    exporter.set_ratio("node-a", 1, 0.93)
    got = wait_for(lambda: ratios(prometheus),
                   lambda r: r.get(("node-a", "1"), (0,))[0] == pytest.approx(0.93),
                   what="card 1 at 0.93")
    assert got[("node-a", "0")].ratio == pytest.approx(0.42)
    assert got[("node-a", "1")].ratio == pytest.approx(0.93)
    for reading in got.values():  # stamped with their scrape time, not long ago
        assert time.time() - reading.sample_ts < 10


def test_old_exporter_timestamps_come_back_and_the_law_calls_them_stale(exporter, prometheus):
    # npu-exporter stamps samples itself; a stuck one keeps serving an old stamp. Prometheus
    # still returns the series for 5 minutes, so only the sample time reveals it.
    stamp = round(time.time() - 120, 3)
    exporter.set_ratio("node-old", 3, 0.95, timestamp=stamp)
    got = wait_for(lambda: ratios(prometheus), lambda r: ("node-old", "3") in r,
                   what="old-stamped card")
    reading = got[("node-old", "3")]
    assert reading.ratio == pytest.approx(0.95)
    assert reading.sample_ts == pytest.approx(stamp, abs=0.002)
    ceiling = type("Ceiling", (), {"max_sequences": 64, "max_tokens": 65536})()
    state = step(GovernorParams(), ceiling, CardState.initial(ceiling), reading.ratio,
                 reading.sample_ts, time.time())
    assert state.stale and state.limits.max_sequences == 64  # held, not cut
    assert "old" in state.reason


def test_a_card_that_stops_reporting_disappears(exporter, prometheus):
    exporter.set_ratio("node-gone", 0, 0.3)
    wait_for(lambda: ratios(prometheus), lambda r: ("node-gone", "0") in r, what="card seen")
    exporter.remove("node-gone")
    # Prometheus writes a staleness marker on the next scrape: the governor sees "no series".
    wait_for(lambda: ratios(prometheus), lambda r: ("node-gone", "0") not in r,
             what="card gone")


def test_node_from_the_scrape_target_when_the_exporter_has_no_node_label(exporter, prometheus):
    wait_for(lambda: ratios(prometheus), lambda r: ("node-a", "0") in r, what="scraped")
    got = ratios(prometheus, npu_exporter_query(node_label="instance"))
    assert ("127.0.0.1", "0") in got and not any(node.startswith("node-") for node, _ in got)


def test_async_client_gives_the_same_answer(prometheus):
    wait_for(lambda: ratios(prometheus), lambda r: ("node-a", "0") in r, what="scraped")
    now = time.time()
    sync = query_card_ratios(prometheus.url, NPU, at=now)
    assert asyncio.run(aquery_card_ratios(prometheus.url, NPU, at=now)) == sync


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


@pytest.mark.parametrize("expr, needle", [
    ("sum(", "bad_data"),
    ("1", "expected an instant vector"),
    ("vector(1)", "without node/device labels"),
])
def test_bad_queries_are_query_errors(prometheus, expr, needle):
    with pytest.raises(PrometheusQueryError, match=needle):
        ratios(prometheus, expr)


# --- the other presets, with promtool -------------------------------------------------------

def _promtool_test(tmp_path: Path, series: dict[str, str], checks: list[tuple[str, list]]):
    """Evaluate each expression at 2m over ``series`` (1 m interval) and compare samples."""
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
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_dcgm_preset(tmp_path):
    q = PRESETS["dcgm"]
    gpu = 'gpu="{g}", Hostname="gpu-host", UUID="GPU-{g}", modelName="H100", job="dcgm"'
    _promtool_test(tmp_path, {
        f'DCGM_FI_DEV_FB_USED{{{gpu.format(g=0)}}}': "16384x2",
        f'DCGM_FI_DEV_FB_FREE{{{gpu.format(g=0)}}}': "49152x2",
        f'DCGM_FI_DEV_FB_USED{{{gpu.format(g=1)}}}': "75000 _ _",  # stuck since t=0
        f'DCGM_FI_DEV_FB_FREE{{{gpu.format(g=1)}}}': "5000 _ _",
    }, [
        (q.ratio, [('{node="gpu-host", device="0"}', 0.25),
                   ('{node="gpu-host", device="1"}', 0.9375)]),
        (q.sample_time, [('{node="gpu-host", device="0"}', 120),
                         ('{node="gpu-host", device="1"}', 0)]),
    ])


def test_npu_preset_edge_cases(tmp_path):
    by_instance = npu_exporter_query(node_label="instance")
    _promtool_test(tmp_path, {
        'npu_chip_info_hbm_used_memory{id="0", instance="10.0.0.5:9101", job="a"}': "58982x2",
        'npu_chip_info_hbm_total_memory{id="0", instance="10.0.0.5:9101", job="a"}': "65536x2",
        # The same card scraped by a second job reads higher: the preset keeps the higher one.
        'npu_chip_info_hbm_used_memory{id="0", instance="10.0.0.5:9101", job="b"}': "61000x2",
        'npu_chip_info_hbm_total_memory{id="0", instance="10.0.0.5:9101", job="b"}': "65536x2",
        'npu_chip_info_hbm_used_memory{id="1", instance="[fd00::7]:9101", job="a"}': "100x2",
        'npu_chip_info_hbm_total_memory{id="1", instance="[fd00::7]:9101", job="a"}': "0x2",
    }, [
        # Zero capacity gives no series (held stale), not +Inf (which would read as pressure).
        (by_instance.ratio, [('{node="10.0.0.5", device="0"}', 61000 / 65536)]),
        (by_instance.sample_time, [('{node="10.0.0.5", device="0"}', 120),
                                   ('{node="[fd00::7]", device="1"}', 120)]),
    ])


def test_embedfleet_preset_reads_the_recording_rule(tmp_path):
    q = PRESETS["embedfleet"]
    assert q.ratio == "card:embedfleet_memory:ratio"
    _promtool_test(tmp_path, {'card:embedfleet_memory:ratio{node="n0", device="1"}': "0.5 0.93 _"},
                   [(q.ratio, [('card:embedfleet_memory:ratio{node="n0", device="1"}', 0.93)]),
                    (q.sample_time, [('{node="n0", device="1"}', 60)])])


def test_preset_names_are_the_literal():
    assert set(PRESETS) == set(PRESET_NAMES)
    assert dcgm_query().ratio == PRESETS["dcgm"].ratio


# --- the stand-in exporter itself -------------------------------------------------------------

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
    proc = subprocess.Popen([sys.executable, "-m", "monitoring.exporters.standin_npu_exporter",
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


# --- the Prometheus process helper ------------------------------------------------------------

def test_bad_config_fails_start_with_the_log(tmp_path):
    start = time.monotonic()
    with pytest.raises(PrometheusStartError, match="exited") as err:
        start_prometheus("scrape_configs: [{job_name: x, bogus_key: 1}]", tmp_path, free_port(),
                         ready_timeout=15)
    assert "bogus_key" in str(err.value)
    assert time.monotonic() - start < 15


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
