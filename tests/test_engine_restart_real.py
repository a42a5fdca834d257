"""A real vLLM engine core killed in a step: the replica's request path restarts the engine in
place and the step's calls come back with the vectors a cold engine gives (issue 40, item 2).

Real parts: vLLM engines (tiny Qwen3 on CPU) built and shut down by the replica's own
``EngineLifecycle`` (its reaper waits for the dead core's processes), the real
``RequestPath._engine_call``, ``EngineGate`` and ``EngineRestart``. The card is the STAND-IN
``tests/support/card_model.py``: the restarted engine can start only once the dead one has given
its 0.95 of the card back, as on a 910B. The OOM itself cannot be made here (the KV pool is
preallocated; what runs out on a card is the attention workspace): SIGKILL of the engine-core
process is the same end for vLLM, whose core does not survive an exception in a step.
"""

from __future__ import annotations

import asyncio
import os
import signal

import numpy as np
import psutil
import pytest

from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.engine import reaper
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.engine.lifecycle import EngineLifecycle
from embedfleet.deployments.replica.engine_restart import EngineRestart
from tests.support.card_model import CARD
from tests.test_swap_resend import path_over

# Two real engine starts in this process: not in `make test-unit` (the `engine` tier).
pytestmark = pytest.mark.engine


def engine_core_pid(before: set[int]) -> int:
    for pid in reaper.engine_pids():
        if pid in before:
            continue
        try:
            if "EngineCore" in " ".join([psutil.Process(pid).name(),
                                        *psutil.Process(pid).cmdline()]):
                return pid
        except psutil.NoSuchProcess:
            continue
    raise AssertionError("no engine-core process found")


def test_a_killed_engine_core_is_restarted_and_its_calls_answered_like_a_cold_engine(
        tiny_qwen3_dir, monkeypatch):
    cfg = parse_config({"platform": {"kind": "cpu"}, "models": [{
        "name": "tiny", "source": {"path": str(tiny_qwen3_dir)}, "max_model_len": 2048,
        "engine": {"max_num_batched_tokens": 4096, "kv_cache_memory_bytes": 64 << 20}}]})
    kwargs = cfg.engine_kwargs(cfg.models[0], enable_prefix_caching=False)
    engines = EngineLifecycle("tests.support.card_model:CardReservingEngine",
                              lambda prefix_cache: {**kwargs,
                                                    "enable_prefix_caching": prefix_cache})
    # EngineLifecycle.build marks this process's children as engine processes (the reaper's
    # marker, inherited); undone after the test, or later tests' children would carry it
    monkeypatch.setenv(reaper.MARKER_ENV, str(os.getpid()))
    before = set(reaper.engine_pids())
    first = engines.build(False)
    core = engine_core_pid(before)
    cuts: list[int] = []

    async def scenario():
        gate = EngineGate(first)
        path = path_over(gate)
        path._hold_s = 240.0  # the restart is a cold start of the engine
        restart = EngineRestart(model="tiny", card_label="n/0", gate=gate,
                                build_engine=engines.build, shutdown_engine=engines.shutdown,
                                prefix_caching=lambda: False,
                                apply_cut=lambda: asyncio.sleep(0, cuts.append(CARD.engines)),
                                on_change=lambda: setattr(path, "engine_failed", False))
        path.on_engine_failure = restart.begin
        # more tokens than one step takes (max_num_batched_tokens 4096): steps still to run
        texts = [f"document {i}: " + "the card's memory is planned up front " * 150
                 for i in range(16)]
        ids = first.tokenize(texts)
        cold = [e.vector for e in await first.embed(ids, request_id="cold")]
        step = [asyncio.ensure_future(path._engine_call([p], True, 0)) for p in ids]
        await asyncio.sleep(0.05)  # the step is out on the engine
        os.kill(core, signal.SIGKILL)
        got = await asyncio.wait_for(asyncio.gather(*step), 300)
        return cold, got, gate.engine, restart

    cold, got, final, restart = asyncio.run(scenario())
    try:
        assert not psutil.pid_exists(core) or psutil.Process(core).status() == "zombie"
        assert final is not first and restart.restarts == 1 and restart.healthy
        assert cuts == [0]  # the cut applied with the dead engine's share of the card free
        # no call lost, none failed; those the kill cut ran again on the new engine
        assert sum(engine is final for _, engine in got) >= 1
        for k, (out, engine) in enumerate(got):
            assert engine in (first, final)
            v = out[0].vector
            cos = float(np.dot(v, cold[k]) / np.linalg.norm(v) / np.linalg.norm(cold[k]))
            assert cos >= 0.99999, (k, cos)
        assert CARD.engines == 1
    finally:
        engines.shutdown(final)
    assert CARD.engines == 0
