"""EngineReplica: the Serve deployment that holds one card, assembled from parts with one job each.

* ``replica.request_path.RequestPath`` — the request path: prepare, the owner queue
  (admission by sequences and tokens), the engine, finish;
* ``replica.prefix_cache.PrefixCacheController`` — prefix caching's one state, the canary, the
  engine swap;
* ``replica.limits.LimitsFollower`` — the card's memory terms and the governor's limits;
* ``replica.reporter.Reporter`` — the heartbeat to the registry, ``describe()``, state gauges;
* ``engine.lifecycle.EngineLifecycle`` — starting and stopping engines (with their reaper).

This class learns its card, prepares the process for the platform, builds the parts and hands
Serve's calls to them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import uuid
from typing import Any

from ..common import metrics
from ..config.schema import EmbedfleetConfig, ModelConfig, parse_config
from ..common.contracts import (CanaryView, EmbedCall, EmbedResult, Fingerprint,
                         Lane, ReplicaDescription, RoutingStats)
from ..fleet.governor import RayMetricsSink
from .health_probe import HealthProbe
from .limits import LimitsFollower
from .prefix_cache import PrefixCacheController
from .reporter import Reporter
from ..engine.card_memory import CpuCardModel
from ..engine.gate import EngineGate
from ..engine.lifecycle import DEFAULT_ENGINE_FACTORY, EngineLifecycle
from ..engine.model_facts import read_model_facts
from ..engine.platform import (card_identity, platform_facts,
                               prepare_ascend_process, prepare_cpu_process)
from ..engine.prefix_cache_policy import resolve as resolve_prefix_cache
from ..engine.vllm_engine import EmbeddingEngine
from .admission import AdmissionBudget
from ..common.fingerprint import model_digest
from ..common.long_input import SpecialTokens
from .request_path import RequestPath
from .tokenize import TokenizeQueue

logger = logging.getLogger("embedfleet.replica")

# An idle replica embeds its health probe at most this often; in between, the engine core's own
# liveness check. Any call wakes vLLM's worker, which then spins a second on its message queue
# (see replica/limits.py): a probe every 10 s cost each idle worker ~4 CPU-s a minute here.
HEALTH_EMBED_EVERY_S = 30.0


def decide_prefix_cache(cfg: EmbedfleetConfig, m: ModelConfig) -> tuple[bool, str]:
    """Resolve ``prefix_cache: auto|on|off`` from the model's own config and the engine versions.

    ``on`` over a known-bad combination raises ``PrefixCacheRefused`` (the replica does not start,
    and Serve shows the reason) unless ``prefix_cache_accept_risk`` is set.
    """
    facts = read_model_facts(m.source.local_dir(), kv_cache_dtype=m.engine.kv_cache_dtype)
    decision = resolve_prefix_cache(m.prefix_cache, facts, platform_facts(cfg.platform.kind),
                                    accept_risk=m.prefix_cache_accept_risk)
    return decision.enabled, decision.reason


def replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside Serve (unit use)
        return uuid.uuid4().hex[:8]


class EngineReplica:
    async def __init__(self, config: dict[str, Any], model_name: str, registry: Any = None,
                       engine_factory: str = DEFAULT_ENGINE_FACTORY, governor: Any = None) -> None:
        self.cfg = cfg = parse_config(config, "deployment args")
        m = cfg.model(model_name)
        kind = cfg.platform.kind
        self.card = card_identity(cfg.platform.card_resource, ascend=kind == "ascend")
        if kind == "ascend":
            from ..engine.ascend_checks import assert_ascend_ready

            logger.info("Ascend start-up checks passed: %s; engine env %s",
                        assert_ascend_ready(), prepare_ascend_process())
        if kind == "cpu":
            binding = prepare_cpu_process(self.card.device, self.card.cards_on_node)
            logger.info("CPU card %s: vLLM threads bound to cores %s", self.card.device, binding)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download weights at run time
        self.replica_id = replica_id()
        self._registry = registry
        self.engines = EngineLifecycle(
            engine_factory, lambda on: cfg.engine_kwargs(m, enable_prefix_caching=on))

        enabled, reason = decide_prefix_cache(cfg, m)
        override = await registry.prefix_cache_override.remote(model_name) \
            if (registry is not None and enabled) else None
        if override is not None:
            enabled, reason = False, override.reason
        engine = self.engines.build(enabled)
        self.gate: EngineGate[EmbeddingEngine] = EngineGate(engine)
        m.long_input.check_model(engine.info.max_model_len,
                                 SpecialTokens.from_tokenizer(engine.hf_tokenizer))
        self.digest = model_digest(m.source.local_dir())
        self.recorder = metrics.Batched()
        ceiling = m.budget_ceiling
        queue = AdmissionBudget(
            ceiling.max_sequences, ceiling.max_tokens, max_waiting=m.admission.max_waiting,
            queue_timeout_s=m.admission.queue_timeout_s,
            bulk_max_waiting=m.admission.bulk_max_waiting,
            bulk_max_inflight_share=m.admission.bulk_max_inflight_share,
            bulk_min_share=m.admission.bulk_min_share,
            bulk_max_drain_s=m.admission.bulk_max_drain_s,
            on_reject=lambda why: self.recorder.inc("embedfleet_overload_rejections_total", 1,
                                                    {"model": model_name, "reason": why}))
        self.prefix = PrefixCacheController(
            model=model_name, card_label=self.card.label, enabled=engine.info.prefix_caching,
            reason=reason, gate=self.gate, build_engine=self.engines.build,
            shutdown_engine=self.engines.shutdown, report_failure=self._report_canary_failure,
            canary_interval_s=m.canary_interval_s, on_change=self._engine_changed)
        self.path = RequestPath(
            model=model_name, gate=self.gate, queue=queue, long_input=m.long_input,
            prompts=m.prompts, reads_cache=lambda: self.prefix.reads_cache,
            fingerprint=self.fingerprint, replica_id=self.replica_id,
            hold_s=m.replicas.cold_start_hold_s, retry_after_s=cfg.router.retry_after_s,
            recorder=self.recorder, card_tags={"node": self.card.node, "device": self.card.device},
            max_tokens=m.max_request_tokens, large_call_tokens=m.large_call_tokens)
        self.tokenizer = TokenizeQueue(
            model=model_name, max_inputs=cfg.router.max_inputs_per_request,
            max_chars=m.max_request_chars, max_tokens=m.max_request_tokens,
            queue_timeout_s=m.admission.queue_timeout_s,
            on_reject=lambda why: self.recorder.inc("embedfleet_overload_rejections_total", 1,
                                                    {"model": model_name, "reason": why}))
        if engine.info.prefix_caching:
            await self.prefix.prove()  # prove cache hits before serving; switches off on failure
        self.follower = LimitsFollower(
            gate=self.gate, budget=queue, card_tags={"node": self.card.node,
                                                     "device": self.card.device},
            ceiling=ceiling, pull_limits=self._pull_limits(governor, ceiling),
            interval_s=cfg.governor.interval_s, sink=RayMetricsSink(),
            peak_window_s=cfg.governor.peak_window_s,
            idle=lambda: self.path.inflight_sequences == 0,
            last_activity=lambda: self.path.last_progress,
            cpu_card=CpuCardModel(cfg.platform.cpu_card_memory_bytes) if kind == "cpu" else None,
            model=model_name, configured_total_bytes=cfg.platform.card_memory_bytes)
        self.path.on_engine_failure = self.follower.engine_oom  # the governor cuts the card
        self.reporter = Reporter(replica_id=self.replica_id, card=self.card, platform=kind,
                                 path=self.path, prefix=self.prefix, follower=self.follower,
                                 registry=registry, healthy=self._ready,
                                 serving=lambda: self.gate.is_open)
        self._healthy = True
        self._health_engine: EmbeddingEngine | None = None  # the engine the last probe embedded on
        self._health_embedded_at = 0.0
        self._probe = HealthProbe(stall_s=cfg.health_stall_timeout_s)
        await self._check_idle_floor()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.reporter.heartbeat_forever()),
                       loop.create_task(self.prefix.run()),
                       loop.create_task(self.follower.run(after_tick=self.reporter.export_state)),
                       loop.create_task(self.recorder.flush_forever())]
        self.reporter.export_state()
        logger.info("replica %s of %s ready on card %s; prefix cache %s (%s)", self.replica_id,
                    model_name, self.card.label, self.prefix.state, self.prefix.reason)

    # -- wiring --------------------------------------------------------------------------------
    def _ready(self) -> bool:
        return self._healthy and not self.path.engine_failed and self.prefix.healthy

    def _engine_changed(self) -> None:
        engine = self.gate.engine
        if engine is not None and engine.info is not self.path.info:
            self.path.use_engine(engine)

    def fingerprint(self) -> Fingerprint:
        info = self.path.info
        return Fingerprint(self.digest, info.dtype, info.engine_version, self.cfg.platform.kind,
                           self.prefix.reads_cache)

    def _pull_limits(self, governor: Any, ceiling):
        if governor is None:
            return None
        return lambda report: governor.limits_for.remote(self.card.node, self.card.device,
                                                         ceiling, report)

    async def _report_canary_failure(self, reason: str, canary: CanaryView) -> None:
        if self._registry is not None:
            await self._registry.disable_prefix_cache.remote(self.path.model, reason, canary)

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
                         reading.capacity_bytes)

    # -- what Serve calls ----------------------------------------------------------------------
    async def embed(self, call: EmbedCall) -> EmbedResult:
        return await self.path.embed(call)

    async def tokenize_tei(self, texts: list[str], add_special_tokens: bool = True,
                           prompt_name: str | None = None, lane: Lane = "interactive") -> list:
        return await self.tokenizer.tokenize(
            self.path.hf_tokenizer, self.path.preparer.prompted(texts, prompt_name),
            add_special_tokens, lane)

    def describe(self) -> ReplicaDescription:
        return self.reporter.describe()

    def record_routing_stats(self) -> dict[str, Any]:
        """Serve's request router polls this (``deployments/ingress/affinity.py``): a
        replica whose prefix cache is off gets no prefix-affinity preference."""
        return RoutingStats(prefix_cache=self.prefix.reads_cache,
                            serving=self.gate.is_open).model_dump()

    async def check_health(self) -> None:
        """Serve's health check: really embed something, within a bound.

        When the engine is busy, a probe would queue behind (possibly huge) admitted work and
        could time out on a healthy replica; then the engine finishing sequences recently is the
        proof of health (not calls: one large call ran 80 s on the test cluster, and the probes
        that timed out behind it came within one failure of Serve killing the replica), and the
        engine core's own liveness check must pass. An idle replica embeds its probe every
        HEALTH_EMBED_EVERY_S, and in between runs only that liveness check. A probe slower than
        one check stays pending (replica/health_probe.py): it fails the checks only once it has
        waited health_stall_timeout_s.
        """
        if not self.prefix.healthy:
            raise RuntimeError(f"engine swap gave up: {self.prefix.swap_error}")
        engine = self.gate.engine
        if engine is None or not self.gate.is_open:
            return  # an engine swap is under way (bounded and retried by the controller)
        busy = self.path.inflight_sequences > 0
        if busy and time.monotonic() - engine.last_output_at < self.cfg.health_check_timeout_s:
            await engine.check_health()
            return
        if (self._healthy and engine is self._health_engine
                and time.monotonic() - self._health_embedded_at < HEALTH_EMBED_EVERY_S):
            await engine.check_health()
            return
        deadline = time.monotonic() + self.cfg.health_check_timeout_s * 0.8
        try:
            answered = await self._probe.run(engine, timeout_s=deadline - time.monotonic())
            if not answered:  # slow, not stuck (health_probe.py): the core must still be alive
                logger.warning("health probe pending for %.0fs (stall bound %gs): engine busy",
                               self._probe.pending_for, self._probe.stall_s)
                await engine.check_health()
                return
            self._healthy = True
            self._health_engine, self._health_embedded_at = engine, time.monotonic()
        except Exception:
            self._healthy = False
            self.reporter.export_state()
            raise
        if not busy:  # vLLM's worker spins a second after that call: re-read the idle card's
            # memory within that wake, not in a wake of its own (replica/limits.py)
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.follower.read_card(fresh=True),
                                       timeout=max(deadline - time.monotonic(), 0.1))

    def __del__(self) -> None:
        for task in getattr(self, "_tasks", []):
            task.cancel()
        prefix = getattr(self, "prefix", None)
        if prefix is not None:
            prefix.cancel()
        probe = getattr(self, "_probe", None)
        if probe is not None:
            probe.cancel()
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
        engines = getattr(self, "engines", None)
        if engines is not None:
            engines.stop_watchdogs()
