"""The memory governor's control law, as pure code (no Ray, no HTTP, no clock).

Why a separate module: the law is the part that must be right at its boundaries (exactly 0.90,
exactly 0.80, the cooldown edge, stale data), and it is only testable exhaustively when it is a
function of its inputs. The MemoryGovernor deployment feeds it one reading per card per control
interval and publishes the result; replicas enforce it as their admission budget.

The law, per card (node, device):

* ratio ≥ ``high`` → multiply both budgets by ``decrease_factor`` (down to the floor), at most
  once per ``cooldown_s``: memory falls only after in-flight work drains and the next scrape
  lands, so a second cut before that would react to the same pressure twice and overshoot.
* ratio ≤ ``low`` → add one step to both budgets (up to the ceiling from the config). Additive
  increase / multiplicative decrease: back off fast, probe back slowly.
* in between → hold (the dead band stops oscillation around one threshold).
* no series, NaN, negative/infinite ratio, or a sample older than ``stale_after_s`` → hold the
  last limits and mark them stale; the reason says which. Serving goes on with the last budget.
* hard triggers (``hard_cut``): a rise in the allocator's ``num_alloc_retries`` or ``num_ooms``,
  or an engine that ran out of memory in a step, cuts at once, whatever the ratio says, stale or
  not, cooldown or not: the card *was* full, which no ratio can contradict. The replica reports
  its counters with each limit pull (``CardReport``), so a cut needs neither Prometheus nor the
  next scrape.

The ratio is memory outside the KV pool (``card_memory``): a full pool alone is not pressure.
Where to cut and where to grow back depends on the card, the engine and the model, so a card
profile (``card_profile``, written by ``embedfleet calibrate``) sets the band when the governor
has one for the model (``params_for_profile``): ``high`` where only the profile's safety margin
is left, ``low`` at the planned operating point (the worst step the config allows), so a card
running its plan is never cut and a card past it is.

Floor and step are fractions of each card's ceiling, because one governor serves every model and
ceilings differ by orders of magnitude (a 32K-token Qwen3-8B card vs a MiniLM card); a fraction
≤ 1 also makes "floor ≤ ceiling" true by construction for every model.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

from ..engine.card_memory import AllocatorCounters
from ..engine.card_profile import CardProfile
from ..config.governor import GovernorParams  # one definition

Action = Literal["start", "decrease", "increase", "hold", "stale"]


class Budget(Protocol):
    """Anything with the two budget numbers (``CardLimits`` or a config's ceiling)."""

    @property
    def max_sequences(self) -> int: ...

    @property
    def max_tokens(self) -> int: ...


class CardLimits(BaseModel):
    """What a replica enforces and what ``status`` / ``/v1/models`` show for one card."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_sequences: PositiveInt
    """Sequences allowed in flight on the card."""
    max_tokens: PositiveInt
    """Prompt tokens allowed in flight on the card."""
    stale: bool = False
    """True while the governor holds these limits without a usable memory reading."""
    reason: str = ""
    """Why the limits are what they are, for people reading logs and status."""


class CardState(BaseModel):
    """The governor's memory of one card between control intervals, and its last decision."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    limits: CardLimits
    action: Action
    """What the last step did; ``stale`` when it held without a usable reading."""
    changed: bool
    """True when the last step changed the budgets or the stale flag, so the caller logs once
    per change rather than once per interval."""
    ratio: float | None = None
    """The ratio the last step saw (None: no series; may be NaN)."""
    sample_ts: float | None = None
    """Timestamp (unix s) of the sample the last step acted on; repeated samples are not
    acted on twice."""
    last_decrease_ts: float | None = None
    """When the last cut happened (unix s), for the cooldown."""

    @property
    def reason(self) -> str:
        return self.limits.reason

    @property
    def stale(self) -> bool:
        return self.limits.stale

    @classmethod
    def initial(cls, ceiling: Budget) -> CardState:
        """A card the governor has not read yet runs at its configured ceiling."""
        return cls(
            limits=CardLimits(max_sequences=ceiling.max_sequences, max_tokens=ceiling.max_tokens,
                              reason="start: ceiling from the config, no reading yet"),
            action="start", changed=False)


def floor_of(params: GovernorParams, ceiling: Budget) -> tuple[int, int]:
    """Lowest (sequences, tokens) the law will set for a card with this ceiling."""
    return (max(1, math.ceil(ceiling.max_sequences * params.floor_fraction)),
            max(1, math.ceil(ceiling.max_tokens * params.floor_fraction)))


def step_of(params: GovernorParams, ceiling: Budget) -> tuple[int, int]:
    """Additive increase (sequences, tokens) per interval for a card with this ceiling."""
    return (max(1, round(ceiling.max_sequences * params.step_fraction)),
            max(1, round(ceiling.max_tokens * params.step_fraction)))


def _fmt(x: float) -> str:
    # %g keeps 0.8999 distinct from 0.9 (fixed decimals would round across the boundary).
    return f"{x:g}"


def _budget(seq: int, tok: int) -> str:
    return f"{seq} seq / {tok} tok"


def _decide(previous: CardState, *, seq: int, tok: int, stale: bool, reason: str,
            action: Action, ratio: float | None, sample_ts: float | None,
            last_decrease_ts: float | None) -> CardState:
    old = previous.limits
    changed = (seq, tok, stale) != (old.max_sequences, old.max_tokens, old.stale)
    return CardState(
        limits=CardLimits(max_sequences=seq, max_tokens=tok, stale=stale, reason=reason),
        action=action, changed=changed, ratio=ratio, sample_ts=sample_ts,
        last_decrease_ts=last_decrease_ts)


def _clamped(params: GovernorParams, ceiling: Budget, previous: CardState) -> tuple[int, int]:
    # The ceiling can change under the governor (a redeploy with a smaller config), so the held
    # limits are re-clamped on every step, stale or not: the config always wins.
    f_seq, f_tok = floor_of(params, ceiling)
    seq = min(max(previous.limits.max_sequences, f_seq), ceiling.max_sequences)
    tok = min(max(previous.limits.max_tokens, f_tok), ceiling.max_tokens)
    return seq, tok


def hold_stale(params: GovernorParams, ceiling: Budget, previous: CardState, why: str,
               *, ratio: float | None = None) -> CardState:
    """Keep the last limits, marked stale, because ``why`` (e.g. "Prometheus unreachable: …").

    The governor calls this directly for every card when the query itself fails; ``step`` calls
    it for a missing, invalid or old sample.
    """
    seq, tok = _clamped(params, ceiling, previous)
    return _decide(previous, seq=seq, tok=tok, stale=True,
                   reason=f"stale: {why}; holding {_budget(seq, tok)}",
                   action="stale", ratio=ratio, sample_ts=previous.sample_ts,
                   last_decrease_ts=previous.last_decrease_ts)


def step(params: GovernorParams, ceiling: Budget, previous: CardState, ratio: float | None,
         sample_ts: float | None, now: float) -> CardState:
    """One control interval for one card.

    ``ratio`` is used/total card memory from Prometheus (None when the card has no series);
    ``sample_ts`` is the sample's own timestamp (None: unknown, taken as fresh); ``now`` is the
    governor's clock in the same unix seconds. Returns the new state; ``changed`` says whether
    to log.
    """
    # Missing or unusable readings: hold, and say precisely which case it is.
    if ratio is None:
        return hold_stale(params, ceiling, previous, "no memory series for this card in Prometheus")
    if not math.isfinite(ratio) or ratio < 0.0:
        return hold_stale(params, ceiling, previous, f"memory ratio is {ratio!r}, not a number "
                          "in [0, ∞)", ratio=ratio)
    if sample_ts is not None and now - sample_ts > params.stale_after_s:
        return hold_stale(params, ceiling, previous,
                          f"last sample is {now - sample_ts:.0f} s old "
                          f"(> stale_after {_fmt(params.stale_after_s)} s)", ratio=ratio)

    seq, tok = _clamped(params, ceiling, previous)
    f_seq, f_tok = floor_of(params, ceiling)
    seen = f"memory {_fmt(ratio)}"
    common = dict(ratio=ratio, sample_ts=sample_ts, last_decrease_ts=previous.last_decrease_ts)

    # The governor may run faster than the scrape: a sample already acted on must not cut or
    # grow the budget a second time.
    if sample_ts is not None and sample_ts == previous.sample_ts:
        return _decide(previous, seq=seq, tok=tok, stale=False, action="hold",
                       reason=f"{seen}: no new sample since the last decision; "
                              f"holding {_budget(seq, tok)}", **common)

    if ratio >= params.high:
        head = f"{seen} ≥ high {_fmt(params.high)}"
        if (seq, tok) == (f_seq, f_tok):
            return _decide(previous, seq=seq, tok=tok, stale=False, action="hold",
                           reason=f"{head}, already at floor {_budget(seq, tok)}", **common)
        last = previous.last_decrease_ts
        if last is not None and now - last < params.cooldown_s:
            left = params.cooldown_s - (now - last)
            return _decide(previous, seq=seq, tok=tok, stale=False, action="hold",
                           reason=f"{head}, but last cut was {now - last:.0f} s ago "
                                  f"(cooldown {_fmt(params.cooldown_s)} s, {left:.0f} s left); "
                                  f"holding {_budget(seq, tok)}", **common)
        # floor() makes every cut strictly smaller (seq ≥ 1, factor < 1), then clamp to the floor.
        new_seq = max(f_seq, math.floor(seq * params.decrease_factor))
        new_tok = max(f_tok, math.floor(tok * params.decrease_factor))
        common["last_decrease_ts"] = now
        return _decide(previous, seq=new_seq, tok=new_tok, stale=False, action="decrease",
                       reason=f"{head}: cut ×{_fmt(params.decrease_factor)} "
                              f"{_budget(seq, tok)} → {_budget(new_seq, new_tok)}", **common)

    if ratio <= params.low:
        head = f"{seen} ≤ low {_fmt(params.low)}"
        if (seq, tok) == (ceiling.max_sequences, ceiling.max_tokens):
            return _decide(previous, seq=seq, tok=tok, stale=False, action="hold",
                           reason=f"{head}, at ceiling {_budget(seq, tok)}", **common)
        s_seq, s_tok = step_of(params, ceiling)
        new_seq = min(ceiling.max_sequences, seq + s_seq)
        new_tok = min(ceiling.max_tokens, tok + s_tok)
        return _decide(previous, seq=new_seq, tok=new_tok, stale=False, action="increase",
                       reason=f"{head}: raise {_budget(seq, tok)} → {_budget(new_seq, new_tok)}"
                              f" (ceiling {ceiling.max_sequences} / {ceiling.max_tokens})",
                       **common)

    return _decide(previous, seq=seq, tok=tok, stale=False, action="hold",
                   reason=f"{seen} between low {_fmt(params.low)} and high {_fmt(params.high)}: "
                          f"holding {_budget(seq, tok)}", **common)


# -- hard triggers -----------------------------------------------------------------------------
class CardReport(BaseModel):
    """What a replica sends with each limit pull: its model (whose profile sets the band) and
    its engine's failure counters (cumulative, so a lost pull loses nothing)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = None
    allocator: AllocatorCounters = AllocatorCounters()
    """The engine's allocator counters (they start again with a new engine)."""
    engine_ooms: int = Field(0, ge=0)
    """Engine calls that failed in a step on this replica since it started (the replica's own
    count: the engine that failed is gone)."""

    def rise_since(self, before: CardReport | None) -> tuple[int, int, int]:
        """(allocator retries, allocator OOMs, engine OOMs) added since ``before``."""
        retries, ooms = self.allocator.rise_since(before.allocator if before else None)
        engine = 0 if before is None else max(0, self.engine_ooms - before.engine_ooms)
        return retries, ooms, engine


def hard_cut(params: GovernorParams, ceiling: Budget, previous: CardState, *, retries: int,
             ooms: int, engine_ooms: int, now: float) -> CardState:
    """Cut at once for allocator retries/OOMs or an engine OOM (no cooldown, no ratio)."""
    seq, tok = _clamped(params, ceiling, previous)
    f_seq, f_tok = floor_of(params, ceiling)
    what = ", ".join(f"{n} {name}" for n, name in ((retries, "allocator retries"),
                                                    (ooms, "allocator OOMs"),
                                                    (engine_ooms, "engine OOMs in a step"))
                     if n)
    seen = "memory (no reading)" if previous.ratio is None else f"memory {_fmt(previous.ratio)}"
    head = f"{seen}: {what} since the last pull"
    if previous.stale:  # still blind: say so beside the cut
        head += f" (ratio {previous.reason})"
    common = dict(ratio=previous.ratio, sample_ts=previous.sample_ts)
    if (seq, tok) == (f_seq, f_tok):
        return _decide(previous, seq=seq, tok=tok, stale=previous.stale, action="hold",
                       reason=f"{head}, already at floor {_budget(seq, tok)}",
                       last_decrease_ts=previous.last_decrease_ts, **common)
    new_seq = max(f_seq, math.floor(seq * params.decrease_factor))
    new_tok = max(f_tok, math.floor(tok * params.decrease_factor))
    return _decide(previous, seq=new_seq, tok=new_tok, stale=previous.stale, action="decrease",
                   reason=f"{head}: cut ×{_fmt(params.decrease_factor)} "
                          f"{_budget(seq, tok)} → {_budget(new_seq, new_tok)}",
                   last_decrease_ts=now, **common)


# -- the band from a card profile --------------------------------------------------------------
MIN_BAND = 0.02
"""The narrowest dead band a profile may leave: wider than one reading's noise (a step's size
moves the ratio by more than this only when the band would not hold anyway)."""


def params_for_profile(params: GovernorParams, profile: CardProfile | None) -> GovernorParams:
    """The law's band for a card of this profile: cut where only the safety margin is left,
    grow back at or below the planned operating point. Without a profile, ``params``."""
    if profile is None:
        return params
    high = min(1.0, profile.safe_ratio)
    low = max(0.0, min(profile.operating_point_ratio, high - MIN_BAND))
    return params.model_copy(update={"high": high, "low": low})
