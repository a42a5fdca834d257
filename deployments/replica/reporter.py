"""What a replica tells the rest of the fleet: its description, its heartbeat, its state gauges.

Every ``HEARTBEAT_INTERVAL_S`` it sends a ``ReplicaDescription`` to the FleetRegistry and acts on
the reply (a fleet-wide prefix-cache override); every control interval it re-sets the replica's
state gauges, because Ray's metrics agent drops a gauge ~20 s after its last update and alerts
(prefix cache disabled, replica not ready) need them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from ..common import metrics
from ..common.contracts import (BudgetView, HeartbeatReply, MemoryView,
                         ReplicaDescription)
from .limits import LimitsFollower
from .prefix_cache import PrefixCacheController
from ..fleet.registry import HEARTBEAT_INTERVAL_S
from ..engine.platform import CardIdentity
from .request_path import RequestPath

logger = logging.getLogger("embedfleet.reporter")


class Reporter:
    def __init__(self, *, replica_id: str, card: CardIdentity, platform: str,
                 path: RequestPath, prefix: PrefixCacheController, follower: LimitsFollower,
                 registry: Any, healthy: Callable[[], bool],
                 serving: Callable[[], bool],
                 engine_restarts: Callable[[], int] = lambda: 0) -> None:
        self.replica_id = replica_id
        self._card = card
        self._platform = platform
        self._path = path
        self._prefix = prefix
        self._follower = follower
        self._registry = registry
        self._healthy = healthy
        self._serving = serving
        self._engine_restarts = engine_restarts
        self._tags = {"model": path.model, "node": card.node, "device": card.device}

    def describe(self) -> ReplicaDescription:
        info, path, reading = self._path.info, self._path, self._follower.reading
        limits = self._follower.limits
        return ReplicaDescription(
            replica_id=self.replica_id, model=path.model, node_id=self._card.node_id,
            node=self._card.node, node_ip=self._card.node_ip, device=self._card.device,
            pid=os.getpid(), ready=self._healthy(), serving=self._serving(),
            engine_restarts=self._engine_restarts(),
            max_model_len=info.max_model_len,
            dimensions=info.hidden_size,
            matryoshka_dimensions=list(info.matryoshka_dimensions or []), dtype=info.dtype,
            block_size=info.block_size, engine_version=info.engine_version,
            platform=self._platform, prefix_cache=self._prefix.view(),
            fingerprint=self._path.fingerprint().headers(),
            budget=BudgetView(**path.queue.snapshot(), stale=limits.stale,
                              reason=limits.reason),
            memory=None if reading is None else MemoryView(
                ratio=reading.ratio, idle_ratio=self._follower.idle_ratio,
                live_bytes=reading.live_bytes, used_bytes=reading.used_bytes,
                total_bytes=reading.total_bytes, kv_pool_bytes=reading.kv_pool_bytes,
                kv_peak_usage=reading.kv_peak_usage))

    def export_state(self) -> None:
        seqs, toks = self._path.queue.limits
        metrics.get("embedfleet_budget_sequences").set(seqs, tags=self._tags)
        metrics.get("embedfleet_budget_tokens").set(toks, tags=self._tags)
        metrics.get("embedfleet_inflight_sequences").set(self._path.inflight_sequences,
                                                         tags=self._tags)
        metrics.get("embedfleet_inflight_tokens").set(self._path.inflight_tokens, tags=self._tags)
        metrics.get("embedfleet_replica_ready").set(int(self._healthy()), tags=self._tags)
        self._prefix.export()

    async def heartbeat_forever(self) -> None:
        while self._registry is not None:
            try:
                reply = HeartbeatReply.model_validate(
                    await self._registry.heartbeat.remote(self.describe()))
                override = reply.prefix_cache_override
                if override is not None and self._prefix.state == "on":
                    logger.warning("prefix caching of %s switched off fleet-wide: %s",
                                   self._path.model, override.reason)
                    self._prefix.switch_off(override.reason)
            except Exception as exc:  # the registry restarting must not kill the replica
                logger.warning("heartbeat to FleetRegistry failed: %r", exc)
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def leave(self) -> None:
        if self._registry is not None:
            self._registry.leave.remote(self.replica_id)
