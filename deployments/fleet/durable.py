"""Control state that must outlive the replica holding it: kept in Ray's GCS-backed internal KV.

The FleetRegistry's prefix-cache overrides (a canary failed: off fleet-wide until an operator
clears it) and the governor's last limits live in their replicas' memory, and Serve restarts a
dead replica with a fresh one. Without this, a registry restart would switch a corrupting cache
back on, and a governor restart during a memory surge would start again at the ceiling.

The GCS keeps the KV for the cluster's lifetime (and across GCS restarts when it runs with
external Redis, as KubeRay's GCS fault tolerance does). One namespace per Serve application, so
two applications on one cluster never read each other's state. Values are the contracts module's
pydantic models, stored as JSON; a value that no longer parses is dropped with a warning rather
than crashing the replica that reads it.
"""

from __future__ import annotations

import logging
from typing import TypeVar

from pydantic import BaseModel, ValidationError

logger = logging.getLogger("embedfleet.durable")

M = TypeVar("M", bound=BaseModel)
# No ':' in a namespace: the GCS stores "@namespace_<ns>:<key>" and, listing keys, cuts at the
# first ':' — a namespace with one gets listed keys that no longer name anything.
NAMESPACE_PREFIX = "embedfleet-"


class DurableStore:
    """``put``/``get``/``delete``/``items`` of typed values under ``<kind>/<key>`` in one app's
    namespace. Every call reaches the GCS: callers use it on changes and at start-up, not per
    request."""

    def __init__(self, app_name: str) -> None:
        self.namespace = NAMESPACE_PREFIX + app_name

    @classmethod
    def connected(cls, app_name: str) -> DurableStore | None:
        """The app's store when this process is connected to a Ray cluster (a Serve replica
        always is), else None: outside Ray, state stays in memory."""
        return cls(app_name) if cls._kv()._internal_kv_initialized() else None

    @staticmethod
    def _kv():  # Ray's internal KV (a private API: tests/support/ray_touch_points.py checks it)
        from ray.experimental import internal_kv

        return internal_kv

    def put(self, kind: str, key: str, value: BaseModel) -> None:
        self._kv()._internal_kv_put(f"{kind}/{key}", value.model_dump_json(), overwrite=True,
                                    namespace=self.namespace)

    def get(self, kind: str, key: str, model: type[M]) -> M | None:
        raw = self._kv()._internal_kv_get(f"{kind}/{key}", namespace=self.namespace)
        return None if raw is None else self._parse(kind, key, raw, model)

    def delete(self, kind: str, key: str) -> None:
        self._kv()._internal_kv_del(f"{kind}/{key}", namespace=self.namespace)

    def items(self, kind: str, model: type[M]) -> dict[str, M]:
        kv = self._kv()
        out: dict[str, M] = {}
        for full in kv._internal_kv_list(f"{kind}/", namespace=self.namespace):
            name = full.decode() if isinstance(full, bytes) else full
            name = name[name.find(f"{kind}/"):]  # defensively: whatever the GCS left before it
            raw = kv._internal_kv_get(name, namespace=self.namespace)
            key = name[len(kind) + 1:]
            value = None if raw is None else self._parse(kind, key, raw, model)
            if value is not None:
                out[key] = value
        return out

    def _parse(self, kind: str, key: str, raw: bytes, model: type[M]) -> M | None:
        try:
            return model.model_validate_json(raw)
        except ValidationError as exc:
            logger.warning("dropping unreadable %s/%s in %s: %s", kind, key, self.namespace, exc)
            return None
