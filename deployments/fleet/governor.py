"""MemoryGovernor: one Serve replica (no card) that turns card memory into per-card batch budgets.

Every ``interval_s`` it runs ONE PromQL query for all cards (``embedfleet.deployments.config.memory_queries``), feeds
each card's reading to the pure control law (``embedfleet.deployments.fleet.governor_law.step``) and keeps the result.
Engine replicas pull their card's limits (``limits_for``) and enforce them as their
``AdmissionBudget``. When Prometheus cannot answer, every card keeps its last limits marked stale
(``hold_stale``) and serving goes on.

Card identity — how a Prometheus series finds its replica. A card is ``(node, device)`` where
``node`` is the node name the replica reports (``CardIdentity.node``: Ray's node name, which is
the node IP unless ``ray start --node-name`` set one) and ``device`` the card id Ray assigned it
(the physical id in ``ASCEND_RT_VISIBLE_DEVICES`` / ``CUDA_VISIBLE_DEVICES``). Every preset yields series labelled
``node`` and ``device``; per preset the labels must carry the same values:

* ``embedfleet``: the replicas export ``embedfleet_card_memory_*{node=<node name>, device=<id>}``
  and the recording rule keeps both labels — matches by construction.
* ``npu-exporter``: ``device`` comes from npu-exporter's ``id`` (the physical chip id, what Ray
  assigns). npu-exporter has no node label: the scrape config must attach ``node=<node IP>``, or
  set ``node_label: instance`` to use the scrape target's host (an IP when targets are IPs).
* ``dcgm``: ``device`` from ``gpu``; the node defaults to DCGM's ``Hostname`` label, which is a
  host *name*: map names to IPs with ``node_aliases`` or use ``node_label: instance``.

Each model's cards get the band of its card profile (``governor.card_profiles``, or what
``embedfleet calibrate`` wrote under the state directory), read once at start; replicas send their
model and their allocator's counters with each pull, and a rise cuts at once (``hard_cut``).

Metrics go through a ``MetricsSink`` (Ray gauges by default) so tests can see what is exported
and a metrics failure can never stop the control loop.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

from ..config.schema import EmbedfleetConfig, parse_config
from ..common.contracts import Ceiling, Limits
from .durable import DurableStore
from ..config.governor import GovernorConfig
from .governor_law import (CardReport, CardState, GovernorParams,
                              hard_cut, hold_stale,
                              params_for_profile, step)
from ..engine.card_profile import CardProfile, resolve_profile
from ..config.memory_queries import (CardKey, CardReading,
                                      PrometheusQueryError,
                                      PrometheusUnavailable,
                                      aquery_card_ratios)

logger = logging.getLogger("embedfleet.governor")
CARD_STATES = "governor_card_state"  # durable kind: one CardState per "node|device"


ReadingSource = Callable[[], Awaitable[dict[CardKey, CardReading]]]
"""Where the governor's per-card readings come from: Prometheus (the default), or a simulated
card (``benchmarks/governor_sim.py``). Raises ``PrometheusUnavailable`` when it cannot answer."""


class MetricsSink(Protocol):
    def set_gauge(self, name: str, value: float, tags: dict[str, str]) -> None: ...


class RayMetricsSink:
    """Ray user metrics (``embedfleet.deployments.common.metrics``). Failures are logged once and swallowed:
    losing a gauge must never stop the governor from steering."""

    def __init__(self) -> None:
        self._warned = False

    def set_gauge(self, name: str, value: float, tags: dict[str, str]) -> None:
        try:
            from ..common import metrics

            metrics.get(name).set(value, tags=tags)
        except Exception as exc:
            if not self._warned:
                logger.warning("cannot export governor metric %s (%r); further failures are "
                               "not logged", name, exc)
                self._warned = True


@dataclass
class _Card:
    ceiling: Ceiling
    state: CardState
    last_pull: float
    model: str | None = None
    report: CardReport | None = None


def _store_key(key: CardKey) -> str:
    return f"{key[0]}|{key[1]}"


def _finite_or_none(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None


class MemoryGovernor:
    """The Serve deployment class. Outside Serve (tests) pass ``autostart=False`` and call
    ``tick()`` yourself; in Serve the control loop starts as a background task."""

    def __init__(self, config: dict[str, Any],
                 governor: GovernorConfig | dict[str, Any] | None = None, *,
                 sink: MetricsSink | None = None, clock: Callable[[], float] = time.time,
                 autostart: bool = True, readings: ReadingSource | None = None,
                 store: DurableStore | None = None) -> None:
        self.cfg: EmbedfleetConfig = parse_config(config, "MemoryGovernor args")
        if governor is None:  # once the main config carries `governor`, it is the source
            governor = getattr(self.cfg, "governor", None) or GovernorConfig()
        self.settings = (governor if isinstance(governor, GovernorConfig)
                         else GovernorConfig.model_validate(governor))
        self._query = self.settings.card_query()
        self._readings = readings or self._from_prometheus
        self._sink: MetricsSink = sink or RayMetricsSink()
        self._clock = clock
        self._cards: dict[CardKey, _Card] = {}
        self._prometheus_error: str | None = None
        self._last_tick_at: float | None = None
        self._ticks = 0
        self._tick_errors = 0
        self._autostart = autostart
        self._task: asyncio.Task[None] | None = None
        # Each card's state is written through to the GCS when it changes, and a restarted
        # governor resumes a card from it: a governor restart during a memory surge must not
        # hand out the ceiling again. In Serve the store is the app's; tests pass their own.
        self._store = store if store is not None or not autostart else DurableStore.connected(
            self.cfg.app_name)
        self._saved: dict[str, CardState] = self._load_saved()
        self.profiles: dict[str, tuple[CardProfile, str]] = {
            m.name: found for m in self.cfg.models
            if (found := self._load_profile(m.name)) is not None}
        self._ensure_started()
        logger.info("memory governor: %s preset at %s every %g s (high %g, low %g)",
                    self._query.name, self.settings.prometheus_url, self.settings.interval_s,
                    self.settings.params.high, self.settings.params.low)

    # -- the loop --------------------------------------------------------------------------------
    def _ensure_started(self) -> None:
        # Serve runs the constructor on the replica's event loop; if there is none yet, the
        # first method call (on the loop) starts it.
        if not self._autostart or (self._task is not None and not self._task.done()):
            return
        try:
            self.start()
        except RuntimeError:  # no running event loop
            pass

    def start(self) -> asyncio.Task[None]:
        """Run the control loop as a background task on the running event loop."""
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self.run(),
                                                               name="memory-governor")
        return self._task

    async def stop(self) -> None:
        """Cancel the control loop; it stays stopped (no automatic restart on the next call)."""
        self._autostart = False
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    async def run(self) -> None:
        """Tick every ``interval_s`` (measured start to start) until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            try:
                await self.tick()
            except Exception:  # a bug in one step must not end steering; limits stay as they are
                self._tick_errors += 1
                logger.exception("memory governor step failed; limits unchanged")
                self._sink.set_gauge("embedfleet_governor_stale", 1, {})
            await asyncio.sleep(max(0.0, self.settings.interval_s - (loop.time() - started)))

    async def tick(self, now: float | None = None) -> dict[CardKey, CardState]:
        """One control step for every known card; returns the new states.

        ``now`` (unix s) defaults to the clock after the query returns, so a slow query does not
        make fresh samples look old.
        """
        self._forget_idle(self._clock() if now is None else now)
        if not self._cards:
            self._sink.set_gauge("embedfleet_governor_stale", 0, {})
            return {}
        readings: dict[CardKey, CardReading] | None = None
        why = ""
        try:
            readings = await self._readings()
        except PrometheusQueryError as exc:
            why = f"Prometheus rejected the memory query: {exc}"
        except PrometheusUnavailable as exc:
            why = f"Prometheus unavailable: {exc}"
        now = self._clock() if now is None else now
        self._note_prometheus(why or None)

        states: dict[CardKey, CardState] = {}
        for key, card in list(self._cards.items()):
            params = self.params_for(card.model)
            prev = card.state
            if readings is None:
                new = hold_stale(params, card.ceiling, prev, why[:300])
            else:
                r = readings.get(key)
                new = step(params, card.ceiling, prev, r.ratio if r else None,
                           r.sample_ts if r else None, now)
            card.state = states[key] = new
            if new.changed or prev.action == "start":
                self._log_change(key, new)
                self._save(key, new)
            self._publish_card(key, card)
        self._sink.set_gauge("embedfleet_governor_stale",
                             int(readings is None or any(s.stale for s in states.values())), {})
        self._ticks += 1
        self._last_tick_at = now
        return states

    async def _from_prometheus(self) -> dict[CardKey, CardReading]:
        timeout = min(self.settings.query_timeout_s, self.settings.interval_s)
        return await aquery_card_ratios(self.settings.prometheus_url, self._query,
                                        timeout=timeout)

    def _forget_idle(self, now: float) -> None:
        for key in [k for k, c in self._cards.items()
                    if now - c.last_pull > self.settings.forget_after_s]:
            del self._cards[key]
            logger.info("card %s/%s: no limit pull for %g s, forgotten", *key,
                        self.settings.forget_after_s)

    def _note_prometheus(self, error: str | None) -> None:
        """Log outages once when they start and once when they end, not every interval."""
        if error and not self._prometheus_error:
            logger.warning("%s; holding the last limits of %d card(s)", error, len(self._cards))
        elif not error and self._prometheus_error:
            logger.info("Prometheus answers again at %s", self.settings.prometheus_url)
        self._prometheus_error = error

    def _log_change(self, key: CardKey, s: CardState) -> None:
        level = logging.WARNING if s.action in ("decrease", "stale") else logging.INFO
        ratio = "none" if s.ratio is None else f"{s.ratio:g}"
        logger.log(level, "card %s/%s: ratio %s → %d seq / %d tok%s (%s)", *key, ratio,
                   s.limits.max_sequences, s.limits.max_tokens,
                   " [stale]" if s.stale else "", s.reason)

    def _publish_card(self, key: CardKey, card: _Card) -> None:
        tags = {"node": key[0], "device": key[1]}
        ratio = _finite_or_none(card.state.ratio)
        if ratio is not None:
            self._sink.set_gauge("embedfleet_governor_memory_ratio", ratio, tags)
        limits = self._effective(card)
        params = self.params_for(card.model)
        self._sink.set_gauge("embedfleet_governor_high", params.high, tags)
        self._sink.set_gauge("embedfleet_governor_low", params.low, tags)
        self._sink.set_gauge("embedfleet_governor_limit_tokens", limits.max_tokens, tags)
        self._sink.set_gauge("embedfleet_governor_limit_sequences", limits.max_sequences, tags)

    # -- card profiles ---------------------------------------------------------------------------
    def _load_profile(self, model: str) -> tuple[CardProfile, str] | None:
        """The model's profile and where it came from; None (the configured band) when there
        is none or it cannot be used (said in the log)."""
        try:
            found = resolve_profile(self.cfg.app_name, model, self.cfg.platform.kind,
                                    self.settings.card_profiles.get(model))
        except ValueError as exc:
            logger.error("model %s: %s; its cards use the configured band", model, exc)
            return None
        if found is None:
            return None
        profile, path = found
        p = params_for_profile(self.settings.params, profile)
        logger.info("model %s: card profile %s (%s, %s): band low %.4f / high %.4f; idle %.4f, "
                    "operating point %.4f%s", model, path, profile.source,
                    profile.measured_at.isoformat(), p.low, p.high, profile.idle_ratio,
                    profile.operating_point_ratio,
                    "" if profile.fits else "; the worst step does NOT leave the safety margin")
        return profile, str(path)

    def params_for(self, model: str | None) -> GovernorParams:
        found = self.profiles.get(model) if model is not None else None
        return params_for_profile(self.settings.params, found[0] if found else None)

    # -- durable state ---------------------------------------------------------------------------
    def _load_saved(self) -> dict[str, CardState]:
        if self._store is None:
            return {}
        try:
            return self._store.items(CARD_STATES, CardState)
        except Exception as exc:  # the GCS unreachable: start from the ceilings, say so
            logger.warning("cannot read the governor's saved card states: %r", exc)
            return {}

    def _save(self, key: CardKey, state: CardState) -> None:
        if self._store is None:
            return
        try:
            self._store.put(CARD_STATES, _store_key(key), state)
        except Exception as exc:
            logger.warning("cannot save card %s/%s's state: %r", *key, exc)

    # -- what replicas and status call -----------------------------------------------------------
    @staticmethod
    def _effective(card: _Card) -> Limits:
        # A smaller ceiling (redeploy) applies at once, before the next step re-clamps the state.
        lim = card.state.limits
        return Limits(max_sequences=min(lim.max_sequences, card.ceiling.max_sequences),
                      max_tokens=min(lim.max_tokens, card.ceiling.max_tokens),
                      stale=lim.stale, reason=lim.reason,
                      ratio=_finite_or_none(card.state.ratio), action=card.state.action)

    async def limits_for(self, node: str, device: str, ceiling: Ceiling,
                         report: CardReport | dict[str, Any] | None = None) -> Limits:
        """The card's current limits. The first call registers the card at its ``ceiling``;
        later calls update the ceiling if it changed. ``report`` (the replica's model and
        allocator counters): a rise since the last report cuts at once (``hard_cut``)."""
        self._ensure_started()
        key: CardKey = (str(node), str(device))
        ceil = Ceiling.model_validate(ceiling)
        card = self._cards.get(key)
        if card is None:
            saved = self._saved.pop(_store_key(key), None)
            card = self._cards[key] = _Card(ceil, saved or CardState.initial(ceil),
                                            self._clock())
            if saved is None:
                logger.info("card %s/%s registered, ceiling %d seq / %d tok", *key,
                            ceil.max_sequences, ceil.max_tokens)
            else:  # the next step clamps it to the (possibly new) ceiling
                logger.warning("card %s/%s resumed from its saved state: %d seq / %d tok (%s)",
                               *key, saved.limits.max_sequences, saved.limits.max_tokens,
                               saved.reason)
            self._publish_card(key, card)
        else:
            if ceil != card.ceiling:
                logger.info("card %s/%s: ceiling %d seq / %d tok → %d seq / %d tok", *key,
                            card.ceiling.max_sequences, card.ceiling.max_tokens,
                            ceil.max_sequences, ceil.max_tokens)
                card.ceiling = ceil
            card.last_pull = self._clock()
        if report is not None:
            self._take_report(key, card, CardReport.model_validate(report))
        return self._effective(card)

    def _take_report(self, key: CardKey, card: _Card, report: CardReport) -> None:
        card.model = report.model or card.model
        retries, ooms, engine_ooms = report.rise_since(card.report)
        card.report = report
        if retries or ooms or engine_ooms:
            card.state = hard_cut(self.params_for(card.model), card.ceiling, card.state,
                                  retries=retries, ooms=ooms, engine_ooms=engine_ooms,
                                  now=self._clock())
            self._log_change(key, card.state)
            self._save(key, card.state)
            self._publish_card(key, card)

    async def snapshot(self) -> dict[str, Any]:
        """Governor state for ``embedfleet status``: settings, Prometheus health, every card."""
        self._ensure_started()
        cards = []
        for (node, device), card in sorted(self._cards.items()):
            params = self.params_for(card.model)
            profile = self.profiles.get(card.model) if card.model else None
            cards.append({"node": node, "device": device, "model": card.model,
                          "high": params.high, "low": params.low,
                          "profile": None if profile is None else profile[1],
                          "ceiling": card.ceiling.model_dump(),
                          **self._effective(card).model_dump(),
                          "sample_ts": card.state.sample_ts, "last_pull_at": card.last_pull})
        return {
            "prometheus_url": self.settings.prometheus_url,
            "query_preset": self.settings.query_preset,
            "interval_s": self.settings.interval_s,
            "prometheus_ok": self._prometheus_error is None,
            "prometheus_error": self._prometheus_error,
            "stale": self._prometheus_error is not None or any(c["stale"] for c in cards),
            "ticks": self._ticks,
            "tick_errors": self._tick_errors,
            "last_tick_at": self._last_tick_at,
            "running": self._task is not None and not self._task.done(),
            "cards": cards,
        }

    async def check_health(self) -> None:
        """Serve's health check: the replica is unhealthy if its control loop has died."""
        if self._autostart and self._task is not None and self._task.done():
            raise RuntimeError("memory governor control loop is not running")

    def __del__(self) -> None:
        task = getattr(self, "_task", None)
        if task is not None and not task.done():
            task.cancel()
