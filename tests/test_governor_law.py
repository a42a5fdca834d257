"""The governor's control law against canned series: boundaries, cooldown, floor/ceiling, staleness;
and the signal's law: a full KV pool alone never cuts, an allocator-retry delta always cuts, a card
profile sets the band.

Pure: no Ray, no Prometheus, no clock. Every number below follows from the default parameters and
a 64-sequence / 65536-token ceiling: floor = 1/16 → 4 / 4096, step = 1/8 → 8 / 8192.
"""

from __future__ import annotations

import math

import pytest
from pydantic import ValidationError

from hypothesis import given, settings, strategies as st

from embedfleet.deployments.fleet.governor_law import (MIN_BAND, CardLimits, CardReport,
                                                          CardState, GovernorParams, floor_of,
                                                          hard_cut, hold_stale,
                                                          params_for_profile, step, step_of)
from embedfleet.deployments.engine.card_memory import AllocatorCounters, CardMemoryReading
from embedfleet.deployments.engine.card_profile import (CardProfile, load_profile,
                                                        shipped_profile_path)
from embedfleet.monitoring import thresholds

P = GovernorParams()
CEIL = CardLimits(max_sequences=64, max_tokens=65536)
T0 = 1_000_000.0  # an arbitrary "now" in unix seconds


def at(seq: int, tok: int, **kw) -> CardState:
    """A card currently held at seq/tok (fresh, no cut yet unless given)."""
    return CardState(limits=CardLimits(max_sequences=seq, max_tokens=tok), action="hold",
                     changed=False, **kw)


def run(series, state: CardState | None = None, params: GovernorParams = P,
        ceiling=CEIL) -> list[CardState]:
    """Feed (now, ratio) or (now, ratio, sample_ts) readings; sample_ts defaults to now."""
    state = state or CardState.initial(ceiling)
    out = []
    for reading in series:
        now, ratio, *rest = reading
        sample_ts = rest[0] if rest else now
        state = step(params, ceiling, state, ratio, sample_ts, now)
        out.append(state)
    return out


def budgets(states) -> list[tuple[int, int]]:
    return [(s.limits.max_sequences, s.limits.max_tokens) for s in states]


# --- parameters -------------------------------------------------------------------------------

def test_defaults_match_the_alert_thresholds():
    assert (P.high, P.low, P.decrease_factor, P.cooldown_s) == (0.90, 0.80, 0.5, 30.0)
    assert (P.high, P.low) == (thresholds.CARD_MEMORY_HIGH, thresholds.CARD_MEMORY_LOW)
    assert P.stale_after_s == thresholds.GOVERNOR_STALE_AFTER_S
    assert floor_of(P, CEIL) == (4, 4096) and step_of(P, CEIL) == (8, 8192)


@pytest.mark.parametrize("kwargs, needle", [
    ({"low": 0.9, "high": 0.9}, "low (0.9) must be below high (0.9)"),
    ({"low": 0.95}, "low (0.95) must be below high (0.9)"),
    ({"high": 1.01}, "less than or equal to 1"),
    ({"decrease_factor": 1.0}, "less than 1"),
    ({"decrease_factor": 0.0}, "greater than 0"),
    ({"step_fraction": 0.0}, "greater than 0"),
    ({"floor_fraction": 1.5}, "less than or equal to 1"),
    ({"cooldown_s": -1}, "greater than or equal to 0"),
    ({"stale_after_s": 0}, "greater than 0"),
    ({"hgih": 0.9}, "Extra inputs are not permitted"),
])
def test_invalid_params_are_refused_with_the_values(kwargs, needle):
    with pytest.raises(ValidationError) as err:
        GovernorParams(**kwargs)
    assert needle in str(err.value)


def test_params_are_immutable():
    with pytest.raises(ValidationError):
        P.high = 0.5  # type: ignore[misc]


# --- thresholds, exactly at and either side -------------------------------------------------

@pytest.mark.parametrize("ratio, action, expected", [
    (0.90, "decrease", (32, 32768)),           # exactly high: cut
    (math.nextafter(0.90, 0), "hold", (64, 65536)),  # the largest float below high: hold
    (0.8999, "hold", (64, 65536)),
    (0.9001, "decrease", (32, 32768)),
    (1.05, "decrease", (32, 32768)),           # used > total (overcommit) is pressure too
])
def test_high_boundary(ratio, action, expected):
    (s,) = run([(T0, ratio)])
    assert (s.action, budgets([s])[0]) == (action, expected)
    assert s.changed is (action == "decrease")
    assert not s.stale


@pytest.mark.parametrize("ratio, action, expected", [
    (0.80, "increase", (28, 28672)),           # exactly low: grow
    (math.nextafter(0.80, 1), "hold", (20, 20480)),  # the smallest float above low: hold
    (0.8001, "hold", (20, 20480)),
    (0.7999, "increase", (28, 28672)),
    (0.0, "increase", (28, 28672)),
])
def test_low_boundary(ratio, action, expected):
    (s,) = run([(T0, ratio)], state=at(20, 20480))
    assert (s.action, budgets([s])[0]) == (action, expected)
    assert s.changed is (action == "increase")


def test_dead_band_holds_and_says_so():
    (s,) = run([(T0, 0.85)], state=at(20, 20480))
    assert (s.action, s.changed, budgets([s])) == ("hold", False, [(20, 20480)])
    assert s.reason == "memory 0.85 between low 0.8 and high 0.9: holding 20 seq / 20480 tok"


# --- cooldown, floor, ceiling -----------------------------------------------------------------

def test_cooldown_blocks_a_second_cut_until_it_has_passed():
    states = run([(T0, 0.95), (T0 + 10, 0.95), (T0 + 29.9, 0.97), (T0 + 30, 0.95),
                  (T0 + 31, 0.95)])
    assert [s.action for s in states] == ["decrease", "hold", "hold", "decrease", "hold"]
    assert budgets(states) == [(32, 32768), (32, 32768), (32, 32768), (16, 16384), (16, 16384)]
    assert [s.changed for s in states] == [True, False, False, True, False]
    assert states[1].reason == ("memory 0.95 ≥ high 0.9, but last cut was 10 s ago "
                                "(cooldown 30 s, 20 s left); holding 32 seq / 32768 tok")
    assert states[3].last_decrease_ts == T0 + 30


def test_cooldown_does_not_delay_growth():
    states = run([(T0, 0.95), (T0 + 1, 0.5)])
    assert [s.action for s in states] == ["decrease", "increase"]
    assert budgets(states) == [(32, 32768), (40, 40960)]


def test_cuts_stop_at_the_floor():
    states = run([(T0 + 30 * i, 0.99) for i in range(6)])
    assert budgets(states) == [(32, 32768), (16, 16384), (8, 8192), (4, 4096), (4, 4096),
                               (4, 4096)]
    assert [s.changed for s in states] == [True, True, True, True, False, False]
    assert states[-1].action == "hold"
    assert states[-1].reason == "memory 0.99 ≥ high 0.9, already at floor 4 seq / 4096 tok"


def test_floor_is_at_least_one_and_cuts_always_shrink():
    tiny = CardLimits(max_sequences=3, max_tokens=10)
    states = run([(T0, 0.95), (T0 + 30, 0.95)], ceiling=tiny)
    assert floor_of(P, tiny) == (1, 1)
    assert budgets(states) == [(1, 5), (1, 2)]


def test_recovery_climbs_step_by_step_from_floor_to_ceiling():
    states = run([(T0 + i, 0.70) for i in range(10)], state=at(4, 4096))
    assert [s for s, _ in budgets(states)] == [12, 20, 28, 36, 44, 52, 60, 64, 64, 64]
    assert [t for _, t in budgets(states)] == [12288, 20480, 28672, 36864, 45056, 53248, 61440,
                                               65536, 65536, 65536]
    assert [s.action for s in states] == ["increase"] * 8 + ["hold"] * 2
    assert [s.changed for s in states] == [True] * 8 + [False] * 2
    assert states[0].reason == ("memory 0.7 ≤ low 0.8: raise 4 seq / 4096 tok → "
                                "12 seq / 12288 tok (ceiling 64 / 65536)")
    assert states[-1].reason == "memory 0.7 ≤ low 0.8, at ceiling 64 seq / 65536 tok"


def test_a_lowered_ceiling_clamps_held_limits_at_once():
    smaller = CardLimits(max_sequences=16, max_tokens=8192)
    (s,) = run([(T0, 0.85)], state=at(64, 65536), ceiling=smaller)
    assert budgets([s]) == [(16, 8192)] and s.changed and s.action == "hold"
    (s,) = run([(T0, None)], state=at(64, 65536), ceiling=smaller)  # even while stale
    assert budgets([s]) == [(16, 8192)] and s.stale


# --- stale, missing, NaN --------------------------------------------------------------------

def test_missing_series_holds_last_limits_marked_stale():
    states = run([(T0, None), (T0 + 5, None)], state=at(16, 16384))
    assert budgets(states) == [(16, 16384)] * 2
    assert all(s.stale and s.action == "stale" for s in states)
    assert [s.changed for s in states] == [True, False]  # logged once, not every interval
    assert states[0].reason == ("stale: no memory series for this card in Prometheus; "
                                "holding 16 seq / 16384 tok")


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.1])
def test_unusable_ratio_holds_marked_stale(bad):
    (s,) = run([(T0, bad)], state=at(16, 16384))
    assert (s.stale, s.action, budgets([s])) == (True, "stale", [(16, 16384)])
    assert s.reason.startswith(f"stale: memory ratio is {bad!r}")


def test_old_sample_is_stale_even_when_it_says_memory_is_high():
    old = T0 - 61
    states = run([(T0, 0.99, old), (T0, 0.99, T0 - 60)], state=at(16, 16384))
    assert states[0].stale and budgets(states[:1]) == [(16, 16384)]
    assert states[0].reason == ("stale: last sample is 61 s old (> stale_after 60 s); "
                                "holding 16 seq / 16384 tok")
    # exactly stale_after old is still fresh, and acts
    assert (states[1].stale, states[1].action, states[1].changed) == (False, "decrease", True)


def test_back_from_stale_is_a_change_and_the_cooldown_survives_the_outage():
    states = run([(T0, 0.95), (T0 + 5, None), (T0 + 10, 0.95), (T0 + 30, 0.95)])
    assert [s.action for s in states] == ["decrease", "stale", "hold", "decrease"]
    assert [s.stale for s in states] == [False, True, False, False]
    assert [s.changed for s in states] == [True, True, True, True]
    assert "cooldown" in states[2].reason


def test_prometheus_unreachable_holds_with_the_callers_reason():
    s = hold_stale(P, CEIL, at(32, 32768), "Prometheus unreachable: connection refused")
    assert (s.stale, s.changed, budgets([s])) == (True, True, [(32, 32768)])
    assert s.reason == ("stale: Prometheus unreachable: connection refused; "
                        "holding 32 seq / 32768 tok")


# --- repeated samples, unknown sample times, the start --------------------------------------

def test_one_sample_is_acted_on_once():
    # The governor polls faster than the exporter updates: the same sample twice must not grow
    # (or cut) twice.
    states = run([(T0, 0.5, T0), (T0 + 1, 0.5, T0), (T0 + 2, 0.5, T0 + 2)], state=at(4, 4096))
    assert budgets(states) == [(12, 12288), (12, 12288), (20, 20480)]
    assert states[1].action == "hold" and "no new sample" in states[1].reason


def test_unknown_sample_time_counts_as_fresh():
    (s,) = run([(T0, 0.95, None)])
    assert s.action == "decrease" and not s.stale


def test_initial_state_is_the_ceiling():
    s = CardState.initial(CEIL)
    assert budgets([s]) == [(64, 65536)] and not s.stale and s.action == "start"
    assert "ceiling" in s.reason


def test_a_whole_canned_series():
    """Pressure, cooldown, dead band, an outage, relief, recovery — one card, 5 s interval."""
    ratios = [0.75, 0.91, 0.93, 0.92, 0.92, 0.92, 0.92, 0.90, 0.86, None, None, 0.79, 0.60,
              0.60, 0.85, 0.60]
    states = run([(T0 + 5 * i, r) for i, r in enumerate(ratios)])
    assert [s.action[0] for s in states] == list("hdhhhhhdhssiiihi")
    assert [s for s, _ in budgets(states)] == [64, 32, 32, 32, 32, 32, 32, 16, 16, 16, 16, 24,
                                               32, 40, 40, 48]
    assert [s.changed for s in states] == [False, True, False, False, False, False, False, True,
                                           False, True, False, True, True, True, False, True]


# --- the signal's law: a full pool is not pressure; the allocator's failures always cut -------

GiB = 1 << 30
PROFILE = load_profile(shipped_profile_path("ascend-910b-qwen3-embedding-8b"))


def states_of(ceiling=CEIL):
    """Any state the law can hold a card in: budgets between floor and ceiling, with or without
    a recent cut, stale or not, with any last ratio."""
    f_seq, f_tok = floor_of(P, ceiling)
    return st.builds(
        lambda seq, tok, cut_ago, stale, ratio: CardState(
            limits=CardLimits(max_sequences=seq, max_tokens=tok, stale=stale),
            action="stale" if stale else "hold", changed=False, ratio=ratio, sample_ts=T0 - 10,
            last_decrease_ts=None if cut_ago is None else T0 - cut_ago),
        st.integers(f_seq, ceiling.max_sequences), st.integers(f_tok, ceiling.max_tokens),
        st.none() | st.floats(0, 100), st.booleans(),
        st.none() | st.floats(allow_nan=True, allow_infinity=True))


@settings(max_examples=300, deadline=None)
@given(total=st.integers(8 * GiB, 96 * GiB), pool_share=st.floats(0.0, 0.9),
       outside_share=st.floats(0.0, 1.0), cache=st.integers(0, 8 * GiB),
       fills=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=5), previous=states_of())
def test_a_full_pool_alone_never_cuts(total, pool_share, outside_share, cache, fills, previous):
    """Whatever the KV pool's fill, the ratio is that of the memory outside it; a card below
    `high` outside its pool is never cut, however full its pool."""
    pool = int(total * pool_share)
    outside = int((total - pool) * outside_share * P.high * 0.999)  # below high outside the pool
    used = outside + pool + cache
    readings = [CardMemoryReading(used_bytes=used, total_bytes=total, kv_pool_bytes=pool,
                                  kv_peak_usage=fill, cache_free_bytes=cache)
                for fill in [1.0, *fills]]
    ratios = {r.ratio for r in readings}
    assert len(ratios) == 1 and ratios.pop() < P.high
    for r in readings:
        new = step(P, CEIL, previous, r.ratio, T0, T0)
        assert new.action != "decrease", new.reason


def test_a_full_pool_at_the_profiles_operating_point_keeps_the_ceiling():
    # The shipped 910B profile: a worst step (2 x 32K) with the pool full reads the planned
    # operating point, above the configured 0.90 but inside the profile's band.
    band = params_for_profile(P, PROFILE)
    outside = PROFILE.worst_step_peak_bytes
    r = CardMemoryReading(used_bytes=outside + PROFILE.kv_pool_bytes,
                          total_bytes=PROFILE.card_total_bytes,
                          kv_pool_bytes=PROFILE.kv_pool_bytes, kv_peak_usage=1.0)
    assert r.ratio == pytest.approx(PROFILE.operating_point_ratio) and r.ratio >= P.high
    states = run([(T0 + 5 * i, r.ratio) for i in range(20)], params=band)
    assert {s.action for s in states} <= {"hold"} and budgets(states)[-1] == (64, 65536)
    # The same card read against the configured band alone would have been cut.
    assert "decrease" in {s.action for s in run([(T0, r.ratio)])}


@settings(max_examples=300, deadline=None)
@given(previous=states_of(), retries=st.integers(1, 5), ooms=st.integers(0, 2),
       engine_ooms=st.integers(0, 2), before=st.integers(0, 1000))
def test_an_allocator_retry_delta_always_cuts(previous, retries, ooms, engine_ooms, before):
    """A rise in num_alloc_retries cuts at once, whatever the ratio (low, NaN, none), stale or
    not, within the cooldown or not; only the floor stops it."""
    was = CardReport(allocator=AllocatorCounters(num_alloc_retries=before, num_ooms=0))
    now = CardReport(allocator=AllocatorCounters(num_alloc_retries=before + retries,
                                                 num_ooms=ooms), engine_ooms=engine_ooms)
    r, o, e = now.rise_since(was)
    assert (r, o, e) == (retries, ooms, engine_ooms)
    new = hard_cut(P, CEIL, previous, retries=r, ooms=o, engine_ooms=e, now=T0)
    old = (previous.limits.max_sequences, previous.limits.max_tokens)
    got = (new.limits.max_sequences, new.limits.max_tokens)
    if old == floor_of(P, CEIL):
        assert got == old and "already at floor" in new.reason
    else:
        assert got < old or got[1] < old[1]
        assert got[0] <= old[0] and got[1] <= old[1] and new.action == "decrease"
        assert got[0] >= floor_of(P, CEIL)[0] and got[1] >= floor_of(P, CEIL)[1]
        assert new.last_decrease_ts == T0
    assert f"{retries} allocator retries" in new.reason


def test_no_rise_no_cut_and_the_first_report_is_a_baseline():
    a = CardReport(allocator=AllocatorCounters(num_alloc_retries=7, num_ooms=2), engine_ooms=1)
    assert a.rise_since(None) == (0, 0, 0)
    assert a.rise_since(a) == (0, 0, 0)
    # engine OOMs are the replica's own count: a lower value never reads as a rise
    assert a.rise_since(a.model_copy(update={"engine_ooms": 3})) == (0, 0, 0)


def test_a_profile_sets_the_band():
    band = params_for_profile(P, PROFILE)
    assert band.high == pytest.approx(PROFILE.safe_ratio)
    assert band.low == pytest.approx(PROFILE.operating_point_ratio)
    assert (band.decrease_factor, band.cooldown_s) == (P.decrease_factor, P.cooldown_s)
    assert params_for_profile(P, None) is P
    # A worst step that does not leave the margin: the plan itself is past the cut, and the
    # band keeps its minimum width below it.
    tight = CardProfile.model_validate({**PROFILE.model_dump(),
                                        "safety_margin_bytes": PROFILE.headroom_bytes * 2})
    assert not tight.fits
    b = params_for_profile(P, tight)
    assert b.high < tight.operating_point_ratio
    assert b.low == pytest.approx(b.high - MIN_BAND)
