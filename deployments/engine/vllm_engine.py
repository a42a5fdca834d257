"""The embedding engine behind a small Protocol, and its vLLM implementation.

The replica deployment only talks to ``EmbeddingEngine``; the real engine is ``VllmEmbeddingEngine``
(vLLM ``AsyncLLM`` with ``runner="pooling"``). Fault injectors for tests wrap an engine and keep
the same Protocol.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

from . import vllm_api
from .kv_usage import KvSample, KvUsageTracker

logger = logging.getLogger("embedfleet.engine")


@dataclass(frozen=True)
class EngineInfo:
    """Facts about the loaded model that the router and `/v1/models` need."""

    model: str
    max_model_len: int
    hidden_size: int
    vocab_size: int
    dtype: str
    matryoshka_dimensions: tuple[int, ...] | None
    supports_dimensions: bool
    prefix_caching: bool
    engine_version: str
    pooling_type: str | None = None
    normalizes: bool = True  # the pooler L2-normalises (sentence-transformers Normalize)
    block_size: int = 0  # the KV block size that actually runs (vllm-ascend may override)
    pooling_task: str = "embed"  # "classify": a reranker, whose "vector" is its pair's score


@dataclass
class Embedding:
    vector: np.ndarray  # float32, normalised as the model's pooler does
    num_tokens: int
    num_cached_tokens: int = 0


@dataclass(frozen=True)
class EngineMemory:
    """Raw memory facts of one engine (``embedfleet.deployments.engine.card_memory`` turns them into a signal)."""

    probe: dict[str, int]  # from the worker process (vllm_api.MemoryProbeExtension)
    kv: KvSample


@runtime_checkable
class EmbeddingEngine(Protocol):
    info: EngineInfo
    hf_tokenizer: Any  # the engine's own tokenizer (special tokens, offsets for /tokenize)
    # time.monotonic() when the engine last finished a sequence (its start before the first):
    # a busy replica's proof of progress. A call is many sequences, and one large call can run
    # for minutes on a slow device while its sequences keep finishing.
    last_output_at: float

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids exactly as the engine would produce them (special tokens included)."""

    async def embed(self, token_ids: list[list[int]], *, request_id: str,
                    dimensions: int | None = None, skip_prefix_cache: bool = False,
                    normalize: bool = True, priority: int = 0) -> list[Embedding]:
        """One vector per input, in input order. ``skip_prefix_cache``: compute without reading
        the prefix cache (the canary's reference, and the safe mode after a canary failure).
        ``normalize=False``: the pooler's raw output (no L2 normalisation). ``priority``:
        vLLM's, lower first (with ``engine.scheduling_policy: priority`` bulk-lane sequences
        wait behind interactive ones)."""

    async def check_health(self) -> None:
        """Raise if the engine cannot embed."""

    async def memory(self, timeout_s: float, idle: bool = False) -> EngineMemory:
        """The engine's memory now (see ``EngineMemory``); ``idle``: nothing is in flight, so
        memory the engine merely caches may be handed back before the reading."""

    def shutdown(self) -> None:
        """Stop the engine and its processes."""


class EngineDead(RuntimeError):
    """The engine's background process is gone; the replica must be replaced."""


@dataclass
class VllmEmbeddingEngine:
    """vLLM ``AsyncLLM`` in pooling mode. Construction starts the engine-core process.

    Every vLLM name it uses goes through ``embedfleet.deployments.engine.vllm_api`` (checked against vLLM 0.23 and
    0.32 sources)."""

    engine_kwargs: dict[str, Any]
    engine_version: str = ""
    observed: bool = True
    """False: no embedfleet stat loggers or memory probe (a bare engine, for the bench)."""
    _llm: Any = field(init=False, repr=False)
    info: EngineInfo = field(init=False)

    def __post_init__(self) -> None:
        t0 = time.monotonic()
        self.last_output_at = t0
        self.kv = KvUsageTracker()
        self._llm = vllm_api.start_engine(self.engine_kwargs, self.kv if self.observed else None)
        self._tokenizer = vllm_api.tokenizer(self._llm)
        self.hf_tokenizer = self._tokenizer
        view = vllm_api.model_view(self._llm)
        self.info = EngineInfo(
            model=self.engine_kwargs.get("served_model_name") or self.engine_kwargs["model"],
            max_model_len=view.max_model_len,
            hidden_size=view.hidden_size,
            vocab_size=view.vocab_size,
            dtype=view.dtype,
            matryoshka_dimensions=view.matryoshka_dimensions,
            supports_dimensions=view.supports_dimensions,
            prefix_caching=view.prefix_caching,
            engine_version=self.engine_version or engine_version_label(),
            pooling_type=view.pooling_type,
            normalizes=view.normalizes,
            block_size=view.block_size,
            pooling_task=view.pooling_task,
        )
        logger.info("engine up in %.1fs: %s; KV pool %d blocks x %d B", time.monotonic() - t0,
                    self.info, self.kv.num_blocks, self.kv.block_bytes)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        # Batched fast-tokenizer call; same settings vLLM applies to a text prompt.
        return [list(ids) for ids in self._tokenizer(texts, add_special_tokens=True)["input_ids"]]

    async def _one(self, ids: list[int], request_id: str, dimensions: int | None,
                   skip_prefix_cache: bool, normalize: bool, priority: int) -> Embedding:
        prompt, params = vllm_api.pooling_request(ids, dimensions=dimensions,
                                                  skip_prefix_cache=skip_prefix_cache,
                                                  normalize=normalize,
                                                  task=self.info.pooling_task)
        out = None
        async for out in self._llm.encode(prompt, params, request_id=request_id,
                                          priority=priority):
            pass
        if out is None:
            raise EngineDead(f"engine returned no output for {request_id}")
        self.last_output_at = time.monotonic()
        pooled = vllm_api.pooled_output(out)
        data = pooled.data
        vec = data.float().numpy() if hasattr(data, "numpy") else np.asarray(data, np.float32)
        return Embedding(vec.astype(np.float32, copy=False), pooled.num_tokens,
                         pooled.num_cached_tokens)

    async def embed(self, token_ids: list[list[int]], *, request_id: str,
                    dimensions: int | None = None, skip_prefix_cache: bool = False,
                    normalize: bool = True, priority: int = 0) -> list[Embedding]:
        if vllm_api.engine_errored(self._llm):
            raise EngineDead("vLLM engine core is not running")
        tasks = [asyncio.ensure_future(
            self._one(ids, f"{request_id}-{i}", dimensions, skip_prefix_cache, normalize,
                      priority))
            for i, ids in enumerate(token_ids)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # A cancelled or failed call must not leave its sibling sequences computing.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def memory(self, timeout_s: float, idle: bool = False) -> EngineMemory:
        """One reading of the engine's memory: its worker's probe plus the KV pool's peak use."""
        probe = await vllm_api.probe_memory(self._llm, timeout_s, idle)
        return EngineMemory(probe=probe, kv=self.kv.sample())

    async def check_health(self) -> None:
        if vllm_api.engine_errored(self._llm):
            raise EngineDead("vLLM engine core is not running")
        await self._llm.check_health()

    def shutdown(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.shutdown()


def engine_version_label() -> str:
    """``vllm X`` plus the plugin's version on Ascend: what ``x-embedfleet-engine`` carries."""
    v = vllm_api.stack_versions()
    label = f"vllm {v.vllm or 'unknown'}"
    return f"{label}; vllm-ascend {v.vllm_ascend}" if v.vllm_ascend else label
