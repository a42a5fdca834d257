"""FleetRegistry: one small replica (no card) that knows which engine replicas are up, where.

Engine replicas send their ``ReplicaDescription`` every few seconds; the router (for
`/v1/models` and `/ready`) and `embedfleet status` read the snapshot. A replica whose heartbeat
is older than ``ttl_s`` no longer counts, so a dead replica drops out by itself. The registry also
holds the fleet's prefix-cache overrides (a canary failed: off on every replica of the model),
kept durably in Ray's internal KV (fleet.durable) so that a restarted registry still enforces
them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from ..config.schema import parse_config
from ..common.contracts import (CanaryView, FleetStatus, HeartbeatReply,
                         ModelReadiness, Override, ReplicaDescription)
from .durable import DurableStore
from .placement import (SEALED_GRACE_S, ReplicaActors, blocked_replicas, card_counts,
                        cards_held_for_good, cluster_can_grow, never_message,
                        reclaimable_cards, waiting_message, waiting_reasons)
from .status import fleet_status
from ..config.ray_options import engine_deployment_name

logger = logging.getLogger("embedfleet.registry")

HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TTL_S = 10.0
OVERRIDES = "prefix_cache_override"  # durable kind: one key per model
READINESS_TTL_S = 1.0  # routers poll readiness about once a second; one actor-table read serves all


def serving_now(records: list[ReplicaDescription],
                alive: set[tuple[str, int]] | None = None) -> int:
    """How many replicas take calls now: healthy, their engine gate open (one mid-swap holds its
    calls, so it counts as starting), and, when ``alive`` is known, their actor still ALIVE.
    A heartbeat pickled by a replica older than the ``serving`` field has no such attribute
    (pydantic restores the old ``__dict__`` as is, without defaults): it serves when ready."""
    return sum(1 for r in records if r.ready and getattr(r, "serving", True)
               and (alive is None or (r.node_id, r.pid) in alive))


class FleetRegistry:
    def __init__(self, config: dict[str, Any] | None = None,
                 ttl_s: float = HEARTBEAT_TTL_S) -> None:
        # The deployed config: what `embedfleet status` and /v1/models describe.
        self.cfg = parse_config(config, "FleetRegistry args") if config is not None else None
        self._ttl_s = ttl_s
        self._replicas: dict[str, ReplicaDescription] = {}
        # Overrides are written through to the GCS and reloaded here: a restarted registry
        # keeps a corrupting cache off. Without the deployed config (unit tests) they live
        # in memory only.
        self._store = (DurableStore.connected(self.cfg.app_name) if self.cfg is not None
                       else None)
        self._overrides: dict[str, Override] = (
            self._store.items(OVERRIDES, Override) if self._store is not None else {})
        self._readiness: dict[str, ModelReadiness] = {}
        self._reading: asyncio.Future[None] | None = None  # the actor-table read under way
        self._creating_since: dict[str, float] = {}  # deployment -> first seen creating a replica
        self._sealed_since: float | None = None  # every card first seen held for good
        self._held_said: bool | None = None  # the "held for good" decision last logged
        if self._overrides:
            logger.warning("prefix-cache overrides reloaded from the GCS: %s",
                           sorted(self._overrides))

    def heartbeat(self, info: ReplicaDescription) -> HeartbeatReply:
        """Record a replica; answer with what the fleet wants of it (prefix-cache override)."""
        self._replicas[info.replica_id] = info.model_copy(update={"seen_at": time.time()})
        return HeartbeatReply(prefix_cache_override=self._overrides.get(info.model))

    # -- prefix cache switched off by a failed canary: stays off until an operator clears it --
    def disable_prefix_cache(self, model: str, reason: str, canary: CanaryView | None) -> None:
        if model not in self._overrides:
            self._overrides[model] = Override(reason=reason, canary=canary, at=time.time())
            if self._store is not None:
                self._store.put(OVERRIDES, model, self._overrides[model])

    def prefix_cache_override(self, model: str) -> Override | None:
        return self._overrides.get(model)

    def clear_prefix_cache_override(self, model: str) -> bool:
        if self._store is not None:
            self._store.delete(OVERRIDES, model)
        return self._overrides.pop(model, None) is not None

    def leave(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def snapshot(self) -> dict[str, list[ReplicaDescription]]:
        """Live replicas grouped by model, sorted by (node, device)."""
        now = time.time()
        for rid in [r for r, i in self._replicas.items() if now - i.seen_at > self._ttl_s]:
            del self._replicas[rid]
        out: dict[str, list[ReplicaDescription]] = {}
        for info in self._replicas.values():
            out.setdefault(info.model, []).append(info)
        for infos in out.values():
            infos.sort(key=lambda i: (i.node, i.device))
        return out

    async def waiting(self) -> dict[str, str]:
        """{model: why replicas wait for a card}, from Ray's state API (off the event loop)."""
        if self.cfg is None:
            return {}
        deployments = {engine_deployment_name(m.name): m.name for m in self.cfg.models}
        try:
            return await asyncio.wait_for(asyncio.to_thread(
                waiting_reasons, self.cfg.app_name, self.cfg.platform.card_resource,
                deployments), timeout=10)
        except Exception as exc:
            logger.warning("placement query failed: %r", exc)
            return {}

    async def readiness(self) -> dict[str, ModelReadiness]:
        """{model: can it serve now}: the last reading of Ray's actor table, refreshed in the
        background once it is ``READINESS_TTL_S`` old (routers' fail-fast). Only the first call
        waits for a reading: a reading slower than a router's 5 s fetch timeout (a starved
        machine's state API) must not time out every router's fetch, forever."""
        if self.cfg is None:
            return {}
        fresh = [r.checked_at for r in self._readiness.values()]
        stale = not fresh or time.time() - min(fresh) >= READINESS_TTL_S
        if stale and (self._reading is None or self._reading.done()):
            self._reading = asyncio.ensure_future(self._read_readiness())
        if not self._readiness and self._reading is not None:
            await asyncio.shield(self._reading)
        return self._readiness

    async def _read_readiness(self) -> None:
        snapshot = self.snapshot()
        try:
            self._readiness = await asyncio.wait_for(
                asyncio.to_thread(self._readiness_of, snapshot), timeout=10)
        except Exception as exc:  # no actor table: what the heartbeats say, no more
            logger.warning("readiness from Ray's actor table failed: %r", exc)
            self._readiness = self._readiness_from_records(snapshot)

    def _readiness_of(self, snapshot: dict[str, list[ReplicaDescription]]
                      ) -> dict[str, ModelReadiness]:
        # A heartbeat says "ready" for up to ttl_s after its replica died; only replicas whose
        # actor is still ALIVE count. ALIVE but not serving is an engine loading (or swapping);
        # an actor still being created is "starting" if a card is free, or will be soon
        # (placement.PLACEMENT_GRACE_S), else it waits for one. A model with no replica at all
        # "can never" get one once every card has been held for good for SEALED_GRACE_S.
        assert self.cfg is not None
        actors = ReplicaActors(self.cfg.app_name)
        resource = self.cfg.platform.card_resource
        free, total = card_counts(resource)
        now = time.time()
        out = {}
        counts = {d: len(a) for d, a in actors.alive.items()}
        mins = {engine_deployment_name(m.name): m.replicas.min_replicas for m in self.cfg.models}
        never = self._never_reasons(counts, mins, resource, free, total, now)
        for m in self.cfg.models:
            d = engine_deployment_name(m.name)
            alive = actors.alive.get(d, set())
            ready = serving_now(snapshot.get(m.name, []), alive)
            creating = actors.creating.get(d, 0)
            if creating:
                since = self._creating_since.setdefault(d, now)
            else:
                self._creating_since.pop(d, None)
                since = now
            blocked = blocked_replicas(creating, free, now - since,
                                       reclaimable_cards(counts, mins, but=d))
            out[m.name] = ModelReadiness(
                ready=ready, starting=len(alive) - ready + creating - blocked,
                waiting=waiting_message(blocked, resource, free, total),
                never=never.get(m.name, "") if not alive else "", checked_at=now)
        return out

    def _never_reasons(self, counts: dict[str, int], mins: dict[str, int], resource: str,
                       free: float, total: float, now: float) -> dict[str, str]:
        """{model: why it can never get a card}, for every model, once every card has been held
        for good (placement.cards_held_for_good) for SEALED_GRACE_S; {} before that."""
        assert self.cfg is not None
        can_grow = cluster_can_grow(resource, total) if free < 1 and total >= 1 else True
        held = cards_held_for_good(counts, mins, free, total, can_grow)
        if (held is not None) is not self._held_said:  # the first decision, or a change
            self._held_said = held is not None
            logger.info("cards held for good: %s (free %g of %g %s, cluster can grow: %s, "
                        "alive replicas %s)", held, free, total, resource, can_grow, counts)
        if held is None:
            self._sealed_since = None
            return {}
        if self._sealed_since is None:
            self._sealed_since = now
        if now - self._sealed_since < SEALED_GRACE_S:
            return {}
        names = {engine_deployment_name(m.name): m.name for m in self.cfg.models}
        holders = {names[d]: n for d, n in held.items()}
        model_mins = {names[d]: n for d, n in mins.items()}
        return {m.name: never_message(m.name, holders, model_mins, resource, total)
                for m in self.cfg.models}

    def _readiness_from_records(self, snapshot: dict[str, list[ReplicaDescription]]
                                ) -> dict[str, ModelReadiness]:
        assert self.cfg is not None
        now = time.time()
        out = {}
        for m in self.cfg.models:
            records = snapshot.get(m.name, [])
            ready = serving_now(records)
            out[m.name] = ModelReadiness(ready=ready, starting=len(records) - ready,
                                         checked_at=now)
        return out

    async def status(self) -> FleetStatus:
        """The deployed fleet's status (fleet.status.fleet_status, the one assembly)."""
        if self.cfg is None:
            raise RuntimeError("this FleetRegistry was started without the deployed config")
        waiting = await self.waiting()
        never = {m: r.never for m, r in (await self.readiness()).items() if r.never}
        return fleet_status(self.cfg, self.snapshot(), {**waiting, **never})

    async def check_health(self) -> None:
        return None
