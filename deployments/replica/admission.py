"""AdmissionBudget: the per-card brake in front of the engine (sequences and tokens in flight).

Why: vLLM fixes its scheduler limits (``max_num_seqs``, ``max_num_batched_tokens``) at engine
start, but card memory depends on the work inside the engine *now*, so each replica admits work
against a budget the memory governor lowers and raises at run time.

Rules, and why:

* **FIFO within a lane.** A request waits behind everything of its lane that arrived before it,
  even when it would fit now, or small requests could overtake a large one forever (TEI's queue
  does the same); head-of-line blocking is bounded by the queue timeout.
* **Two lanes: interactive ahead of bulk.** An interactive call overtakes every waiting bulk call:
  - bulk holds at most ``bulk_max_inflight_share`` of the budget, so a query arriving during a
    flood finds room at once; while queries come (one in the last ``INTERACTIVE_RECENT_S``), at
    most the tokens the card drains in ``bulk_max_drain_s`` (``drain_rate.py``), and the replica
    sends a bulk call in runs of that size. Bulk alone keeps its whole share;
  - while bulk waits, it is owed ``bulk_min_share`` of the tokens admitted (a deficit count,
    reset when bulk's queue empties): a steady interactive stream never starves it;
  - at most ``bulk_max_waiting`` bulk calls queue; past it, or past its wait bound, 429.
* **A call's next run** (``follows``) is not refused for the waiting limits (work done is kept);
  in bulk it waits at its lane's head, in interactive (a large call) at the tail: queries first.
* **Oversize runs alone.** A request larger than the whole budget (more sequences or tokens than
  the limits) is admitted once nothing else is in flight, and nothing is admitted beside it. A
  budget the governor cut low must slow big inputs down, never reject them forever.
* **Bounded waiting.** At most ``max_waiting`` requests queue; beyond that, and after
  ``timeout_s`` in the queue, the caller gets ``Overloaded`` (429) with a Retry-After estimate.
* **Limit changes never cancel.** Lowered: admitted work finishes, new work waits for it to
  drain. Raised: waiters are admitted at once. **A cancelled waiter** leaves the queue, and one
  cancelled as it was granted gives the grant back.

Retry-After (Little's law): a full budget drains one budget's work per mean hold time ``H``
(EWMA), so the work ahead of a caller (in flight and queued, itself too) takes ``max(tokens_ahead
/ max_tokens, seqs_ahead / max_sequences) * H``; before any completion ``H`` is the caller's wait
so far (or the queue timeout if refused at once). Clamped to [1 s, ``max_retry_after_s``].

Everything runs on the replica's event loop: no method awaits while it changes the counters.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any

from ..common.contracts import LANES, Lane
from ..common.errors import Overloaded
from .drain_rate import DrainRate, ewma

#: Reasons for ``on_reject``: bounded values of ``embedfleet_overload_rejections_total{reason}``.
REJECT_QUEUE_FULL = "budget_queue_full"
REJECT_QUEUE_TIMEOUT = "budget_queue_timeout"
REJECT_BULK_QUEUE_FULL = "bulk_queue_full"

# The drain cap holds while a query came this recently: bulk alone gets its full share back soon.
INTERACTIVE_RECENT_S = 10.0

_HOLD_EWMA_ALPHA = 0.2  # the newest hold time's weight: follows ~5 completions, not one outlier


@dataclass(frozen=True)
class Admission:
    """What ``admit`` yields: the grant, for logs and latency metrics."""

    sequences: int
    tokens: int
    waited_s: float  # queued for budget (0 on the fast path)
    alone: bool  # larger than the budget, so it runs with nothing beside it


@dataclass(eq=False)
class _Waiter:
    seqs: int
    tokens: int
    future: asyncio.Future[None]
    lane: Lane = "interactive"
    runs: bool = False
    queued: bool = True
    admission: Admission | None = None


class AdmissionBudget:
    """Sequences and tokens in flight on one card, admitted FIFO per lane, interactive first.

    ``async with budget.admit(n_seqs, n_tokens, timeout_s, lane=...): ...`` holds the budget for
    the body.
    """

    def __init__(self, max_sequences: int, max_tokens: int, *, max_waiting: int = 1024,
                 queue_timeout_s: float = 30.0, max_retry_after_s: float = 60.0,
                 bulk_max_inflight_share: float = 0.75, bulk_min_share: float = 0.25,
                 bulk_max_waiting: int | None = None, bulk_max_drain_s: float | None = None,
                 on_reject: Callable[[str], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {max_waiting}")
        if not (0 < bulk_max_inflight_share <= 1 and 0 <= bulk_min_share < 1):
            raise ValueError(f"bulk shares out of range: inflight {bulk_max_inflight_share}, "
                             f"min {bulk_min_share}")
        self._max_seqs = 0
        self._max_tokens = 0
        self._check_and_set(max_sequences, max_tokens)
        self._max_waiting = max_waiting
        self._bulk_max_waiting = max_waiting // 2 if bulk_max_waiting is None else bulk_max_waiting
        self._bulk_inflight_share = bulk_max_inflight_share
        self._bulk_min_share = bulk_min_share
        self._bulk_max_drain_s = bulk_max_drain_s
        self._drain = DrainRate(clock=clock)
        self._last_interactive_t: float | None = None
        self._queue_timeout_s = queue_timeout_s
        self._max_retry_after_s = max_retry_after_s
        self._on_reject = on_reject
        self._clock = clock
        self._lanes: dict[Lane, collections.deque[_Waiter]] = {
            lane: collections.deque() for lane in LANES}
        self._waiting_seqs = 0
        self._waiting_tokens = 0
        self._inflight_seqs = 0
        self._inflight_tokens = 0
        self._bulk_seqs = 0     # the bulk lane's part of the in-flight counts
        self._bulk_tokens = 0
        self._run_seqs = 0      # sequences in flight in runs (bulk, large calls): DrainRate's load
        # Tokens admitted per lane since bulk last had no waiter (bulk_min_share's deficit count).
        self._window = {lane: 0 for lane in LANES}
        self._hold_ewma_s: float | None = None
        self._admitted = {lane: 0 for lane in LANES}
        self._oversize = 0
        self._cancelled = 0
        self._rejected = {REJECT_QUEUE_FULL: 0, REJECT_QUEUE_TIMEOUT: 0,
                          REJECT_BULK_QUEUE_FULL: 0}

    # -- limits ----------------------------------------------------------------------------------
    def _check_and_set(self, max_sequences: int, max_tokens: int) -> None:
        if max_sequences < 1 or max_tokens < 1:
            raise ValueError(f"budget limits must be >= 1, got max_sequences={max_sequences}, "
                             f"max_tokens={max_tokens}")
        self._max_seqs, self._max_tokens = int(max_sequences), int(max_tokens)

    def set_limits(self, max_sequences: int, max_tokens: int) -> None:
        """Change the budget now. Lowering never touches admitted work; raising admits waiters."""
        self._check_and_set(max_sequences, max_tokens)
        self._wake()

    @property
    def limits(self) -> tuple[int, int]:  # (max_sequences, max_tokens)
        return self._max_seqs, self._max_tokens

    @property
    def _waiters(self) -> list[_Waiter]:
        """Every waiter, interactive first: the order the budget serves them in."""
        return [*self._lanes["interactive"], *self._lanes["bulk"]]

    # -- admission -------------------------------------------------------------------------------
    @contextlib.asynccontextmanager
    async def admit(self, n_seqs: int, n_tokens: int, timeout_s: float | None = None,
                    lane: Lane = "interactive", follows: bool = False, runs: bool = False
                    ) -> AsyncIterator[Admission]:
        """Hold ``n_seqs`` sequences and ``n_tokens`` tokens of the budget for the ``with`` body.

        Waits in its lane for at most ``timeout_s`` (None: the budget's ``queue_timeout_s``; 0: do
        not queue). Raises ``Overloaded`` when the queue is full or the wait times out.
        ``follows``: the next run of a call already admitted (a bulk or a large interactive call
        goes in runs): it waits past the waiting limits, so work done is not refused; in bulk at
        the head of the lane, in the interactive lane at its tail (queries go between runs).
        ``runs``: a run of such a call; the drain rate (which sizes runs) measures the card while
        runs are in flight, a large interactive call's as well as a bulk call's.
        """
        runs = runs or lane == "bulk"
        admission = await self._acquire(n_seqs, n_tokens, timeout_s, lane, follows, runs)
        started = self._clock()
        try:
            yield admission
        finally:
            self._release(n_seqs, n_tokens, lane, held_s=self._clock() - started, runs=runs)

    async def _acquire(self, n_seqs: int, n_tokens: int, timeout_s: float | None,
                       lane: Lane, follows: bool = False, runs: bool = False) -> Admission:
        # Wrong sizes are a bug in the caller, not the client's fault: ValueError → 500.
        if n_seqs < 1 or n_tokens < 0:
            raise ValueError(f"admit needs n_seqs >= 1 and n_tokens >= 0, got {n_seqs}, {n_tokens}")
        timeout = self._queue_timeout_s if timeout_s is None else timeout_s
        if lane == "interactive":
            self._tick(busy=self._inflight_seqs > 0)  # the time before this query is accounted
            self._last_interactive_t = self._clock()
        head = follows and lane == "bulk"  # a bulk call's next run waits at its lane's head
        ahead = self._ahead_of_new("interactive" if head else lane)
        # An interactive call overtakes waiting bulk calls, unless bulk is owed its share.
        if not ahead and self._fits(n_seqs, n_tokens, lane) and (
                lane == "bulk" or not self._bulk_owed()):
            return self._take(n_seqs, n_tokens, lane, bool(self._lanes["bulk"]), runs)
        refusal = None if follows else self._refusal(lane, timeout)
        if refusal is not None:
            raise self._reject(refusal, n_seqs, n_tokens, waited_s=0.0, ahead=ahead,
                               fallback_hold_s=1.0 if timeout <= 0 else timeout)

        waiter = _Waiter(n_seqs, n_tokens, asyncio.get_running_loop().create_future(), lane, runs)
        (self._lanes[lane].appendleft if head else self._lanes[lane].append)(waiter)
        self._waiting_seqs += n_seqs
        self._waiting_tokens += n_tokens
        self._wake()  # e.g. an interactive call queued for owed bulk that the bulk cap holds back
        t0 = self._clock()
        try:
            async with asyncio.timeout(timeout):
                await waiter.future
        except BaseException as exc:
            granted = waiter.future.done() and not waiter.future.cancelled()
            if granted and isinstance(exc, TimeoutError):
                # Granted in the very iteration the timer fired: the budget is ours, use it.
                return self._granted(waiter, waited_s=self._clock() - t0)
            if granted:  # cancelled right after the grant: give it back
                self._release(n_seqs, n_tokens, lane, held_s=None, runs=runs)
            else:
                ahead = self._ahead_of(waiter)
                self._dequeue(waiter)
                self._wake()  # leaving the head may unblock the next waiter
                if isinstance(exc, TimeoutError):
                    raise self._reject(REJECT_QUEUE_TIMEOUT, n_seqs, n_tokens,
                                       waited_s=self._clock() - t0, ahead=ahead,
                                       fallback_hold_s=timeout) from None
            if isinstance(exc, asyncio.CancelledError):
                self._cancelled += 1
            raise
        return self._granted(waiter, waited_s=self._clock() - t0)

    def _refusal(self, lane: Lane, timeout: float) -> str | None:  # why a new call may not queue
        if len(self._lanes["interactive"]) + len(self._lanes["bulk"]) >= self._max_waiting:
            return REJECT_QUEUE_FULL
        if lane == "bulk" and len(self._lanes["bulk"]) >= self._bulk_max_waiting:
            return REJECT_BULK_QUEUE_FULL
        return REJECT_QUEUE_TIMEOUT if timeout <= 0 else None

    def _ahead_of_new(self, lane: Lane) -> list[_Waiter]:
        """Who a call arriving now waits behind: its own lane, and for bulk the interactive one."""
        return [*self._lanes["interactive"]] if lane == "interactive" else self._waiters

    def _ahead_of(self, waiter: _Waiter) -> list[_Waiter]:
        before = list(itertools.takewhile(lambda w: w is not waiter, self._lanes[waiter.lane]))
        return before if waiter.lane == "interactive" else [*self._lanes["interactive"], *before]

    @staticmethod
    def _granted(waiter: _Waiter, waited_s: float) -> Admission:  # _wake counted it in flight
        assert waiter.admission is not None
        return dataclasses.replace(waiter.admission, waited_s=waited_s)

    def _oversize_now(self, n_seqs: int, n_tokens: int) -> bool:
        return n_seqs > self._max_seqs or n_tokens > self._max_tokens

    def _fits(self, n_seqs: int, n_tokens: int, lane: Lane) -> bool:
        if self._inflight_seqs == 0 and self._inflight_tokens == 0:
            return True  # idle card: anything runs, an oversize request alone
        # The bulk cap binds only beside other bulk work: one bulk call never needs an idle card.
        if lane == "bulk" and (self._bulk_seqs or self._bulk_tokens) and (
                self._bulk_seqs + n_seqs > self.bulk_seq_cap
                or self._bulk_tokens + n_tokens > self.bulk_token_cap):
            return False
        return (self._inflight_seqs + n_seqs <= self._max_seqs
                and self._inflight_tokens + n_tokens <= self._max_tokens)

    @property
    def bulk_seq_cap(self) -> int:  # bulk's in-flight sequences: its share (at least one)
        return max(1, int(self._bulk_inflight_share * self._max_seqs))

    @property
    def bulk_token_cap(self) -> float:
        """Bulk's in-flight tokens: its share, and what the card drains in ``bulk_max_drain_s``."""
        cap, rate = self._bulk_inflight_share * self._max_tokens, self._drain.capacity_tokens_per_s
        seen = self._last_interactive_t
        if (self._bulk_max_drain_s is None or rate is None or seen is None
                or self._clock() - seen > INTERACTIVE_RECENT_S):
            return cap
        return min(cap, rate * self._bulk_max_drain_s)

    def _tick(self, busy: bool) -> None:  # the drain rate's clock; the cap holds till seen + RECENT
        until = None if (t := self._last_interactive_t) is None else t + INTERACTIVE_RECENT_S
        self._drain.tick(busy, bulk=self._run_seqs > 0, capped_until=until)

    def _take(self, n_seqs: int, n_tokens: int, lane: Lane, in_window: bool,
              runs: bool = False) -> Admission:
        """``in_window``: bulk had waiters when this was admitted (bulk_min_share's count)."""
        self._tick(busy=self._inflight_seqs > 0)
        self._inflight_seqs += n_seqs
        self._inflight_tokens += n_tokens
        self._run_seqs += n_seqs if runs else 0
        if lane == "bulk":
            self._bulk_seqs += n_seqs
            self._bulk_tokens += n_tokens
        if in_window:
            self._window[lane] += max(1, n_tokens)
        self._admitted[lane] += 1
        alone = self._oversize_now(n_seqs, n_tokens)
        self._oversize += alone
        return Admission(n_seqs, n_tokens, 0.0, alone)

    def _dequeue(self, waiter: _Waiter) -> None:
        if not waiter.queued:
            return
        waiter.queued = False
        self._waiting_seqs -= waiter.seqs
        self._waiting_tokens -= waiter.tokens
        with contextlib.suppress(ValueError):
            self._lanes[waiter.lane].remove(waiter)
        if not self._lanes["bulk"]:
            self._window = {lane: 0 for lane in LANES}  # the share counts while bulk waits

    def _bulk_owed(self) -> bool:
        """Bulk waits and has had less than ``bulk_min_share`` of what was admitted meanwhile."""
        total = self._window["interactive"] + self._window["bulk"]
        return bool(self._lanes["bulk"]) and self._window["bulk"] < self._bulk_min_share * total

    def _next_lane(self) -> Lane | None:
        """Interactive first, unless bulk is owed its share."""
        if not self._lanes["interactive"]:
            return "bulk" if self._lanes["bulk"] else None
        return "bulk" if self._bulk_owed() else "interactive"

    def _wake(self) -> None:
        """Admit waiters while the chosen lane's head fits; stop at the first that does not,
        except that a bulk head held back only by bulk's cap lets interactive calls by."""
        while (lane := self._next_lane()) is not None:
            head = self._lanes[lane][0]
            if head.future.done():  # cancelled; its task removes it too, but do not block on it
                self._dequeue(head)
                continue
            if not self._fits(head.seqs, head.tokens, lane):
                capped = lane == "bulk" and self._fits(head.seqs, head.tokens, "interactive")
                if not (capped and self._lanes["interactive"]):
                    return
                head = self._lanes["interactive"][0]
                if head.future.done():
                    self._dequeue(head)
                    continue
                if not self._fits(head.seqs, head.tokens, "interactive"):
                    return
                lane = "interactive"
            in_window = bool(self._lanes["bulk"])
            self._dequeue(head)
            head.admission = self._take(head.seqs, head.tokens, lane, in_window, head.runs)
            head.future.set_result(None)

    def _release(self, n_seqs: int, n_tokens: int, lane: Lane, held_s: float | None,
                 runs: bool = False) -> None:
        self._tick(busy=True)
        self._inflight_seqs -= n_seqs
        self._inflight_tokens -= n_tokens
        self._run_seqs -= n_seqs if runs else 0
        if lane == "bulk":
            self._bulk_seqs -= n_seqs
            self._bulk_tokens -= n_tokens
        if held_s is not None:  # a finished call (None: a grant given back unused)
            self._drain.finished(n_tokens)
            self._hold_ewma_s = ewma(self._hold_ewma_s, held_s, _HOLD_EWMA_ALPHA)
        self._wake()

    # -- refusal ---------------------------------------------------------------------------------
    def retry_after_s(self, seqs_ahead: int, tokens_ahead: int, fallback_hold_s: float) -> float:
        """Seconds until ``seqs_ahead``/``tokens_ahead`` of work has drained (module docstring)."""
        hold = self._hold_ewma_s if self._hold_ewma_s is not None else fallback_hold_s
        fills = max(seqs_ahead / self._max_seqs, tokens_ahead / self._max_tokens)
        return min(self._max_retry_after_s, max(1.0, fills * hold))

    def _reject(self, reason: str, n_seqs: int, n_tokens: int, *, waited_s: float,
                ahead: Iterable[_Waiter], fallback_hold_s: float) -> Overloaded:
        live = [w for w in ahead if not w.future.done()]  # skip cancelled, not yet removed
        seqs = self._inflight_seqs + sum(w.seqs for w in live) + n_seqs
        tokens = self._inflight_tokens + sum(w.tokens for w in live) + n_tokens
        retry = self.retry_after_s(seqs, tokens, max(fallback_hold_s, waited_s))
        self._rejected[reason] += 1
        if self._on_reject is not None:
            self._on_reject(reason)
        state = (f"in flight {self._inflight_seqs} seq / {self._inflight_tokens} tok of "
                 f"{self._max_seqs} / {self._max_tokens}, {len(self._waiters)} waiting")
        msg = {REJECT_QUEUE_FULL: f"card is saturated: admission queue full "
                                  f"({self._max_waiting} waiting; {state})",
               REJECT_BULK_QUEUE_FULL: f"bulk lane is full: {self._bulk_max_waiting} bulk calls "
                                       f"waiting ({state}); the rest of the queue is kept for "
                                       "interactive calls"
               }.get(reason, f"card is saturated: no batch budget for {n_seqs} seq / "
                             f"{n_tokens} tok after {waited_s:.1f} s ({state})")
        return Overloaded(f"{msg}; retry in about {retry:.0f} s", retry_after_s=retry)

    # -- status ----------------------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """Limits, in-flight and waiting work, and counters: for ``/v1/models`` and ``status``."""
        return {
            "max_sequences": self._max_seqs,
            "max_tokens": self._max_tokens,
            "inflight_sequences": self._inflight_seqs,
            "inflight_tokens": self._inflight_tokens,
            "waiting": len(self._waiters),
            "waiting_sequences": self._waiting_seqs,
            "waiting_tokens": self._waiting_tokens,
            "max_waiting": self._max_waiting,
            "queue_timeout_s": self._queue_timeout_s,
            "mean_hold_s": self._hold_ewma_s,
            "admitted_total": sum(self._admitted.values()),
            "admitted_bulk_total": self._admitted["bulk"],
            "inflight_bulk_sequences": self._bulk_seqs,
            "inflight_bulk_tokens": self._bulk_tokens,
            "bulk_max_inflight_tokens": int(self.bulk_token_cap),
            "drain_tokens_per_s": self._drain.tokens_per_s,
            "drain_capacity_tokens_per_s": self._drain.capacity_tokens_per_s,
            "waiting_bulk": len(self._lanes["bulk"]),
            "oversize_total": self._oversize,
            "cancelled_total": self._cancelled,
            "rejected": dict(self._rejected),
        }
