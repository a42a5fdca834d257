"""An idle engine's worker is not woken every few seconds: any call into the engine makes vLLM's
worker spin a second on its message queue. The limits follower reuses an idle card's reading for
up to IDLE_REPROBE_S (deployments/replica/limits.py), and an idle replica's health check embeds
its probe at most every HEALTH_EMBED_EVERY_S (deployments/replica/engine_replica.py), and re-reads the idle card
right after that embedding, inside the same wake. A busy replica's health check embeds no probe
while its engine keeps finishing sequences (a probe would queue behind the work)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from embedfleet.deployments.common.contracts import Ceiling
from embedfleet.deployments.replica import limits as limits_mod
from embedfleet.deployments.replica.limits import LimitsFollower
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.engine.kv_usage import KvSample
from embedfleet.deployments.engine.vllm_engine import EngineMemory

GIB = 1 << 30


class CountingEngine:
    """Stand-in engine: a device probe of a 64 GiB card, counting how often it is woken."""

    def __init__(self, used_gib: float) -> None:
        self.used = int(used_gib * GIB)
        self.probes = 0

    async def memory(self, timeout_s: float, idle: bool = False) -> EngineMemory:
        self.probes += 1
        probe = {"kind": 1, "used": self.used, "total": 64 * GIB, "reserved": 0,
                 "peak_allocated": 0}
        return EngineMemory(probe=probe, kv=KvSample(8 * GIB, 0.0, 0, 0))


class Budget:
    limits = (8, 1024)

    def set_limits(self, max_sequences: int, max_tokens: int) -> None:
        self.limits = (max_sequences, max_tokens)


class Sink:
    def __init__(self) -> None:
        self.sets = 0

    def set_gauge(self, name, value, tags) -> None:
        self.sets += name == "embedfleet_card_memory_used_bytes"


def follower(engine, activity: list[float], sink: Sink, busy: list[bool]) -> LimitsFollower:
    return LimitsFollower(gate=EngineGate(engine), budget=Budget(),
                          card_tags={"node": "n", "device": "0"},
                          ceiling=Ceiling(max_sequences=8, max_tokens=1024), pull_limits=None,
                          interval_s=2, sink=sink, cpu_card=None, peak_window_s=0.0,
                          idle=lambda: not busy[0], last_activity=lambda: activity[0])


def test_an_idle_engine_is_probed_once_then_its_reading_reused_and_reexported():
    engine, sink, activity, busy = CountingEngine(20), Sink(), [0.0], [False]
    f = follower(engine, activity, sink, busy)

    async def ticks(n: int):
        for _ in range(n):
            await f.read_card()

    asyncio.run(ticks(5))
    assert engine.probes == 1 and sink.sets == 5  # gauges re-set every tick, never stale
    assert f.reading is not None and f.reading.used_bytes == 20 * GIB

    # A call finished on the engine since: the next tick reads the card again.
    import time
    engine.used = 30 * GIB
    activity[0] = time.monotonic()
    asyncio.run(ticks(1))
    assert engine.probes == 2 and f.reading.used_bytes == 30 * GIB

    # Work in flight: probed every tick (the governor needs the live pressure).
    busy[0] = True
    asyncio.run(ticks(3))
    assert engine.probes == 5


def test_an_idle_reading_is_refreshed_after_idle_reprobe_s_and_after_an_engine_swap(monkeypatch):
    engine, sink, activity, busy = CountingEngine(20), Sink(), [0.0], [False]
    f = follower(engine, activity, sink, busy)
    asyncio.run(f.read_card())
    monkeypatch.setattr(limits_mod, "IDLE_REPROBE_S", 0.0)
    asyncio.run(f.read_card())
    assert engine.probes == 2
    monkeypatch.setattr(limits_mod, "IDLE_REPROBE_S", 3600.0)
    new = CountingEngine(25)
    f._gate = EngineGate(new)  # the prefix-cache controller swapped the engine
    asyncio.run(f.read_card())
    assert new.probes == 1 and f.reading.used_bytes == 25 * GIB


def test_without_an_activity_clock_every_tick_probes():
    """The governor simulation (benchmarks/governor_sim.py) drives the follower that way."""
    engine = CountingEngine(20)
    f = LimitsFollower(gate=EngineGate(engine), budget=Budget(),
                       card_tags={"node": "n", "device": "0"},
                       ceiling=Ceiling(max_sequences=8, max_tokens=1024), pull_limits=None,
                       interval_s=2, sink=Sink(), cpu_card=None, idle=lambda: True)

    async def ticks():
        for _ in range(3):
            await f.read_card()

    asyncio.run(ticks())
    assert engine.probes == 3


class ProbeEngine:
    """Stand-in engine for the health check: counts embeds and liveness checks."""

    def __init__(self) -> None:
        self.embeds = self.liveness = self.probes = 0
        self.woken: list[str] = []  # what woke the worker, in order
        self.last_output_at = 0.0  # no sequence finished since long ago: a stalled engine

    def tokenize(self, texts):
        return [[1, 2, 3] for _ in texts]

    async def embed(self, ids, request_id: str):
        import numpy as np

        self.embeds += 1
        self.woken.append("embed")
        return [SimpleNamespace(vector=np.ones(4, dtype=np.float32))]

    async def memory(self, timeout_s: float, idle: bool = False) -> EngineMemory:
        self.probes += 1
        self.woken.append("probe")
        return await CountingEngine(20).memory(timeout_s, idle)

    async def check_health(self) -> None:
        self.liveness += 1

    def shutdown(self) -> None:
        pass


def replica_around(engine: ProbeEngine, inflight: int):
    """The real ``EngineReplica.check_health``, around stand-ins of its parts and a real
    limits follower sharing the replica's gate."""
    from embedfleet.deployments.replica.health_probe import HealthProbe
    from embedfleet.deployments.replica.engine_replica import EngineReplica

    r = object.__new__(EngineReplica)
    r.__dict__.update(
        prefix=SimpleNamespace(healthy=True, cancel=lambda: None),
        restart=SimpleNamespace(healthy=True, cancel=lambda: None, begun=[], error=None),
        replica_id="r1", model_cfg=SimpleNamespace(name="m"),
        path=SimpleNamespace(inflight_sequences=inflight, last_progress=0.0),
        cfg=SimpleNamespace(health_check_timeout_s=30), _healthy=True, _health_engine=None,
        _health_embedded_at=0.0, _probe=HealthProbe(stall_s=120),
        reporter=SimpleNamespace(export_state=lambda: None),
        follower=follower(engine, [0.0], Sink(), [inflight > 0]))
    r.gate = r.follower._gate
    r.restart.begin = r.restart.begun.append
    return r


def test_an_idle_replicas_health_check_embeds_at_most_every_health_embed_every_s(monkeypatch):

    from embedfleet.deployments.replica import engine_replica as replica_mod

    engine = ProbeEngine()
    r = replica_around(engine, inflight=0)

    async def checks(n: int):
        for _ in range(n):
            await r.check_health()

    asyncio.run(checks(4))
    assert (engine.embeds, engine.liveness) == (1, 3)
    # The idle card was re-read right after the embedding, so the limits loop's next ticks
    # reuse that reading: one wake of the worker, not a second one for the probe.
    assert engine.woken == ["embed", "probe"]

    async def ticks(n: int):
        for _ in range(n):
            await r.follower.read_card()

    asyncio.run(ticks(3))
    assert engine.probes == 1 and r.follower.reading is not None
    monkeypatch.setattr(replica_mod, "HEALTH_EMBED_EVERY_S", 0.0)
    asyncio.run(checks(2))
    assert engine.embeds == 3
    monkeypatch.setattr(replica_mod, "HEALTH_EMBED_EVERY_S", 3600.0)
    other = ProbeEngine()
    r.gate = r.follower._gate = EngineGate(other)  # a swapped engine is embedded on at once
    asyncio.run(checks(2))
    assert (other.embeds, other.liveness) == (1, 1) and other.woken == ["embed", "probe"]


def test_a_busy_replicas_health_check_leaves_the_probe_to_the_limits_loop():
    """Under load the limits loop probes every tick anyway: the health check adds no probe."""


    engine = ProbeEngine()
    r = replica_around(engine, inflight=3)  # stalled (no progress since 0.0): it embeds
    asyncio.run(r.check_health())
    assert engine.woken == ["embed"]


def test_a_busy_engine_whose_sequences_keep_finishing_is_healthy_without_a_probe():
    """One large call can run for minutes on a slow device. Its sequences finishing is the
    proof of progress, though no whole call has finished within the health-check timeout: a
    probe would wait behind the call, time out, and three such failures make Serve kill a
    healthy replica with everything in flight."""
    import time

    engine = ProbeEngine()
    r = replica_around(engine, inflight=3)  # path.last_progress 0.0: no call finished
    engine.last_output_at = time.monotonic() - 5
    asyncio.run(r.check_health())
    assert engine.woken == [] and engine.liveness == 1
    engine.last_output_at = time.monotonic() - r.cfg.health_check_timeout_s - 1
    asyncio.run(r.check_health())
    assert engine.woken == ["embed"]


def test_the_engine_marks_each_finished_sequence_before_its_call_ends():
    """``VllmEmbeddingEngine.last_output_at`` moves when a sequence's output arrives, not when
    the whole call returns (vLLM's AsyncLLM is faked: the second sequence waits on an event)."""
    import numpy as np

    from embedfleet.deployments.engine.vllm_engine import VllmEmbeddingEngine

    class FakeLLM:
        errored = False

        def __init__(self) -> None:
            self.release = asyncio.Event()

        async def encode(self, prompt, params, request_id, priority=0):
            if request_id.endswith("-1"):
                await self.release.wait()
            yield SimpleNamespace(outputs=SimpleNamespace(data=np.ones(4, np.float32)),
                                  prompt_token_ids=[1, 2], num_cached_tokens=0)

    async def scenario() -> tuple[float, float, int]:
        engine = object.__new__(VllmEmbeddingEngine)  # no engine process
        engine._llm, engine.last_output_at = FakeLLM(), 0.0
        engine.info = SimpleNamespace(pooling_task="embed")  # what an embedding model's runs
        call = asyncio.ensure_future(engine.embed([[1, 2], [3, 4]], request_id="x"))
        for _ in range(50):  # until the first sequence's output is in
            await asyncio.sleep(0.01)
            if engine.last_output_at:
                break
        first = engine.last_output_at
        assert not call.done()
        await asyncio.sleep(0.05)
        engine._llm.release.set()
        await call
        return first, engine.last_output_at, len(call.result())

    first, last, n = asyncio.run(scenario())
    assert first > 0 and last > first and n == 2
