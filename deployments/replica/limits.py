"""LimitsFollower: once per control interval, read the card and follow the governor's limits.

Per tick:
1. read the engine's memory (its worker's probe and the KV pool's peak use) and export the card's
   terms (``embedfleet.deployments.engine.card_memory``): Prometheus computes the governor's signal from them.
   What is exported is the highest reading of the last ``peak_window_s``
   (``governor.peak_window_s``): Ray's metrics agent reports every ~10 s and Prometheus scrapes
   every 5 s, so a one-interval spike must outlive both to be seen;
2. pull this card's limits from the MemoryGovernor and apply them to the admission budget. The
   pull carries a ``CardReport``: the model, the engine allocator's retry and OOM counters and
   the engine OOMs this replica saw in a step (``engine_oom``); a rise cuts at once.

A failed read or pull keeps the last limits (the governor may be restarting; the engine may be
being swapped): serving never waits on the control loop.

An idle card is not probed every interval: the probe is a call into the engine's worker process,
and after any call vLLM's worker spins on its message queue for a second before it sleeps
(``SpinCondition.busy_loop_s`` in vLLM's shm_broadcast). Measured here: a probe every 2 s cost an
idle MiniLM worker 7.2 CPU-s per 20 s (0.12 without probes), so the test cluster's six idle
replicas kept both cores busy. With nothing run on the engine since the last probe, its reading
is reused (and re-exported, so the gauges never go stale) for up to ``IDLE_REPROBE_S``. The
replica's health check re-reads it right after its own idle probe embedding
(``read_card(fresh=True)``), inside the spin that embedding started: an idle card then wakes its
worker once per health probe, not twice.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Protocol

from ..common.contracts import Ceiling, Limits
from ..fleet.governor_law import CardReport
from ..engine.card_memory import (AllocatorCounters, CardMemoryReading,
                                  CpuCardModel, reading_from_probe,
                                  total_mismatch)
from ..engine.vllm_engine import EmbeddingEngine
from ..engine.gate import EngineGate

logger = logging.getLogger("embedfleet.limits")

# An idle card's memory is re-read at least this often. Longer than the health check's embedding
# interval (deployments/replica/engine_replica.py), which re-reads it first while it is idle.
IDLE_REPROBE_S = 60.0


class Budget(Protocol):
    @property
    def limits(self) -> tuple[int, int]: ...

    def set_limits(self, max_sequences: int, max_tokens: int) -> None: ...


class Sink(Protocol):
    def set_gauge(self, name: str, value: float, tags: dict[str, str]) -> None: ...


class LimitsFollower:
    def __init__(self, *, gate: EngineGate[EmbeddingEngine], budget: Budget,
                 card_tags: dict[str, str], ceiling: Ceiling,
                 pull_limits: Callable[[CardReport], Awaitable[Limits]] | None,
                 interval_s: float, sink: Sink, cpu_card: CpuCardModel | None,
                 peak_window_s: float = 15.0, idle: Callable[[], bool] = lambda: False,
                 last_activity: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                 clock: Callable[[], float] | None = None, model: str | None = None,
                 configured_total_bytes: int | None = None) -> None:
        self._gate = gate
        self._budget = budget
        self._tags = card_tags  # {"node": ..., "device": ...}
        self._pull = pull_limits
        self._interval_s = interval_s
        self._sink = sink
        self._cpu_card = cpu_card
        self._sleep = sleep
        self._peak_window_s = peak_window_s
        # time.monotonic() of the engine's last finished call; None: probe every interval
        self._last_activity = last_activity
        self._probed: tuple[float, EmbeddingEngine, CardMemoryReading] | None = None
        self._idle = idle
        self._clock = clock or (lambda: asyncio.get_running_loop().time())
        self._recent: deque[tuple[float, CardMemoryReading]] = deque()
        self.ceiling = ceiling
        self.limits = Limits(max_sequences=ceiling.max_sequences, max_tokens=ceiling.max_tokens,
                             reason="ceiling (no governor reading yet)")
        self.reading: CardMemoryReading | None = None
        self.idle_ratio: float | None = None
        """The signal's first reading, taken before any request: the card's idle floor."""
        self.model = model
        self._configured_total = configured_total_bytes  # cross-checks the runtime's total
        self.allocator = AllocatorCounters()
        """The current engine's allocator counters, as last read."""
        self.engine_ooms = 0
        self._report_task: asyncio.Task[None] | None = None

    async def read_card(self, fresh: bool = False) -> CardMemoryReading | None:
        """The card's reading; probed unless an idle card's last probe still holds. ``fresh``:
        probe anyway (the caller just woke the engine's worker)."""
        engine = self._gate.engine if self._gate.is_open else None
        if engine is None:
            return None
        reading = None if fresh else self._unchanged_since_last_probe(engine)
        if reading is None:
            try:
                mem = await engine.memory(timeout_s=self._interval_s, idle=self._idle())
            except Exception as exc:  # engine busy past the bound, or dying: skip this sample
                logger.warning("card %s/%s: memory probe failed: %r", self._tags["node"],
                               self._tags["device"], exc)
                return None
            reading = reading_from_probe(mem.probe, mem.kv.pool_bytes, mem.kv.peak_usage,
                                         self._cpu_card)
            self._probed = (time.monotonic(), engine, reading)
            self.allocator = reading.allocator
        if self.idle_ratio is None:
            self.idle_ratio = reading.ratio
            if (why := total_mismatch(reading.total_bytes, self._configured_total)) is not None:
                logger.warning("card %s/%s: %s", self._tags["node"], self._tags["device"], why)
        now = self._clock()
        self._recent.append((now, reading))
        while self._recent[0][0] < now - self._peak_window_s:
            self._recent.popleft()
        self.reading = max((r for _, r in self._recent), key=lambda r: r.ratio)
        self._export(self.reading)
        return reading

    def _unchanged_since_last_probe(self, engine: EmbeddingEngine) -> CardMemoryReading | None:
        """The last probe's reading when nothing has run on this engine since it (and it is
        younger than IDLE_REPROBE_S); None: probe now (a swapped engine is always probed)."""
        if self._last_activity is None or self._probed is None or not self._idle():
            return None
        at, probed_engine, reading = self._probed
        fresh = time.monotonic() - at < IDLE_REPROBE_S
        same = probed_engine is engine
        return reading if fresh and same and self._last_activity() < at else None

    def _export(self, r: CardMemoryReading) -> None:
        for name, value in (("embedfleet_card_memory_used_bytes", r.used_bytes),
                            ("embedfleet_card_memory_total_bytes", r.total_bytes),
                            ("embedfleet_kv_cache_pool_bytes", r.kv_pool_bytes),
                            ("embedfleet_kv_cache_usage_peak", r.kv_peak_usage),
                            ("embedfleet_kv_cache_free_bytes", r.kv_free_bytes),
                            ("embedfleet_allocator_cache_free_bytes", r.cache_free_bytes),
                            ("embedfleet_allocator_alloc_retries",
                             self.allocator.num_alloc_retries),
                            ("embedfleet_allocator_ooms", self.allocator.num_ooms),
                            ("embedfleet_card_memory_live_ratio", r.ratio)):
            self._sink.set_gauge(name, value, self._tags)

    def report(self) -> CardReport:
        return CardReport(model=self.model, allocator=self.allocator,
                          engine_ooms=self.engine_ooms)

    def engine_oom(self) -> None:
        """An engine call failed in a step (its engine is gone): report it to the governor now,
        which cuts this card at once (the cut outlives this replica: the governor keeps the
        card's state). Counted here because the engine's own counters went with it."""
        self.engine_ooms += 1
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop (a synchronous caller): the next pull reports it
            return
        self._report_task = loop.create_task(self.follow())

    async def follow(self) -> None:
        if self._pull is None:
            return
        try:
            limits = await self._pull(self.report())
        except Exception as exc:  # governor restarting: keep the last limits
            logger.warning("cannot pull limits from MemoryGovernor: %r", exc)
            return
        new = (limits.max_sequences, limits.max_tokens)
        if new != self._budget.limits:
            logger.warning("card %s/%s budget -> %d sequences / %d tokens (%s)",
                           self._tags["node"], self._tags["device"], *new, limits.reason)
        self._budget.set_limits(*new)
        self.limits = limits

    async def tick(self) -> None:
        await self.read_card()
        await self.follow()

    async def run(self, after_tick: Callable[[], None] = lambda: None) -> None:
        while True:
            await self.tick()
            after_tick()
            await self._sleep(self._interval_s)
