"""Holding a request while its model has no ready replica (scaled to zero, or waiting for a card).

Serve's handle already queues a call until a replica exists (and its queued calls are what make
the autoscaler start one from zero); what the router adds is the bound: a call gets the usual
``request_timeout_s``, and only if the model still has no ready replica by then is it held longer,
up to ``cold_start_hold_s`` from arrival — an engine's cold start, not a stuck replica's. The
router holds a call for a scale-to-zero model, or for one whose replica is on its way (loading,
replaced, swapping its engine); one with none ready or starting gets 503 + Retry-After.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any


class Refused(Exception):
    """While the call waited, its model became unservable (``refuse()`` gave the reason)."""


class HoldExpired(Exception):
    """The call did not finish within its bound; ``no_replica`` says whether it was held."""

    def __init__(self, waited_s: float, no_replica: bool) -> None:
        super().__init__(f"no answer after {waited_s:.0f}s")
        self.waited_s = waited_s
        self.no_replica = no_replica


async def _wait_unless_refused(task: asyncio.Future[Any], timeout: float,
                               refuse: Callable[[], str | None] | None,
                               tick: Callable[[], Awaitable[Any]] | None = None) -> set[Any]:
    # A call queued in Serve for a replica that will not come (its card taken) would otherwise
    # wait out request_timeout_s: look at the readiness view once a second (and call ``tick``).
    if refuse is None and tick is None:
        done, _ = await asyncio.wait({task}, timeout=timeout)
        return done
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        done, _ = await asyncio.wait({task}, timeout=max(0.0, min(left, 1.0)))
        if done or left <= 1.0:
            return done
        if tick is not None:
            await tick()
        why = refuse() if refuse is not None else None
        if why is not None:
            raise Refused(why)


async def await_with_hold(call: Awaitable[Any], request_timeout_s: float,
                          hold_s: float | Callable[[], float],
                          has_ready_replica: Callable[[], Awaitable[bool]],
                          refuse: Callable[[], str | None] | None = None,
                          sent_cold: bool = False) -> Any:
    """Await ``call``; raise ``HoldExpired`` (after cancelling it) when its bound runs out, or
    ``Refused`` when ``refuse()`` says the model cannot serve.

    ``hold_s``: how long a call may be held for a replica to come up; a callable is asked when
    ``request_timeout_s`` runs out, so a call sent to a serving model is held if its replica
    stopped serving meanwhile (an engine swap holds calls at the replica's gate for up to the
    model's cold start; cutting them at ``request_timeout_s`` gave a 503 in a CI run whose swap
    took ~2 min).

    ``sent_cold``: the call was sent while its model had no ready replica. Whenever the model is
    seen with no ready replica while the call is out (looked at once a second), and a replica
    is seen ready again, the call gets ``request_timeout_s`` from then, within its bound (the
    larger of the two times): without this, a replica ready at 119 s of 120 cut the call it was
    started for (seen in tests/test_e2e_autoscaling.py), while a replica that came up early and
    then hung still cuts the call about ``request_timeout_s`` after it came up."""
    t0 = time.monotonic()
    task = asyncio.ensure_future(call)
    hold_now = hold_s if callable(hold_s) else (lambda: hold_s)
    outage = sent_cold  # the model had no ready replica at some moment of the call
    ready_at: float | None = None  # when a replica was last seen ready again after that
    held = hold_now() if sent_cold else 0.0  # the longest hold an outage of the call allowed

    async def watch() -> bool:
        nonlocal ready_at, outage, held
        ready = await has_ready_replica()
        if not ready:
            outage, ready_at, held = True, None, max(held, hold_now())
        elif outage and ready_at is None:
            ready_at = time.monotonic()
        return ready

    try:
        done = await _wait_unless_refused(task, request_timeout_s, refuse, watch)
        no_replica = False
        if not done:
            no_replica = not await watch()
            hold = max(held, hold_now())
            left = hold - (time.monotonic() - t0)
            if not no_replica and ready_at is not None:
                until = min(ready_at + request_timeout_s, t0 + max(request_timeout_s, hold))
                done, _ = await asyncio.wait({task}, timeout=max(0.0, until - time.monotonic()))
            elif no_replica and left > 0:
                # Wait for a replica to come up, then give the call its usual time on it.
                while not done and left > 0:
                    done, _ = await asyncio.wait({task}, timeout=min(left, 2.0))
                    left = hold - (time.monotonic() - t0)
                    if not done and await has_ready_replica():
                        # Its usual time on the replica, within the call's bound.
                        until = min(time.monotonic() + request_timeout_s,
                                    t0 + max(request_timeout_s, hold))
                        done, _ = await asyncio.wait(
                            {task}, timeout=max(0.0, until - time.monotonic()))
                        no_replica = False
                        break
        if not done:
            raise HoldExpired(time.monotonic() - t0, no_replica)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
