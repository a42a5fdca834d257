"""The fleet's status, assembled in one place for `/v1/models`, `/ready` and `embedfleet status`.

Inputs: the deployed config (what should run), the registry's snapshot (what runs and how it is
doing) and Ray's placement view (which replicas wait for a card, and why, including a model that
can never get one: the registry's ``never`` reason, shown under ``waiting``).
"""

from __future__ import annotations

from ..config.schema import EmbedfleetConfig
from ..common.contracts import (CardStatus, FleetStatus, ModelStatus,
                         PrefixCacheView, ReplicaDescription)

NO_REPLICA_YET = PrefixCacheView(enabled=None, state="unknown", reason="no replica up yet")


def fleet_status(cfg: EmbedfleetConfig, snapshot: dict[str, list[ReplicaDescription]],
                 waiting: dict[str, str]) -> FleetStatus:
    models = []
    for m in cfg.models:
        replicas = snapshot.get(m.name, [])
        ready = sum(1 for r in replicas if r.ready)
        state = ("waiting for a card" if m.name in waiting else "serving" if ready
                 else "scaled to zero" if m.replicas.min_replicas == 0 else "starting")
        first = replicas[0] if replicas else None
        models.append(ModelStatus(
            model=m.name, min_replicas=m.replicas.min_replicas,
            max_replicas=m.replicas.max_replicas, ready=ready, state=state,
            waiting=waiting.get(m.name, ""),
            max_input_tokens=first.max_model_len if first else m.max_model_len,
            dimensions=first.dimensions if first else None,
            matryoshka_dimensions=first.matryoshka_dimensions if first else [],
            prefix_cache=first.prefix_cache if first else NO_REPLICA_YET,
            cards=[CardStatus(node=r.node, device=r.device, replica_id=r.replica_id,
                              ready=r.ready, pid=r.pid, budget=r.budget, memory=r.memory,
                              block_size=r.block_size, prefix_cache=r.prefix_cache,
                              engine_restarts=r.engine_restarts)
                   for r in replicas]))
    return FleetStatus(app=cfg.app_name, models=models)
