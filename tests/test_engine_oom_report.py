"""An engine that dies in a step (an OOM cannot be told from another death once its core is
gone) is reported once to the memory governor, at once, and the governor cuts the card: the
real RequestPath._engine_call over a real EngineGate and a stand-in engine, the real
LimitsFollower and MemoryGovernor (no Prometheus: it is not needed for a hard trigger)."""

from __future__ import annotations

import asyncio

import pytest

from embedfleet.deployments.common.contracts import Ceiling
from embedfleet.deployments.fleet.governor import MemoryGovernor
from embedfleet.deployments.replica.limits import LimitsFollower
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.common.errors import EngineUnavailable
from tests.test_swap_resend import StandInEngine, path_over

CONFIG = {"models": [{"name": "m", "source": {"path": "/nonexistent"}}]}
CEILING = Ceiling(max_sequences=64, max_tokens=8192)


class Budget:
    def __init__(self) -> None:
        self.limits = (CEILING.max_sequences, CEILING.max_tokens)

    def set_limits(self, seq: int, tok: int) -> None:
        self.limits = (seq, tok)


class Sink:
    def set_gauge(self, name: str, value: float, tags: dict[str, str]) -> None:
        pass


def test_an_engine_dying_in_a_step_is_reported_once_and_cuts_the_card():
    async def scenario():
        engine = StandInEngine(1.0)
        gate = EngineGate(engine)
        path = path_over(gate)
        gov = MemoryGovernor(CONFIG, {"prometheus_url": "http://127.0.0.1:9"}, sink=Sink(),
                             autostart=False)
        budget = Budget()
        follower = LimitsFollower(
            gate=gate, budget=budget, card_tags={"node": "n1", "device": "0"}, ceiling=CEILING,
            pull_limits=lambda report: gov.limits_for("n1", "0", CEILING, report),
            interval_s=5.0, sink=Sink(), cpu_card=None, model="m")
        path.on_engine_failure = lambda engine: follower.engine_oom()  # no restart here
        await follower.follow()  # the first pull: the baseline
        assert budget.limits == (64, 8192)

        engine.hold.clear()
        calls = [asyncio.ensure_future(path._engine_call([[1, 2, 3]], True, 0))
                 for _ in range(3)]
        await asyncio.sleep(0.05)
        engine.down.set()  # the core dies under three calls
        for call in calls:
            with pytest.raises(EngineUnavailable):  # nothing restarts it: retried elsewhere
                await call
        await asyncio.sleep(0.05)  # the report goes out at once, not at the next interval
        assert follower.engine_ooms == 1 and path.engine_failed
        assert budget.limits == (32, 4096)
        assert "1 engine OOMs in a step" in follower.limits.reason
        # The next replica on the card starts its own count: no second cut from the same death.
        fresh = LimitsFollower(
            gate=gate, budget=Budget(), card_tags={"node": "n1", "device": "0"},
            ceiling=CEILING, pull_limits=lambda report: gov.limits_for("n1", "0", CEILING, report),
            interval_s=5.0, sink=Sink(), cpu_card=None, model="m")
        await fresh.follow()
        assert fresh.limits.max_tokens == 4096

    asyncio.run(scenario())
