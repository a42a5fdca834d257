"""Holding a request while its model has no ready replica (scaled to zero, or waiting for a card).

Serve's handle already queues a call until a replica exists (and its queued calls are what make
the autoscaler start one from zero); what the router adds is the bound: a call gets the usual
``request_timeout_s``, and only if the model still has no ready replica by then is it held longer,
up to ``cold_start_hold_s`` from arrival — an engine's cold start, not a stuck replica's. The
router passes a hold only for scale-to-zero models; the others get 503 + Retry-After.
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


async def await_with_hold(call: Awaitable[Any], request_timeout_s: float, hold_s: float,
                          has_ready_replica: Callable[[], Awaitable[bool]],
                          refuse: Callable[[], str | None] | None = None,
                          sent_cold: bool = False) -> Any:
    """Await ``call``; raise ``HoldExpired`` (after cancelling it) when its bound runs out, or
    ``Refused`` when ``refuse()`` says the model cannot serve.

    ``sent_cold``: the call was sent while its model had no ready replica. Once one is seen
    ready (looked at once a second), the call gets ``request_timeout_s`` from then, within its
    bound (the larger of the two times): without this, a replica ready at 119 s of 120 cut the
    call it was started for (seen in tests/test_e2e_autoscaling.py), while a replica that came up
    early and then hung still cuts the call about ``request_timeout_s`` after it came up."""
    t0 = time.monotonic()
    task = asyncio.ensure_future(call)
    ready_at: float | None = None  # when a replica was first seen ready (sent_cold calls)

    async def watch() -> bool:
        nonlocal ready_at
        ready = await has_ready_replica()
        if ready and ready_at is None:
            ready_at = time.monotonic()
        return ready

    try:
        done = await _wait_unless_refused(task, request_timeout_s, refuse,
                                          watch if sent_cold else None)
        no_replica = False
        if not done:
            no_replica = not await watch()
            left = hold_s - (time.monotonic() - t0)
            if sent_cold and not no_replica and ready_at is not None:
                until = min(ready_at + request_timeout_s, t0 + max(request_timeout_s, hold_s))
                done, _ = await asyncio.wait({task}, timeout=max(0.0, until - time.monotonic()))
            elif no_replica and left > 0:
                # Wait for a replica to come up, then give the call its usual time on it.
                while not done and left > 0:
                    done, _ = await asyncio.wait({task}, timeout=min(left, 2.0))
                    left = hold_s - (time.monotonic() - t0)
                    if not done and await has_ready_replica():
                        done, _ = await asyncio.wait({task}, timeout=request_timeout_s)
                        no_replica = False
                        break
        if not done:
            raise HoldExpired(time.monotonic() - t0, no_replica)
        return task.result()
    finally:
        if not task.done():
            task.cancel()
