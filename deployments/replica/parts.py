"""An engine replica's parts, each built from the config sections it reads, and their links.

``EngineReplica.build`` and ``start`` (``replica/engine_replica.py``) call these builders with
whole config sections (a ``ModelConfig``, its ``admission`` section, the ``router`` and
``governor`` sections), so which config field feeds which constructor argument is decided in one
place per part. The parts talk to each other and to the fleet through small named objects
instead of closures:

* ``EngineRecipe.kwargs`` — the engine's arguments, with or without prefix caching (the engine
  lifecycle builds the first engine and a swap's replacement from it);
* ``Rejections.count`` — one overload rejection, counted by reason (admission and ``/tokenize``);
* ``PathActivity`` — what the limits follower asks of the request path (idle? last progress?);
* ``GovernorLink.pull`` / ``RegistryLink`` — the replica's calls to the governor and the registry.

Nothing here does I/O or awaits when it is built: the remote calls happen when the links are
used.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from ..common import metrics
from ..common.contracts import CanaryView, Ceiling, Fingerprint, Limits
from ..config.governor import GovernorConfig, GovernorParams
from ..config.router import RouterConfig
from ..config.admission import AdmissionConfig
from ..config.schema import EmbedfleetConfig, ModelConfig, PlatformProfile
from ..engine.card_memory import CpuCardModel
from ..engine.card_profile import resolve_profile
from ..engine.gate import EngineGate
from ..engine.lifecycle import EngineLifecycle
from ..engine.platform import CardIdentity
from ..engine.vllm_engine import EmbeddingEngine
from ..fleet.governor import RayMetricsSink
from ..fleet.governor_law import CardReport, params_for_profile
from .admission import AdmissionBudget
from .limits import LimitsFollower
from .prefix_cache import PrefixCacheController
from .request_path import RequestPath
from .tokenize import TokenizeQueue

logger = logging.getLogger("embedfleet.replica")


# -- links -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class EngineRecipe:
    """The engine's constructor arguments for one model (``EmbedfleetConfig.engine_kwargs``)."""

    cfg: EmbedfleetConfig
    model: ModelConfig

    def kwargs(self, prefix_cache: bool) -> dict[str, Any]:
        return self.cfg.engine_kwargs(self.model, enable_prefix_caching=prefix_cache)


@dataclass(frozen=True)
class Rejections:
    """``embedfleet_overload_rejections_total`` of one model, by reason (a bounded label)."""

    recorder: metrics.Batched
    model: str

    def count(self, reason: str) -> None:
        self.recorder.inc("embedfleet_overload_rejections_total", 1,
                          {"model": self.model, "reason": reason})


@dataclass(frozen=True)
class PathActivity:
    """What the limits follower reads of the request path: whether the card is idle (an idle
    card's memory is re-read less often) and when work last progressed."""

    path: RequestPath

    def idle(self) -> bool:
        return self.path.inflight_sequences == 0

    def last_activity(self) -> float:
        return self.path.last_progress


@dataclass(frozen=True)
class GovernorLink:
    """This card's limits from the MemoryGovernor (its Serve handle)."""

    governor: Any
    card: CardIdentity
    ceiling: Ceiling

    def pull(self, report: CardReport) -> Awaitable[Limits]:
        return self.governor.limits_for.remote(self.card.node, self.card.device, self.ceiling,
                                               report)


@dataclass(frozen=True)
class RegistryLink:
    """The replica's calls to the FleetRegistry (its Serve handle; None outside a fleet)."""

    registry: Any
    model: str

    async def prefix_cache_override(self) -> Any:
        """The model's fleet-wide prefix-cache override (a canary failed somewhere), or None."""
        if self.registry is None:
            return None
        return await self.registry.prefix_cache_override.remote(self.model)

    async def report_canary_failure(self, reason: str, canary: CanaryView) -> None:
        if self.registry is not None:
            await self.registry.disable_prefix_cache.remote(self.model, reason, canary)

    def leave(self, replica_id: str) -> None:
        if self.registry is not None:
            self.registry.leave.remote(replica_id)


def governor_band(cfg: EmbedfleetConfig, model: str) -> GovernorParams:
    """The governor's band for this model's cards: its card profile's when it has one
    (``governor.card_profiles``, or the one ``calibrate`` wrote), else ``governor.params``.
    A profile that cannot be used gives the configured band (the governor logs why)."""
    try:
        found = resolve_profile(cfg.app_name, model, cfg.platform.kind,
                                cfg.governor.card_profiles.get(model))
    except ValueError as exc:
        logger.debug("model %s: no usable card profile here (%s)", model, exc)
        found = None
    return params_for_profile(cfg.governor.params, found[0] if found else None)


# -- parts -----------------------------------------------------------------------------------
def admission_budget(ceiling: Ceiling, admission: AdmissionConfig,
                     rejections: Rejections) -> AdmissionBudget:
    """The card's owner queue, at the model's ceiling until the governor's first limits."""
    return AdmissionBudget(
        ceiling.max_sequences, ceiling.max_tokens, max_waiting=admission.max_waiting,
        queue_timeout_s=admission.queue_timeout_s, bulk_max_waiting=admission.bulk_max_waiting,
        bulk_max_inflight_share=admission.bulk_max_inflight_share,
        bulk_min_share=admission.bulk_min_share, bulk_max_drain_s=admission.bulk_max_drain_s,
        on_reject=rejections.count)


def tokenize_queue(m: ModelConfig, router: RouterConfig,
                   rejections: Rejections) -> TokenizeQueue:
    """``/tokenize``'s bounded work, within the model's request limits."""
    return TokenizeQueue(model=m.name, max_inputs=router.max_inputs_per_request,
                         max_chars=m.max_request_chars, max_tokens=m.max_request_tokens,
                         queue_timeout_s=m.admission.queue_timeout_s,
                         on_reject=rejections.count)


def prefix_cache_controller(
        m: ModelConfig, card: CardIdentity, enabled: bool, reason: str,
        gate: EngineGate[EmbeddingEngine], engines: EngineLifecycle, registry: RegistryLink, *,
        on_change: Callable[[], None]) -> PrefixCacheController:
    """Prefix caching's one state around the started engine (``enabled``: what it caches)."""
    return PrefixCacheController(
        model=m.name, card_label=card.label, enabled=enabled, reason=reason, gate=gate,
        build_engine=engines.build, shutdown_engine=engines.shutdown,
        report_failure=registry.report_canary_failure, canary_interval_s=m.canary_interval_s,
        on_change=on_change)


def request_path(m: ModelConfig, router: RouterConfig, card: CardIdentity, replica_id: str, *,
                 gate: EngineGate[EmbeddingEngine], queue: AdmissionBudget,
                 reads_cache: Callable[[], bool], fingerprint: Callable[[], Fingerprint],
                 recorder: metrics.Batched) -> RequestPath:
    return RequestPath(
        model=m.name, gate=gate, queue=queue, long_input=m.long_input, prompts=m.prompts,
        reads_cache=reads_cache, fingerprint=fingerprint, replica_id=replica_id,
        hold_s=m.replicas.cold_start_hold_s, retry_after_s=router.retry_after_s,
        recorder=recorder, card_tags=card_tags(card), max_tokens=m.max_request_tokens,
        large_call_tokens=m.large_call_tokens)


def limits_follower(m: ModelConfig, governor: GovernorConfig, platform: PlatformProfile,
                    card: CardIdentity, *, gate: EngineGate[EmbeddingEngine],
                    queue: AdmissionBudget, activity: PathActivity,
                    link: GovernorLink | None) -> LimitsFollower:
    """The card's memory terms and the governor's limits (none pulled without a governor)."""
    return LimitsFollower(
        gate=gate, budget=queue, card_tags=card_tags(card), ceiling=m.budget_ceiling,
        pull_limits=None if link is None else link.pull, interval_s=governor.interval_s,
        sink=RayMetricsSink(), peak_window_s=governor.peak_window_s, idle=activity.idle,
        last_activity=activity.last_activity,
        cpu_card=(CpuCardModel(platform.cpu_card_memory_bytes) if platform.kind == "cpu"
                  else None),
        model=m.name, configured_total_bytes=platform.card_memory_bytes)


def card_tags(card: CardIdentity) -> dict[str, str]:
    return {"node": card.node, "device": card.device}
