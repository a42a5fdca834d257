"""The memory governor's settings: where it reads card memory, how often, its law's parameters.

Kept apart from the governor itself so the config schema (``config.schema``) can hold them
without importing the fleet's governor (which parses that schema). ``GovernorParams`` is here
for the same reason: the law in ``fleet.governor_law`` reads them, the schema holds them.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, model_validator

from ...monitoring import thresholds

from .memory_queries import (PRESETS, CardMemoryQuery, PresetName,
                              dcgm_query, npu_exporter_query)


class GovernorParams(BaseModel):
    """Thresholds and rates of the control law. One set for the whole cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    # The band's defaults come from embedfleet.monitoring.thresholds, where the card-memory alert gets its
    # threshold too: the governor and the alert must not disagree about what "too full" is.
    high: float = Field(thresholds.CARD_MEMORY_HIGH, gt=0.0, le=1.0)
    """Card memory ratio at or above which budgets are cut (why this value: ``thresholds``)."""

    low: float = Field(thresholds.CARD_MEMORY_LOW, ge=0.0, lt=1.0)
    """Card memory ratio at or below which budgets grow again. The gap to ``high`` is the dead
    band that keeps the governor from oscillating."""

    decrease_factor: float = Field(0.5, gt=0.0, lt=1.0)
    """Budgets are multiplied by this on each cut; halving is the classic AIMD choice."""

    step_fraction: float = Field(0.125, gt=0.0, le=1.0)
    """Additive increase per control interval, as a fraction of the card's ceiling
    (0.125: eight calm intervals from near zero back to the ceiling)."""

    floor_fraction: float = Field(0.0625, gt=0.0, le=1.0)
    """Budgets never go below this fraction of the ceiling (at least 1 sequence and 1 token).
    0.0625 is four halvings: enough to relieve pressure, never a full stop. An input larger than
    the whole budget still runs alone in the replica, so a small token floor cannot starve it."""

    cooldown_s: float = Field(30.0, ge=0.0)
    """Minimum seconds between two cuts on one card: long enough for in-flight batches to drain
    and for Prometheus to scrape the lower memory (scrape interval + engine step)."""

    stale_after_s: float = Field(thresholds.GOVERNOR_STALE_AFTER_S, gt=0.0)
    """A sample older than this is not acted upon (why this value: ``thresholds``)."""

    @model_validator(mode="after")
    def _check_band(self) -> GovernorParams:
        if not self.low < self.high:
            raise ValueError(
                f"low ({self.low}) must be below high ({self.high}): the band between them is "
                "where the governor holds")
        return self


class GovernorConfig(BaseModel):
    """Where the governor reads card memory, how often, and its control law's parameters."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prometheus_url: str = "http://127.0.0.1:9090"
    """Prometheus' base URL (the HTTP API is under ``/api/v1``)."""
    query_preset: PresetName = "embedfleet"
    """Which card memory query to run (``embedfleet.deployments.config.memory_queries.PRESETS``)."""
    node_label: str | None = None
    """For the exporter presets: the exporter label that names the node (``instance`` = the
    scrape target's host). None: the preset's default. See the module docstring."""
    node_aliases: dict[str, str] = Field(default_factory=dict)
    """Prometheus ``node`` value → the node IP replicas report, for exporters that name nodes
    differently (DCGM's hostnames)."""
    interval_s: PositiveFloat = 5.0
    """Seconds between control steps; replicas pull limits at the same pace."""
    query_timeout_s: PositiveFloat = 3.0
    """Bound on one Prometheus query (capped at ``interval_s``): a hung Prometheus must not
    stretch the control interval."""
    peak_window_s: PositiveFloat = 15.0
    """Replicas export the highest card reading of this many seconds (``LimitsFollower``): Ray's
    metrics agent reports every ~10 s, so a one-interval spike must outlive a report to be seen."""
    forget_after_s: PositiveFloat = 60.0
    """A card whose replica has not pulled limits for this long is dropped: its memory series
    disappears with the replica, and keeping it would report "stale" forever."""
    params: GovernorParams = GovernorParams()
    card_profiles: dict[str, str] = Field(
        default_factory=dict,
        description="Model name -> its card profile (deployments/engine/card_profile.py): a "
        "file path, or the name of a profile shipped in deployments/configs/profiles. A model "
        "not named here uses the profile `embedfleet calibrate` wrote for it under the state "
        "directory, if any. A model's profile sets its cards' band: cut where only the "
        "profile's safety margin is left, grow back at its planned operating point, because "
        "where a card's ratio sits at its plan depends on the card, engine and model; without "
        "one, params.high and params.low apply.")

    @model_validator(mode="after")
    def _check(self) -> GovernorConfig:
        if self.query_preset == "embedfleet" and (self.node_label is not None
                                                  or self.node_aliases):
            raise ValueError(f"node_label={self.node_label!r} / node_aliases="
                             f"{self.node_aliases!r} only apply to exporter presets; the "
                             "embedfleet preset's series already carry the replicas' node names")
        if self.params.cooldown_s < self.peak_window_s:
            raise ValueError(f"params.cooldown_s ({self.params.cooldown_s}) must be at least "
                             f"peak_window_s ({self.peak_window_s}): replicas report the peak of "
                             "that window, so a shorter cooldown cuts again for the spike the "
                             "last cut already answered")
        if self.forget_after_s < 3 * self.interval_s:
            raise ValueError(f"forget_after_s ({self.forget_after_s}) must be at least 3 x "
                             f"interval_s ({self.interval_s}): replicas pull once per interval, "
                             "and a couple of missed pulls must not drop a live card")
        return self

    def card_query(self) -> CardMemoryQuery:
        if self.node_label is None and not self.node_aliases:
            return PRESETS[self.query_preset]
        if self.query_preset == "npu-exporter":
            return npu_exporter_query(node_label=self.node_label or "node",
                                      aliases=self.node_aliases)
        return dcgm_query(node_label=self.node_label or "Hostname", aliases=self.node_aliases)
