"""The router's readiness view: send, hold or refuse at once, decided without a remote call."""

from __future__ import annotations

import asyncio

from embedfleet.deployments.common.contracts import ModelReadiness
from embedfleet.deployments.ingress.readiness import ReadinessView

WAIT = "1 replica(s) waiting for a card: each needs {\"CPU_CARD\": 1}; 0 of the cluster's 6 cards are free"


def r(ready: int, starting: int, waiting: str = "") -> ModelReadiness:
    return ModelReadiness(ready=ready, starting=starting, waiting=waiting, checked_at=0.0)


def view(now: list[float]) -> ReadinessView:
    async def never():  # refresh_forever is not used by these tests
        raise AssertionError
    return ReadinessView(never, grace_s=2.0, max_age_s=3.0, clock=lambda: now[0])


def test_no_replica_and_none_starting_is_refused_only_after_the_grace():
    now = [100.0]
    v = view(now)
    v.update({"m": r(0, 0, WAIT)})
    assert v.unservable("m") is None  # a replica may have just died: Serve is replacing it
    now[0] += 1.0
    v.update({"m": r(0, 0, WAIT)})
    assert v.unservable("m") is None
    now[0] += 1.5  # 2.5 s with nothing ready or starting
    v.update({"m": r(0, 0, WAIT)})
    assert v.unservable("m") == WAIT


def test_a_starting_replica_means_hold_and_resets_the_grace():
    now = [0.0]
    v = view(now)
    v.update({"m": r(0, 0)})
    now[0] = 2.5
    v.update({"m": r(0, 1)})  # a replacement was created
    assert v.unservable("m") is None and v.starting_only("m")
    assert not asyncio.run(v.has_ready("m"))
    now[0] = 3.0
    v.update({"m": r(0, 0)})  # gone again: the grace starts over
    assert v.unservable("m") is None
    now[0] = 5.1
    v.update({"m": r(0, 0)})
    assert v.unservable("m") == "no replica is running or starting"


def test_ready_replicas_serve_and_are_not_held():
    now = [0.0]
    v = view(now)
    v.update({"m": r(2, 1)})
    assert asyncio.run(v.has_ready("m")) and not v.starting_only("m")
    assert v.unservable("m") is None


def test_a_stale_view_decides_nothing():
    # The registry unreachable: the view neither refuses nor holds (Serve's queue decides).
    now = [0.0]
    v = view(now)
    v.update({"m": r(0, 0, WAIT)})
    now[0] = 2.5
    v.update({"m": r(0, 0, WAIT)})
    assert v.unservable("m") == WAIT
    now[0] = 6.0  # no refresh for 3.5 s > max_age_s
    assert v.unservable("m") is None and v.get("m") is None
    assert not v.starting_only("m") and v.waiting("m") == ""
    assert v.unservable("unknown-model") is None


def test_refresh_forever_keeps_the_last_view_through_a_failed_fetch():
    answers = [{"m": r(1, 0)}, RuntimeError("registry restarting"), {"m": r(0, 1)}]
    seen_before_fetch = []

    async def scenario():
        finished = asyncio.Event()
        v = ReadinessView(lambda: fetch(v, finished), every_s=0.001)
        task = asyncio.create_task(v.refresh_forever())
        await asyncio.wait_for(finished.wait(), timeout=10)
        await asyncio.sleep(0.01)
        task.cancel()
        return v

    async def fetch(v, finished):
        seen_before_fetch.append(v.get("m"))
        a = answers.pop(0)
        if not answers:
            finished.set()
        if isinstance(a, Exception):
            raise a
        return a

    v = asyncio.run(scenario())
    assert seen_before_fetch[0] is None
    assert seen_before_fetch[2].ready == 1  # the failed fetch in between kept the view
    assert v.starting_only("m")  # the third answer is the view now


def test_a_replacement_needing_a_card_still_being_freed_counts_as_starting_at_first():
    # An engine replaced after its death: the new actor waits for the card the old one (or a
    # replica scaling down) is still giving back. Holding requests for it is right; refusing
    # them with "waiting for a card" two seconds in was wrong (the soak's kill-engine 503s).
    from embedfleet.deployments.fleet.placement import PLACEMENT_GRACE_S, blocked_replicas

    assert blocked_replicas(1, free_cards=0, creating_for_s=2.0) == 0
    assert blocked_replicas(1, free_cards=0, creating_for_s=PLACEMENT_GRACE_S) == 1
    assert blocked_replicas(2, free_cards=1, creating_for_s=60.0) == 0  # a card is free
    assert blocked_replicas(0, free_cards=0, creating_for_s=60.0) == 0


def test_a_replacement_waiting_for_a_card_another_model_scaled_up_into_is_still_coming():
    # The soak's kill-engine window: tiny-qwen3's card went to minilm-autoscale scaling 1 -> 2;
    # the replacement waited for autoscale to scale back down. Held, not refused at the grace mark.
    from embedfleet.deployments.fleet.placement import (
        PLACEMENT_GRACE_S, blocked_replicas, reclaimable_cards)

    alive = {"engine-a": 2, "engine-auto": 2, "engine-zero": 1, "engine-q": 0, "Router": 2,
             "FleetRegistry": 1}  # no card: not engines
    mins = {"engine-a": 2, "engine-auto": 1, "engine-zero": 0, "engine-q": 1}
    assert reclaimable_cards(alive, mins, but="engine-q") == 2  # auto's 2nd, zero's only one
    assert blocked_replicas(1, free_cards=0, creating_for_s=60.0, reclaimable_cards=2) == 0
    # every other model at its minimum: nothing will give a card back, so it is blocked
    at_min = {"engine-a": 2, "engine-auto": 1, "engine-zero": 0, "engine-q": 0, "Router": 2,
              "MemoryGovernor": 1}
    assert reclaimable_cards(at_min, mins, but="engine-q") == 0
    assert blocked_replicas(1, free_cards=0, creating_for_s=PLACEMENT_GRACE_S,
                            reclaimable_cards=0) == 1
    # a model's own extra replicas do not count for itself
    assert reclaimable_cards({"engine-q": 3}, {"engine-q": 1}, but="engine-q") == 0


def test_a_replica_swapping_its_engine_counts_as_starting_not_ready():
    # Its heartbeat says ready (healthy) but not serving: its calls wait at the gate for the new
    # engine. Counted ready, the router cut them at request_timeout_s (a 503 in a CI run whose
    # swap took ~2 min); counted starting, they are held like a cold start's.
    from embedfleet.deployments.common.contracts import ReplicaDescription
    from embedfleet.deployments.fleet.registry import serving_now

    def replica(pid: int, ready: bool = True, serving: bool = True) -> ReplicaDescription:
        return ReplicaDescription.model_construct(node_id="n", pid=pid, ready=ready,
                                                  serving=serving)

    fleet = [replica(1), replica(2, serving=False), replica(3, ready=False)]
    assert serving_now(fleet) == 1
    assert serving_now(fleet, alive={("n", 2), ("n", 3)}) == 0
    assert serving_now([replica(4)], alive={("n", 4)}) == 1
    # A heartbeat pickled by a replica older than the field (a rolling upgrade): pydantic
    # restores its __dict__ as it was, without the default, and it still counts.
    old = replica(5).__getstate__()
    old["__dict__"] = {k: v for k, v in old["__dict__"].items() if k != "serving"}
    older = ReplicaDescription.__new__(ReplicaDescription)
    older.__setstate__(old)
    assert not hasattr(older, "serving") and serving_now([older]) == 1
