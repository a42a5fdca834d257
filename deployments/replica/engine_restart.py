"""EngineRestart: an engine that died in a step is replaced in place, and that step's calls run
again on the new one.

vLLM's engine core does not survive an exception in a step: an OOM in the attention workspace or
from fragmentation (what runs out on a card is what the profile did not plan) ends the core, and
every call on it fails with the core's death. The calls' inputs are idempotent, so nothing has to
be lost: the request path (``RequestPath._engine_call``) reports the death once, and this part

1. closes the gate at once (synchronously, before the failing calls loop back to it): those
   calls and every call admitted after them wait at the gate, bounded by the model's
   ``cold_start_hold_s``, as they do during a prefix-cache swap;
2. takes the dead engine and shuts it down, waiting until its processes are gone: a second
   engine does not fit beside the first on a card, and a dead core's memory is free only then;
3. applies the governor's cut (the death was reported to it as an engine OOM) before anything
   runs again, so the new engine does not meet the step that killed the old one;
4. builds a new engine with the replica's current prefix-cache setting and opens the gate: the
   waiting calls run on it, and the client sees neither a 5xx nor a lost request.

A build that fails is retried with the prefix-cache swap's backoff; after ``SWAP_ATTEMPTS`` the
replica reports unhealthy and Serve replaces it (the ingress retries what it held). Restarts and
swaps take turns on ``EngineGate.replacing``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..common import metrics
from ..engine.gate import EngineGate
from ..engine.vllm_engine import EmbeddingEngine
from .prefix_cache import SWAP_ATTEMPTS, SWAP_BACKOFF_S

logger = logging.getLogger("embedfleet.engine_restart")


class EngineRestart:
    def __init__(self, *, model: str, card_label: str, gate: EngineGate[EmbeddingEngine],
                 build_engine: Callable[[bool], EmbeddingEngine],
                 shutdown_engine: Callable[[EmbeddingEngine], object],
                 prefix_caching: Callable[[], bool], apply_cut: Callable[[], Awaitable[None]],
                 on_change: Callable[[], None] = lambda: None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        self.model = model
        self._card = card_label
        self._gate = gate
        self._build = build_engine
        self._shutdown = shutdown_engine
        self._prefix_caching = prefix_caching
        self._apply_cut = apply_cut
        self._on_change = on_change
        self._sleep = sleep
        self.restarts = 0
        self.error: str | None = None
        self.gave_up = False
        self._task: asyncio.Task[None] | None = None

    @property
    def healthy(self) -> bool:
        """False only once the restart gave up: then Serve should replace the replica."""
        return not self.gave_up

    def begin(self, dead: EmbeddingEngine) -> None:
        """The engine ``dead`` died in a step. Close the gate now (its failing calls wait there)
        and replace it in the background. Nothing to do when it is no longer the gate's engine
        (a swap took it) or a restart is under way."""
        if self._gate.engine is not dead or (self._task is not None and not self._task.done()):
            return
        if self._gate.is_open:
            self._gate.close("its engine died in a step and is being restarted")
        self._task = asyncio.get_running_loop().create_task(self._restart(dead),
                                                            name=f"restart-{self.model}")

    async def _restart(self, dead: EmbeddingEngine) -> None:
        async with self._gate.replacing:
            if self._gate.engine is not dead:  # a swap replaced it first
                return
            t0 = time.monotonic()
            await self._gate.drain(5.0)  # the calls on a dead core fail at once
            self._gate.take()
            try:
                await asyncio.to_thread(self._shutdown, dead)
            except Exception as exc:  # a dead core's shutdown may raise; its processes are gone
                logger.warning("%s: shutting the dead engine down raised %r", self.model, exc)
            try:
                await self._apply_cut()
            except Exception as exc:  # governor unreachable: the last limits stand
                logger.warning("%s: the governor's cut could not be pulled: %r", self.model, exc)
            new = await self._build_with_retries()
            if new is None:
                return
            self._gate.open(new)
            self.restarts += 1
            self.error = None
            metrics.get("embedfleet_engine_restarts_total").inc(
                1, tags={"model": self.model, "outcome": "ok"})
            self._on_change()
            logger.warning("%s on %s: engine restarted after it died in a step (%.1f s); the "
                           "calls it held run again on the new engine", self.model, self._card,
                           time.monotonic() - t0)

    async def _build_with_retries(self) -> EmbeddingEngine | None:
        attempts = 0
        while True:
            attempts += 1
            try:
                return await asyncio.to_thread(self._build, self._prefix_caching())
            except Exception as exc:
                self.error = f"{type(exc).__name__}: {exc}"[:500]
                metrics.get("embedfleet_engine_restarts_total").inc(
                    1, tags={"model": self.model, "outcome": "failed"})
                if attempts >= SWAP_ATTEMPTS:
                    self.gave_up = True
                    logger.error("%s on %s: engine restart gave up after %d attempts: %s",
                                 self.model, self._card, attempts, self.error)
                    return None
                wait = SWAP_BACKOFF_S[min(attempts, len(SWAP_BACKOFF_S)) - 1]
                logger.error("%s: engine restart attempt %d failed (%s); retrying in %.0f s",
                             self.model, attempts, self.error, wait)
                await self._sleep(wait)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
