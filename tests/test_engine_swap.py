"""The engine swap after a failed canary, under the card's semantics (real vLLM engines).

The card is the STAND-IN ``tests/support/card_model.py``: a second engine cannot start while the
first holds 0.95 of it, exactly vLLM-Ascend's start-up check. The engines are real vLLM engines
(tiny Qwen3 on CPU); the canary fails because the first engine is wrapped in the cache-hit fault
injector. Requests keep arriving throughout, through the gate the replica's request path uses.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest

from embedfleet.deployments.config.schema import parse_config
from embedfleet.deployments.engine.vllm_engine import VllmEmbeddingEngine
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.common.errors import EngineUnavailable
from embedfleet.deployments.replica.prefix_cache import PrefixCacheController
from tests.support.card_model import CardReservingEngine, SimulatedCard
from tests.support.fault_injectors import CacheHitCorruptingFaultInjector

ROOT = Path(__file__).resolve().parent.parent
# Real vLLM engines, started and swapped in this process: minutes on two cores, so not in
# `make test-unit` (pyproject's `engine` tier); `make test` runs them.
pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def engine_kwargs(tiny_qwen3_dir) -> dict:
    cfg = parse_config({"platform": {"kind": "cpu"}, "models": [{
        "name": "tiny", "source": {"path": str(tiny_qwen3_dir)}, "max_model_len": 2048,
        "engine": {"max_num_batched_tokens": 4096, "kv_cache_memory_bytes": 64 << 20}}]})
    return {k: v for k, v in cfg.engine_kwargs(cfg.models[0], enable_prefix_caching=True).items()}


def test_swap_completes_on_a_full_card_and_loses_no_request(engine_kwargs):
    card = SimulatedCard()
    order: list[str] = []

    def build(prefix_cache: bool):
        order.append(f"build prefix_cache={prefix_cache} free={card.free / card.total:.2f}")
        kwargs = {**engine_kwargs, "enable_prefix_caching": prefix_cache}
        if prefix_cache:  # the first engine: its cache hits come back corrupted
            return CardReservingEngine(kwargs, card=card, util=0.95, inner_factory=lambda kw:
                                       CacheHitCorruptingFaultInjector(VllmEmbeddingEngine(kw)))
        return CardReservingEngine(kwargs, card=card, util=0.95)

    def shutdown(engine):
        order.append("shutdown")
        engine.shutdown()

    async def scenario():
        gate = EngineGate(build(True))
        truth_engine = gate.engine
        ctl = PrefixCacheController(
            model="tiny", card_label="n/0", enabled=True, reason="policy", gate=gate,
            build_engine=build, shutdown_engine=shutdown, report_failure=None,
            canary_interval_s=3600)
        texts = [f"query number {i} about the card's memory" for i in range(4)]
        ids = truth_engine.tokenize(texts)
        cold = await truth_engine.embed(ids, request_id="cold", skip_prefix_cache=True)
        answers: list[np.ndarray] = []
        errors: list[BaseException] = []
        stop = asyncio.Event()

        async def client(k: int) -> None:
            while not stop.is_set():
                try:
                    async with gate.use(hold_s=300) as engine:
                        out = await engine.embed([ids[k % 4]], request_id=f"c{k}-{time.time_ns()}",
                                                 skip_prefix_cache=not ctl.reads_cache)
                    answers.append((k % 4, out[0].vector))
                except BaseException as exc:  # noqa: BLE001 - every loss is a failure here
                    errors.append(exc)
                await asyncio.sleep(0.05)

        result = await ctl.canary_once()  # the fault injector makes cache hits wrong
        assert result.verdict == "failed", result
        assert ctl.state in ("safe-mode", "swapping") and not ctl.reads_cache
        assert ctl._swap_task is not None
        # Clients arrive while the swap runs: held at the gate, then served by the new engine.
        clients = [asyncio.create_task(client(k)) for k in range(4)]
        await asyncio.wait_for(ctl._swap_task, timeout=240)
        await asyncio.sleep(1.0)
        stop.set()
        await asyncio.gather(*clients)
        final = gate.engine
        return ctl, cold, answers, errors, final

    ctl, cold, answers, errors, final = asyncio.run(scenario())
    try:
        assert errors == []  # no request lost while the card held only one engine at a time
        assert len(answers) > 20
        # Every answer — held at the gate during the swap, then served — is the cold vector.
        for k, vec in answers:
            cos = float(np.dot(vec, cold[k].vector) / np.linalg.norm(vec)
                        / np.linalg.norm(cold[k].vector))
            assert cos >= 0.99999, (k, cos)
        assert ctl.state == "off" and ctl.swap_attempts == 1 and ctl.swap_error is None
        assert final.info.prefix_caching is False
        # The order the card allows: the old engine was shut down before the new one started.
        assert order[0].startswith("build prefix_cache=True free=1.00")
        assert order[1:] == ["shutdown", "build prefix_cache=False free=1.00"]
        assert card.engines == 1 and card.refusals == 0
        # ...and the card model really refuses a second engine while one holds it.
        with pytest.raises(ValueError, match=r"Free memory on device \(3\.2/64\.0 GiB\) on "
                                             r"startup is less than desired GPU memory "
                                             r"utilization \(0\.95, 60\.8 GiB\)"):
            CardReservingEngine(engine_kwargs, card=card, util=0.95)
        assert card.refusals == 1 and card.engines == 1
    finally:
        final.shutdown()
    assert card.engines == 0 and card.free == card.total


def test_failed_swap_is_retried_and_shown(engine_kwargs):
    """A new engine that cannot start is retried (attempts and the error are visible), and
    requests wait at the gate meanwhile; giving up makes the replica unhealthy."""
    card = SimulatedCard()
    attempts: list[int] = []
    blocker = object()

    def build(prefix_cache: bool):
        attempts.append(1)
        if len(attempts) == 2:  # someone else grabbed the card: the first retry is refused
            card.reserve(blocker, 0.5)
        if len(attempts) == 3:
            card.release(blocker)
        return CardReservingEngine({**engine_kwargs, "enable_prefix_caching": prefix_cache},
                                   card=card, util=0.95)

    async def scenario():
        gate = EngineGate(build(True))
        waits: list[float] = []

        async def fast_sleep(s: float) -> None:
            waits.append(s)
            await asyncio.sleep(0)

        ctl = PrefixCacheController(
            model="tiny", card_label="n/0", enabled=True, reason="policy", gate=gate,
            build_engine=build, shutdown_engine=lambda e: e.shutdown(), report_failure=None,
            canary_interval_s=3600, sleep=fast_sleep)
        seen: list[str] = []
        ctl._on_change = lambda: seen.append(f"{ctl.state}:{ctl.swap_error or ''}")
        ctl.switch_off("disabled by a test")
        await asyncio.sleep(0)  # the swap task starts: it closes the gate first
        with pytest.raises(EngineUnavailable, match="being replaced"):
            async with gate.use(hold_s=0.01):
                pass
        await asyncio.wait_for(ctl._swap_task, timeout=240)
        return ctl, seen, waits, gate

    ctl, seen, waits, gate = asyncio.run(scenario())
    try:
        assert ctl.state == "off" and ctl.swap_attempts == 2 and not ctl.gave_up
        assert any(s.startswith("swap-failed:ValueError: Free memory on device") for s in seen)
        assert waits == [5.0]  # backoff before the retry
        assert ctl.view().swap.attempts == 2
    finally:
        gate.engine.shutdown()


def test_a_cache_that_never_hits_is_inconclusive_never_passed(engine_kwargs):
    """No cache hit observed proves nothing: the verdict says so, the canary is rerun at once,
    and nothing reads as proven (the engine here caches nothing, as an evicting or misconfigured
    cache would)."""
    runs: list[str] = []

    async def scenario():
        engine = VllmEmbeddingEngine({**engine_kwargs, "enable_prefix_caching": False})
        gate = EngineGate(engine)
        ctl = PrefixCacheController(
            model="tiny", card_label="n/0", enabled=True, reason="policy", gate=gate,
            build_engine=lambda _: None, shutdown_engine=lambda e: None, report_failure=None,
            canary_interval_s=3600, on_change=lambda: runs.append("change"))
        real = ctl.canary_once

        async def counted():
            runs.append("canary")
            return await real()

        ctl.canary_once = counted
        await ctl.prove()
        return engine, ctl

    engine, ctl = asyncio.run(scenario())
    try:
        canary = ctl.view().last_canary
        assert canary.verdict == "inconclusive" and canary.passed is False
        assert canary.conclusive is False and canary.cached_tokens == 0
        assert "nothing proven" in canary.detail
        assert runs.count("canary") == 4  # the first run and three immediate reruns
        assert ctl.state == "on" and ctl.swap_attempts == 0  # not a failure: no swap
    finally:
        engine.shutdown()
