"""A health probe slower than one health check is not a failed check (deployments/replica/
health_probe.py): on a busy or starved device it waits behind the engine's batches, and a CI run
on two shared cores saw Serve kill a working MiniLM replica after three such timeouts. The probe
stays pending across checks; only one left unanswered for ``health_stall_timeout_s`` (a hung
card) fails the checks, every one of them, until the engine answers it."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from embedfleet.deployments.config.schema import ConfigError, parse_config
from embedfleet.deployments.replica.health_probe import EngineStalled, HealthProbe
from tests.test_idle_engine_wakeups import ProbeEngine, replica_around


class SlowEngine(ProbeEngine):
    """The probe's answer waits on an event: an engine computing a large batch first."""

    def __init__(self) -> None:
        super().__init__()
        self.release = asyncio.Event()

    async def embed(self, ids, request_id: str):
        self.embeds += 1
        await self.release.wait()
        return [SimpleNamespace(vector=np.ones(4, dtype=np.float32))]


def test_a_slow_probe_stays_pending_across_checks_and_its_answer_counts():
    async def scenario():
        engine = SlowEngine()
        r = replica_around(engine, inflight=0)
        r.cfg.health_check_timeout_s = 0.05  # each check waits 40 ms for the probe
        await r.check_health()
        await r.check_health()  # the same probe, still pending: no second embed
        assert (engine.embeds, engine.liveness, r._healthy) == (1, 2, True)
        engine.release.set()
        await r.check_health()
        return engine, r

    engine, r = asyncio.run(scenario())
    assert engine.embeds == 1 and r._health_engine is engine and r._probe.pending_for == 0


def test_a_probe_unanswered_for_the_stall_bound_fails_every_check_until_answered():
    async def scenario():
        engine = SlowEngine()
        r = replica_around(engine, inflight=0)
        r.cfg.health_check_timeout_s = 0.05
        r._probe = HealthProbe(stall_s=0.2)
        await r.check_health()  # pending, under the bound
        await asyncio.sleep(0.25)
        failures = 0
        for _ in range(3):  # Serve replaces a replica after three failures in a row
            with pytest.raises(EngineStalled, match="unanswered for"):
                await r.check_health()
            failures += 1
        assert r._healthy is False and engine.embeds == 1
        engine.release.set()  # the engine answers after all: healthy again
        await r.check_health()
        return r, failures

    r, failures = asyncio.run(scenario())
    assert failures == 3 and r._healthy is True


def test_a_dead_engine_still_fails_at_once():
    class DeadEngine(ProbeEngine):
        async def embed(self, ids, request_id: str):
            raise RuntimeError("EngineCore died")

    r = replica_around(DeadEngine(), inflight=0)
    with pytest.raises(RuntimeError, match="EngineCore died"):
        asyncio.run(r.check_health())
    assert r._healthy is False
    assert r.restart.begun == []  # not known dead: Serve decides


def test_an_engine_whose_core_is_gone_is_restarted_in_place_not_failed():
    from embedfleet.deployments.engine.vllm_engine import EngineDead

    class CoreGone(ProbeEngine):
        async def embed(self, ids, request_id: str):
            raise EngineDead("vLLM engine core is not running")

    engine = CoreGone()
    r = replica_around(engine, inflight=0)
    asyncio.run(r.check_health())  # passes: the replica restarts the engine itself
    assert r.restart.begun == [engine] and r._healthy is True


def test_the_stall_bound_must_exceed_the_health_check_timeout():
    base = {"models": [{"name": "m", "source": {"path": "/m"}}]}
    with pytest.raises(ConfigError, match="health_stall_timeout_s=30 must be above "
                                         "health_check_timeout_s=30"):
        parse_config({**base, "health_stall_timeout_s": 30}, "test")
    assert parse_config(base, "test").health_stall_timeout_s == 120


def test_a_probe_cancelled_under_the_check_is_a_failed_check_not_a_cancellation():
    class ShuttingDown(ProbeEngine):
        async def embed(self, ids, request_id: str):
            raise asyncio.CancelledError

    r = replica_around(ShuttingDown(), inflight=0)
    with pytest.raises(RuntimeError, match="cancelled by the engine"):
        asyncio.run(r.check_health())
    assert r._healthy is False
