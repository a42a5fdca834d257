"""FleetRegistry: one small replica (no card) that knows which engine replicas are up, where.

Engine replicas send a heartbeat every few seconds with their model, card and readiness; the
router (for `/v1/models` and `/ready`) and `embedfleet status` read the snapshot. A replica whose
heartbeat is older than ``ttl_s`` no longer counts, so a dead replica drops out by itself.
"""

from __future__ import annotations

import time
from typing import Any

from ray import serve

HEARTBEAT_INTERVAL_S = 2.0
HEARTBEAT_TTL_S = 10.0


class FleetRegistry:
    def __init__(self, ttl_s: float = HEARTBEAT_TTL_S) -> None:
        self._ttl_s = ttl_s
        self._replicas: dict[str, dict[str, Any]] = {}
        # Held in this replica's memory: a registry restart forgets overrides, and the next
        # failing canary sets them again.
        self._overrides: dict[str, dict[str, Any]] = {}

    def heartbeat(self, info: dict[str, Any]) -> dict[str, Any]:
        """Record a replica; answer with what the fleet wants of it (prefix-cache override)."""
        self._replicas[info["replica_id"]] = {**info, "seen_at": time.time()}
        return {"prefix_cache_override": self._overrides.get(info["model"])}

    # -- prefix cache switched off by a failed canary: stays off until an operator clears it --
    def disable_prefix_cache(self, model: str, reason: str, canary: dict[str, Any]) -> None:
        if model not in self._overrides:
            self._overrides[model] = {"reason": reason, "canary": canary, "at": time.time()}

    def prefix_cache_override(self, model: str) -> dict[str, Any] | None:
        return self._overrides.get(model)

    def clear_prefix_cache_override(self, model: str) -> bool:
        return self._overrides.pop(model, None) is not None

    def leave(self, replica_id: str) -> None:
        self._replicas.pop(replica_id, None)

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """Live replicas grouped by model, sorted by (node, device)."""
        now = time.time()
        for rid in [r for r, i in self._replicas.items() if now - i["seen_at"] > self._ttl_s]:
            del self._replicas[rid]
        out: dict[str, list[dict[str, Any]]] = {}
        for info in self._replicas.values():
            out.setdefault(info["model"], []).append(info)
        for infos in out.values():
            infos.sort(key=lambda i: (i.get("node", ""), i.get("device", "")))
        return out

    async def check_health(self) -> None:
        return None


FleetRegistryDeployment = serve.deployment(
    FleetRegistry, name="FleetRegistry", num_replicas=1, ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1000,
)
