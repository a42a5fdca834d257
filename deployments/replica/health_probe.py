"""The replica's health probe: a tiny embedding that may stay pending across health checks.

Serve gives a health check ``health_check_timeout_s`` and kills the replica after three failures
in a row. A probe waits behind whatever the engine is computing, so on a slow or starved device
a healthy engine's probe can outlast one check: seen in a CI run on two shared cores, where a
MiniLM replica that was still working was killed with its calls in flight. So a probe that is
not answered within one check stays pending, and the next checks wait on the same probe; the
engine is reported stuck only when that one probe has gone unanswered for ``stall_s``. An engine
whose core died still fails at once (its error, or the core's own liveness check).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from dataclasses import dataclass, field

import numpy as np

from ..engine.vllm_engine import EmbeddingEngine

HEALTH_PROBE_TEXT = "embedfleet health check"


class EngineStalled(RuntimeError):
    """The engine left one health probe unanswered for the stall bound."""


@dataclass
class HealthProbe:
    stall_s: float
    _task: asyncio.Future | None = field(default=None, repr=False)
    _engine: EmbeddingEngine | None = field(default=None, repr=False)
    _sent_at: float = 0.0

    @property
    def pending_for(self) -> float:
        """Seconds the current probe has waited for its answer (0 when none is pending)."""
        return time.monotonic() - self._sent_at if self._task is not None else 0.0

    async def run(self, engine: EmbeddingEngine, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the probe on ``engine`` (sending one if none is pending).

        True: answered with a finite vector. False: still pending, for less than ``stall_s``.
        Raises the engine's error, or ``EngineStalled`` once the probe has waited ``stall_s``.
        """
        if self._task is not None and self._engine is not engine:
            self.cancel()  # the engine was swapped: its successor gets a probe of its own
        if self._task is None:
            ids = engine.tokenize([HEALTH_PROBE_TEXT])
            self._task = asyncio.ensure_future(
                engine.embed(ids, request_id=f"health-{uuid.uuid4().hex[:8]}"))
            self._engine, self._sent_at = engine, time.monotonic()
        done, _ = await asyncio.wait({self._task}, timeout=max(timeout_s, 0.0))
        if not done:
            waited = self.pending_for
            if waited < self.stall_s:
                return False
            # kept pending: every later check fails too (Serve replaces a replica after three
            # failures in a row), until the engine answers it after all
            raise EngineStalled(f"the engine left its health probe unanswered for {waited:.0f}s "
                                f"(health_stall_timeout_s={self.stall_s:g})")
        task, self._task = self._task, None
        if task.cancelled():  # e.g. the engine shut down under it: a failed probe, not a
            # CancelledError escaping the health check (a BaseException Serve would not count)
            raise RuntimeError("the health probe was cancelled by the engine")
        out = task.result()
        if not np.isfinite(out[0].vector).all():
            raise RuntimeError("health probe embedding is not finite")
        return True

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()
        self._task = self._engine = None
