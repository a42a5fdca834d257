"""FAULT INJECTORS — for tests only (kept under tests/, never installed). Never configure these in
production.

Each is an ``EmbeddingEngine`` wrapper (same Protocol) built by an engine-factory import path
(``engine_factory`` in the Serve application args), so the replica code path is the real one.

``corrupting_cache_hits_engine`` reproduces the vLLM-Ascend 0.13–0.17 failure on CPU: a request that
hits the prefix cache (vLLM reports ``num_cached_tokens``) gets a vector that is wrong the way that
bug made it wrong — pulled away from the true vector to cosine ~0.6 — while cold requests are exact.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import numpy as np

from embedfleet.deployments.engine.vllm_engine import Embedding, EmbeddingEngine, VllmEmbeddingEngine

logger = logging.getLogger("embedfleet.fault_injectors")


class CacheHitCorruptingFaultInjector:
    """Wraps an engine; perturbs the vectors of requests that hit the prefix cache."""

    def __init__(self, inner: EmbeddingEngine, seed: int = 1234, mix: float = 1.3,
                 armed_by: str | None = None) -> None:
        self.inner = inner
        # When set, corrupt only while this file exists: a test arms the fault mid-run.
        self._armed_by = Path(armed_by) if armed_by else None
        self.info = inner.info
        self.hf_tokenizer = inner.hf_tokenizer
        self._rng = np.random.default_rng(seed)
        self._mix = mix
        self.corrupted = 0
        logger.warning("FAULT INJECTOR active: cache-hit embeddings will be corrupted")

    @property
    def last_output_at(self) -> float:
        return self.inner.last_output_at

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.inner.tokenize(texts)

    async def embed(self, token_ids: list[list[int]], *, request_id: str,
                    dimensions: int | None = None, skip_prefix_cache: bool = False,
                    normalize: bool = True, priority: int = 0) -> list[Embedding]:
        out = await self.inner.embed(token_ids, request_id=request_id, dimensions=dimensions,
                                     skip_prefix_cache=skip_prefix_cache, normalize=normalize,
                                     priority=priority)
        armed = self._armed_by is None or self._armed_by.exists()
        for e in out:
            if armed and e.num_cached_tokens > 0:
                noise = self._rng.standard_normal(e.vector.shape).astype(np.float32)
                noise /= np.linalg.norm(noise)
                v = e.vector + self._mix * noise * np.linalg.norm(e.vector)
                e.vector = (v / np.linalg.norm(v)).astype(np.float32)
                self.corrupted += 1
        return out

    async def check_health(self) -> None:
        await self.inner.check_health()

    async def memory(self, timeout_s: float, idle: bool = False):
        return await self.inner.memory(timeout_s, idle)

    def shutdown(self) -> None:
        self.inner.shutdown()


ARM_FILE_ENV = "EMBEDFLEET_FAULT_ARM_FILE"


def corrupting_cache_hits_engine(engine_kwargs: dict[str, Any]) -> CacheHitCorruptingFaultInjector:
    """Engine factory: the real vLLM engine wrapped in the cache-hit fault injector.

    With ``EMBEDFLEET_FAULT_ARM_FILE`` set (in the replica's runtime env), the fault is active
    only while that file exists; otherwise from the start.
    """
    return CacheHitCorruptingFaultInjector(VllmEmbeddingEngine(engine_kwargs),
                                           armed_by=os.environ.get(ARM_FILE_ENV))
