"""EngineGate: which engine a replica's calls use, and a way to close it for a swap.

On a real card two engines do not fit: vLLM checks at start-up that ``gpu_memory_utilization`` of
the card is free, and the first engine holds 0.95 of it. So replacing an engine (prefix caching
switched off after a failed canary) is: close the gate (new calls wait, bounded), drain the calls
the old engine holds, shut it down and wait until its processes are gone (their memory with
them), start the new one, open the gate. Calls never see a half-swapped engine.

Two parts replace engines (the prefix-cache swap, and the restart of an engine that died in a
step: ``replica/engine_restart.py``); ``replacing`` makes them take turns, so two engines are
never built for one card at once.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Generic, TypeVar

from ..common.errors import EngineUnavailable

E = TypeVar("E")


class EngineGate(Generic[E]):
    def __init__(self, engine: E) -> None:
        self._engine: E | None = engine
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._inflight = 0
        self.why_closed = ""
        self.replacing = asyncio.Lock()
        """Held by whoever is replacing the engine, from taking the old one to opening the new."""

    @property
    def engine(self) -> E | None:
        """The engine calls use now; None while a swap has shut the old one down."""
        return self._engine

    @property
    def is_open(self) -> bool:
        return self._open.is_set()

    @property
    def inflight(self) -> int:
        return self._inflight

    @contextlib.asynccontextmanager
    async def use(self, hold_s: float, retry_after_s: float = 1.0) -> AsyncIterator[E]:
        """The engine, for one call. While the gate is closed the call waits, up to ``hold_s``;
        then ``EngineUnavailable`` (503 + Retry-After; the router retries it elsewhere)."""
        if not self._open.is_set():
            try:
                await asyncio.wait_for(self._open.wait(), timeout=hold_s)
            except TimeoutError:
                raise EngineUnavailable(
                    f"the engine is being replaced ({self.why_closed}); held {hold_s:.0f} s",
                    retry_after_s=retry_after_s) from None
        engine = self._engine
        assert engine is not None  # open implies an engine
        self._inflight += 1
        self._idle.clear()
        try:
            yield engine
        finally:
            self._inflight -= 1
            if self._inflight == 0:
                self._idle.set()

    def close(self, why: str) -> None:
        self.why_closed = why
        self._open.clear()

    async def drain(self, timeout_s: float) -> bool:
        """Wait until no call holds the engine; False when ``timeout_s`` passed first."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout=timeout_s)
            return True
        except TimeoutError:
            return False

    def take(self) -> E | None:
        """Remove the engine (to shut it down); the gate must be closed and drained."""
        engine, self._engine = self._engine, None
        return engine

    def open(self, engine: E) -> None:
        self._engine = engine
        self.why_closed = ""
        self._open.set()
