"""The chaos tool without a cluster: URL guard, fault kinds and their cycling, options, which
actor each fault hits (from real ``ActorState`` records), the workload, the per-model arithmetic
and verdict of the report, and the orchestration with a stand-in cluster.

The fault injection itself needs a live cluster and kills its processes, so it is exercised by the
documented soak command (`python -m embedfleet.benchmarks.chaos --soak`), not here.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import time
import types
from pathlib import Path

import httpx
import pytest
import yaml
from embedfleet.benchmarks import chaos, chaos_targets
from embedfleet.benchmarks.chaos_load import send
from embedfleet.deployments.ingress.openai import parse_embedding_request
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.config.ray_options import serve_queue_limits
from ray.util.state.common import ActorState

S = chaos.Sample
ROOT = Path(__file__).resolve().parent.parent
E2E = Path(__file__).resolve().parent / "configs" / "e2e-cpu.yaml"


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


def test_soak_schedule_is_a_fault_every_minute_for_eleven_minutes_each_kind_once():
    plan = chaos.fault_schedule(660, 60, chaos.FAULT_KINDS)
    assert [t for t, _ in plan] == [60 * i for i in range(1, 11)]
    assert [k for _, k in plan] == list(chaos.FAULT_KINDS)  # ten kinds, ten slots


def test_longer_soaks_cycle_through_the_kinds_in_order():
    kinds = [k for _, k in chaos.fault_schedule(1200, 60, chaos.FAULT_KINDS)]
    assert len(kinds) == 19 and kinds == (list(chaos.FAULT_KINDS) * 3)[:19]


def test_every_issue_fault_kind_exists_and_every_kind_but_prometheus_has_a_target():
    assert {"kill-proxy", "kill-controller", "kill-governor", "kill-registry", "pause-engine",
            "flood-kill", "kill-replica", "kill-engine", "stop-prometheus", "kill-router"} == set(
        chaos.FAULT_KINDS)
    assert set(chaos.TARGETS) == set(chaos.FAULT_KINDS) - {"stop-prometheus"}
    assert chaos.parse_faults(",".join(chaos.FAULT_KINDS)) == chaos.FAULT_KINDS


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
                prometheus_down=20.0, config=None, request_timeout=60.0, pause=None,
                burst=None, connection_retries=None)
    return argparse.Namespace(**{**base, **kw})


def test_defaults_are_load_only():
    opts = chaos.resolve_options(_args())
    assert opts["faults"] == [] and opts["concurrency"] == 4 and opts["duration"] == 60


def test_soak_preset_and_flags_override_it():
    soak = chaos.resolve_options(_args(soak=True))
    assert soak["duration"] == 660 and soak["fault_every"] == 60
    assert soak["faults"] == list(chaos.FAULT_KINDS)
    plan = chaos.fault_schedule(soak["duration"], soak["fault_every"], soak["faults"])
    assert {k for _, k in plan} == set(chaos.FAULT_KINDS)
    assert soak["pause_s"] is None and soak["burst"] is None  # filled from the cluster's config
    short = chaos.resolve_options(_args(soak=True, duration=120, rps=5.0))
    assert short["duration"] == 120 and short["rps"] == 5.0 and short["concurrency"] is None
    assert short["fault_every"] == 60


@pytest.mark.parametrize("kw", [dict(duration=0), dict(duration=chaos.MAX_DURATION_S + 1),
                                dict(max_requests=0),
                                dict(max_requests=chaos.MAX_REQUESTS + 1),
                                dict(concurrency=chaos.MAX_CONCURRENCY + 1), dict(rps=0.0),
                                dict(faults="kill-engine", fault_every=0.0),
                                dict(faults="explode"), dict(url="http://10.1.2.3:8000"),
                                dict(pause=0.0), dict(pause=chaos.MAX_PAUSE_S + 1),
                                dict(burst=0), dict(burst=chaos.MAX_BURST + 1),
                                dict(connection_retries=-1),
                                dict(connection_retries=chaos.MAX_CONNECTION_RETRIES + 1)])
def test_out_of_bounds_options_are_refused(kw):
    with pytest.raises(ValueError):
        chaos.resolve_options(_args(**kw))


def test_main_refuses_a_remote_url_before_any_traffic(capsys):
    with pytest.raises(SystemExit) as exc:
        chaos.main(["--url", "http://203.0.113.9:8000", "--duration", "1"])
    assert exc.value.code == 2
    assert "not loopback" in capsys.readouterr().err


def test_main_help_lists_every_fault_kind(capsys):
    with pytest.raises(SystemExit) as exc:
        chaos.main(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and "--pause" in out and "--burst" in out
    assert all(f"  {k} " in out for k in chaos.FAULT_KINDS)


# -- which actor each fault hits, from the records Ray's state API returns -----------------------
def _actor(class_name: str, pid: int, name: str | None = None, state: str = "ALIVE") -> ActorState:
    return ActorState(actor_id=f"id{pid}", class_name=class_name, state=state, job_id="01",
                      name=name, node_id="n1", pid=pid, ray_namespace="serve")


ACTORS = [
    _actor("ServeReplica:embedfleet:engine-all-minilm-l6-v2", 11,
           "SERVE_REPLICA::embedfleet#engine-all-minilm-l6-v2#a"),
    _actor("ServeReplica:embedfleet:engine-all-minilm-l6-v2", 12,
           "SERVE_REPLICA::embedfleet#engine-all-minilm-l6-v2#b", state="DEAD"),
    _actor("ServeReplica:embedfleet:Router", 13, "SERVE_REPLICA::embedfleet#Router#r"),
    _actor("ServeReplica:embedfleet:MemoryGovernor", 14,
           "SERVE_REPLICA::embedfleet#MemoryGovernor#g"),
    _actor("ProxyActor", 15, "SERVE_PROXY_ACTOR-n1"),
    _actor("ServeController", 16, "SERVE_CONTROLLER_ACTOR"),
    _actor("ServeReplica:other-app:engine-x", 17, "SERVE_REPLICA::other-app#engine-x#c"),
    _actor("ServeReplica:embedfleet:FleetRegistry", 18,
           "SERVE_REPLICA::embedfleet#FleetRegistry#f"),
    _actor("ServeReplica:embedfleet:engine-tiny-qwen3", 0, "starting"),  # pid 0: not created yet
    _actor("ServeReplica:embedfleet:MemoryGovernorV2", 19, "lookalike"),
    _actor("ServeReplica:embedfleet:engine-all-minilm-l6-v2", 20,
           "SERVE_REPLICA::embedfleet#engine-all-minilm-l6-v2#c"),
    _actor("SomeoneElsesActor", 21, "x"),
]


@pytest.mark.parametrize("kind, pids", [
    ("kill-proxy", [15]), ("kill-controller", [16]), ("kill-governor", [14]),
    ("kill-registry", [18]), ("kill-replica", [11, 20, 17]), ("kill-engine", [11, 20, 17]),
    ("pause-engine", [11, 20, 17]), ("flood-kill", [11, 20, 17])])
def test_each_fault_finds_its_alive_started_actor_in_real_actor_records(kind, pids):
    assert [r["pid"] for r in chaos.find_targets(kind, ACTORS)] == pids


def test_the_config_app_limits_replica_targets_but_not_the_proxy():
    assert [r["pid"] for r in chaos.find_targets("kill-replica", ACTORS, app="embedfleet")] == [
        11, 20]
    assert chaos.find_targets("kill-governor", ACTORS, app="other-app") == []
    assert [r["pid"] for r in chaos.find_targets("kill-proxy", ACTORS, app="other-app")] == [15]


def test_dict_records_work_too_and_the_target_choice_is_seeded():
    dicts = [dataclasses.asdict(a) for a in ACTORS]
    assert chaos.find_targets("kill-registry", dicts) == chaos.find_targets("kill-registry",
                                                                            ACTORS)
    picks = {chaos_targets.pick_target("kill-replica", ACTORS, random.Random(seed))["pid"]
             for seed in range(20)}
    assert picks == {11, 17, 20}
    assert (chaos_targets.pick_target("kill-replica", ACTORS, random.Random(4))
            == chaos_targets.pick_target("kill-replica", ACTORS, random.Random(4)))
    with pytest.raises(RuntimeError, match="no alive Serve controller"):
        chaos_targets.pick_target("kill-controller", ACTORS[:3], random.Random(0))


def test_kill_router_hits_the_engine_replicas_of_an_app_without_a_router():
    # ACTORS' Router (pid 13) is embedfleet's; other-app serves one model, engine-x taking HTTP
    router = chaos_targets.pick_target("kill-router", ACTORS, random.Random(0), app="embedfleet")
    assert router["pid"] == 13
    ingress = chaos_targets.pick_target("kill-router", ACTORS, random.Random(0), app="other-app")
    assert ingress["pid"] == 17
    # an app whose only Router is dead (being replaced) has no direct ingress: nothing to kill
    dead = [_actor(a.class_name, a.pid, a.name, "DEAD") if a.pid == 13 else a for a in ACTORS]
    with pytest.raises(RuntimeError, match="no alive Router replica"):
        chaos_targets.pick_target("kill-router", dead, random.Random(0), app="embedfleet")


def test_engine_replicas_and_their_models():
    assert [a["pid"] for a in chaos.engine_replicas(ACTORS)] == [11, 20, 17]
    assert chaos.model_of("ServeReplica:embedfleet:engine-all-minilm-l6-v2") == "all-minilm-l6-v2"
    assert chaos.model_of("ServeReplica:embedfleet:Router") is None


def test_memory_roles_and_the_processes_followed():
    roles = [chaos.process_role(a.class_name) for a in ACTORS[:8]]
    assert roles == ["engine-all-minilm-l6-v2", "engine-all-minilm-l6-v2", "Router",
                     "MemoryGovernor", "proxy", "controller", "engine-x", "FleetRegistry"]
    assert [r["pid"] for r in chaos.serve_actors(ACTORS)] == [11, 13, 14, 15, 16, 17, 18, 19, 20]


def test_a_signal_only_goes_to_the_actors_own_worker_process():
    ok = chaos.is_actor_process
    assert ok(["ray::ProxyActor"], "ProxyActor")
    assert ok(["ray::ServeController.run_control_loop", ""], "ServeController")
    assert ok(["ray::ServeReplica:embedfleet:engine-x"], "ServeReplica:embedfleet:engine-x")
    assert not ok(["ray::ServeReplica:embedfleet:engine-x2"], "ServeReplica:embedfleet:engine-x")
    assert not ok(["/usr/bin/python", "ray::ProxyActor"], "ProxyActor")  # a reused pid
    assert not ok([], "ProxyActor")


def test_engine_core_is_found_among_a_replicas_children():
    children = [(21, "python3", ["/venv/bin/python3", "-B", "-c"]),
                (22, "VLLM::EngineCore", ["VLLM::EngineCore", "", ""]),
                (23, "VLLM::Worker", ["VLLM::Worker"]),
                (24, "VLLM::EngineCor", ["VLLM::EngineCore"])]  # name cut to 15 chars by Linux
    assert chaos.engine_core_pids(children) == [22, 24]
    assert chaos.engine_core_pids([(21, "python3", [])]) == []


@pytest.mark.parametrize("kind, name, no_restart", [
    ("kill-controller", "SERVE_CONTROLLER_ACTOR", False),  # killed for good, Serve is gone
    ("kill-proxy", "SERVE_PROXY_ACTOR-n1", True),
    ("kill-registry", "SERVE_REPLICA::embedfleet#FleetRegistry#f", True)])
def test_kill_actor_lets_ray_restart_only_the_controller(kind, name, no_restart):
    killed = []
    cluster = chaos.Cluster.__new__(chaos.Cluster)  # no Ray: only the kill's arguments matter
    cluster.rng, cluster.app, cluster.actors = random.Random(0), "embedfleet", lambda: ACTORS
    cluster._ray = types.SimpleNamespace(get_actor=lambda name, namespace: (name, namespace),
                                         kill=lambda h, no_restart: killed.append((*h, no_restart)))
    target = cluster.kill_actor(kind)
    assert killed == [(name, "serve", no_restart)] and name in target


# -- flood and pause sizing ------------------------------------------------------------------
def test_the_burst_overfills_the_bound_serve_and_admission_give_a_model():
    cfg = parse_config(yaml.safe_load(E2E.read_text()), "e2e")
    minilm = next(m for m in cfg.models if m.name == "all-minilm-l6-v2")
    limits = serve_queue_limits(minilm)  # 64 + 8 per replica, as many queued in Serve
    size, bound = chaos.burst_size(minilm.budget_ceiling.max_sequences,
                                   minilm.admission.max_waiting, 2)
    assert bound == 2 * limits["max_ongoing_requests"] + limits["max_queued_requests"] == 216
    assert size == 324 > bound
    # Serve's limits are capped at MAX_ONGOING_REQUESTS (936): 3 x 936; the burst is capped too
    assert chaos.burst_size(256, 1024, 2) == (chaos.MAX_BURST, 2808)
    assert "not overfilled" in chaos.flood_plan(None, (256, 1024), 2)[1]
    assert chaos.flood_plan(None, (64, 8), 2) == (324, "burst 324 > admission bound 216")
    assert chaos.flood_plan(50, (64, 8), 1)[0] == 50
    assert chaos.flood_plan(None, None, 2) == (
        256, "burst 256 (admission bound unknown without --config)")


def test_the_default_pause_outlasts_the_health_stall_bound_and_three_failed_checks():
    assert chaos.default_pause(None) == 160  # the schema's 120 s stall bound + 4 x 10 s periods
    cfg = types.SimpleNamespace(health_stall_timeout_s=50.0, health_check_period_s=2.0)
    assert chaos.default_pause(cfg) == 58.0 > cfg.health_stall_timeout_s + 3 * 2.0


def test_the_default_client_timeout_waits_out_the_longest_answer_the_cluster_may_take():
    assert chaos.client_timeout(None) == 60.0
    cfg = parse_config(yaml.safe_load((ROOT / "tests" / "configs" / "e2e-cpu.yaml").read_text()
                                      .replace("TINY_QWEN3", "/nonexistent")), "test")
    bounds = [max(cfg.router.request_timeout_s, m.replicas.cold_start_hold_s) for m in cfg.models]
    assert chaos.client_timeout(cfg) == max(bounds) + 30 > cfg.router.request_timeout_s


@pytest.mark.parametrize("outcome, at_most", [("503", 6), ("connection_error", 6), ("ok", None)])
def test_a_closed_loop_worker_backs_off_after_a_failure_only(monkeypatch, outcome, at_most):
    from embedfleet.benchmarks import chaos_load

    async def instant(client, body, n, t0, connection_retries=0):
        await asyncio.sleep(0.001)
        return S(0.0, body["model"], outcome, 0.001, outcome == "503")
    monkeypatch.setattr(chaos_load, "send", instant)
    monkeypatch.setattr(chaos_load, "FAILURE_BACKOFF_S", 0.1)
    tally = chaos_load.Tally()
    opts = {"seed": 0, "concurrency": 1, "rps": None, "url": "http://127.0.0.1:9",
            "request_timeout_s": 1.0, "max_requests": 10_000, "connection_retries": 0}
    asyncio.run(chaos_load.run_load(opts, ["m"], tally, time.monotonic() + 0.45))
    if at_most is None:  # no failure, no pause: the loop runs as fast as answers come
        assert len(tally.samples) > 50
    else:  # ~0.45 s / 0.1 s pauses
        assert 3 <= len(tally.samples) <= at_most, len(tally.samples)


# -- what clients saw: per-model arithmetic and the verdict -------------------------------------
def test_client_records_retry_after_and_classifies_what_came_back():
    def reply(request):
        model = json.loads(request.content)["model"]
        return {"good": httpx.Response(200, json={"data": [{}]}),
                "busy": httpx.Response(429, headers={"Retry-After": "1"}, json={}),
                "bare": httpx.Response(503, json={}),
                "broken": httpx.Response(500, text="oops")}.get(model) or _raise(request)

    def _raise(request):
        raise httpx.ReadTimeout("slow", request=request)

    async def go():
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply),
                                     base_url="http://t") as client:
            return [await send(client, {"model": m, "input": "x"}, 1, 0.0)
                    for m in ("good", "busy", "bare", "broken", "slow")]
    got = [(s.model, s.outcome, s.retry_after) for s in asyncio.run(go())]
    assert got == [("good", "ok", False), ("busy", "429", True), ("bare", "503", False),
                   ("broken", "500", False), ("slow", "timeout", False)]


def test_connection_retries_resend_broken_connections_only_and_are_counted(monkeypatch):
    from embedfleet.benchmarks import chaos_load

    # the SDK's schedule: 0.5 s doubling, capped at 8 s
    assert [chaos_load.retry_pause_s(a) for a in (1, 2, 3, 9)] == [0.5, 1.0, 2.0, 8.0]
    monkeypatch.setattr(chaos_load, "retry_pause_s", lambda attempt: 0.0)
    calls: dict[str, int] = {}

    def reply(request):
        model = json.loads(request.content)["model"]
        calls[model] = calls.get(model, 0) + 1
        if model == "flaky" and calls[model] == 1:  # the first connection is cut
            raise httpx.RemoteProtocolError("peer closed", request=request)
        if model == "dead":
            raise httpx.ConnectError("refused", request=request)
        if model == "slow":
            raise httpx.ReadTimeout("slow", request=request)
        if model == "busy":
            return httpx.Response(503, headers={"Retry-After": "1"}, json={})
        return httpx.Response(200, json={"data": [{}]})

    async def go(retries):
        calls.clear()
        async with httpx.AsyncClient(transport=httpx.MockTransport(reply),
                                     base_url="http://t") as client:
            return [await send(client, {"model": m, "input": "x"}, 1, 0.0, retries)
                    for m in ("flaky", "dead", "slow", "busy")], dict(calls)
    got, n = asyncio.run(go(2))
    assert [(s.outcome, s.retries) for s in got] == [("ok", 1), ("connection_error", 2),
                                                      ("timeout", 0), ("503", 0)]
    assert n == {"flaky": 2, "dead": 3, "slow": 1, "busy": 1}  # timeouts, statuses: never resent
    got, _ = asyncio.run(go(0))
    assert [(s.outcome, s.retries) for s in got][:2] == [("connection_error", 0),
                                                         ("connection_error", 0)]
    st = chaos.by_model(asyncio.run(go(2))[0])
    assert st["flaky"]["connection_retried"] == st["flaky"]["ok_after_connection_retry"] == 1
    assert st["dead"]["connection_retried"] == 1 and st["dead"]["ok_after_connection_retry"] == 0


def _samples(model: str, *outcomes: tuple[str, bool], t_s: float = 0.0) -> list:
    return [S(t_s, model, o, (i + 1) / 100, ra) for i, (o, ra) in enumerate(outcomes)]


def test_per_model_figures_and_the_clean_failure_verdict():
    a = _samples("a", *[("ok", False)] * 96, ("503", True), ("429", True), ("503", True),
                 ("ok", False))
    b = _samples("b", ("ok", False), ("503", False), ("500", False), ("timeout", False),
                 ("connection_error", False), ("bad_200", False))
    got = chaos.by_model(a + b)
    assert list(got) == ["a", "b"]
    ga, gb = got["a"], got["b"]
    assert (ga["requests"], ga["successes"], ga["success_pct"]) == (100, 97, 97.0)
    assert ga["statuses"] == {"200": 97, "429": 1, "503": 2} and ga["timeouts"] == 0
    assert ga["every_failure_503_or_429_with_retry_after"] is True and ga["other_failures"] == {}
    assert (ga["p50_ms"], ga["p99_ms"], ga["failed_p99_ms"]) == (500.0, 990.0, 990.0)
    assert (gb["requests"], gb["successes"], gb["success_pct"]) == (6, 1, 16.667)
    assert gb["statuses"] == {"200": 2, "500": 1, "503": 1}  # no status for client-side failures
    assert (gb["timeouts"], gb["connection_errors"]) == (1, 1)
    assert gb["every_failure_503_or_429_with_retry_after"] is False
    assert gb["other_failures"] == {"503 without Retry-After": 1, "500": 1, "timeout": 1,
                                    "connection_error": 1, "bad_200": 1}


@pytest.mark.parametrize("outcome, retry_after", [("503", False), ("429", False), ("500", True),
                                                  ("timeout", False), ("bad_200", False)])
def test_one_unclean_failure_spoils_the_verdict(outcome, retry_after):
    group = [S(0, "m", "ok", 0.1), S(0, "m", "503", 0.1, True), S(0, "m", outcome, 0.1,
                                                                  retry_after)]
    assert chaos.stats(group)["every_failure_503_or_429_with_retry_after"] is False
    assert chaos.stats(group[:2])["every_failure_503_or_429_with_retry_after"] is True


def test_empty_groups_are_vacuously_clean():
    assert chaos.stats([]) == {
        "requests": 0, "successes": 0, "success_pct": None, "statuses": {}, "timeouts": 0,
        "connection_errors": 0, "every_failure_503_or_429_with_retry_after": True,
        "other_failures": {}, "p50_ms": None, "p99_ms": None, "failed_p99_ms": None,
        "connection_retried": 0, "ok_after_connection_retry": 0}


def _proc(pid, role, rss):
    return {"pid": pid, "role": role, "rss_mb": rss, "tree_rss_mb": rss * 2}


def test_report_splits_clients_by_fault_window_and_model():
    tally = chaos.Tally(t0=0.0)
    tally.samples += _samples("a", *[("ok", False)] * 10, t_s=5.0)           # before faults
    tally.samples += _samples("a", ("ok", False), ("503", True), t_s=25.0)    # kill-replica
    tally.samples += _samples("b", ("timeout", False), t_s=26.0)
    tally.samples += _samples("c", ("ok", False), t_s=40.0)  # sent as kill-proxy came: its window
    tally.samples += _samples("b", ("ok", False), ("ok", False), t_s=45.0)    # kill-proxy
    tally.samples += _samples("a", ("ok", False), t_s=60.0)                   # sent at the end
    tally.sent = len(tally.samples)
    log = [{"t_s": 20.0, "kind": "kill-replica", "ok": True, "target": "actor a"},
           {"t_s": 30.0, "kind": "stop-prometheus", "ok": False, "error": "RuntimeError: none"},
           {"t_s": 40.0, "kind": "kill-proxy", "ok": True, "target": "proxy"},
           {"t_s": 55.0, "kind": "restart-prometheus", "ok": True, "target": "restarted"}]
    start = [_proc(1, "Router", 200.0), _proc(2, "proxy", 100.0), _proc(3, "engine-x", 900.0)]
    end = [_proc(1, "Router", 212.5), _proc(4, "proxy", 90.0), _proc(3, "engine-x", 899.0)]
    report = chaos.build_report({"duration": 60}, tally, 60.0, log, start, end)
    before, (replica, prom, proxy, restart) = report["before_faults"], report["faults"]
    assert before["a"]["requests"] == 10 and set(before) == {"a"}
    assert replica["window_s"] == [20.0, 30.0]
    assert replica["clients"]["a"]["statuses"] == {"200": 1, "503": 1}
    assert replica["clients"]["b"]["timeouts"] == 1
    assert replica["clients"]["b"]["every_failure_503_or_429_with_retry_after"] is False
    assert prom["clients"] == {} and prom["window_s"] == [30.0, 40.0]
    assert proxy["window_s"] == [40.0, 60.0] and proxy["clients"]["b"]["successes"] == 2
    assert proxy["clients"]["c"]["requests"] == 1
    assert proxy["clients"]["a"]["requests"] == 1  # the last window keeps requests sent at the end
    assert "clients" not in restart  # undoing a fault opens no window
    head = report["summary"]
    assert head["success_pct"] == 88.235 and head["client_timeouts"] == 1  # 15 of 17
    assert head["success_pct_by_model"] == {"a": 92.308, "b": 66.667, "c": 100.0}
    assert head["every_failure_503_or_429_with_retry_after"] is False
    assert head["memory_growth_mb_by_process"] == {"Router:1": 12.5, "engine-x:3": -1.0}
    mem = report["memory"]
    assert mem["processes"]["gone"] == ["proxy:2"] and mem["processes"]["new"] == ["proxy:4"]
    assert mem["growth_mb"] == {"Router": 25.0, "engine-x": -2.0, "proxy": -20.0}  # trees
    text = chaos.summary(report)
    assert "17 requests" in text and "client timeouts 1" in text and "NO" in text
    assert "kill-proxy" in text and "RuntimeError: none" in text and "Router:1 +12.5" in text
    json.dumps(report)  # it is written as JSON


def test_report_and_summary_keep_the_overall_figures():
    tally = chaos.Tally()
    for i in range(1, 101):
        tally.sent += 1
        tally.record("ok" if i <= 97 else ("503" if i <= 99 else "timeout"), i / 1000)
    report = chaos.build_report({"duration": 50}, tally, 50.0, [], [], [])
    r = report["requests"]
    assert (r["sent"], r["succeeded"], r["failed"]) == (100, 97, 3)
    assert r["failed_by_status"] == {"503": 2, "timeout": 1}
    assert r["success_ratio"] == 0.97 and r["achieved_rps"] == 2.0
    assert report["latency_ms"]["ok_p50"] == 49.0 and report["latency_ms"]["ok_p99"] == 97.0
    assert report["latency_ms"]["all_max"] == 100.0
    assert "succeeded 97" in chaos.summary(report) and "97.00%" in chaos.summary(report)


def test_empty_report_does_not_divide_by_zero():
    report = chaos.build_report({}, chaos.Tally(), 0.0, [], [], [])
    assert report["requests"]["success_ratio"] is None
    assert "n/a" in chaos.summary(report)


# -- the orchestration, with a stand-in cluster: faults in turn, everything undone -------------
class FakeCluster:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.prometheus_stopped = False
        self.paused: list[int] = []

    def kill_actor(self, kind, record=None) -> str:
        self.calls.append(kind if record is None else f"{kind}:{record['pid']}")
        return f"actor {kind}"

    def kill_engine(self) -> str:
        raise RuntimeError("no EngineCore child under replica pid 7")

    def pause_engine(self, seconds):
        self.calls.append(f"pause {seconds}")
        self.paused += [41, 42]
        return "stopped", [41, 42]

    def resume_engine(self, procs) -> str:
        self.calls.append(f"resume {procs}")
        self.paused = [p for p in self.paused if p not in procs]
        return "resumed"

    def flood_target(self):
        return {"pid": 11}, "m", 2

    def admission(self, model):
        return (64, 8)

    async def flood(self, url, model, size, timeout_s, t0):
        self.calls.append(f"flood {model} {size}")
        await asyncio.sleep(0.05)
        return [S(1.0, model, "ok", 0.1), S(1.0, model, "429", 0.1, True)]

    def stop_prometheus(self) -> str:
        self.calls.append("stop")
        self.prometheus_stopped = True
        return "stopped"

    def start_prometheus(self) -> str:
        self.calls.append("start")
        self.prometheus_stopped = False
        return "restarted"


def _load_until(cluster: FakeCluster, calls: int, cap_s: float = 30.0):
    """A steady load that runs to its deadline and on until the stand-in cluster has had
    ``calls`` calls: on a loaded machine the fault timers run late, and the load ending would
    end the faults before they came. Fails rather than wait past ``cap_s``."""
    async def load(tally, deadline):
        while time.monotonic() < deadline or len(cluster.calls) < calls:
            assert time.monotonic() < deadline + cap_s, f"only {cluster.calls} came"
            tally.sent += 1
            tally.record("ok", 0.001)
            await asyncio.sleep(0.01)
    return load


def _drive(calls: int = 0, load=None, **opts):
    cluster = FakeCluster()
    base = {"duration": 0.9, "fault_every": 0.2, "prometheus_down_s": 30.0, "pause_s": 30.0,
            "faults": list(chaos.FAULT_KINDS), "url": "http://127.0.0.1:8000",
            "request_timeout_s": 5.0, "flood_lead_s": 0.01}
    load = load or _load_until(cluster, calls)
    return cluster, asyncio.run(chaos.drive({**base, **opts}, cluster, load))


def test_faults_run_in_turn_and_a_stopped_prometheus_is_restarted_at_the_end():
    cluster, (tally, log, wall) = _drive(calls=3)
    assert [e["kind"] for e in log] == ["kill-replica", "kill-engine", "stop-prometheus",
                                        "kill-proxy", "restart-prometheus"]
    engine = log[1]
    assert engine["ok"] is False and "no EngineCore child" in engine["error"]
    assert cluster.calls == ["kill-replica", "stop", "kill-proxy", "start"]
    assert not cluster.prometheus_stopped and tally.sent > 10 and wall >= 0.9
    assert all(-0.01 <= s.t_s <= wall for s in tally.samples)  # placed in the run's time


def test_all_kinds_reach_the_cluster_and_what_is_undone_is_undone_at_the_end():
    cluster, (_, log, _) = _drive(calls=10, duration=2.2)
    assert [e["kind"] for e in log if e["kind"] in chaos.FAULT_KINDS] == list(chaos.FAULT_KINDS)
    assert cluster.calls[:10] == ["kill-replica", "stop", "kill-proxy", "pause 30.0",
                                  "kill-governor", "flood m 324", "flood-kill:11",
                                  "kill-controller", "kill-registry", "kill-router"]
    assert sorted(cluster.calls[10:]) == ["resume [41, 42]", "start"]  # 30 s timers cut short
    assert cluster.paused == [] and not cluster.prometheus_stopped


def test_a_pause_is_undone_after_its_time_during_the_run():
    # the load waits for both resumes: were they left to the end, it would give up and fail
    cluster, (_, log, _) = _drive(calls=4, faults=["pause-engine"], duration=0.5, pause_s=0.05)
    assert sorted(e["kind"] for e in log) == ["pause-engine"] * 2 + ["resume-engine"] * 2
    assert sorted(cluster.calls) == ["pause 0.05"] * 2 + ["resume [41, 42]"] * 2
    assert cluster.calls[0] == "pause 0.05" and cluster.paused == []


def test_flood_kill_kills_under_the_burst_and_keeps_the_burst_apart_from_the_load():
    cluster, (tally, log, _) = _drive(calls=2, faults=["flood-kill"], duration=0.3)
    (entry,) = log
    assert cluster.calls == ["flood m 324", "flood-kill:11"]  # burst first, then the kill
    assert entry["ok"] and "burst 324 > admission bound 216 to m (2 replicas)" in entry["target"]
    assert entry["burst"]["m"]["statuses"] == {"200": 1, "429": 1}
    assert entry["burst"]["m"]["every_failure_503_or_429_with_retry_after"] is True
    assert {s.model for s in tally.samples} == {"_all"}  # not in the load's tally


def test_prometheus_comes_back_after_its_down_time_during_the_run():
    cluster, (_, log, _) = _drive(calls=4, faults=["stop-prometheus"], duration=0.5,
                                  prometheus_down_s=0.05)
    assert sorted(e["kind"] for e in log) == ["restart-prometheus"] * 2 + ["stop-prometheus"] * 2
    assert sorted(cluster.calls) == ["start", "start", "stop", "stop"]
    assert cluster.calls[0] == "stop" and not cluster.prometheus_stopped


def test_prometheus_and_engines_are_restored_when_the_load_fails():
    cluster = FakeCluster()

    async def failing_load(tally, deadline):
        while len(cluster.calls) < 2:  # both faults in
            await asyncio.sleep(0.01)
        raise RuntimeError("load broke")

    opts = {"duration": 10, "fault_every": 0.1, "prometheus_down_s": 30.0, "pause_s": 30.0,
            "faults": ["stop-prometheus", "pause-engine"]}
    with pytest.raises(RuntimeError, match="load broke"):
        asyncio.run(chaos.drive(opts, cluster, failing_load))
    assert not cluster.prometheus_stopped and cluster.paused == []
    assert sorted(cluster.calls[-2:]) == ["resume [41, 42]", "start"]


def test_faults_stop_when_the_load_ends_early():
    async def short_load(tally, deadline):
        await asyncio.sleep(0.05)  # e.g. --max-requests reached

    cluster, (_, log, wall) = _drive(load=short_load, duration=60, fault_every=1.0)
    assert log == [] and cluster.calls == [] and wall < 5
