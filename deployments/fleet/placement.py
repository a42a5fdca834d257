"""Why a model has fewer replicas than it asked for: replicas that Ray has not placed on a card.

Serve calls a replica STARTING both while it waits for a card and while it loads its engine; only
Ray's actor state tells the two apart (``PENDING_CREATION`` = no node has the resources yet). The
router's ``/ready`` and ``embedfleet status`` both report through this module, so they say the
same thing.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping

logger = logging.getLogger("embedfleet.placement")


def own_cluster_actors(filters: list[tuple[str, str, str]]) -> list:
    """Ray's actors matching ``filters``, from the cluster this process belongs to.

    Ray's state API, given no address, takes the machine's "latest" cluster
    (/tmp/ray/ray_current_cluster, the last `ray start` here) when several run on one machine,
    and points this process's internal KV at it as a side effect. A replica of a second cluster
    on the machine then read the first one's actor table and found none of its own replicas
    (a never-placeable model was held, not refused; seen beside the test session's cluster).
    Its own GCS address says which cluster is meant."""
    import ray
    from ray.util.state import list_actors

    return list_actors(address=ray.get_runtime_context().gcs_address, filters=filters,
                       limit=10000)


def pending_replica_actors(app_name: str) -> dict[str, int]:
    """Replica actors per deployment that Ray has not placed yet (waiting for resources).

    Blocking (Ray's state API); an unavailable state API reports nothing rather than a guess."""
    prefix = f"ServeReplica:{app_name}:"
    counts: dict[str, int] = {}
    try:
        actors = own_cluster_actors([("state", "=", "PENDING_CREATION")])
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


# -- a card that can never come back --------------------------------------------------------
# Autoscaler v1 on a cluster of nodes started by hand (`ray start`, `embedfleet up`) runs with a
# read-only provider: it launches nothing and names each node ``node_<node id>``.
_READ_ONLY_NODE_TYPE = re.compile(r"^node_[0-9a-f]+$")


def autoscaler_may_add_cards(resource: str, total: float,
                             max_resources: Mapping[str, float] | None,
                             v1_status: Mapping | None) -> bool:
    """Whether Ray's autoscaler may still add nodes with cards: True unless Ray says it cannot.

    ``max_resources``: autoscaler v2's ceiling per resource (None: no v2 cluster config).
    ``v1_status``: autoscaler v1's status report (None: none written). With neither, nothing is
    known, and a request is held as before rather than refused on a guess."""
    if max_resources is not None:
        return max_resources.get(resource, 0) > total
    report = (v1_status or {}).get("autoscaler_report")
    if not report:
        return True
    types = {*(report.get("active_nodes") or {}), *(report.get("idle_nodes") or {}),
             *(report.get("pending_launches") or {}),
             *(n[1] for n in report.get("pending_nodes") or [])}
    return not types or not all(_READ_ONLY_NODE_TYPE.match(t) for t in types)


def cluster_can_grow(resource: str, total: float) -> bool:
    """``autoscaler_may_add_cards`` from the running cluster's GCS (blocking)."""
    from ray._private import ray_constants, state
    from ray.experimental import internal_kv

    try:  # private APIs: tests/support/ray_touch_points.py checks them
        max_resources = state.state.get_max_resources_from_cluster_config()
        raw = None if max_resources is not None else internal_kv._internal_kv_get(
            ray_constants.DEBUG_AUTOSCALING_STATUS)
        v1_status = json.loads(raw) if raw else None
    except Exception as exc:  # unknown: hold, as before
        logger.debug("autoscaler state unavailable: %r", exc)
        return True
    return autoscaler_may_add_cards(resource, total, max_resources, v1_status)


# Cards held for good only after this long: a replica scaling down or replaced frees its card a
# moment after its actor leaves ALIVE, and Ray's free count shows it a moment later.
SEALED_GRACE_S = PLACEMENT_GRACE_S


def cards_held_for_good(alive: Mapping[str, int], min_replicas: Mapping[str, int],
                        free_cards: float, total_cards: float,
                        can_grow: bool) -> dict[str, int] | None:
    """{engine deployment: cards} when no card can ever come back, else None.

    Never while a card is free, the cluster can grow, or a model holds more than its
    ``min_replicas`` (its autoscaler gives the extra back). The ALIVE engine replicas must
    account for every card in use: a card held by a replica still being made (a replacement
    about to be placed), or by something outside this application, may come back."""
    if can_grow or free_cards >= 1 or total_cards < 1:
        return None
    held = {d: n for d, n in alive.items() if d in min_replicas and n > 0}
    if sum(held.values()) != total_cards - free_cards:
        return None
    if any(n > min_replicas[d] for d, n in held.items()):
        return None
    return held


def never_message(model: str, holders: Mapping[str, int], min_replicas: Mapping[str, int],
                  resource: str, total_cards: float) -> str:
    """Why ``model`` can never get a card; ``holders``: {model: cards} at their minimum."""
    who = ", ".join(f"'{m}' ({n} at min_replicas={min_replicas[m]})"
                    for m, n in sorted(holders.items()))
    return (f"model '{model}' can never get a card: all {total_cards:g} {resource} card(s) of "
            f"the cluster are held by {who}, which never scale below their min_replicas, and "
            f"the cluster cannot grow; lower {'their' if len(holders) > 1 else 'its'} "
            f"min_replicas or add cards")


def unreachable_max(models: Mapping[str, tuple[int, int]], cards: int) -> dict[str, int]:
    """{model: replicas it can reach} for models (``{name: (min, max)}``) whose
    ``max_replicas`` a cluster of ``cards`` that cannot grow never reaches: the others' minimums
    always hold their cards."""
    mins = sum(lo for lo, _ in models.values())
    out = {}
    for name, (lo, hi) in models.items():
        reach = max(0, cards - (mins - lo))
        if reach < hi:
            out[name] = reach
    return out


# Ray actor states of a replica that exists or is being made (DEAD ones are gone for good:
# Serve replaces them with a new actor).
_LIVE_STATES = ("ALIVE", "PENDING_CREATION", "DEPENDENCIES_UNREADY", "RESTARTING")


class ReplicaActors:
    """One look at Ray's actor table for an application's replicas: per deployment, the
    (node id, pid) of ALIVE replica actors and the number still being created."""

    def __init__(self, app_name: str) -> None:
        prefix = f"ServeReplica:{app_name}:"
        self.alive: dict[str, set[tuple[str, int]]] = {}
        self.creating: dict[str, int] = {}
        actors = own_cluster_actors([("state", "!=", "DEAD")])
        for a in actors:
            if not a.class_name.startswith(prefix) or a.state not in _LIVE_STATES:
                continue
            name = a.class_name[len(prefix):]
            if a.state == "ALIVE":
                self.alive.setdefault(name, set()).add((a.node_id, a.pid))
            else:
                self.creating[name] = self.creating.get(name, 0) + 1
