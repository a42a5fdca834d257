"""EmbeddingEngine deployment: one replica per card, a vLLM pooling engine inside.

The replica is thin: it learns its card, prepares the process for the platform, builds the engine
through an injected factory (an import path, so fault injectors can wrap the real engine), and for
each call tokenizes, checks lengths and parameters against the model, and embeds. It reports itself
to the FleetRegistry every few seconds.
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from embedfleet.deployments import metrics
from embedfleet.deployments.config import EmbedfleetConfig, ModelConfig, parse_config
from embedfleet.deployments.engine.vllm_engine import Embedding, EmbeddingEngine, EngineInfo
from embedfleet.deployments.errors import EmbedfleetError, EngineUnavailable
from embedfleet.deployments.api.tei import tokenize_tei
from embedfleet.deployments.engine.model_facts import read_model_facts
from embedfleet.deployments.engine.platform import (
    card_identity,
    platform_facts,
    prepare_ascend_process,
    prepare_cpu_process,
)
from embedfleet.deployments.engine.prefix_cache_policy import resolve as resolve_prefix_cache
from embedfleet.deployments.request_path.batching import LengthAwareBatcher
from embedfleet.deployments.request_path.admission import AdmissionBudget
from embedfleet.deployments.request_path.inputs import InputPreparer, PreparedCall
from embedfleet.deployments.request_path.long_input import LongInputPolicy, SpecialTokens
from embedfleet.deployments.engine.card_memory import CpuCardModel
from embedfleet.deployments.engine.gate import EngineGate
from embedfleet.deployments.control.governor import RayMetricsSink
from embedfleet.deployments.control.limits import LimitsFollower
from embedfleet.deployments.control.prefix_cache import PrefixCacheController
from embedfleet.deployments.request_path.fingerprint import fingerprint_headers, model_digest
from embedfleet.deployments.engine import reaper
from embedfleet.deployments.control.registry import HEARTBEAT_INTERVAL_S

logger = logging.getLogger("embedfleet.replica")

DEFAULT_ENGINE_FACTORY = "embedfleet.deployments.engine.vllm_engine:VllmEmbeddingEngine"
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
    """One card's replica: a request path in front of the engine, plus three parts with one job
    each — the prefix-cache controller (canary and swap), the limits follower (card memory and
    the governor's limits) and the heartbeat to the registry."""

    async def __init__(self, config: dict[str, Any], model_name: str, registry: Any = None,
                       engine_factory: str = DEFAULT_ENGINE_FACTORY, governor: Any = None) -> None:
        self.cfg = parse_config(config, "deployment args")
        self.model_cfg = self.cfg.model(model_name)
        kind = self.cfg.platform.kind
        self.card = card_identity(self.cfg.platform.card_resource, ascend=kind == "ascend")
        if kind == "ascend":
            from embedfleet.deployments.engine.ascend_checks import assert_ascend_ready

            logger.info("Ascend start-up checks passed: %s; engine env %s",
                        assert_ascend_ready(), prepare_ascend_process())
        if kind == "cpu":
            binding = prepare_cpu_process(self.card.device, self.card.cards_on_node)
            logger.info("CPU card %s: vLLM threads bound to cores %s", self.card.device, binding)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download weights at run time
        self._registry = registry
        self._engine_procs: dict[int, tuple[list[int], Any]] = {}
        self._factory = load_factory(engine_factory)
        adm = self.model_cfg.admission
        self.ceiling = self.model_cfg.budget_ceiling
        self.budget = AdmissionBudget(
            self.ceiling["max_sequences"], self.ceiling["max_tokens"],
            max_waiting=adm.max_waiting, queue_timeout_s=adm.queue_timeout_s,
            on_reject=lambda reason: metrics.get("embedfleet_overload_rejections_total").inc(
                1, tags={"model": model_name, "reason": reason}))
        enabled, reason = decide_prefix_cache(self.cfg, self.model_cfg)
        override = await self._registry.prefix_cache_override.remote(model_name) \
            if (self._registry is not None and enabled) else None
        if override:
            enabled, reason = False, override["reason"]
        engine = self._build(enabled)
        self.gate: EngineGate[EmbeddingEngine] = EngineGate(engine)
        self.info: EngineInfo = engine.info
        self.model_cfg.long_input.check_model(
            self.info.max_model_len, SpecialTokens.from_tokenizer(engine.hf_tokenizer))
        self.preparer = self._make_preparer(engine)
        self.hf_tokenizer = engine.hf_tokenizer
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
        self._healthy = True
        self._last_progress = time.monotonic()
        self.prefix = PrefixCacheController(
            model=model_name, card_label=self.card.label,
            enabled=self.info.prefix_caching, reason=reason, gate=self.gate,
            build_engine=self._build, shutdown_engine=self._shutdown_engine,
            report_failure=self._report_canary_failure,
            canary_interval_s=self.model_cfg.canary_interval_s, on_change=self._engine_changed)
        if self.info.prefix_caching:
            await self.prefix.prove()  # prove cache hits before serving; switches off on failure
        self.follower = LimitsFollower(
            gate=self.gate, budget=self.budget,
            card_tags={"node": self.card.node, "device": self.card.device},
            ceiling=self.ceiling, pull_limits=self._pull_limits(governor),
            interval_s=self.cfg.governor.interval_s, sink=RayMetricsSink(),
            peak_window_s=self.cfg.governor.peak_window_s,
            idle=lambda: self._inflight_seqs == 0,
            cpu_card=CpuCardModel(self.cfg.platform.cpu_card_memory_bytes)
            if kind == "cpu" else None)
        await self._check_idle_floor()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self._heartbeat_loop()),
                       loop.create_task(self.prefix.run()),
                       loop.create_task(self.follower.run(after_tick=self._export_state))]
        metrics.get("embedfleet_replica_ready").set(1, tags=self._tags)
        self.prefix.export()
        logger.info("replica %s of %s ready on card %s; prefix cache %s (%s)", self.replica_id,
                    model_name, self.card.label, self.prefix.state, self.prefix.reason)

    # -- engines: built through the factory, shut down until their processes are gone -------
    def _build(self, prefix_cache: bool) -> EmbeddingEngine:
        kwargs = self.cfg.engine_kwargs(self.model_cfg, enable_prefix_caching=prefix_cache)
        os.environ[reaper.MARKER_ENV] = str(os.getpid())  # inherited by the engine's processes
        before = set(reaper.engine_pids())
        engine = self._factory(kwargs)
        pids = [p for p in reaper.engine_pids() if p not in before]
        self._engine_procs[id(engine)] = (pids, reaper.start_reaper(pids))
        return engine

    def _shutdown_engine(self, engine: EmbeddingEngine) -> None:
        """Shut ``engine`` down and wait until its processes are gone: on a card their exit is
        what frees the memory the next engine's start-up check needs."""
        pids, watchdog = self._engine_procs.pop(id(engine), ([], None))
        engine.shutdown()
        left = reaper.wait_gone(pids, timeout_s=60)
        if left:
            logger.warning("engine processes %s outlived shutdown; killed", left)
            reaper.kill_engine_processes(left)
        if watchdog is not None:
            watchdog.terminate()
        gc.collect()

    def _engine_changed(self) -> None:
        engine = self.gate.engine
        if engine is not None and engine.info is not self.info:
            self.info = engine.info
            self.preparer = self._make_preparer(engine)
            self.hf_tokenizer = engine.hf_tokenizer

    def fingerprint(self) -> dict[str, str]:
        return fingerprint_headers(digest=self.digest, dtype=self.info.dtype,
                                   engine=self.info.engine_version,
                                   platform=self.cfg.platform.kind,
                                   prefix_cache=self.prefix.reads_cache)

    # -- batch limits: pulled from the MemoryGovernor, enforced by the admission budget ------
    def _pull_limits(self, governor: Any):
        if governor is None:
            return None
        return lambda: governor.limits_for.remote(self.card.node, self.card.device, self.ceiling)

    async def _check_idle_floor(self) -> None:
        """The signal before any request is the card's floor; at or above ``high`` the governor
        would hold this card at its floor forever, so say so loudly."""
        reading = await self.follower.read_card()
        high = self.cfg.governor.params.high
        if reading is not None and reading.ratio >= high:
            logger.error("card %s: live memory ratio at idle is %.3f >= governor high %.2f: the "
                         "governor will keep this card's budget at its floor; lower "
                         "gpu_memory_utilization or serve a smaller model (live %d of %d bytes)",
                         self.card.label, reading.ratio, high, reading.live_bytes,
                         reading.total_bytes - reading.kv_free_bytes)

    def _export_state(self) -> None:
        """Re-set the state gauges every pass: Ray's metrics agent drops a gauge ~20 s after
        its last update, and alerts such as "prefix cache disabled by the canary" need them."""
        seqs, toks = self.budget.limits
        metrics.get("embedfleet_budget_sequences").set(seqs, tags=self._tags)
        metrics.get("embedfleet_budget_tokens").set(toks, tags=self._tags)
        self.prefix.export()
        self._export_inflight()
        metrics.get("embedfleet_replica_ready").set(int(self._healthy), tags=self._tags)

    # -- the prefix-cache canary's fleet-wide side -------------------------------------------
    async def _report_canary_failure(self, reason: str, canary: dict[str, Any]) -> None:
        if self._registry is not None:
            await self._registry.disable_prefix_cache.remote(self.model_cfg.name, reason, canary)

    # -- what the registry and /v1/models see ------------------------------------------------
    def describe(self) -> dict[str, Any]:
        reading = self.follower.reading
        limits = self.follower.limits
        return {
            "replica_id": self.replica_id,
            "model": self.model_cfg.name,
            "node_id": self.card.node_id,
            "node": self.card.node,
            "node_ip": self.card.node_ip,
            "device": self.card.device,
            "pid": os.getpid(),
            "ready": self._healthy and self.prefix.healthy,
            "max_model_len": self.info.max_model_len,
            "dimensions": self.info.hidden_size,
            "matryoshka_dimensions": list(self.info.matryoshka_dimensions or []),
            "dtype": self.info.dtype,
            "block_size": self.info.block_size,
            "engine_version": self.info.engine_version,
            "platform": self.cfg.platform.kind,
            "prefix_cache": self.prefix.view(),
            "fingerprint": self.fingerprint(),
            "inflight_sequences": self._inflight_seqs,
            "inflight_tokens": self._inflight_tokens,
            "memory": None if reading is None else {
                "ratio": reading.ratio, "idle_ratio": self.follower.idle_ratio,
                "live_bytes": reading.live_bytes, "used_bytes": reading.used_bytes,
                "total_bytes": reading.total_bytes, "kv_pool_bytes": reading.kv_pool_bytes,
                "kv_peak_usage": reading.kv_peak_usage},
            "budget": {**self.budget.snapshot(), "stale": limits.get("stale"),
                       "reason": limits.get("reason")},
        }

    async def _heartbeat_loop(self) -> None:
        while self._registry is not None:
            try:
                wanted = await self._registry.heartbeat.remote(self.describe())
                override = (wanted or {}).get("prefix_cache_override")
                if override and self.prefix.state == "on":
                    logger.warning("prefix caching of %s switched off fleet-wide: %s",
                                   self.model_cfg.name, override["reason"])
                    self.prefix.switch_off(override["reason"])
            except Exception as exc:  # the registry restarting must not kill the replica
                logger.warning("heartbeat to FleetRegistry failed: %r", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    # -- the request path --------------------------------------------------------------------
    def _make_preparer(self, engine: EmbeddingEngine) -> InputPreparer:
        return InputPreparer(engine.info, engine.tokenize,
                             SpecialTokens.from_tokenizer(engine.hf_tokenizer),
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
        """One engine call; the batcher groups concurrent callers' pieces by length first.

        While the engine is being replaced the call waits at the gate (up to the model's
        ``cold_start_hold_s``), then runs on the new engine."""
        hold_s = self.model_cfg.replicas.cold_start_hold_s
        async with self.gate.use(hold_s, self.cfg.router.retry_after_s) as engine:
            skip = engine.info.prefix_caching and not self.prefix.reads_cache
            try:
                out = await engine.embed(pieces, request_id=f"b-{uuid.uuid4().hex[:12]}",
                                         skip_prefix_cache=skip, normalize=normalize)
            except (EmbedfleetError, asyncio.CancelledError):
                raise
            except Exception as exc:
                # The engine-core process died (or hung up): the call is safe to retry
                # elsewhere, and the next health check makes Serve replace this replica.
                self._healthy = False
                raise EngineUnavailable(f"engine of replica {self.replica_id} failed: "
                                        f"{type(exc).__name__}", retry_after_s=1) from None
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
        return tokenize_tei(self.hf_tokenizer, self.preparer.prompted(texts, prompt_name),
                            add_special_tokens)

    async def check_health(self) -> None:
        """Serve's health check: really embed something, within a bound.

        When the engine is busy, a probe would queue behind (possibly huge) admitted work and
        could time out on a healthy replica; then the engine finishing batches recently is the
        proof of health, and the engine core's own liveness check must pass.
        """
        if not self.prefix.healthy:
            raise RuntimeError(f"engine swap gave up: {self.prefix.swap_error}")
        engine = self.gate.engine
        if engine is None or not self.gate.is_open:
            return  # an engine swap is under way (bounded and retried by the controller)
        busy = self._inflight_seqs > 0
        if busy and time.monotonic() - self._last_progress < self.cfg.health_check_timeout_s:
            await engine.check_health()
            return
        try:
            ids = engine.tokenize([HEALTH_PROBE_TEXT])
            out = await asyncio.wait_for(
                engine.embed(ids, request_id=f"health-{uuid.uuid4().hex[:8]}"),
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
        prefix = getattr(self, "prefix", None)
        if prefix is not None:
            prefix.cancel()
        registry = getattr(self, "_registry", None)
        if registry is not None:
            try:
                registry.leave.remote(self.replica_id)
            except Exception:
                pass
        gate = getattr(self, "gate", None)
        engine = gate.take() if gate is not None else None
        if engine is not None:
            engine.shutdown()
            logger.info("engine of replica %s shut down", getattr(self, "replica_id", "?"))
        for _, watchdog in getattr(self, "_engine_procs", {}).values():
            if watchdog is not None:
                watchdog.terminate()

