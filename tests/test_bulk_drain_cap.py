"""Bulk's in-flight cap in time, not only in tokens: while interactive calls come, the card's
measured drain rate times ``bulk_max_drain_s`` (replica/drain_rate.py, admission.py)."""

from __future__ import annotations

import asyncio

import pytest

from embedfleet.deployments.config.schema import ConfigError, parse_config
from embedfleet.deployments.replica.admission import INTERACTIVE_RECENT_S, AdmissionBudget
from embedfleet.deployments.replica.drain_rate import DrainRate
from tests.support.admission_clock import Clock
from tests.support.admission_clock import measure as _measure


def test_drain_rate_counts_tokens_over_busy_time_only():
    clock = Clock()
    d = DrainRate(window_s=1.0, clock=clock)
    d.tick(busy=False)            # a call starts on an idle card
    clock.t += 2.0
    d.tick(busy=True, bulk=True)
    d.finished(400)               # 400 tokens in 2 busy seconds, bulk work in flight
    assert d.tokens_per_s == pytest.approx(200)
    clock.t += 60                 # an idle minute says nothing about the card's speed
    d.tick(busy=False)
    clock.t += 1.0
    d.tick(busy=True)
    d.finished(1200)              # a faster window moves the EWMA toward 1,200/s, not past it
    assert 200 < d.tokens_per_s < 1200
    assert d.tokens_per_s == pytest.approx(0.3 * 1200 + 0.7 * 200)


def test_drain_rate_waits_for_a_whole_window():
    clock = Clock()
    d = DrainRate(window_s=1.0, clock=clock)
    d.tick(busy=False)
    clock.t += 0.4
    d.tick(busy=True)
    d.finished(1000)
    assert d.tokens_per_s is None  # 0.4 s of busy time is not a measurement yet
    clock.t += 0.6
    d.tick(busy=True)
    d.finished(0)
    assert d.tokens_per_s == pytest.approx(1000)


def test_the_cap_follows_the_peak_rate_not_the_capped_one():
    """Small runs measure a slower card; the capacity the cap is sized from keeps the peak and
    forgets it by half every PEAK_HALF_LIFE_S, and a faster window raises it at once."""
    from embedfleet.deployments.replica.drain_rate import PEAK_HALF_LIFE_S

    clock = Clock()
    d = DrainRate(window_s=1.0, clock=clock)

    def window(tokens: int) -> None:
        d.tick(busy=True, bulk=True)
        clock.t += 1.0
        d.tick(busy=True, bulk=True)
        d.finished(tokens)

    d.tick(busy=False)
    window(4000)
    assert d.capacity_tokens_per_s == pytest.approx(4000)
    for _ in range(20):           # the capped load: the EWMA sinks toward 500/s
        window(500)
    assert d.tokens_per_s < 600
    assert d.capacity_tokens_per_s == pytest.approx(4000 * 0.5 ** (20 / PEAK_HALF_LIFE_S))
    clock.t += PEAK_HALF_LIFE_S - 20
    d.tick(busy=False)            # idle meanwhile
    assert d.capacity_tokens_per_s == pytest.approx(2000)
    window(100_000)               # a faster window is a new peak at once
    assert d.capacity_tokens_per_s == pytest.approx(d.tokens_per_s) and d.tokens_per_s > 2000


def test_queries_alone_do_not_size_the_cap_and_capped_time_does_not_age_it():
    """A replica that saw only light query traffic measured ~1,000 tokens/s, which is its load,
    not its card: the first flood would start in tiny runs and stay near that fixed point. And a
    peak that aged under the cap would sink to it within hours of a flood beside queries."""
    from embedfleet.deployments.replica.drain_rate import PEAK_HALF_LIFE_S

    async def main():
        clock = Clock()
        b = AdmissionBudget(256, 16384, bulk_max_drain_s=0.25, clock=clock)
        for _ in range(3):
            async with b.admit(1, 1000):  # queries alone: 1,000 tokens a busy second
                clock.t += 1.0
        assert b.snapshot()["drain_tokens_per_s"] == pytest.approx(1000)
        assert b.bulk_token_cap == pytest.approx(0.75 * 16384)  # not 250: bulk keeps its share
        await _measure(b, clock, 8000, 1.0)  # the first window with bulk work: 8,000 tokens/s
        assert b.bulk_token_cap == pytest.approx(2000)
        for _ in range(int(2 * PEAK_HALF_LIFE_S)):  # an hour of capped flood beside queries
            async with b.admit(1, 500, lane="bulk"):  # small runs measure a slower card
                clock.t += 1.0
            await _measure(b, clock, 0, 0.0)
        assert b.bulk_token_cap == pytest.approx(2000)  # the peak did not age under the cap
        clock.t += INTERACTIVE_RECENT_S + PEAK_HALF_LIFE_S  # then no query for half an hour,
        async with b.admit(1, 1):                          # and a query ends it
            pass
        assert b.bulk_token_cap == pytest.approx(1000)  # aged by that half-hour, not its last 10 s

    asyncio.run(main())


def test_a_small_bulk_call_among_light_queries_does_not_size_the_cap():
    """Only a window with bulk in flight for most of its busy time measures the card."""
    async def main():
        clock = Clock()
        b = AdmissionBudget(256, 16384, bulk_max_drain_s=0.25, clock=clock)
        async with b.admit(1, 50, lane="bulk"):  # 0.1 s of bulk in a 1.1 s busy window
            clock.t += 0.1
        async with b.admit(1, 1000):
            clock.t += 1.0
        assert b.snapshot()["drain_tokens_per_s"] == pytest.approx(1050 / 1.1)
        assert b.snapshot()["drain_capacity_tokens_per_s"] is None
        assert b.bulk_token_cap == pytest.approx(0.75 * 16384)

    asyncio.run(main())


def test_a_large_interactive_calls_runs_measure_the_card():
    """A large interactive call goes in runs at bulk's priority (request_path._runs), admitted in
    the interactive lane. Its runs load the card as bulk does, so they measure it: without that,
    a replica that only ever saw large interactive calls kept the cap at its whole share, and a
    1,024-token run of MiniLM (1-1.5 s on two cores) made every query beside it wait that long."""
    async def main():
        clock = Clock()
        b = AdmissionBudget(256, 16384, bulk_max_drain_s=0.25, clock=clock)
        async with b.admit(1, 1000, lane="interactive", runs=True):
            clock.t += 1.0
        async with b.admit(1, 1):  # a query: the cap holds while queries come
            pass
        assert b.snapshot()["drain_capacity_tokens_per_s"] == pytest.approx(1000)
        assert b.bulk_token_cap == pytest.approx(250)
        assert b.snapshot()["admitted_bulk_total"] == 0  # still the interactive lane's call

    asyncio.run(main())


def test_bulk_in_flight_is_capped_at_what_the_card_drains_in_the_bound():
    async def main():
        clock = Clock()
        b = AdmissionBudget(256, 16384, max_waiting=100, bulk_max_drain_s=0.25, clock=clock)
        assert b.bulk_token_cap == pytest.approx(0.75 * 16384)  # nothing measured: the share
        await _measure(b, clock, 1000, 1.0)                      # a slow card: 1,000 tokens/s
        assert b.snapshot()["drain_tokens_per_s"] == pytest.approx(1000)
        assert b.bulk_token_cap == pytest.approx(250)

        release = asyncio.Event()
        bulk = [asyncio.create_task(_hold(b, "bulk", release, tokens=100)) for _ in range(10)]
        await asyncio.sleep(0.01)
        snap = b.snapshot()
        assert snap["inflight_bulk_tokens"] == 200 and snap["waiting_bulk"] == 8  # 250 // 100
        got: list[str] = []
        inter = asyncio.create_task(_hold(b, "interactive", release, tokens=3000, log=got))
        await asyncio.sleep(0.01)
        assert got == ["interactive"]  # the cap is bulk's alone
        release.set()
        await asyncio.gather(*bulk, inter)
        assert b.snapshot()["admitted_bulk_total"] == 1 + 10  # _measure's, then all ten
        clock.t += INTERACTIVE_RECENT_S + 1  # no query for a while: bulk alone gets its share
        assert b.bulk_token_cap == pytest.approx(0.75 * 16384)
        await _measure(b, clock, 10, 0.001)  # a query comes: the cap is back
        assert b.bulk_token_cap < 0.75 * 16384

    asyncio.run(main())


def test_a_bulk_call_larger_than_the_cap_still_runs_when_no_other_bulk_is_in_flight():
    async def main():
        clock = Clock()
        b = AdmissionBudget(256, 16384, max_waiting=100, bulk_max_drain_s=0.25, clock=clock)
        await _measure(b, clock, 100, 1.0)  # 100 tokens/s: cap 25 tokens
        release = asyncio.Event()
        got: list[str] = []
        calls = [asyncio.create_task(_hold(b, "bulk", release, tokens=500, log=got, tag=f"b{i}"))
                 for i in range(2)]
        await asyncio.sleep(0.01)
        assert got == ["b0"]  # one at a time: never starved by its own cap
        release.set()
        await asyncio.gather(*calls)
        assert got == ["b0", "b1"]

    asyncio.run(main())


def test_fast_card_keeps_the_share_and_no_bound_keeps_the_share():
    async def main():
        for drain_s, rate_tokens in ((0.25, 100_000), (None, 100)):
            clock = Clock()
            b = AdmissionBudget(256, 16384, bulk_max_drain_s=drain_s, clock=clock)
            await _measure(b, clock, rate_tokens, 1.0)
            assert b.bulk_token_cap == pytest.approx(0.75 * 16384), drain_s

    asyncio.run(main())


def test_bulk_max_drain_s_is_validated_at_load():
    m = {"name": "m", "source": {"path": "/m"}}
    cfg = parse_config({"models": [m]}, "t")
    assert cfg.models[0].admission.bulk_max_drain_s == 0.05
    off = parse_config({"models": [{**m, "admission": {"bulk_max_drain_s": None}}]}, "t")
    assert off.models[0].admission.bulk_max_drain_s is None
    with pytest.raises(ConfigError, match=r"bulk_max_drain_s"):
        parse_config({"models": [{**m, "admission": {"bulk_max_drain_s": 0}}]}, "t")


async def _hold(budget: AdmissionBudget, lane: str, release: asyncio.Event, tokens: int,
                log: list[str] | None = None, tag: str = "") -> None:
    async with budget.admit(1, tokens, lane=lane):
        if log is not None:
            log.append(tag or lane)
        await release.wait()
