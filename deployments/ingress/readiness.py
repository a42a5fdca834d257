"""The router's view of which models can serve now, refreshed off the request path.

The registry answers ``readiness()`` from Ray's actor table and the replicas' heartbeats (at most
~1 s old); the router polls it every ``every_s`` in a background task, so deciding whether to
send, hold or refuse a request costs no remote call.

* ready replicas: send.
* none ready, one starting (an engine loading, a replacement on its way): hold the request,
  bounded like a cold start.
* none ready and none starting for ``grace_s`` (its card is taken, or nothing is placed): refuse
  at once with 503 + Retry-After and the reason, instead of waiting in Serve's queue for
  ``request_timeout_s``. The grace covers the moment between a replica's death and Serve
  creating its replacement, when "none starting" is true but not for long.
* a model that can never get a card (the registry's ``never``: every card held for good by
  models at their minimum, on a cluster that cannot grow): refuse at once, scale-to-zero models
  too, whose calls are otherwise held as a cold start that would never come.

A view older than ``max_age_s`` (registry unreachable) is no view: requests then go the way
they went before this existed (Serve's queue, bounded by ``request_timeout_s``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

from ..common.contracts import ModelReadiness

logger = logging.getLogger("embedfleet.readiness")

Fetch = Callable[[], Awaitable[dict[str, ModelReadiness]]]


class ReadinessView:
    def __init__(self, fetch: Fetch, *, every_s: float = 0.5, grace_s: float = 2.0,
                 max_age_s: float = 3.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._fetch = fetch
        self.every_s = every_s
        self.grace_s = grace_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._models: dict[str, ModelReadiness] = {}
        self._updated_at: float | None = None
        self._unservable_since: dict[str, float] = {}
        self._failing = False

    def update(self, readiness: dict[str, ModelReadiness]) -> None:
        now = self._clock()
        self._models = dict(readiness)
        self._updated_at = now
        for model, r in readiness.items():
            if r.ready == 0 and r.starting == 0:
                self._unservable_since.setdefault(model, now)
            else:
                self._unservable_since.pop(model, None)

    def get(self, model: str) -> ModelReadiness | None:
        """The model's readiness, or None when the view is too old to act on."""
        if self._updated_at is None or self._clock() - self._updated_at > self.max_age_s:
            return None
        return self._models.get(model)

    def unservable(self, model: str) -> str | None:
        """Why ``model`` cannot serve (no replica ready or starting for ``grace_s``, or it can
        never get a card), or None."""
        if why := self.never(model):
            return why
        r = self.get(model)
        since = self._unservable_since.get(model)
        if r is None or since is None or self._clock() - since < self.grace_s:
            return None
        return r.waiting or "no replica is running or starting"

    def never(self, model: str) -> str | None:
        """Why ``model`` can never get a card (the registry waited out its transients), or None."""
        r = self.get(model)
        return r.never if r is not None and r.never else None

    def starting_only(self, model: str) -> bool:
        """No replica ready, but one on its way: a request is worth holding."""
        r = self.get(model)
        return r is not None and r.ready == 0 and r.starting > 0

    def has_starting(self, model: str) -> bool:
        """A replica of ``model`` is on its way: loading, replaced, or swapping its engine."""
        r = self.get(model)
        return r is not None and r.starting > 0

    def has_ready_now(self, model: str) -> bool:
        r = self.get(model)
        return r is not None and r.ready > 0

    async def has_ready(self, model: str) -> bool:
        return self.has_ready_now(model)

    def waiting(self, model: str) -> str:
        r = self.get(model)
        return "" if r is None else r.waiting

    async def refresh_forever(self) -> None:
        while True:
            try:
                self.update(await asyncio.wait_for(self._fetch(), timeout=5))
                if self._failing:
                    logger.info("readiness view refreshed again")
                self._failing = False
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the registry restarting: keep the old view until stale
                if not self._failing:
                    logger.warning("readiness refresh failed: %r", exc)
                self._failing = True
            await asyncio.sleep(self.every_s)
