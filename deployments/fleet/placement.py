"""Why a model has fewer replicas than it asked for: replicas that Ray has not placed on a card.

Serve calls a replica STARTING both while it waits for a card and while it loads its engine; only
Ray's actor state tells the two apart (``PENDING_CREATION`` = no node has the resources yet). The
router's ``/ready`` and ``embedfleet status`` both report through this module, so they say the
same thing.
"""

from __future__ import annotations

import logging

logger = logging.getLogger("embedfleet.placement")


def pending_replica_actors(app_name: str) -> dict[str, int]:
    """Replica actors per deployment that Ray has not placed yet (waiting for resources).

    Blocking (Ray's state API); an unavailable state API reports nothing rather than a guess."""
    from ray.util.state import list_actors

    prefix = f"ServeReplica:{app_name}:"
    counts: dict[str, int] = {}
    try:
        actors = list_actors(filters=[("state", "=", "PENDING_CREATION")], limit=10000)
    except Exception as exc:
        logger.debug("Ray state API unavailable: %r", exc)
        return counts
    for a in actors:
        if a.class_name.startswith(prefix):
            name = a.class_name[len(prefix):]
            counts[name] = counts.get(name, 0) + 1
    return counts


def card_counts(resource: str) -> tuple[float, float]:
    """(free, total) cards in the cluster, from Ray's resource view."""
    import ray

    return ray.available_resources().get(resource, 0), ray.cluster_resources().get(resource, 0)


def waiting_message(waiting: int, resource: str, free: float, total: float) -> str:
    if not waiting:
        return ""
    return (f"{waiting} replica(s) waiting for a card: each needs {{\"{resource}\": 1}}; "
            f"{free:g} of the cluster's {total:g} cards are free")


def waiting_reasons(app_name: str, resource: str, deployments: dict[str, str]) -> dict[str, str]:
    """{model: why its replicas wait} for the models (``{deployment name: model}``) that wait."""
    pending = pending_replica_actors(app_name)
    if not any(pending.get(d) for d in deployments):
        return {}
    free, total = card_counts(resource)
    return {model: waiting_message(pending[d], resource, free, total)
            for d, model in deployments.items() if pending.get(d)}


# A replica being created is "waiting for a card" only after this long with none free: a
# replacement usually needs the card its predecessor (or a replica scaling down) is still giving
# back, and the free count shows it a moment later. Counted as starting meanwhile, so a request
# is held for it instead of refused (seen in the soak: 503s 2 s into an engine replacement).
PLACEMENT_GRACE_S = 10.0


def blocked_replicas(creating: int, free_cards: float, creating_for_s: float,
                     reclaimable_cards: int = 0) -> int:
    """How many of ``creating`` replica actors wait for a card that will not come by itself.

    ``reclaimable_cards``: cards other models hold above their ``min_replicas``. Their autoscaler
    gives them back when their load drops, so a replica waiting for one is still coming. Seen in
    the soak: a killed engine's card went to another model scaling up; its replacement waited
    ~25 s for that model to scale back down, and the calls held for it were refused with 503 at
    the grace mark although the card came back 10 s later."""
    if not creating or free_cards >= 1 or reclaimable_cards >= 1:
        return 0
    return creating if creating_for_s >= PLACEMENT_GRACE_S else 0


def reclaimable_cards(alive: dict[str, int], min_replicas: dict[str, int], but: str) -> int:
    """Cards held by replicas above their deployment's ``min_replicas``, other than ``but``'s.
    Only the engine deployments named in ``min_replicas`` hold cards: the router, registry and
    governor replicas in ``alive`` hold none (counting the two routers made every replacement
    look "coming" and broke the fail-fast 503: caught by tests/test_e2e_reliability.py)."""
    return sum(max(0, n - min_replicas[d]) for d, n in alive.items()
               if d != but and d in min_replicas)


# Ray actor states of a replica that exists or is being made (DEAD ones are gone for good:
# Serve replaces them with a new actor).
_LIVE_STATES = ("ALIVE", "PENDING_CREATION", "DEPENDENCIES_UNREADY", "RESTARTING")


class ReplicaActors:
    """One look at Ray's actor table for an application's replicas: per deployment, the
    (node id, pid) of ALIVE replica actors and the number still being created."""

    def __init__(self, app_name: str) -> None:
        from ray.util.state import list_actors

        prefix = f"ServeReplica:{app_name}:"
        self.alive: dict[str, set[tuple[str, int]]] = {}
        self.creating: dict[str, int] = {}
        actors = list_actors(filters=[("state", "!=", "DEAD")], limit=10000)
        for a in actors:
            if not a.class_name.startswith(prefix) or a.state not in _LIVE_STATES:
                continue
            name = a.class_name[len(prefix):]
            if a.state == "ALIVE":
                self.alive.setdefault(name, set()).add((a.node_id, a.pid))
            else:
                self.creating[name] = self.creating.get(name, 0) + 1
