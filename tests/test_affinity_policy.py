"""Prefix-affinity routing (deployments/ingress/affinity.py), driven through Serve's own routing
loop (RequestRouter._choose_replica_for_request, Ray 2.60) with stand-in replicas.

The stand-in replica (``StandInReplica``) has what Serve's router reads of a RunningReplica: id,
node, queue length (probed), routing stats and max_ongoing_requests; nothing is sent to it."""

from __future__ import annotations

import asyncio
import functools
import subprocess
import sys
import uuid
from collections import Counter

import pytest
from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
from ray.serve.request_router import PendingRequest, ReplicaID

from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.config.affinity import RoutingConfig
from embedfleet.deployments.common.contracts import EmbedCall, RoutingStats
from embedfleet.deployments.config.ray_options import (AFFINITY_ROUTER_CLASS, engine_deployment_options)
from embedfleet.deployments.ingress.affinity import (HashRing, PrefixAffinityPolicy,
                                                          affinity_key, under_bound)

DEPLOYMENT = DeploymentID(name="engine-tiny", app_name="embedfleet")
INSTRUCTIONS = [f"Instruct: task number {k} " + "with a long shared instruction " * 8
                for k in range(8)]


class StandInReplica:
    """Stand-in for Serve's RunningReplica: what the request router reads."""

    def __init__(self, uid: str, caching: bool = True, queue_len: int = 0) -> None:
        self.replica_id = ReplicaID(uid, DEPLOYMENT)
        self.node_id = "node-1"
        self.availability_zone = None
        self.multiplexed_model_ids: set[str] = set()
        self.routing_stats = RoutingStats(prefix_cache=caching).model_dump()
        self.max_ongoing_requests = 100
        self.queue_len = queue_len

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return self.queue_len


def make_router(replicas: list[StandInReplica], **kwargs) -> PrefixAffinityPolicy:
    r = PrefixAffinityPolicy(deployment_id=DEPLOYMENT, handle_source=DeploymentHandleSource.REPLICA,
                             use_replica_queue_len_cache=True, self_node_id="node-1")
    r.initialize_state(**{**RoutingConfig().router_kwargs(), **kwargs})
    r.update_replicas(replicas)  # type: ignore[arg-type]
    return r


def pending(text: str, method: str = "embed", internal_id: str | None = None) -> PendingRequest:
    call = EmbedCall([text, "second input"], f"req-{uuid.uuid4().hex[:6]}", "tiny")
    meta = RequestMetadata(request_id=call.request_id,
                           internal_request_id=internal_id or uuid.uuid4().hex,
                           call_method=method)
    return PendingRequest(args=[call], kwargs={}, metadata=meta)


async def route(router: PrefixAffinityPolicy, pr: PendingRequest) -> ReplicaID:
    replica = await asyncio.wait_for(router._choose_replica_for_request(pr), 10)
    router.on_request_routed(pr, replica.replica_id, None)
    return replica.replica_id


def run_async(fn):
    """Each case on its own event loop (the router binds to the loop it was built on)."""
    @functools.wraps(fn)
    def run() -> None:
        asyncio.run(fn())
    return run


def queries(n: int) -> list[str]:
    return [f"{INSTRUCTIONS[i % 8]} query {i}" for i in range(n)]


@run_async
async def test_a_key_always_goes_to_the_same_replica_and_keys_spread_over_replicas():
    replicas = [StandInReplica(f"r{i}") for i in range(2)]
    router = make_router(replicas)
    chosen: dict[int, set[ReplicaID]] = {}
    for i, text in enumerate(queries(64)):
        chosen.setdefault(i % 8, set()).add(await route(router, pending(text)))
    assert all(len(s) == 1 for s in chosen.values()), chosen  # idle replicas: never spilled
    assert len(set().union(*chosen.values())) == 2  # 8 keys land on both replicas
    # A second Router replica (its own instance, same ring) prefers the same replicas.
    other = make_router([StandInReplica(f"r{i}") for i in range(2)])
    for k, s in chosen.items():
        assert await route(other, pending(f"{INSTRUCTIONS[k]} another query")) in s


@run_async
async def test_default_power_of_two_spreads_the_same_keys_over_both_replicas():
    """The baseline the affinity must beat: Serve's router ignores the prompt."""
    replicas = [StandInReplica(f"r{i}") for i in range(2)]
    router = make_router(replicas)
    for r in replicas:
        r.routing_stats = RoutingStats(prefix_cache=False).model_dump()  # cache off: no key
    router.update_replicas(replicas)  # type: ignore[arg-type]
    seen = {await route(router, pending(f"{INSTRUCTIONS[0]} q{i}")) for i in range(40)}
    assert len(seen) == 2


@run_async
async def test_a_busy_preferred_replica_spills_to_power_of_two_within_the_bound():
    a, b = StandInReplica("a"), StandInReplica("b")
    router = make_router([a, b])
    text = next(t for t in queries(8) if router.preferred(pending(t)) == a.replica_id)
    assert await route(router, pending(text)) == a.replica_id
    # a has 6 calls in flight, b none: 7 > ceil(1.5 x 7 / 2) = 6, so the call spills to b.
    router.replica_queue_len_cache.update(a.replica_id, 6)
    router.replica_queue_len_cache.update(b.replica_id, 0)
    a.queue_len = 6
    assert await route(router, pending(text)) == b.replica_id
    # Back within the bound: a again.
    router.replica_queue_len_cache.update(a.replica_id, 1)
    a.queue_len = 1
    assert await route(router, pending(text)) == a.replica_id


@run_async
async def test_concurrent_slices_sharing_an_internal_request_id_each_get_their_own_replica():
    """Slices of one HTTP request share Serve's internal_request_id; matching on it would
    hand one slice's replica to another and leave a slice unrouted (a hang)."""
    a, b = StandInReplica("a"), StandInReplica("b")
    router = make_router([a, b])
    texts = queries(8)
    by = {router.preferred(pending(t)) for t in texts}
    assert by == {a.replica_id, b.replica_id}
    shared = uuid.uuid4().hex
    prs = [pending(t, internal_id=shared) for t in texts * 4]
    got = await asyncio.gather(*(route(router, pr) for pr in prs))
    assert len(got) == len(prs)
    assert [router.preferred(pr) for pr in prs] == list(got)  # idle: each to its own key's owner


@run_async
async def test_calls_without_a_key_and_replicas_with_the_cache_off_are_routed_by_power_of_two():
    a, b = StandInReplica("a"), StandInReplica("b", caching=False)
    router = make_router([a, b])
    texts = queries(8)
    owned_by_b = [t for t in texts if router._ring.owner(
        affinity_key(pending(t).args[0], 256, 64), router._replicas) == b.replica_id]
    assert owned_by_b, "the ring gives b some of the 8 keys"
    assert all(router.preferred(pending(t)) is None for t in owned_by_b)  # b: no preference
    assert router.preferred(pending(texts[0], method="tokenize_tei")) is None
    assert router.preferred(None) is None
    # A routing round without a request (Ray 2.55's spare task) still gets a replica rank.
    assert (await router.choose_replicas(router._replicas_list, None))[0]
    await route(router, pending(owned_by_b[0], method="tokenize_tei"))  # routed, no error


@run_async
async def test_a_router_error_falls_back_to_every_replica_instead_of_dropping_the_request():
    a, b = StandInReplica("a"), StandInReplica("b")
    router = make_router([a, b])

    def broken(_pr):
        raise RuntimeError("fault injector: key extraction failed")

    router.preferred = broken  # type: ignore[method-assign]
    assert await route(router, pending(INSTRUCTIONS[0])) in {a.replica_id, b.replica_id}


def test_a_replica_joining_or_leaving_moves_only_its_own_keys():
    ids = [ReplicaID(f"r{i}", DEPLOYMENT) for i in range(5)]
    keys = [f"key {i}".encode() for i in range(4000)]
    ring4, ring5 = HashRing(64), HashRing(64)
    ring4.rebuild(frozenset(ids[:4]))
    ring5.rebuild(frozenset(ids))
    before = {k: ring4.owner(k, ids) for k in keys}
    after = {k: ring5.owner(k, ids) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == ids[4] for k in moved)  # join: keys only move to the newcomer
    assert 0.12 < len(moved) / len(keys) < 0.30  # about 1/5 of them
    shares = Counter(before.values())
    assert max(shares.values()) / min(shares.values()) < 1.5  # 64 points each: an even spread
    # Leave: a replica that died before the next rebuild loses only its own keys.
    alive = set(ids[:4]) - {ids[1]}
    for k in keys:
        now = ring4.owner(k, alive)
        assert now == before[k] or before[k] == ids[1]


def test_bounded_load_limit():
    assert under_bound(0, [0, 0], 1.25, 1)  # idle: ceil(1.25 x 1 / 2) = 1
    assert under_bound(1, [1, 0], 1.25, 1)  # 2 <= ceil(1.25 x 2 / 2) = 2
    assert not under_bound(2, [2, 0], 1.25, 1)  # 3 > ceil(1.25 x 3 / 2) = 2
    assert under_bound(2, [2, 0], 1.25, 4)  # the floor: 3 <= 4
    assert not under_bound(1, [1, 0, 0, 0], 1.25, 1)  # 4 replicas: ceil(1.25 x 2 / 4) = 1
    assert under_bound(1, [1, 0, 0, 0], 1.25, 4)
    assert under_bound(4, [4, 4], 1.25, 1)  # 5 <= ceil(1.25 x 9 / 2) = 6
    assert not under_bound(6, [6, 0], 1.25, 4)  # 7 > 5


def test_the_key_is_the_template_and_the_first_inputs_head():
    def key(inputs, **kw):
        return affinity_key(EmbedCall(inputs, "r", "m", **kw), 16, 4)

    assert key(["0123456789abcdefXXX"]) == key(["0123456789abcdefYYY", "other"])
    assert key(["0123456789abcdef"]) != key(["0123456789abcdeX"])
    assert key(["same"], prompt_name="query") != key(["same"], prompt_name="passage")
    assert key(["same"], task="a") != key(["same"], task="b")
    assert key([[1, 2, 3, 4, 5]]) == key([[1, 2, 3, 4, 6]]) != key([[1, 2, 3, 5]])
    assert key([]) is None


@pytest.mark.parametrize("policy,prefix_cache,routed", [
    ("auto", "auto", True), ("auto", "on", True), ("auto", "off", False),
    ("prefix_affinity", "off", True), ("power_of_two", "on", False)])
def test_the_config_renders_serves_request_router_config(policy, prefix_cache, routed):
    model = {"name": "m", "source": {"path": "/models/m"}, "prefix_cache": prefix_cache,
             "routing": {"policy": policy, "load_factor": 1.5}}
    one = parse_config({"models": [model]}, "t")  # one replica: HAProxy to it, no Router
    assert one.direct_ingress and "request_router_config" not in engine_deployment_options(
        one, one.models[0])
    cfg = parse_config({"models": [{**model, "replicas": {"min_replicas": 2,
                                                          "max_replicas": 2}}]}, "t")
    opts = engine_deployment_options(cfg, cfg.models[0])
    if not routed:
        assert "request_router_config" not in opts
        return
    rc = opts["request_router_config"]
    assert rc["request_router_class"] == AFFINITY_ROUTER_CLASS
    assert rc["request_router_kwargs"]["load_factor"] == 1.5
    # Serve accepts it as it is: it imports the class and pickles it by value, and a Router
    # replica (another process) unpickles it.
    from ray.serve.config import RequestRouterConfig

    pickled = RequestRouterConfig(**rc)._serialized_request_router_cls
    out = subprocess.run([sys.executable, "-c", "import sys, cloudpickle; c = cloudpickle.loads("
                          "sys.stdin.buffer.read()); print(c.__name__, c.__mro__[1].__name__)"],
                         input=pickled, capture_output=True, timeout=120)
    assert out.stdout.decode().split() == ["PrefixAffinityPolicy",
                                           "PowerOfTwoChoicesRequestRouter"], out.stderr[-2000:]


def test_invalid_routing_values_fail_at_load_naming_the_field():
    from embedfleet.deployments.config.schema import ConfigError

    with pytest.raises(ConfigError, match=r"routing.*load_factor|load_factor.*0\.5"):
        parse_config({"models": [{"name": "m", "source": {"path": "/m"},
                                  "routing": {"load_factor": 0.5}}]}, "t")


@run_async
async def test_under_saturation_calls_without_a_preferred_replica_are_served_oldest_first():
    """A call whose round found no preferred replica gets Serve's FIFO hand-out, as with the
    default router: a call in a long backoff is not overtaken by younger ones. (Handing every
    round's replica to its own call starved the oldest calls for the whole overload.)"""
    reps = [StandInReplica(f"r{i}", caching=False) for i in range(2)]
    router = make_router(reps)

    def set_busy(busy: int) -> None:
        for r in reps:
            r.queue_len = busy
            router.replica_queue_len_cache.update(r.replica_id, busy)

    for r in reps:
        r.max_ongoing_requests = 2
    set_busy(2)
    calls = [asyncio.create_task(router._choose_replica_for_request(pending(t)))
             for t in queries(1)]
    for k in range(1, 150):  # arrivals outpace the slots that free up: a queue builds
        calls.append(asyncio.create_task(router._choose_replica_for_request(
            pending(f"query {k}"))))
        await asyncio.sleep(0.002)
        if k % 3 == 0:  # one replica frees a slot for a moment
            reps[k % 2].queue_len = 1
            router.replica_queue_len_cache.update(reps[k % 2].replica_id, 1)
        await asyncio.sleep(0.02)
        set_busy(2)
    waiting = [i for i, c in enumerate(calls) if not c.done()]
    assert 0 < len(waiting) < len(calls), "the load must leave a queue behind"
    assert waiting == list(range(len(calls) - len(waiting), len(calls))), waiting[:10]
    set_busy(0)
    await asyncio.wait_for(asyncio.gather(*calls), 10)  # and every call is routed


@run_async
async def test_a_replica_swapping_its_engine_gets_calls_only_when_the_others_are_full():
    # b swaps its engine after a failed canary: its calls wait at its gate for the new engine
    # (minutes on a card). Calls go to a, the keys b owns included, while a has room.
    a, b = StandInReplica("a"), StandInReplica("b")
    b.routing_stats = RoutingStats(prefix_cache=False, serving=False).model_dump()
    router = make_router([a, b])
    texts = queries(16)
    seen = Counter([await route(router, pending(t)) for t in texts])
    seen.update([await route(router, pending(t, method="tokenize_tei")) for t in texts[:4]])
    assert seen == Counter({a.replica_id: 20}), seen
    a.queue_len = a.max_ongoing_requests  # full: the swapping replica is better than no replica
    router.replica_queue_len_cache.invalidate_key(a.replica_id)
    assert await route(router, pending(texts[0])) == b.replica_id
    # b's swap is over: both serve again, and the keys spread over both.
    a.queue_len = 0
    b.routing_stats = RoutingStats(prefix_cache=True).model_dump()
    router.update_replicas([a, b])  # type: ignore[arg-type]
    router.replica_queue_len_cache.invalidate_key(a.replica_id)
    assert len({await route(router, pending(t)) for t in texts}) == 2


@run_async
async def test_with_three_replicas_a_swapping_one_comes_after_every_serving_one():
    # Power-of-two samples two: a sample of [swapping b, full a] must still reach idle c.
    a, b, c = StandInReplica("a"), StandInReplica("b"), StandInReplica("c")
    b.routing_stats = RoutingStats(prefix_cache=False, serving=False).model_dump()
    router = make_router([a, b, c])
    ranks = router._holding_last([[b, a]], [a, b, c])
    assert [[r.replica_id for r in rank] for rank in ranks] == [
        [a.replica_id], [c.replica_id], [b.replica_id]]
    a.queue_len = a.max_ongoing_requests
    seen = Counter([await route(router, pending(t)) for t in queries(12)])
    assert b.replica_id not in seen and seen[c.replica_id] == 12, seen
