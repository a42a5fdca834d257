"""STAND-IN card model — FOR TESTS ONLY. It simulates a device's memory; it reads no hardware.

There is no NPU here, but the engine swap must be right under the card's semantics: vLLM (and
vLLM-Ascend, ``NPUWorker.init_device``) takes a snapshot of the device's free memory at start-up
and refuses to start when it is below ``gpu_memory_utilization`` x total —

    ValueError: Free memory on device (3.2/64.0 GiB) on startup is less than desired GPU memory
    utilization (0.95, 60.8 GiB). Decrease GPU memory utilization or reduce GPU memory used by
    other processes.

— and the first engine holds its share until its processes exit. ``SimulatedCard`` keeps that
ledger per process (a replica owns one card), and ``CardReservingEngine`` wraps a REAL engine:
it reserves the engine's share before the real engine starts (raising vLLM-Ascend's own error
when the card cannot give it) and gives it back only when the engine has been shut down. So a
second engine beside the first fails here exactly as it would on a 910B.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from embedfleet.deployments.engine.vllm_engine import EmbeddingEngine, EngineMemory, VllmEmbeddingEngine

GiB = 1 << 30
#: The share each engine reserves when the config gives none (CPU configs have no
#: gpu_memory_utilization): the shipped 910B profile's.
UTIL_ENV = "EMBEDFLEET_STANDIN_CARD_UTIL"
DEFAULT_UTIL = 0.95


class SimulatedCard:
    """One card's memory ledger: total bytes and what each live engine reserved."""

    def __init__(self, total: int = 64 * GiB) -> None:
        self.total = total
        self._held: dict[int, int] = {}
        self._lock = threading.Lock()
        self.refusals = 0

    @property
    def free(self) -> int:
        return self.total - sum(self._held.values())

    def reserve(self, owner: object, util: float) -> None:
        want = int(util * self.total)
        with self._lock:
            if self.free < want:
                self.refusals += 1
                gib = lambda b: round(b / GiB, 2)  # noqa: E731 - vLLM's own formatting
                raise ValueError(
                    f"Free memory on device ({gib(self.free)}/{gib(self.total)} GiB) on startup "
                    f"is less than desired GPU memory utilization ({util}, {gib(want)} GiB). "
                    "Decrease GPU memory utilization or reduce GPU memory used by other "
                    "processes.")
            self._held[id(owner)] = want

    def release(self, owner: object) -> None:
        with self._lock:
            self._held.pop(id(owner), None)

    @property
    def engines(self) -> int:
        return len(self._held)


#: The card of this process (a replica process owns exactly one).
CARD = SimulatedCard()


class CardReservingEngine:
    """A real engine that holds its share of ``card`` from start-up until it is shut down."""

    def __init__(self, engine_kwargs: dict[str, Any], *, card: SimulatedCard = CARD,
                 inner_factory=VllmEmbeddingEngine, util: float | None = None) -> None:
        util = util or engine_kwargs.get("gpu_memory_utilization") or float(
            os.environ.get(UTIL_ENV, DEFAULT_UTIL))
        self.card = card
        card.reserve(self, util)  # before the real engine starts, as vLLM's init_device does
        try:
            self.inner: EmbeddingEngine = inner_factory(engine_kwargs)
        except BaseException:
            card.release(self)
            raise
        self.info = self.inner.info
        self.hf_tokenizer = self.inner.hf_tokenizer

    @property
    def last_output_at(self) -> float:
        return self.inner.last_output_at

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.inner.tokenize(texts)

    async def embed(self, token_ids, **kwargs):
        return await self.inner.embed(token_ids, **kwargs)

    async def memory(self, timeout_s: float, idle: bool = False) -> EngineMemory:
        return await self.inner.memory(timeout_s, idle)

    async def check_health(self) -> None:
        await self.inner.check_health()

    def shutdown(self) -> None:
        try:
            self.inner.shutdown()
        finally:
            self.card.release(self)


def card_reserving_engine(engine_kwargs: dict[str, Any]) -> CardReservingEngine:
    """Engine factory (Serve app arg ``engine_factories``): the real vLLM engine on the card."""
    return CardReservingEngine(engine_kwargs)


def faulty_card_engine(engine_kwargs: dict[str, Any]) -> CardReservingEngine:
    """The real engine on the card, wrapped in the cache-hit fault injector (armed by a file)."""
    from tests.support.fault_injectors import corrupting_cache_hits_engine

    return CardReservingEngine(engine_kwargs, inner_factory=corrupting_cache_hits_engine)
