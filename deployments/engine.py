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


@dataclass
class Embedding:
    vector: np.ndarray  # float32, normalised as the model's pooler does
    num_tokens: int
    num_cached_tokens: int = 0


@runtime_checkable
class EmbeddingEngine(Protocol):
    info: EngineInfo
    hf_tokenizer: Any  # the engine's own tokenizer (special tokens, offsets for /tokenize)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids exactly as the engine would produce them (special tokens included)."""

    async def embed(self, token_ids: list[list[int]], *, request_id: str,
                    dimensions: int | None = None, skip_prefix_cache: bool = False,
                    normalize: bool = True) -> list[Embedding]:
        """One vector per input, in input order. ``skip_prefix_cache``: compute without reading
        the prefix cache (the canary's reference, and the safe mode after a canary failure).
        ``normalize=False``: the pooler's raw output (no L2 normalisation)."""

    async def check_health(self) -> None:
        """Raise if the engine cannot embed."""

    def shutdown(self) -> None:
        """Stop the engine and its processes."""


class EngineDead(RuntimeError):
    """The engine's background process is gone; the replica must be replaced."""


@dataclass
class VllmEmbeddingEngine:
    """vLLM ``AsyncLLM`` in pooling mode. Construction starts the engine-core process."""

    engine_kwargs: dict[str, Any]
    _llm: Any = field(init=False, repr=False)
    info: EngineInfo = field(init=False)

    def __post_init__(self) -> None:
        import vllm
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        t0 = time.monotonic()
        self._llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**self.engine_kwargs))
        mc = self._llm.model_config
        self._tokenizer = self._llm.get_tokenizer()
        self.hf_tokenizer = self._tokenizer
        pooler = getattr(mc, "pooler_config", None)
        matryoshka = getattr(mc, "matryoshka_dimensions", None)
        self.info = EngineInfo(
            model=self.engine_kwargs.get("served_model_name", mc.model),
            max_model_len=int(mc.max_model_len),
            hidden_size=int(mc.get_hidden_size()),
            vocab_size=int(mc.get_vocab_size()),
            dtype=str(mc.dtype).removeprefix("torch."),
            matryoshka_dimensions=tuple(matryoshka) if matryoshka else None,
            supports_dimensions=bool(getattr(mc, "is_matryoshka", False)),
            prefix_caching=bool(self._llm.vllm_config.cache_config.enable_prefix_caching),
            engine_version=f"vllm {vllm.__version__}",
            pooling_type=getattr(pooler, "seq_pooling_type", None) if pooler else None,
            normalizes=bool(getattr(pooler, "use_activation", True)) if pooler else True,
        )
        logger.info("engine up in %.1fs: %s", time.monotonic() - t0, self.info)

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        # Batched fast-tokenizer call; same settings vLLM applies to a text prompt.
        return [list(ids) for ids in self._tokenizer(texts, add_special_tokens=True)["input_ids"]]

    async def _one(self, ids: list[int], request_id: str, dimensions: int | None,
                   skip_prefix_cache: bool, normalize: bool) -> Embedding:
        from vllm import PoolingParams
        from vllm.inputs import TokensPrompt

        params = PoolingParams(task="embed", dimensions=dimensions,
                               skip_reading_prefix_cache=skip_prefix_cache or None,
                               use_activation=None if normalize else False)
        out = None
        async for out in self._llm.encode(TokensPrompt(prompt_token_ids=ids), params,
                                          request_id=request_id):
            pass
        if out is None:
            raise EngineDead(f"engine returned no output for {request_id}")
        data = out.outputs.data
        vec = data.float().numpy() if hasattr(data, "numpy") else np.asarray(data, np.float32)
        return Embedding(vec.astype(np.float32, copy=False), len(out.prompt_token_ids),
                         int(out.num_cached_tokens or 0))

    async def embed(self, token_ids: list[list[int]], *, request_id: str,
                    dimensions: int | None = None, skip_prefix_cache: bool = False,
                    normalize: bool = True) -> list[Embedding]:
        if self._llm.errored:
            raise EngineDead("vLLM engine core is not running")
        tasks = [asyncio.ensure_future(
            self._one(ids, f"{request_id}-{i}", dimensions, skip_prefix_cache, normalize))
            for i, ids in enumerate(token_ids)]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # A cancelled or failed call must not leave its sibling sequences computing.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def check_health(self) -> None:
        if self._llm.errored:
            raise EngineDead("vLLM engine core is not running")
        await self._llm.check_health()

    def shutdown(self) -> None:
        llm, self._llm = getattr(self, "_llm", None), None
        if llm is not None:
            llm.shutdown()
