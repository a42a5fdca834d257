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

    def heartbeat(self, info: dict[str, Any]) -> None:
        self._replicas[info["replica_id"]] = {**info, "seen_at": time.time()}

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
            infos.sort(key=lambda i: (i.get("node_ip", ""), i.get("device", "")))
        return out

    async def check_health(self) -> None:
        return None


FleetRegistryDeployment = serve.deployment(
    FleetRegistry, name="FleetRegistry", num_replicas=1, ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=1000,
)
