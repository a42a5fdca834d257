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
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from deployments import metrics
from deployments.config import EmbedfleetConfig, ModelConfig, parse_config
from deployments.engine import Embedding, EmbeddingEngine, EngineInfo
from deployments.errors import EmbedfleetError, EngineUnavailable
from deployments.protocol_tei import tokenize_tei
from deployments.model_facts import read_model_facts
from deployments.platform import (
    card_identity,
    platform_facts,
    prepare_cpu_process,
)
from deployments.prefix_cache_policy import resolve as resolve_prefix_cache
from deployments.batching import LengthAwareBatcher
from deployments.budget import AdmissionBudget
from deployments.inputs import InputPreparer, PreparedCall
from deployments.long_input import LongInputPolicy, SpecialTokens
from deployments.canary import run_canary
from deployments.card_memory import CardMemorySampler, CardMemoryUnavailable
from deployments.fingerprint import fingerprint_headers, model_digest
from deployments import reaper
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
    model: str = ""
    long_input: LongInputPolicy | None = None  # None = the model's default policy
    prompt_name: str | None = None
    task: str | None = None
    normalize: bool = True


@dataclass
class EmbedResult:
    vectors: list[np.ndarray]
    prompt_tokens: int
    cached_tokens: int
    replica_id: str
    fingerprint: dict[str, str]
    inputs: list[dict[str, Any]] = field(default_factory=list)  # per input: truncated, chunks


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
                       engine_factory: str = DEFAULT_ENGINE_FACTORY, governor: Any = None) -> None:
        self.cfg = parse_config(config, "deployment args")
        self.model_cfg = self.cfg.model(model_name)
        resource = self.cfg.platform.card_resource
        self.card = card_identity(resource)
        if self.cfg.platform.kind == "ascend":
            from deployments.ascend_checks import assert_ascend_ready

            logger.info("Ascend start-up checks passed: %s", assert_ascend_ready())
        if self.cfg.platform.kind == "cpu":
            binding = prepare_cpu_process(self.card.device, self.card.cards_on_node)
            logger.info("CPU card %s: vLLM threads bound to cores %s", self.card.device, binding)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download weights at run time
        self._registry = registry
        self._governor = governor
        self._reapers: list = []
        self._factory = load_factory(engine_factory)
        adm = self.model_cfg.admission
        self.ceiling = self.model_cfg.budget_ceiling
        self.budget = AdmissionBudget(
            self.ceiling["max_sequences"], self.ceiling["max_tokens"],
            max_waiting=adm.max_waiting, queue_timeout_s=adm.queue_timeout_s,
            on_reject=lambda reason: metrics.get("embedfleet_overload_rejections_total").inc(
                1, tags={"model": model_name, "reason": reason}))
        self.limits: dict[str, Any] = {**self.ceiling, "stale": False,
                                       "reason": "ceiling (no governor reading yet)"}
        self.prefix_cache, self.prefix_cache_reason = decide_prefix_cache(self.cfg, self.model_cfg)
        override = await self._registry.prefix_cache_override.remote(model_name) \
            if (self._registry is not None and self.prefix_cache) else None
        if override:
            self.prefix_cache, self.prefix_cache_reason = False, override["reason"]
        self.engine: EmbeddingEngine = self._build(self.prefix_cache)
        self.info: EngineInfo = self.engine.info
        self.model_cfg.long_input.check_model(
            self.info.max_model_len, SpecialTokens.from_tokenizer(self.engine.hf_tokenizer))
        self.preparer = self._make_preparer()
        self.batcher = LengthAwareBatcher(
            embed_fn=self._engine_batch, max_batch_tokens=self.model_cfg.engine.max_num_batched_tokens,
            max_batch_size=self.model_cfg.engine.max_num_seqs)
        self.digest = model_digest(self.model_cfg.source.local_dir())
        try:
            from ray import serve

            self.replica_id = serve.get_replica_context().replica_id.unique_id
        except Exception:  # outside Serve (unit use)
            self.replica_id = uuid.uuid4().hex[:8]
        self._tags = {"model": model_name, "node": self.card.node, "device": self.card.device}
        self._inflight_seqs = 0
        self._inflight_tokens = 0
        self._calls_by_engine: dict[int, int] = {}
        self._skip_reads = False  # safe mode between a failed canary and the engine swap
        self._switching: asyncio.Task | None = None
        self._healthy = True
        self._last_progress = time.monotonic()
        self.last_canary: dict[str, Any] | None = None
        if self.info.prefix_caching:
            await self._canary_once()  # prove cache hits before serving; switches off on failure
        self._memory = CardMemorySampler.from_config(self.cfg)
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._heartbeat_loop()),
                       loop.create_task(self._canary_loop()),
                       loop.create_task(self._limits_loop())]
        metrics.get("embedfleet_replica_ready").set(1, tags=self._tags)
        self._export_prefix_state()
        logger.info("replica %s of %s ready on card %s; prefix cache %s (%s)", self.replica_id,
                    model_name, self.card.label, "on" if self.info.prefix_caching else "off",
                    self.prefix_cache_reason)

    def _build(self, prefix_cache: bool) -> EmbeddingEngine:
        kwargs = self.cfg.engine_kwargs(self.model_cfg, enable_prefix_caching=prefix_cache)
        os.environ[reaper.MARKER_ENV] = str(os.getpid())  # inherited by the engine's processes
        before = set(reaper.engine_pids())
        engine = self._factory(kwargs)
        watchdog = reaper.start_reaper([p for p in reaper.engine_pids() if p not in before])
        if watchdog is not None:
            self._reapers.append(watchdog)
        return engine

    def fingerprint(self) -> dict[str, str]:
        return fingerprint_headers(digest=self.digest, dtype=self.info.dtype,
                                   engine=self.info.engine_version,
                                   platform=self.cfg.platform.kind,
                                   prefix_cache=self.info.prefix_caching and not self._skip_reads)

    # -- batch limits: pulled from the MemoryGovernor, enforced by the admission budget ------
    async def _limits_loop(self) -> None:
        interval = self.cfg.governor.interval_s
        while True:
            self._export_card_memory()
            if self._governor is not None:
                try:
                    limits = await self._governor.limits_for.remote(
                        self.card.node, self.card.device, self.ceiling)
                    if (limits["max_sequences"], limits["max_tokens"]) != self.budget.limits:
                        logger.warning("card %s budget -> %d sequences / %d tokens (%s)",
                                       self.card.label, limits["max_sequences"],
                                       limits["max_tokens"], limits.get("reason"))
                    self.budget.set_limits(limits["max_sequences"], limits["max_tokens"])
                    self.limits = limits
                except Exception as exc:  # governor restarting: keep the last limits
                    logger.warning("cannot pull limits from MemoryGovernor: %r", exc)
            seqs, toks = self.budget.limits
            metrics.get("embedfleet_budget_sequences").set(seqs, tags=self._tags)
            metrics.get("embedfleet_budget_tokens").set(toks, tags=self._tags)
            self._export_state()
            await asyncio.sleep(interval)

    def _export_state(self) -> None:
        """Re-set the state gauges every pass: Ray's metrics agent drops a gauge ~20 s after
        its last update, and alerts such as "prefix cache disabled by the canary" need them."""
        self._export_prefix_state()
        self._export_inflight()
        metrics.get("embedfleet_replica_ready").set(int(self._healthy), tags=self._tags)
        if self.last_canary is not None:
            metrics.get("embedfleet_canary_last_cosine").set(
                self.last_canary["min_cosine"], tags={"model": self.model_cfg.name})

    def _export_card_memory(self) -> None:
        try:
            used, total = self._memory.sample()
        except CardMemoryUnavailable as exc:
            logger.warning("card memory unavailable: %s", exc)
            return
        tags = {"node": self.card.node, "device": self.card.device}
        metrics.get("embedfleet_card_memory_used_bytes").set(used, tags=tags)
        metrics.get("embedfleet_card_memory_total_bytes").set(total, tags=tags)

    # -- prefix-cache canary and the switch to "off" ------------------------------------------
    async def _canary_once(self) -> None:
        engine = self.engine
        result = await run_canary(engine, label=f"canary-{self.model_cfg.name}")
        self.last_canary = result.to_dict()
        model_tag = {"model": self.model_cfg.name}
        metrics.get("embedfleet_canary_last_cosine").set(result.min_cosine, tags=model_tag)
        if result.passed:
            logger.info("prefix-cache canary of %s: %s", self.model_cfg.name, result.detail)
            return
        metrics.get("embedfleet_canary_failures_total").inc(1, tags=model_tag)
        reason = f"disabled by the canary: {result.detail}"
        logger.error("prefix-cache canary FAILED for %s on card %s: %s; switching prefix caching "
                     "off for this model", self.model_cfg.name, self.card.label, result.detail)
        if self._registry is not None:
            await self._registry.disable_prefix_cache.remote(self.model_cfg.name, reason,
                                                             self.last_canary)
        await self._switch_prefix_cache_off(reason)

    async def _canary_loop(self) -> None:
        while self.info.prefix_caching:
            await asyncio.sleep(self.model_cfg.canary_interval_s)
            if not self.info.prefix_caching or self._switching:
                return
            try:
                await self._canary_once()
            except Exception as exc:  # a canary that cannot run is logged, never fatal
                logger.warning("prefix-cache canary of %s could not run: %r",
                               self.model_cfg.name, exc)

    def _switch_prefix_cache_off(self, reason: str) -> asyncio.Task:
        """Stop reading the cache at once, then swap in an engine built with caching off.

        Requests keep flowing: until the new engine is up, every request skips reading the
        prefix cache (correct vectors, just slower); afterwards the old engine finishes the calls
        it holds and is shut down.
        """
        if self._switching is None:
            self._skip_reads = True
            self.prefix_cache_reason = reason
            self._export_prefix_state()
            self._switching = asyncio.get_running_loop().create_task(self._swap_engine())
        return self._switching

    async def _swap_engine(self) -> None:
        new = await asyncio.to_thread(self._build, False)
        old, self.engine, self.info = self.engine, new, new.info
        self.preparer = self._make_preparer()
        self._skip_reads = False
        self._export_prefix_state()
        logger.warning("replica %s of %s now serves with prefix caching off",
                       self.replica_id, self.model_cfg.name)
        for _ in range(1200):  # let the old engine finish what it holds (bounded: 120 s)
            if not self._calls_by_engine.get(id(old)):
                break
            await asyncio.sleep(0.1)
        old.shutdown()

    def _export_prefix_state(self) -> None:
        on = self.info.prefix_caching and not self._skip_reads
        metrics.get("embedfleet_prefix_cache_enabled").set(
            int(on), tags={"model": self.model_cfg.name})

    # -- what the registry and /v1/models see ------------------------------------------------
    def describe(self) -> dict[str, Any]:
        return {
            "replica_id": self.replica_id,
            "model": self.model_cfg.name,
            "node_id": self.card.node_id,
            "node": self.card.node,
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
            "prefix_cache": {"enabled": self.info.prefix_caching and not self._skip_reads,
                             # on | off | safe-mode (canary failed; engine swap under way)
                             "state": "safe-mode" if self._skip_reads else
                             ("on" if self.info.prefix_caching else "off"),
                             "reason": self.prefix_cache_reason,
                             "last_canary": self.last_canary},
            "fingerprint": self.fingerprint(),
            "inflight_sequences": self._inflight_seqs,
            "inflight_tokens": self._inflight_tokens,
            "budget": {**self.budget.snapshot(), "stale": self.limits.get("stale"),
                       "reason": self.limits.get("reason")},
        }

    async def _heartbeat_loop(self) -> None:
        while self._registry is not None:
            try:
                wanted = await self._registry.heartbeat.remote(self.describe())
                override = (wanted or {}).get("prefix_cache_override")
                if override and self.info.prefix_caching and self._switching is None:
                    logger.warning("prefix caching of %s switched off fleet-wide: %s",
                                   self.model_cfg.name, override["reason"])
                    self._switch_prefix_cache_off(override["reason"])
            except Exception as exc:  # the registry restarting must not kill the replica
                logger.warning("heartbeat to FleetRegistry failed: %r", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    # -- the request path --------------------------------------------------------------------
    def _make_preparer(self) -> InputPreparer:
        return InputPreparer(self.info, self.engine.tokenize,
                             SpecialTokens.from_tokenizer(self.engine.hf_tokenizer),
                             self.model_cfg.long_input, self.model_cfg.prompts)

    async def embed(self, call: EmbedCall) -> EmbedResult:
        t0 = time.perf_counter()
        prepared = self.preparer.prepare(call.inputs, policy=call.long_input,
                                         prompt_name=call.prompt_name, task=call.task,
                                         dimensions=call.dimensions)
        async with self.budget.admit(len(prepared.pieces), prepared.piece_tokens):
            return await self._embed_admitted(call, prepared, t0)

    async def _engine_batch(self, pieces: list[list[int]], normalize: bool = True
                            ) -> list[Embedding]:
        """One engine call; the batcher groups concurrent callers' pieces by length first."""
        engine = self.engine
        self._calls_by_engine[id(engine)] = self._calls_by_engine.get(id(engine), 0) + 1
        try:
            out = await engine.embed(pieces, request_id=f"b-{uuid.uuid4().hex[:12]}",
                                     skip_prefix_cache=self._skip_reads, normalize=normalize)
        except (EmbedfleetError, asyncio.CancelledError):
            raise
        except Exception as exc:
            # The engine-core process died (or hung up): the call is safe to retry elsewhere,
            # and the next health check makes Serve replace this replica.
            self._healthy = False
            raise EngineUnavailable(f"engine of replica {self.replica_id} failed: "
                                    f"{type(exc).__name__}", retry_after_s=1) from None
        finally:
            self._calls_by_engine[id(engine)] -= 1
        self._last_progress = time.monotonic()
        metrics.get("embedfleet_engine_batch_size").observe(
            len(pieces), tags={"model": self.model_cfg.name})
        return out

    async def _embed_admitted(self, call: EmbedCall, prepared: PreparedCall,
                              t0: float) -> EmbedResult:
        pieces, n_tokens = prepared.pieces, prepared.piece_tokens
        self._inflight_seqs += len(pieces)
        self._inflight_tokens += n_tokens
        self._export_inflight()
        try:
            if call.normalize:
                out: list[Embedding] = await self.batcher.embed(pieces)
            else:  # raw pooler output: its own engine call, never mixed into shared batches
                out = await self._engine_batch(pieces, normalize=False)
        finally:
            self._inflight_seqs -= len(pieces)
            self._inflight_tokens -= n_tokens
            self._export_inflight()
        vectors = self.preparer.finish(prepared, [e.vector for e in out],
                                       dimensions=call.dimensions, normalize=call.normalize)
        cached = sum(e.num_cached_tokens for e in out)
        model_tag = {"model": self.model_cfg.name}
        metrics.get("embedfleet_prompt_tokens_total").inc(n_tokens, tags=model_tag)
        if cached:
            metrics.get("embedfleet_prefix_cache_hit_tokens_total").inc(cached, tags=model_tag)
        report = prepared.report()
        truncated = [r for r in report if r["truncated"]]
        if truncated:
            metrics.get("embedfleet_truncated_inputs_total").inc(len(truncated), tags=model_tag)
            metrics.get("embedfleet_dropped_tokens_total").inc(
                sum(r["dropped_tokens"] for r in truncated), tags=model_tag)
        chunks = sum(r["chunks"] for r in report if r["chunks"] > 1)
        if chunks:
            metrics.get("embedfleet_chunks_total").inc(chunks, tags=model_tag)
        metrics.get("embedfleet_engine_latency_seconds").observe(
            time.perf_counter() - t0, tags=model_tag)
        return EmbedResult(vectors, prepared.input_tokens, cached, self.replica_id,
                           self.fingerprint(), report)

    def _export_inflight(self) -> None:
        metrics.get("embedfleet_inflight_sequences").set(self._inflight_seqs, tags=self._tags)
        metrics.get("embedfleet_inflight_tokens").set(self._inflight_tokens, tags=self._tags)

    async def tokenize_tei(self, texts: list[str], add_special_tokens: bool = True,
                           prompt_name: str | None = None) -> list:
        return tokenize_tei(self.engine.hf_tokenizer, self.preparer.prompted(texts, prompt_name),
                            add_special_tokens)

    async def check_health(self) -> None:
        """Serve's health check: really embed something, within a bound.

        When the engine is busy, a probe would queue behind (possibly huge) admitted work and
        could time out on a healthy replica; then the engine finishing batches recently is the
        proof of health, and the engine core's own liveness check must pass.
        """
        busy = self._inflight_seqs > 0
        if busy and time.monotonic() - self._last_progress < self.cfg.health_check_timeout_s:
            await self.engine.check_health()
            return
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
        for task in getattr(self, "_tasks", []):
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
        for watchdog in getattr(self, "_reapers", []):
            watchdog.terminate()

