"""Calling a model's replicas through its Serve handle: bounded, held for a cold start, retried.

* A model that should always have a replica (min >= 1) but has none ready and none starting
  answers 503 + Retry-After at once (``ingress.readiness``), not after ``request_timeout_s``.
* A call is held (``cold_start_hold_s``) while its model has no ready replica but one is on its
  way: a scale-to-zero model's cold start, a replacement for a replica that died, or an engine
  swap (the registry counts a replica whose gate holds calls as starting, not ready), whether
  that began before the call was sent or while it was out.
* A call not answered within ``request_timeout_s`` while a replica of its model is starting or
  swapping its engine (it may have waited at that replica's gate) is sent again, within the
  bound.
* A call whose replica or engine died is retried (inputs are idempotent): on another replica if
  there is one, else on the replacement, until the bound — the larger of ``request_timeout_s``
  and ``cold_start_hold_s`` — passes; then 503 + Retry-After saying why.
* Serve's own queue full is 429 + Retry-After.
* A call cancelled here (its client went away, or a sibling slice of its request failed) cancels
  its Serve request too: awaiting a response does not, and the replica would go on embedding.
* A small call (online traffic) goes by value over Serve's gRPC transport, a large one through
  Ray's object store (``by_value``; ``router.handle_transport``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from ..common import metrics
from ..config.schema import ModelConfig, RouterConfig
from ..common.contracts import EmbedCall, EmbedResult
from ..common.errors import EngineUnavailable, NoCardEver, NotReady, Overloaded
from ..config.ray_options import request_bound_s
from .cold_start import HoldExpired, Refused, await_with_hold
from .readiness import ReadinessView

logger = logging.getLogger("embedfleet.remote")

REPLICA_GONE = (RayActorError, ActorDiedError, ActorUnavailableError)
# Serve's gRPC transport (a handle's ``_by_reference=False``, Ray 2.60) sends a call straight to
# the replica's own gRPC server and its answer back by value, past Ray core's task submission and
# object store. Its messages are capped at 4 MiB (RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH) and a
# large answer is cheaper as a zero-copy object, so only small calls take it: online traffic.
# 32 texts of at most 256 KiB in all: their answer is at most 32 x 4,096 float32 = 512 KiB.
BY_VALUE_MAX_INPUTS = 32
BY_VALUE_MAX_BYTES = 256 << 10
TOKEN_ID_BYTES = 5  # a pickled int below 2**31


def by_value(call: EmbedCall) -> bool:
    """Whether ``call`` is small enough for the gRPC transport (see BY_VALUE_MAX_BYTES)."""
    if len(call.inputs) > BY_VALUE_MAX_INPUTS:
        return False
    size = sum(len(x.encode()) if isinstance(x, str) else TOKEN_ID_BYTES * len(x)
               for x in call.inputs)
    return size <= BY_VALUE_MAX_BYTES


class RemoteCaller:
    """``await caller(call)``: one model's replicas behind its Serve handle."""

    def __init__(self, handle: Any, model: ModelConfig, router: RouterConfig,
                 readiness: ReadinessView, method: str = "embed") -> None:
        self._method = method  # the replica's: embed, or rerank (a RerankCall)
        self._handle = handle
        # None: every call through the object store (``router.handle_transport``)
        self._by_value = (handle.options(_by_reference=False)
                          if router.handle_transport == "grpc" else None)
        self._model = model
        self._router = router
        self._readiness = readiness
        bounds = model.replicas
        self._cold_start_s = bounds.cold_start_hold_s
        self._always_up = bounds.min_replicas > 0
        # The whole call's bound, retries included: a replacement engine's cold start.
        self._bound_s = request_bound_s(router, model)

    def _hold_s(self, model: str) -> float:
        # A scale-to-zero model is always worth holding (the queued call is what starts a
        # replica); another only while a replica of it is starting.
        if not self._always_up or self._readiness.starting_only(model):
            return self._cold_start_s
        return 0.0

    def _unservable(self, model: str) -> str | None:
        # A scale-to-zero model is held for its cold start, unless it can never get a card.
        return (self._readiness.unservable(model) if self._always_up
                else self._readiness.never(model))

    def _refuse(self, model: str, why: str) -> NotReady:
        metrics.get("embedfleet_overload_rejections_total").inc(
            1, tags={"model": model, "reason": "no_ready_replica"})
        if self._readiness.never(model):
            return NoCardEver(why, retry_after_s=self._router.retry_after_s)
        return NotReady(f"model '{model}' has no ready replica and none is starting: {why}",
                        retry_after_s=self._router.retry_after_s)

    async def __call__(self, call: EmbedCall) -> EmbedResult:
        retry_after = self._router.retry_after_s
        deadline = time.monotonic() + self._bound_s
        attempt = 0
        # the same call on every attempt, so the same transport
        handle = self._by_value if self._by_value is not None and by_value(call) else self._handle
        while True:
            why = self._unservable(call.model)
            if why is not None:
                raise self._refuse(call.model, why)
            hold_s = self._hold_s(call.model)
            left_s = deadline - time.monotonic()  # an attempt and its hold stay within the bound
            timeout = max(0.1, min(self._router.request_timeout_s, left_s))
            sent_cold = hold_s > 0 and not self._readiness.has_ready_now(call.model)
            response = getattr(handle, self._method).remote(call)
            try:
                return await await_with_hold(response, timeout,
                                             lambda: min(self._hold_s(call.model), left_s),
                                             lambda: self._readiness.has_ready(call.model),
                                             lambda: self._unservable(call.model), sent_cold)
            except asyncio.CancelledError:
                response.cancel()
                raise
            except Refused as err:
                response.cancel()
                raise self._refuse(call.model, str(err)) from None
            except BackPressureError as err:
                metrics.get("embedfleet_overload_rejections_total").inc(
                    1, tags={"model": call.model, "reason": "serve_queue_full"})
                raise Overloaded(f"model is at capacity ({err}); retry after {retry_after}s",
                                 retry_after_s=retry_after) from None
            except DeploymentUnavailableError as err:
                raise NotReady(str(err.message), retry_after_s=retry_after) from None
            except HoldExpired as err:
                response.cancel()
                if err.no_replica:
                    why = self._readiness.waiting(call.model) or "no replica came up"
                    raise NotReady(f"model '{call.model}' has no ready replica; the request was "
                                   f"held {err.waited_s:.0f}s (cold_start_hold_s="
                                   f"{self._cold_start_s:g}): {why}",
                                   retry_after_s=retry_after) from None
                if (self._readiness.has_starting(call.model)
                        and time.monotonic() + 1.0 < deadline):
                    # Another replica of the model serves while one swaps its engine (or
                    # starts): the call may have waited at that replica's gate. Send it again;
                    # the affinity router ranks a swapping replica last.
                    attempt += 1
                    logger.warning("%s: no answer within %.0fs while a replica of %s is "
                                   "starting or swapping; sending it again (attempt %d)",
                                   call.request_id, err.waited_s, call.model, attempt)
                    continue
                raise EngineUnavailable(f"no replica answered within {err.waited_s:.0f}s",
                                        retry_after_s=retry_after) from None
            except (EngineUnavailable, *REPLICA_GONE) as err:
                attempt += 1
                pause = min(0.25 * attempt, 2.0)
                if time.monotonic() + pause >= deadline:
                    raise EngineUnavailable(
                        f"no replica of '{call.model}' could serve the request within "
                        f"{self._bound_s:g}s ({attempt} attempts; last: {err})",
                        retry_after_s=retry_after) from None
                logger.warning("replica died during %s (attempt %d): %r; retrying",
                               call.request_id, attempt, err)
                await asyncio.sleep(pause)
