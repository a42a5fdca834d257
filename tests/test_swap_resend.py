"""A call out on an engine that a prefix-cache swap shuts down runs again on the new engine.

The swap drains the old engine for at most DRAIN_TIMEOUT_S, then shuts it down anyway; on a
starved machine a call can still be out then. Before, that call failed (503) and marked the
replica's engine failed for good, so the replica failed every health check after a successful
swap and Serve killed it with its calls: a CI run's canary test saw a 503 during the switch.
These run the real RequestPath._engine_call over a real EngineGate and stand-in engines.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import numpy as np
import pytest

from embedfleet.deployments.common import metrics
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.engine.vllm_engine import Embedding
from embedfleet.deployments.common.errors import EngineUnavailable
from embedfleet.deployments.replica.request_path import RequestPath


class StandInEngine:
    """Answers with a vector of its own ``value``; once ``down`` is set, calls fail as a dead
    core's do; ``hold`` keeps calls out until it is set (or ``down`` is)."""

    def __init__(self, value: float) -> None:
        self.value = value
        self.info = SimpleNamespace(prefix_caching=False)
        self.hold = asyncio.Event()
        self.hold.set()
        self.down = asyncio.Event()
        self.calls = 0

    async def embed(self, pieces, *, request_id, skip_prefix_cache, normalize, priority):
        self.calls += 1
        held = asyncio.ensure_future(self.hold.wait())
        shut = asyncio.ensure_future(self.down.wait())
        await asyncio.wait({held, shut}, return_when=asyncio.FIRST_COMPLETED)
        held.cancel()
        shut.cancel()
        if self.down.is_set():
            raise RuntimeError("EngineDeadError: the engine core is gone")
        return [Embedding(np.full(4, self.value, np.float32), len(p), 0) for p in pieces]


def path_over(gate: EngineGate) -> RequestPath:
    path = object.__new__(RequestPath)  # only the engine call's parts
    path.__dict__.update(_gate=gate, _hold_s=30.0, _retry_after_s=1.0, _reads_cache=lambda: True,
                         _replica_id="r1", _rec=metrics.Batched(), engine_failed=False,
                         last_progress=0.0, _long_input=None, _prompts=None)
    return path


def test_a_call_cut_by_the_swap_shutting_its_engine_down_runs_on_the_new_engine():
    async def scenario():
        old, new = StandInEngine(1.0), StandInEngine(2.0)
        old.hold.clear()  # the call stays out past the drain
        gate = EngineGate(old)
        path = path_over(gate)
        call = asyncio.ensure_future(path._engine_call([[1, 2, 3]], True, 0))
        await asyncio.sleep(0.05)
        gate.close("prefix caching is being switched off after a failed canary")
        assert not await gate.drain(0.05)  # the drain bound runs out with the call still out
        retired = gate.take()
        assert retired is old
        old.down.set()  # shut down under the call
        await asyncio.sleep(0.05)
        assert not call.done()  # waiting at the gate for the new engine, not failed
        gate.open(new)
        out, engine = await asyncio.wait_for(call, 5)
        assert engine is new  # the call says which engine answered (RequestPath._runs)
        return out, path, old, new

    out, path, old, new = asyncio.run(scenario())
    assert float(out[0].vector[0]) == 2.0  # the new engine's answer
    assert (old.calls, new.calls) == (1, 1)
    assert path.engine_failed is False  # the replica stays healthy after the swap


def test_a_dead_engine_still_fails_the_call_and_the_replica():
    async def scenario():
        engine = StandInEngine(1.0)
        engine.down.set()
        gate = EngineGate(engine)
        path = path_over(gate)
        with pytest.raises(EngineUnavailable, match="failed: RuntimeError"):
            await path._engine_call([[1]], True, 0)
        return path

    path = asyncio.run(scenario())
    assert path.engine_failed is True  # Serve is told to replace the replica


def test_following_a_new_engine_clears_the_old_engines_failure(monkeypatch):
    from embedfleet.deployments.replica import request_path as replica_path

    monkeypatch.setattr(replica_path, "InputPreparer", lambda *a: "preparer")
    monkeypatch.setattr(replica_path.SpecialTokens, "from_tokenizer", staticmethod(lambda t: t))
    path = path_over(EngineGate(StandInEngine(1.0)))
    path.engine_failed = True
    new = StandInEngine(2.0)
    new.hf_tokenizer, new.tokenize = object(), lambda *a, **k: []
    path.use_engine(new)
    assert path.engine_failed is False and path.info is new.info
