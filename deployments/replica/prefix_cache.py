"""A replica's prefix-cache state, its canary, and the engine swap when the canary fails.

One state, one owner:

* ``on``          — the engine caches prefixes and calls read the cache; the canary runs at
                    start-up and every ``canary_interval_s`` (sooner while inconclusive).
* ``off``         — the policy, the config or an earlier failure turned it off.
* ``safe-mode``   — a canary failed (here, or on another replica of the model: the registry's
                    override). Calls stop reading the cache at once (correct vectors, slower)
                    until the swap takes over.
* ``swapping``    — the gate is closed (calls wait, bounded), the old engine drains and is shut
                    down, and an engine with prefix caching off starts. On a real card the old
                    engine must be gone first: vLLM refuses to start while the card does not have
                    ``gpu_memory_utilization`` of its memory free.
* ``swap-failed`` — the new engine did not start; retried with backoff, the error shown in
                    ``/v1/models`` and counted in ``embedfleet_engine_swaps_total{outcome}``.
                    After ``SWAP_ATTEMPTS`` the replica reports unhealthy, so Serve replaces it;
                    the registry already holds the override, so the new replica starts with
                    caching off.

A canary that saw no cache hit, or whose cosine lies between ``canary.FAIL_COSINE`` and the
floor calibrated at start (``canary.calibrate_floor``), is ``inconclusive``: never shown as
passed, rerun sooner and alerted on, and never a reason to switch caching off. Only ``failed``
(below ``FAIL_COSINE``) switches this replica off and reports to the registry, which switches the
model off fleet-wide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Literal

from ..common import metrics
from ..common.contracts import CanaryView, PrefixCacheView, SwapView
from .canary import (VERDICTS, CanaryFloor, CanaryResult,
                     calibrate_floor, run_canary)
from ..engine.vllm_engine import EmbeddingEngine
from ..engine.gate import EngineGate

logger = logging.getLogger("embedfleet.prefix_cache")

State = Literal["on", "off", "safe-mode", "swapping", "swap-failed"]
SWAP_ATTEMPTS = 5
SWAP_BACKOFF_S = (5.0, 15.0, 30.0, 60.0)
DRAIN_TIMEOUT_S = 120.0
INCONCLUSIVE_RERUNS = 3  # immediate reruns before waiting for the next interval


class PrefixCacheController:
    def __init__(self, *, model: str, card_label: str, enabled: bool, reason: str,
                 gate: EngineGate[EmbeddingEngine],
                 build_engine: Callable[[bool], EmbeddingEngine],
                 shutdown_engine: Callable[[EmbeddingEngine], None],
                 report_failure: Callable[[str, dict[str, Any]], Awaitable[None]] | None,
                 canary_interval_s: float, on_change: Callable[[], None] = lambda: None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.model = model
        self._card = card_label
        self.state: State = "on" if enabled else "off"
        self.reason = reason
        self._gate = gate
        self._build = build_engine
        self._shutdown = shutdown_engine
        self._report_failure = report_failure
        self._interval_s = canary_interval_s
        self._on_change = on_change
        self._sleep = sleep
        self.last_canary: CanaryResult | None = None
        self.floor: CanaryFloor | None = None  # calibrated on this replica's engine at start
        self.swap_attempts = 0
        self.swap_error: str | None = None
        self.gave_up = False
        self._swap_task: asyncio.Task[None] | None = None

    # -- what the request path and describe() read ------------------------------------------
    @property
    def reads_cache(self) -> bool:
        return self.state == "on"

    def view(self) -> PrefixCacheView:
        return PrefixCacheView(
            enabled=self.reads_cache, state=self.state, reason=self.reason,
            last_canary=CanaryView(**self.last_canary.to_dict()) if self.last_canary else None,
            swap=SwapView(attempts=self.swap_attempts, error=self.swap_error,
                          gave_up=self.gave_up))

    def export(self) -> None:
        tag = {"model": self.model}
        metrics.get("embedfleet_prefix_cache_enabled").set(int(self.reads_cache), tags=tag)
        if self.last_canary is not None:
            metrics.get("embedfleet_canary_last_cosine").set(self.last_canary.min_cosine,
                                                            tags=tag)
            metrics.get("embedfleet_canary_floor").set(self.last_canary.floor, tags=tag)
            for v in VERDICTS:
                metrics.get("embedfleet_canary_verdict").set(
                    int(self.last_canary.verdict == v), tags={**tag, "verdict": v})

    def _set(self, state: State, reason: str | None = None) -> None:
        self.state = state
        if reason is not None:
            self.reason = reason
        self.export()
        self._on_change()

    # -- the canary ---------------------------------------------------------------------------
    async def calibrate(self) -> CanaryFloor:
        """The floor from two cold runs of the probes on this replica's engine."""
        engine = self._gate.engine
        assert engine is not None
        self.floor = await calibrate_floor(engine, label=f"canary-floor-{self.model}")
        logger.info("prefix-cache canary of %s on %s: %s", self.model, self._card,
                    self.floor.detail)
        return self.floor

    async def canary_once(self) -> CanaryResult:
        engine = self._gate.engine
        assert engine is not None
        floor = self.floor or await self.calibrate()
        result = await run_canary(engine, label=f"canary-{self.model}", floor=floor.floor)
        self.last_canary = result
        self.export()
        if result.verdict == "inconclusive":
            metrics.get("embedfleet_canary_inconclusive_total").inc(1, tags={"model": self.model})
            logger.warning("prefix-cache canary of %s on %s: %s", self.model, self._card,
                           result.detail)
        elif result.passed:
            logger.info("prefix-cache canary of %s: %s", self.model, result.detail)
        else:
            metrics.get("embedfleet_canary_failures_total").inc(1, tags={"model": self.model})
            logger.error("prefix-cache canary FAILED for %s on card %s: %s; switching prefix "
                         "caching off for this model", self.model, self._card, result.detail)
            reason = f"disabled by the canary: {result.detail}"
            if self._report_failure is not None:
                await self._report_failure(reason, CanaryView(**result.to_dict()))
            self.switch_off(reason)
        return result

    async def prove(self) -> None:
        """The start-up canary: calibrate the floor, then rerun at once while inconclusive (a
        fresh nonce each time). An inconclusive end leaves caching on, unproven."""
        if self.state == "on":
            await self.calibrate()
        for _ in range(1 + INCONCLUSIVE_RERUNS):
            if self.state != "on" or (await self.canary_once()).verdict != "inconclusive":
                return

    async def run(self) -> None:
        """Rerun the canary every interval (a quarter of it while inconclusive)."""
        while self.state == "on":
            inconclusive = self.last_canary is not None and not self.last_canary.conclusive
            await self._sleep(self._interval_s / 4 if inconclusive else self._interval_s)
            if self.state != "on":
                return
            try:
                await self.canary_once()
            except Exception as exc:  # a canary that cannot run is logged, never fatal
                logger.warning("prefix-cache canary of %s could not run: %r", self.model, exc)

    # -- switching off ------------------------------------------------------------------------
    def switch_off(self, reason: str) -> asyncio.Task[None] | None:
        """Stop reading the cache now; swap to an engine without prefix caching in the background."""
        if self.state != "on":
            return self._swap_task
        self._set("safe-mode", reason)
        self._swap_task = asyncio.get_running_loop().create_task(self._swap(),
                                                                 name=f"swap-{self.model}")
        return self._swap_task

    async def _swap(self) -> None:
        self._gate.close("prefix caching is being switched off after a failed canary")
        self._set("swapping")
        async with self._gate.replacing:  # a restart of a dead engine goes first, or after
            engine = self._gate.engine
            if engine is not None and not engine.info.prefix_caching:
                # an engine restarted meanwhile was built with caching off (safe-mode)
                self._gate.open(engine)
                self._set("off")
                return
            await self._replace()

    async def _replace(self) -> None:
        if not await self._gate.drain(DRAIN_TIMEOUT_S):
            logger.warning("%s: %d call(s) still on the old engine after %.0f s; shutting it "
                           "down anyway (they fail over to another replica)", self.model,
                           self._gate.inflight, DRAIN_TIMEOUT_S)
        old = self._gate.take()
        if old is not None:
            await asyncio.to_thread(self._shutdown, old)  # its memory is free when this returns
        while True:
            self.swap_attempts += 1
            t0 = time.monotonic()
            try:
                new = await asyncio.to_thread(self._build, False)
            except Exception as exc:
                self.swap_error = f"{type(exc).__name__}: {exc}"[:500]
                metrics.get("embedfleet_engine_swaps_total").inc(
                    1, tags={"model": self.model, "outcome": "failed"})
                if self.swap_attempts >= SWAP_ATTEMPTS:
                    self.gave_up = True
                    self._set("swap-failed", f"{self.reason}; engine swap failed "
                              f"{self.swap_attempts} times, the replica asks Serve to replace "
                              f"it: {self.swap_error}")
                    logger.error("%s: engine swap gave up: %s", self.model, self.swap_error)
                    return
                wait = SWAP_BACKOFF_S[min(self.swap_attempts, len(SWAP_BACKOFF_S)) - 1]
                self._set("swap-failed")
                logger.error("%s: engine swap attempt %d failed (%s); retrying in %.0f s",
                             self.model, self.swap_attempts, self.swap_error, wait)
                await self._sleep(wait)
                self._set("swapping")
                continue
            break
        self._gate.open(new)
        self.swap_error = None
        metrics.get("embedfleet_engine_swaps_total").inc(1, tags={"model": self.model,
                                                                   "outcome": "ok"})
        self._set("off")
        logger.warning("%s on %s now serves with prefix caching off (new engine in %.1f s)",
                       self.model, self._card, time.monotonic() - t0)

    @property
    def healthy(self) -> bool:
        """False only once the swap gave up: then Serve should replace the replica."""
        return not self.gave_up

    def cancel(self) -> None:
        if self._swap_task is not None:
            self._swap_task.cancel()
