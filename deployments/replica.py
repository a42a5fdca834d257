"""EmbeddingEngine deployment: one replica per card, a vLLM pooling engine inside.

The replica is thin: it learns its card, prepares the process for the platform, builds the engine
through an injected factory (an import path, so fault injectors can wrap the real engine), and for
each call tokenizes, checks lengths and parameters against the model, and embeds. It reports itself
to the FleetRegistry every few seconds.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from deployments import metrics
from deployments.config import EmbedfleetConfig, ModelConfig, parse_config
from deployments.engine import Embedding, EmbeddingEngine, EngineInfo
from deployments.errors import (
    EmbedfleetError,
    InputTooLong,
    InvalidParameterValue,
    InvalidTokenId,
    UnsupportedParameter,
)
from deployments.model_facts import read_model_facts
from deployments.platform import (
    card_identity,
    cards_on_this_node,
    platform_facts,
    prepare_cpu_process,
)
from deployments.prefix_cache_policy import resolve as resolve_prefix_cache
from deployments.registry import HEARTBEAT_INTERVAL_S

logger = logging.getLogger("embedfleet.replica")

DEFAULT_ENGINE_FACTORY = "deployments.engine:VllmEmbeddingEngine"
HEALTH_PROBE_TEXT = "embedfleet health check"


@dataclass
class EmbedCall:
    """One router -> replica call: all inputs of one request (or one slice of it)."""

    inputs: list[str] | list[list[int]]
    dimensions: int | None = None
    request_id: str = ""


@dataclass
class EmbedResult:
    vectors: list[np.ndarray]
    prompt_tokens: int
    cached_tokens: int
    replica_id: str


def load_factory(path: str) -> Callable[..., EmbeddingEngine]:
    module, _, attr = path.partition(":")
    return getattr(importlib.import_module(module), attr)


def decide_prefix_cache(cfg: EmbedfleetConfig, m: ModelConfig) -> tuple[bool, str]:
    """Resolve ``prefix_cache: auto|on|off`` from the model's own config and the engine versions.

    ``on`` over a known-bad combination raises ``PrefixCacheRefused`` (the replica does not start,
    and Serve shows the reason) unless ``prefix_cache_accept_risk`` is set.
    """
    facts = read_model_facts(m.source.local_dir(), kv_cache_dtype=m.engine.kv_cache_dtype)
    decision = resolve_prefix_cache(m.prefix_cache, facts, platform_facts(cfg.platform.kind),
                                    accept_risk=m.prefix_cache_accept_risk)
    return decision.enabled, decision.reason


class EngineReplica:
    async def __init__(self, config: dict[str, Any], model_name: str, registry: Any = None,
                       engine_factory: str = DEFAULT_ENGINE_FACTORY) -> None:
        self.cfg = parse_config(config, "deployment args")
        self.model_cfg = self.cfg.model(model_name)
        resource = self.cfg.platform.card_resource
        self.card = card_identity(resource)
        if self.cfg.platform.kind == "cpu":
            binding = prepare_cpu_process(self.card.device, cards_on_this_node(resource))
            logger.info("CPU card %s: vLLM threads bound to cores %s", self.card.device, binding)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download weights at run time
        self.prefix_cache, self.prefix_cache_reason = decide_prefix_cache(self.cfg, self.model_cfg)
        kwargs = self.cfg.engine_kwargs(self.model_cfg, enable_prefix_caching=self.prefix_cache)
        self.engine: EmbeddingEngine = load_factory(engine_factory)(kwargs)
        self.info: EngineInfo = self.engine.info
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use)
            self.replica_id = uuid.uuid4().hex[:8]
        self._tags = {"model": model_name, "node": self.card.node_ip, "device": self.card.device}
        self._inflight_seqs = 0
        self._inflight_tokens = 0
        self._healthy = True
        self._registry = registry
        self._heartbeat_task = asyncio.get_running_loop().create_task(self._heartbeat_loop())
        metrics.get("embedfleet_replica_ready").set(1, tags=self._tags)
        metrics.get("embedfleet_prefix_cache_enabled").set(
            int(self.info.prefix_caching), tags={"model": model_name})
        logger.info("replica %s of %s ready on card %s", self.replica_id, model_name,
                    self.card.label)

    # -- what the registry and /v1/models see ------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "model": self.model_cfg.name,
            "node_id": self.card.node_id,
            "node_ip": self.card.node_ip,
            "device": self.card.device,
            "pid": os.getpid(),
            "ready": self._healthy,
            "max_model_len": self.info.max_model_len,
            "dimensions": self.info.hidden_size,
            "matryoshka_dimensions": list(self.info.matryoshka_dimensions or []),
            "dtype": self.info.dtype,
            "engine_version": self.info.engine_version,
            "platform": self.cfg.platform.kind,
            "prefix_cache": {"enabled": self.info.prefix_caching,
                             "reason": self.prefix_cache_reason},
            "inflight_sequences": self._inflight_seqs,
            "inflight_tokens": self._inflight_tokens,
        }

    async def _heartbeat_loop(self) -> None:
        while self._registry is not None:
            try:
                await self._registry.heartbeat.remote(self.describe())
            except Exception as exc:  # the registry restarting must not kill the replica
                logger.warning("heartbeat to FleetRegistry failed: %r", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    # -- the request path --------------------------------------------------------------------
    def _prepare(self, call: EmbedCall) -> list[list[int]]:
        info = self.info
        if call.dimensions is not None:
            if not info.supports_dimensions:
                raise UnsupportedParameter(
                    f"model '{info.model}' does not support 'dimensions' (it has no Matryoshka "
                    f"dimensions); it always returns {info.hidden_size}-d vectors",
                    param="dimensions")
            if call.dimensions > info.hidden_size:
                raise InvalidParameterValue(
                    f"dimensions={call.dimensions} is larger than model '{info.model}''s "
                    f"{info.hidden_size}-d vectors", param="dimensions")
        if call.inputs and isinstance(call.inputs[0], str):
            ids = self.engine.tokenize(list(call.inputs))  # type: ignore[arg-type]
        else:
            ids = [list(x) for x in call.inputs]  # type: ignore[arg-type]
            for i, seq in enumerate(ids):
                bad = next((t for t in seq if t >= info.vocab_size), None)
                if bad is not None:
                    raise InvalidTokenId(
                        f"input[{i}] holds token id {bad}, outside model '{info.model}''s "
                        f"vocabulary of {info.vocab_size} ids", param="input")
        for i, seq in enumerate(ids):
            if len(seq) > info.max_model_len:
                raise InputTooLong(
                    f"input[{i}] has {len(seq)} tokens, more than model '{info.model}''s "
                    f"maximum context length of {info.max_model_len} tokens",
                    param="input")
        return ids

    async def embed(self, call: EmbedCall) -> EmbedResult:
        t0 = time.perf_counter()
        ids = self._prepare(call)
        n_tokens = sum(len(s) for s in ids)
        self._inflight_seqs += len(ids)
        self._inflight_tokens += n_tokens
        self._export_inflight()
        try:
            out: list[Embedding] = await self.engine.embed(
                ids, request_id=call.request_id or uuid.uuid4().hex, dimensions=call.dimensions)
        finally:
            self._inflight_seqs -= len(ids)
            self._inflight_tokens -= n_tokens
            self._export_inflight()
        cached = sum(e.num_cached_tokens for e in out)
        model_tag = {"model": self.model_cfg.name}
        metrics.get("embedfleet_engine_batch_size").observe(len(ids), tags=model_tag)
        metrics.get("embedfleet_prompt_tokens_total").inc(n_tokens, tags=model_tag)
        if cached:
            metrics.get("embedfleet_prefix_cache_hit_tokens_total").inc(cached, tags=model_tag)
        metrics.get("embedfleet_engine_latency_seconds").observe(
            time.perf_counter() - t0, tags=model_tag)
        return EmbedResult([e.vector for e in out], n_tokens, cached, self.replica_id)

    def _export_inflight(self) -> None:
        metrics.get("embedfleet_inflight_sequences").set(self._inflight_seqs, tags=self._tags)
        metrics.get("embedfleet_inflight_tokens").set(self._inflight_tokens, tags=self._tags)

    async def tokenize(self, texts: list[str]) -> list[list[int]]:
        return self.engine.tokenize(texts)

    async def check_health(self) -> None:
        """Serve's health check: really embed something, within a bound."""
        try:
            ids = self.engine.tokenize([HEALTH_PROBE_TEXT])
            out = await asyncio.wait_for(
                self.engine.embed(ids, request_id=f"health-{uuid.uuid4().hex[:8]}"),
                timeout=self.cfg.health_check_timeout_s * 0.8)
            if not np.isfinite(out[0].vector).all():
                raise RuntimeError("health probe embedding is not finite")
            self._healthy = True
        except Exception:
            self._healthy = False
            metrics.get("embedfleet_replica_ready").set(0, tags=self._tags)
            raise
        metrics.get("embedfleet_replica_ready").set(1, tags=self._tags)

    def __del__(self) -> None:
        task = getattr(self, "_heartbeat_task", None)
        if task is not None:
            task.cancel()
        registry = getattr(self, "_registry", None)
        if registry is not None:
            try:
                registry.leave.remote(self.replica_id)
            except Exception:
                pass
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown()
            logger.info("engine of replica %s shut down", getattr(self, "replica_id", "?"))


def is_client_error(exc: BaseException) -> bool:
    return isinstance(exc, EmbedfleetError) and exc.status < 500
