"""The chaos tool's pure parts: URL guard, fault schedule, options, workload, report.

The fault injection itself needs a live cluster and kills its processes, so it is exercised by the
documented soak command (`python -m embedfleet.benchmarks.chaos --soak`), not here.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import pytest

from embedfleet.benchmarks import chaos
from embedfleet.deployments.api.openai import parse_embedding_request


@pytest.mark.parametrize("url", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/",
                                 "http://127.4.5.6:9000", "http://localhost:8000",
                                 "https://localhost", "http://[::1]:8000"])
def test_loopback_urls_are_accepted(url):
    assert chaos.check_loopback(url) == url.rstrip("/")


@pytest.mark.parametrize("url", ["http://10.0.0.5:8000", "http://0.0.0.0:8000",
                                 "http://192.168.1.10:8000", "http://example.com:8000",
                                 "http://localhost.example.com:8000", "http://127.0.0.1.nip.io",
                                 "http://127.0.0.1@evil.example:8000", "http://[::2]:8000",
                                 "ftp://127.0.0.1/", "127.0.0.1:8000", "http://:8000", ""])
def test_other_urls_are_refused(url):
    with pytest.raises(ValueError):
        chaos.check_loopback(url)


def test_parse_faults():
    assert chaos.parse_faults("none") == ()
    assert chaos.parse_faults("") == ()
    assert chaos.parse_faults(" kill-replica, stop-prometheus ") == ("kill-replica",
                                                                      "stop-prometheus")
    with pytest.raises(ValueError, match="rm-rf"):
        chaos.parse_faults("kill-engine,rm-rf")


def test_schedule_takes_kinds_in_turn_after_a_warm_up_period():
    kinds = ["kill-replica", "kill-engine", "stop-prometheus"]
    assert chaos.fault_schedule(60, 20, kinds) == [(20, "kill-replica"), (40, "kill-engine")]
    assert chaos.fault_schedule(65, 20, kinds) == [(20, "kill-replica"), (40, "kill-engine"),
                                                   (60, "stop-prometheus")]


def test_soak_schedule_is_a_fault_every_minute_for_ten_minutes():
    plan = chaos.fault_schedule(600, 60, chaos.FAULT_KINDS)
    assert [t for t, _ in plan] == [60 * i for i in range(1, 10)]
    assert [k for _, k in plan[:4]] == [*chaos.FAULT_KINDS, chaos.FAULT_KINDS[0]]


@pytest.mark.parametrize("duration, every, kinds", [(10, 30, ["kill-engine"]),
                                                    (30, 30, ["kill-engine"]),
                                                    (60, 0, ["kill-engine"]), (60, 10, [])])
def test_no_faults_when_none_fit_or_none_asked(duration, every, kinds):
    assert chaos.fault_schedule(duration, every, kinds) == []


def test_percentile_is_nearest_rank():
    values = list(range(100, 0, -1))  # 1..100, unsorted
    assert chaos.percentile(values, 50) == 50
    assert chaos.percentile(values, 99) == 99
    assert chaos.percentile(values, 100) == 100
    assert chaos.percentile(values, 0) == 1
    assert chaos.percentile([7.5], 99) == 7.5
    assert chaos.percentile([], 50) is None


def test_classify_counts_vectors_against_inputs():
    three = {"data": [{}, {}, {}]}
    assert chaos.classify(200, three, 3) == "ok"
    assert chaos.classify(200, three, 2) == "bad_200"
    assert chaos.classify(200, None, 1) == "bad_200"
    assert chaos.classify(503, {"error": {}}, 1) == "503"


def test_mixed_requests_are_valid_bounded_and_seeded():
    models = ["all-minilm-l6-v2", "tiny-qwen3"]
    a = [chaos.mixed_request(random.Random(3), models) for _ in range(1)]
    assert a == [chaos.mixed_request(random.Random(3), models)]
    rng = random.Random(0)
    shapes = set()
    for _ in range(300):
        body, n = chaos.mixed_request(rng, models)
        req = parse_embedding_request(body)  # the router would accept it
        assert len(req.input) == n and 1 <= n <= 16
        assert req.model in models
        shapes.add("ids" if req.is_tokens else "one" if n == 1 else "batch")
        if req.is_tokens:
            assert all(0 <= t < 30522 for t in req.input[0])
        else:
            assert all(len(t.split()) <= 60 for t in req.input)
    assert shapes == {"ids", "one", "batch"}


def _args(**kw) -> argparse.Namespace:
    base = dict(url="http://127.0.0.1:8000", duration=None, concurrency=None, rps=None,
                max_requests=None, fault_every=None, faults=None, soak=False, seed=0,
                prometheus_down=20.0, config=None, request_timeout=60.0)
    return argparse.Namespace(**{**base, **kw})


def test_defaults_are_load_only():
    opts = chaos.resolve_options(_args())
    assert opts["faults"] == [] and opts["concurrency"] == 4 and opts["duration"] == 60


def test_soak_preset_and_flags_override_it():
    soak = chaos.resolve_options(_args(soak=True))
    assert soak["duration"] == 600 and soak["fault_every"] == 60
    assert soak["faults"] == list(chaos.FAULT_KINDS)
    assert chaos.fault_schedule(soak["duration"], soak["fault_every"], soak["faults"])
    short = chaos.resolve_options(_args(soak=True, duration=120, rps=5.0))
    assert short["duration"] == 120 and short["rps"] == 5.0 and short["concurrency"] is None
    assert short["fault_every"] == 60


@pytest.mark.parametrize("kw", [dict(duration=0), dict(duration=chaos.MAX_DURATION_S + 1),
                                dict(max_requests=0),
                                dict(max_requests=chaos.MAX_REQUESTS + 1),
                                dict(concurrency=chaos.MAX_CONCURRENCY + 1), dict(rps=0.0),
                                dict(faults="kill-engine", fault_every=0.0),
                                dict(faults="explode"), dict(url="http://10.1.2.3:8000")])
def test_out_of_bounds_options_are_refused(kw):
    with pytest.raises(ValueError):
        chaos.resolve_options(_args(**kw))


def test_main_refuses_a_remote_url_before_any_traffic(capsys):
    with pytest.raises(SystemExit) as exc:
        chaos.main(["--url", "http://203.0.113.9:8000", "--duration", "1"])
    assert exc.value.code == 2
    assert "not loopback" in capsys.readouterr().err


ACTORS = [
    {"class_name": "ServeReplica:embedfleet:engine-all-minilm-l6-v2", "state": "ALIVE",
     "name": "SERVE_REPLICA::embedfleet#engine-all-minilm-l6-v2#a", "pid": 11},
    {"class_name": "ServeReplica:embedfleet:engine-all-minilm-l6-v2", "state": "DEAD",
     "name": "SERVE_REPLICA::embedfleet#engine-all-minilm-l6-v2#b", "pid": 12},
    {"class_name": "ServeReplica:embedfleet:Router", "state": "ALIVE", "pid": 13},
    {"class_name": "ServeReplica:embedfleet:MemoryGovernor", "state": "ALIVE", "pid": 14},
    {"class_name": "ProxyActor", "state": "ALIVE", "pid": 15},
    {"class_name": "ServeController", "state": "ALIVE", "pid": 16},
    {"class_name": "ServeReplica:other-app:engine-x", "state": "ALIVE", "pid": 17},
]


def test_only_alive_engine_replicas_are_fault_targets():
    assert [a["pid"] for a in chaos.engine_replicas(ACTORS)] == [11, 17]


def test_memory_roles():
    roles = [chaos.process_role(a["class_name"]) for a in ACTORS]
    assert roles == ["engine-all-minilm-l6-v2", "engine-all-minilm-l6-v2", "Router",
                     "MemoryGovernor", "proxy", None, "engine-x"]


def test_engine_core_is_found_among_a_replicas_children():
    children = [(21, "python3", ["/venv/bin/python3", "-B", "-c"]),
                (22, "VLLM::EngineCore", ["VLLM::EngineCore", "", ""]),
                (23, "VLLM::Worker", ["VLLM::Worker"]),
                (24, "VLLM::EngineCor", ["VLLM::EngineCore"])]  # name cut to 15 chars by Linux
    assert chaos.engine_core_pids(children) == [22, 24]
    assert chaos.engine_core_pids([(21, "python3", [])]) == []


def test_report_and_summary():
    tally = chaos.Tally()
    for i in range(1, 101):
        tally.sent += 1
        tally.record("ok" if i <= 97 else ("503" if i <= 99 else "timeout"), i / 1000)
    start = {"Router": {"processes": 1, "rss_mb": 200.0}, "proxy": {"processes": 1,
                                                                     "rss_mb": 100.0}}
    end = {"Router": {"processes": 1, "rss_mb": 212.5}, "engine-x": {"processes": 1,
                                                                      "rss_mb": 900.0}}
    faults = [{"t_s": 20.0, "kind": "kill-replica", "ok": True, "target": "actor a"},
              {"t_s": 40.0, "kind": "kill-engine", "ok": False, "error": "RuntimeError: none"}]
    report = chaos.build_report({"duration": 50}, tally, 50.0, faults, start, end)
    r = report["requests"]
    assert (r["sent"], r["succeeded"], r["failed"]) == (100, 97, 3)
    assert r["failed_by_status"] == {"503": 2, "timeout": 1}
    assert r["success_ratio"] == 0.97 and r["achieved_rps"] == 2.0
    assert report["latency_ms"]["ok_p50"] == 49.0 and report["latency_ms"]["ok_p99"] == 97.0
    assert report["latency_ms"]["all_max"] == 100.0
    assert report["memory"]["growth_mb"] == {"Router": 12.5}  # only roles seen at both ends
    text = chaos.summary(report)
    assert "100 requests" in text and "succeeded 97" in text and "97.00%" in text
    assert "kill-engine" in text and "RuntimeError: none" in text and "+12.5" in text


def test_empty_report_does_not_divide_by_zero():
    report = chaos.build_report({}, chaos.Tally(), 0.0, [], {}, {})
    assert report["requests"]["success_ratio"] is None
    assert "n/a" in chaos.summary(report)


# -- the orchestration, with a stand-in cluster: faults in turn, Prometheus always restored ----
class FakeCluster:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.prometheus_stopped = False

    def kill_replica(self) -> str:
        self.calls.append("kill-replica")
        return "actor a"

    def kill_engine(self) -> str:
        raise RuntimeError("no EngineCore child under replica pid 7")

    def stop_prometheus(self) -> str:
        self.calls.append("stop")
        self.prometheus_stopped = True
        return "stopped"

    def start_prometheus(self) -> str:
        self.calls.append("start")
        self.prometheus_stopped = False
        return "restarted"


def _drive(load, **opts):
    cluster = FakeCluster()
    base = {"duration": 0.9, "fault_every": 0.2, "prometheus_down_s": 30.0,
            "faults": list(chaos.FAULT_KINDS)}
    return cluster, asyncio.run(chaos.drive({**base, **opts}, cluster, load))


async def _steady_load(tally, deadline):
    while time.monotonic() < deadline:
        tally.sent += 1
        tally.record("ok", 0.001)
        await asyncio.sleep(0.01)


def test_faults_run_in_turn_and_a_stopped_prometheus_is_restarted_at_the_end():
    cluster, (tally, log, wall) = _drive(_steady_load)
    assert [e["kind"] for e in log] == ["kill-replica", "kill-engine", "stop-prometheus",
                                        "kill-replica", "restart-prometheus"]
    engine = log[1]
    assert engine["ok"] is False and "no EngineCore child" in engine["error"]
    assert cluster.calls == ["kill-replica", "stop", "kill-replica", "start"]
    assert not cluster.prometheus_stopped and tally.sent > 10 and wall >= 0.9


def test_prometheus_comes_back_after_its_down_time_during_the_run():
    cluster, (_, log, _) = _drive(_steady_load, faults=["stop-prometheus"], duration=0.5,
                                  prometheus_down_s=0.05)
    assert [e["kind"] for e in log] == ["stop-prometheus", "restart-prometheus"] * 2
    assert cluster.calls == ["stop", "start", "stop", "start"]


def test_prometheus_is_restored_when_the_load_fails():
    cluster = FakeCluster()

    async def failing_load(tally, deadline):
        await asyncio.sleep(0.3)
        raise RuntimeError("load broke")

    opts = {"duration": 10, "fault_every": 0.1, "prometheus_down_s": 30.0,
            "faults": ["stop-prometheus"]}
    with pytest.raises(RuntimeError, match="load broke"):
        asyncio.run(chaos.drive(opts, cluster, failing_load))
    assert cluster.calls[-1] == "start" and not cluster.prometheus_stopped


def test_faults_stop_when_the_load_ends_early():
    async def short_load(tally, deadline):
        await asyncio.sleep(0.05)  # e.g. --max-requests reached

    cluster, (_, log, wall) = _drive(short_load, duration=60, fault_every=1.0)
    assert log == [] and cluster.calls == [] and wall < 5
