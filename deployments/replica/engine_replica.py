"""EngineReplica: the Serve deployment that holds one card, assembled from parts with one job each.

* ``replica.request_path.RequestPath`` — the request path: prepare, the owner queue
  (admission by sequences and tokens), the engine, finish;
* ``replica.prefix_cache.PrefixCacheController`` — prefix caching's one state, the canary, the
  engine swap;
* ``replica.limits.LimitsFollower`` — the card's memory terms and the governor's limits;
* ``replica.engine_restart.EngineRestart`` — an engine that died in a step restarted in place,
  after the governor's cut, with that step's calls run again on it;
* ``replica.reporter.Reporter`` — the heartbeat to the registry, ``describe()``, state gauges;
* ``engine.lifecycle.EngineLifecycle`` — starting and stopping engines (with their reaper).

Two steps, as Ray Serve LLM's server: ``build`` makes the parts that need no engine from the
config sections (no I/O, nothing awaited); ``start`` learns the card, prepares the process,
starts the engine, builds the parts that hold it (the request path reads the engine's info and
tokenizer when it is made), proves the prefix cache and starts the loops. ``replica.parts``
holds the builders and the named links between the parts. The direct ingress
(``ingress/direct.py``) holds a replica built and started the same way.
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
from ..common.contracts import (EmbedCall, EmbedResult, Fingerprint, Lane,
                                ReplicaDescription, RoutingStats)
from ..common.fingerprint import model_digest
from ..common.long_input import SpecialTokens
from ..config.schema import EmbedfleetConfig, ModelConfig, parse_config
from ..engine.gate import EngineGate
from ..engine.lifecycle import DEFAULT_ENGINE_FACTORY, EngineLifecycle
from ..engine.model_facts import read_model_facts
from ..engine.platform import (CardIdentity, card_identity, platform_facts,
                               prepare_ascend_process, prepare_cpu_process)
from ..engine.prefix_cache_policy import resolve as resolve_prefix_cache
from ..engine.vllm_engine import EmbeddingEngine, EngineDead
from .health_probe import HealthProbe
from .parts import (EngineRecipe, GovernorLink, PathActivity, RegistryLink, Rejections,
                    admission_budget, governor_band, limits_follower, prefix_cache_controller,
                    request_path, tokenize_queue)
from .engine_restart import EngineRestart
from .reporter import Reporter
from .rerank_path import RerankCall, RerankPath, RerankResult

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


def prepare_process(cfg: EmbedfleetConfig, card: CardIdentity) -> None:
    """The platform's checks and environment, before any engine starts in this process."""
    if cfg.platform.kind == "ascend":
        from ..engine.ascend_checks import assert_ascend_ready

        logger.info("Ascend start-up checks passed: %s; engine env %s",
                    assert_ascend_ready(), prepare_ascend_process())
    if cfg.platform.kind == "cpu":
        binding = prepare_cpu_process(card.device, card.cards_on_node)
        logger.info("CPU card %s: vLLM threads bound to cores %s", card.device, binding)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never download weights at run time


class EngineReplica:
    """One model's replica on one card: ``build``, then ``start`` (Serve awaits both here)."""

    async def __init__(self, config: dict[str, Any], model_name: str, registry: Any = None,
                       engine_factory: str = DEFAULT_ENGINE_FACTORY, governor: Any = None) -> None:
        self.build(parse_config(config, "deployment args"), model_name, registry=registry,
                   governor=governor, engine_factory=engine_factory)
        await self.start()

    @classmethod
    def built(cls, cfg: EmbedfleetConfig, model_name: str, *, registry: Any = None,
              governor: Any = None,
              engine_factory: str = DEFAULT_ENGINE_FACTORY) -> EngineReplica:
        """A replica built, not started, for a deployment that holds one (``ingress/direct.py``)."""
        replica = cls.__new__(cls)
        replica.build(cfg, model_name, registry=registry, governor=governor,
                      engine_factory=engine_factory)
        return replica

    def build(self, cfg: EmbedfleetConfig, model_name: str, *, registry: Any, governor: Any,
              engine_factory: str) -> None:
        """The parts that need no engine, from the config sections: no I/O, nothing awaited."""
        self.cfg = cfg
        self.model_cfg = m = cfg.model(model_name)
        self.replica_id = replica_id()
        self.registry = RegistryLink(registry, m.name)
        self._governor = governor
        self.engines = EngineLifecycle(engine_factory, EngineRecipe(cfg, m).kwargs)
        self.recorder = metrics.Batched()
        rejections = Rejections(self.recorder, m.name)
        self.queue = admission_budget(m.budget_ceiling, m.admission, rejections)
        self.tokenizer = tokenize_queue(m, cfg.router, rejections)
        self._probe = HealthProbe(stall_s=cfg.health_stall_timeout_s)
        self._healthy = True
        self._health_engine: EmbeddingEngine | None = None  # the engine the last probe embedded on
        self._health_embedded_at = 0.0
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        """Learn the card, start the engine and the parts that hold it, prove the prefix cache,
        check the idle card against the governor's band, then run the loops."""
        cfg, m = self.cfg, self.model_cfg
        self.card = card_identity(cfg.platform.card_resource,
                                  ascend=cfg.platform.kind == "ascend")
        prepare_process(cfg, self.card)
        enabled, reason = decide_prefix_cache(cfg, m)
        override = await self.registry.prefix_cache_override() if enabled else None
        if override is not None:
            enabled, reason = False, override.reason
        engine = self.engines.build(enabled)
        self.gate: EngineGate[EmbeddingEngine] = EngineGate(engine)
        m.long_input.check_model(engine.info.max_model_len,
                                 SpecialTokens.from_tokenizer(engine.hf_tokenizer))
        self.digest = model_digest(m.source.local_dir())
        self._hold_engine(engine.info.prefix_caching, reason)
        if engine.info.prefix_caching:
            await self.prefix.prove()  # prove cache hits before serving; switches off on failure
        self.reranker = RerankPath(self.path, m)  # a reranker's pairs; its canary before serving
        await self.reranker.start()
        await self._check_idle_floor()
        loop = asyncio.get_running_loop()
        self._tasks = [loop.create_task(self.reporter.heartbeat_forever()),
                       loop.create_task(self.prefix.run()),
                       loop.create_task(self.follower.run(after_tick=self.reporter.export_state)),
                       loop.create_task(self.recorder.flush_forever())]
        self.reporter.export_state()
        logger.info("replica %s of %s ready on card %s; prefix cache %s (%s)", self.replica_id,
                    m.name, self.card.label, self.prefix.state, self.prefix.reason)

    def _hold_engine(self, prefix_caching: bool, reason: str) -> None:
        """The parts around the gate's engine (no I/O: they read the engine's info)."""
        cfg, m, card = self.cfg, self.model_cfg, self.card
        self.prefix = prefix_cache_controller(m, card, prefix_caching, reason, self.gate,
                                              self.engines, self.registry,
                                              on_change=self._engine_changed)
        self.path = request_path(m, cfg.router, card, self.replica_id, gate=self.gate,
                                 queue=self.queue, reads_cache=self._reads_cache,
                                 fingerprint=self._fingerprint, recorder=self.recorder)
        link = (None if self._governor is None
                else GovernorLink(self._governor, card, m.budget_ceiling))
        self.follower = limits_follower(m, cfg.governor, cfg.platform, card, gate=self.gate,
                                        queue=self.queue, activity=PathActivity(self.path),
                                        link=link)
        self.restart = EngineRestart(model=m.name, card_label=card.label, gate=self.gate,
                                     build_engine=self.engines.build,
                                     shutdown_engine=self.engines.shutdown,
                                     prefix_caching=self._reads_cache,
                                     apply_cut=self.follower.follow, on_change=self._engine_changed)
        self.path.on_engine_failure = self._engine_died
        self.reporter = Reporter(replica_id=self.replica_id, card=card,
                                 platform=cfg.platform.kind, path=self.path, prefix=self.prefix,
                                 follower=self.follower, registry=self.registry.registry,
                                 healthy=self._ready, serving=self._serving,
                                 engine_restarts=lambda: self.restart.restarts)

    # -- what the parts ask of each other ------------------------------------------------------
    def _ready(self) -> bool:
        return (self._healthy and not self.path.engine_failed and self.prefix.healthy
                and self.restart.healthy)

    def _engine_died(self, engine: EmbeddingEngine) -> None:
        """Reported to the governor as an OOM (it cuts this card), then restarted in place."""
        self.follower.engine_oom()
        self.restart.begin(engine)

    def _serving(self) -> bool:
        return self.gate.is_open

    def _reads_cache(self) -> bool:
        return self.prefix.reads_cache

    def _engine_changed(self) -> None:
        engine = self.gate.engine
        if engine is not None and engine.info is not self.path.info:
            self.path.use_engine(engine)

    def _fingerprint(self) -> Fingerprint:
        info = self.path.info
        return Fingerprint(self.digest, info.dtype, info.engine_version, self.cfg.platform.kind,
                           self.prefix.reads_cache)

    async def _check_idle_floor(self) -> None:
        """The signal before any request is the card's floor; at or above the governor's
        ``high`` for this model (its card profile's band, else ``governor.params``) the
        governor would hold this card at its floor forever, so say so loudly."""
        reading = await self.follower.read_card()
        high = governor_band(self.cfg, self.model_cfg.name).high
        if reading is not None and reading.ratio >= high:
            logger.error("card %s: live memory ratio at idle is %.3f >= governor high %.2f: the "
                         "governor will keep this card's budget at its floor; lower "
                         "gpu_memory_utilization or serve a smaller model (live %d of %d bytes)",
                         self.card.label, reading.ratio, high, reading.live_bytes,
                         reading.capacity_bytes)

    # -- what Serve calls ----------------------------------------------------------------------
    async def embed(self, call: EmbedCall) -> EmbedResult:
        return await self.path.embed(call)

    async def rerank(self, call: RerankCall) -> RerankResult:
        return await self.reranker.rerank(call)

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
        if not self.restart.healthy:
            raise RuntimeError(f"engine restart gave up: {self.restart.error}")
        engine = self.gate.engine
        if engine is None or not self.gate.is_open:
            return  # an engine swap or restart is under way (bounded and retried)
        try:
            await self._check_engine(engine)
        except EngineDead:
            # The core died with no call on it (a call that meets the death restarts the engine
            # itself, and reports it to the governor as an OOM in a step): restart it in place
            # as well, rather than have Serve replace the replica and its calls.
            logger.error("replica %s: the engine core of %s is gone; restarting the engine",
                         self.replica_id, self.model_cfg.name)
            self._healthy = True
            self.restart.begin(engine)

    async def _check_engine(self, engine: EmbeddingEngine) -> None:
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

    def stop(self) -> None:
        """Cancel the loops, leave the registry, shut the engine down (safe to call twice: Serve
        calls ``__del__`` at shutdown and the collector may again)."""
        for task in getattr(self, "_tasks", []):
            task.cancel()
        for part in (getattr(self, "prefix", None), getattr(self, "restart", None)):
            if part is not None:
                part.cancel()
        probe = getattr(self, "_probe", None)
        if probe is not None:
            probe.cancel()
        registry = getattr(self, "registry", None)
        if registry is not None:
            try:
                registry.leave(self.replica_id)
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

    def __del__(self) -> None:
        self.stop()
