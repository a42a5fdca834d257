"""DrainRate: how many tokens per second this card finishes while it has work in flight.

Why it exists: the bulk lane's in-flight cap is meant to bound how long an interactive call
arriving during a flood waits for the engine. A share of the budget bounds tokens, not time, and
the time a token takes is the device's: on two CPU cores a 12k-token step of MiniLM took about a
second, and on a 910B it should take milliseconds (not measured on a card). So the admission
budget caps bulk at what the card drains in ``bulk_max_drain_s`` (``AdmissionConfig``), measured
here, on the device it runs on, with no per-device constant.

How: time counts only while something is in flight (an idle card says nothing about its speed),
tokens count when their call releases the budget; every ``window_s`` of busy time gives one sample
(tokens / busy seconds), smoothed by an EWMA. That is the throughput at the load the card had;
the cap is sized from its recent peak (``capacity_tokens_per_s``), since under the cap the
loaded figure is a fixed point that can shrink itself. Only windows in which bulk work was in
flight most of the busy time set the peak (queries alone, or a small bulk call among them,
measure their own light load, not the card), and time under the cap does not age it (a capped
window cannot show the card's full speed, so a long flood beside a steady query stream would
otherwise sink to that fixed point, 30 min per halving).
"""

from __future__ import annotations

import time
from collections.abc import Callable

_ALPHA = 0.3  # weight of the newest window: follows a change of load within a few seconds
PEAK_HALF_LIFE_S = 1800.0  # how fast a measured peak is forgotten (capacity_tokens_per_s)


def ewma(prev: float | None, sample: float, alpha: float) -> float:
    """An exponentially weighted mean that starts at its first sample."""
    return sample if prev is None else alpha * sample + (1 - alpha) * prev


class DrainRate:
    def __init__(self, window_s: float = 1.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._last: float | None = None  # when busy time was last accounted
        self._busy_s = 0.0
        self._bulk_busy_s = 0.0  # of _busy_s, the time bulk work was in flight
        self._tokens = 0
        self.tokens_per_s: float | None = None  # None until one busy window has passed
        self._bulk_rate: float | None = None  # the EWMA over bulk-loaded windows only
        self._peak: float | None = None  # capacity_tokens_per_s when last measured, at _peak_t
        self._peak_t = 0.0

    def tick(self, busy: bool, bulk: bool = False, capped_until: float | None = None) -> None:
        """Account the time since the last tick; ``busy``: was work in flight all that time,
        ``bulk``: bulk work; ``capped_until``: when bulk's drain cap stops being in force (the
        time before it does not age the peak). Call it before every change of the in-flight
        counts, and before the cap's condition changes."""
        now = self._clock()
        if self._last is not None:
            self._busy_s += (now - self._last) if busy else 0.0
            self._bulk_busy_s += (now - self._last) if busy and bulk else 0.0
            if capped_until is not None:
                self._peak_t += max(0.0, min(now, capped_until) - self._last)
        self._last = now

    def finished(self, tokens: int) -> None:
        """A call released ``tokens``; after ``tick(busy=True)``."""
        self._tokens += tokens
        if self._busy_s >= self._window_s:
            sample = self._tokens / self._busy_s
            self.tokens_per_s = ewma(self.tokens_per_s, sample, _ALPHA)
            if self._bulk_busy_s >= 0.5 * self._busy_s:  # bulk loaded the card: it measures it
                self._bulk_rate = ewma(self._bulk_rate, sample, _ALPHA)
                self._peak = max(self.capacity_tokens_per_s or 0.0, self._bulk_rate)
                self._peak_t = self._last or 0.0  # the last tick's time: never ahead of a tick
            self._busy_s, self._bulk_busy_s, self._tokens = 0.0, 0.0, 0

    @property
    def capacity_tokens_per_s(self) -> float | None:
        """The most this card was seen to drain lately with bulk work loading it: the peak of
        that rate's EWMA, halving every ``PEAK_HALF_LIFE_S`` of time not under the cap. What
        bulk's cap is sized from: the rate at the capped load is a fixed point that shrinks
        itself where a step's own overhead is near ``bulk_max_drain_s`` (small runs measure a
        slower card, which makes smaller runs; on two shared cores bulk fell to 29-96 texts/s
        of 488 solo in some repeats). The peak is the device's speed, which changes slowly; too
        high a figure only makes bulk's runs longer. None until a bulk-loaded window: until
        then bulk keeps its whole share."""
        if self._peak is None:
            return None
        return self._peak * 0.5 ** ((self._clock() - self._peak_t) / PEAK_HALF_LIFE_S)
