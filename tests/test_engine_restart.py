"""An engine that dies in a step is restarted in place after the governor's cut, and the calls
it held run again on the new engine: none is lost, none sees a 5xx (issue 40, item 2).

The real RequestPath._engine_call over a real EngineGate and stand-in engines (a dead one fails
its calls as vLLM's dead core does), the real EngineRestart, LimitsFollower and MemoryGovernor
(no Prometheus: a hard trigger needs none), and the real PrefixCacheController for the turn
taking between a restart and a prefix-cache swap.
"""

from __future__ import annotations

import asyncio
import threading

import pytest

from embedfleet.deployments.common.contracts import Ceiling
from embedfleet.deployments.common.errors import EngineUnavailable
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.fleet.governor import MemoryGovernor
from embedfleet.deployments.replica.engine_restart import EngineRestart
from embedfleet.deployments.replica.limits import LimitsFollower
from embedfleet.deployments.replica.prefix_cache import PrefixCacheController
from tests.test_engine_oom_report import CEILING, CONFIG, Budget, Sink
from tests.test_swap_resend import StandInEngine, path_over


class Card:
    """The card's one slot: building an engine while another is alive is what a 910B refuses
    (vLLM's start-up check wants ``gpu_memory_utilization`` of the card free)."""

    def __init__(self, first: StandInEngine) -> None:
        self.alive = {id(first)}
        self.built: list[StandInEngine] = []
        self.shut: list[StandInEngine] = []
        self.budget_at_build: list[tuple[int, int]] = []
        self.budget: Budget | None = None
        self.fail_builds = 0
        self.overlaps = 0  # builds begun while another engine was alive
        self.started = threading.Event()  # an engine's start has begun
        self.release = threading.Event()  # an engine's start may finish (set: at once)
        self.release.set()

    def build(self, prefix_cache: bool) -> StandInEngine:
        if self.alive:  # a second engine does not fit beside the first
            self.overlaps += 1
        self.started.set()
        self.release.wait(5)
        if self.fail_builds:
            self.fail_builds -= 1
            raise RuntimeError("engine start failed")
        engine = StandInEngine(float(2 + len(self.built)))
        engine.info.prefix_caching = prefix_cache
        self.alive.add(id(engine))
        self.built.append(engine)
        if self.budget is not None:
            self.budget_at_build.append(self.budget.limits)
        return engine

    def shutdown(self, engine: StandInEngine) -> None:
        self.alive.discard(id(engine))
        self.shut.append(engine)


async def no_sleep(_s: float) -> None:
    await asyncio.sleep(0)


def wired(gate: EngineGate, card: Card, *, apply_cut=None, caching=lambda: False):
    """The request path with the replica's wiring (EngineReplica._engine_died)."""
    path = path_over(gate)
    restart = EngineRestart(model="m", card_label="n1/0", gate=gate, build_engine=card.build,
                            shutdown_engine=card.shutdown, prefix_caching=caching,
                            apply_cut=apply_cut or (lambda: asyncio.sleep(0)), sleep=no_sleep,
                            on_change=lambda: setattr(path, "engine_failed", False))
    path.on_engine_failure = restart.begin
    return path, restart


def test_a_step_that_kills_the_engine_runs_again_on_a_new_one_after_the_governors_cut():
    async def scenario():
        old = StandInEngine(1.0)
        gate, card = EngineGate(old), Card(old)
        gov = MemoryGovernor(CONFIG, {"prometheus_url": "http://127.0.0.1:9"}, sink=Sink(),
                             autostart=False)
        budget = card.budget = Budget()
        follower = LimitsFollower(
            gate=gate, budget=budget, card_tags={"node": "n1", "device": "0"}, ceiling=CEILING,
            pull_limits=lambda report: gov.limits_for("n1", "0", CEILING, report),
            interval_s=5.0, sink=Sink(), cpu_card=None, model="m")
        path, restart = wired(gate, card, apply_cut=follower.follow)
        path.on_engine_failure = lambda e: (follower.engine_oom(), restart.begin(e))
        await follower.follow()  # the first pull: the baseline
        old.hold.clear()
        step = [asyncio.ensure_future(path._engine_call([[1, 2, 3]], True, 0))
                for _ in range(3)]
        await asyncio.sleep(0.05)
        old.down.set()  # the core dies under the step's three calls
        got = await asyncio.wait_for(asyncio.gather(*step), 5)
        late = await asyncio.wait_for(path._engine_call([[4]], True, 0), 5)
        return got, late, card, budget, follower, restart, path

    got, late, card, budget, follower, restart, path = asyncio.run(scenario())
    new = card.built[0]
    assert [engine for _, engine in got] == [new] * 3  # every call of the step, on the new engine
    assert all(float(out[0].vector[0]) == 2.0 for out, _ in got)
    assert late[1] is new and len(card.built) == 1  # one restart for the whole step
    assert len(card.shut) == 1 and card.shut[0].value == 1.0  # the dead one shut down first
    assert card.budget_at_build == [(32, 4096)]  # the governor's cut came before the new engine
    assert follower.engine_ooms == 1 and restart.restarts == 1 and restart.healthy
    assert path.engine_failed is False  # healthy again on the new engine


def test_without_a_restart_the_call_still_fails_with_retry_after():
    async def scenario():
        engine = StandInEngine(1.0)
        engine.down.set()
        path = path_over(EngineGate(engine))
        seen = []
        path.on_engine_failure = seen.append  # reported, but nothing replaces the engine
        with pytest.raises(EngineUnavailable, match="failed: RuntimeError") as err:
            await path._engine_call([[1]], True, 0)
        return seen, err.value

    seen, err = asyncio.run(scenario())
    assert len(seen) == 1 and err.retry_after_s == 1  # the router retries it elsewhere


def test_a_restarted_engine_that_dies_too_ends_the_call_bounded():
    async def scenario():
        old = StandInEngine(1.0)
        old.down.set()
        gate, card = EngineGate(old), Card(old)
        path, restart = wired(gate, card)
        real_build = card.build

        def build_dead(prefix_cache: bool) -> StandInEngine:
            engine = real_build(prefix_cache)
            engine.down.set()  # the same step kills every engine
            return engine

        card.build = build_dead
        restart._build = build_dead
        with pytest.raises(EngineUnavailable):
            await asyncio.wait_for(path._engine_call([[1]], True, 0), 5)
        return card

    card = asyncio.run(scenario())
    assert 1 <= len(card.built) <= 3  # bounded resends, not a loop


def test_a_restart_whose_builds_keep_failing_gives_up_and_reports_unhealthy():
    async def scenario():
        old = StandInEngine(1.0)
        gate, card = EngineGate(old), Card(old)
        card.fail_builds = 99
        path, restart = wired(gate, card)
        path._hold_s = 0.5
        old.down.set()
        with pytest.raises(EngineUnavailable):
            await path._engine_call([[1]], True, 0)
        await asyncio.wait_for(restart._task, 5)
        return restart

    restart = asyncio.run(scenario())
    assert restart.gave_up and not restart.healthy and "engine start failed" in restart.error


def test_a_restart_and_a_prefix_cache_swap_take_turns_and_never_build_two_engines():
    async def scenario():
        old = StandInEngine(1.0)
        old.info.prefix_caching = True
        gate, card = EngineGate(old), Card(old)
        prefix = PrefixCacheController(
            model="m", card_label="n1/0", enabled=True, reason="test", gate=gate,
            build_engine=card.build, shutdown_engine=card.shutdown, report_failure=None,
            canary_interval_s=60, sleep=no_sleep)
        path, restart = wired(gate, card, caching=lambda: prefix.reads_cache)
        old.hold.clear()
        card.release.clear()  # the restart's new engine takes a while to start
        call = asyncio.ensure_future(path._engine_call([[1]], True, 0))
        await asyncio.sleep(0.05)
        old.down.set()  # dies; the restart begins ...
        await asyncio.to_thread(card.started.wait, 5)
        swap = prefix.switch_off("a canary failed")  # ... and a canary fails meanwhile
        await asyncio.sleep(0.2)  # the swap's turn would come now, were it not for the lock
        card.release.set()
        out, engine = await asyncio.wait_for(call, 5)
        await asyncio.wait_for(swap, 5)
        return card, prefix, gate, engine

    card, prefix, gate, engine = asyncio.run(scenario())
    assert prefix.state == "off" and gate.is_open
    assert gate.engine.info.prefix_caching is False
    assert len(card.alive) == 1 and card.overlaps == 0  # never two engines on the card
    # the restart's engine began while caching was on; the swap then replaced it, in turn
    assert [e.info.prefix_caching for e in card.built] == [True, False]
    assert engine is gate.engine or engine in card.shut
