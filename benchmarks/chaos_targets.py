"""Which process each fault hits, read from Ray's actor records; pure, so it is unit-tested.

The records are what ``ray.util.state.list_actors`` returns (``ActorState``; dicts are accepted
too). Serve names its actors' classes ``ServeReplica:<app>:<deployment>``, ``ProxyActor`` and
``ServeController``; the deployment names come from deployments/config/ray_options.py, the one place that
names them, so a renamed deployment cannot leave the chaos tool aiming at nothing.
"""

from __future__ import annotations

import math
import random
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass, is_dataclass
from typing import Any, Literal, get_args

from ..deployments.config.ray_options import (GOVERNOR_NAME, REGISTRY_NAME, ROUTER_NAME,
                                   engine_deployment_name)

# The order is the soak's: --soak's eleven minutes hold ten faults, one of each kind; the three
# kinds of the first recorded soak come first, and engine faults alternate with control-plane
# ones so each window shows one kind of trouble.
FaultKind = Literal["kill-replica", "kill-engine", "stop-prometheus", "kill-proxy", "pause-engine",
                    "kill-governor", "flood-kill", "kill-controller", "kill-registry",
                    "kill-router"]
FAULT_KINDS: tuple[str, ...] = get_args(FaultKind)

ENGINE_PREFIX = engine_deployment_name("")
ENGINE_REPLICA = re.compile(rf"ServeReplica:[^:]+:({re.escape(ENGINE_PREFIX)}.+)")
# A flood large enough to need more connections than this is refused rather than sent: the tool
# must stay bounded, and the report says when the queue could not be filled.
MAX_BURST = 1024
BURST_OVERFLOW = 1.5  # a burst this many times the admission bound, so some of it must be refused


@dataclass(frozen=True)
class Target:
    """The actors a fault kind may hit."""

    what: str                # for messages: "no alive <what> found"
    class_name: str          # regex, full match on ActorState.class_name; {app} = the Serve app
    ray_restarts: bool = False  # True: Ray restarts it (the controller); else Serve replaces it


def _replica(deployment: str) -> str:
    return "ServeReplica:{app}:" + re.escape(deployment)


ENGINE = Target("engine replica", _replica(ENGINE_PREFIX) + ".+")
TARGETS: dict[str, Target] = {  # every kind but stop-prometheus, which is no Ray actor
    "kill-replica": ENGINE, "kill-engine": ENGINE, "pause-engine": ENGINE, "flood-kill": ENGINE,
    "kill-proxy": Target("Serve proxy (ProxyActor)", "ProxyActor"),
    # max_restarts=-1 (ray/serve/_private/default_impl.py): killed with restart allowed, Ray
    # brings it back; killed for good, Serve would be gone for the rest of the shared cluster.
    "kill-controller": Target("Serve controller", "ServeController", ray_restarts=True),
    "kill-governor": Target("governor replica", _replica(GOVERNOR_NAME)),
    "kill-registry": Target("registry replica", _replica(REGISTRY_NAME)),
    # With HAProxy ingress, what it held is replayed on another Router (options.HAPROXY_REPLAY_ENV)
    "kill-router": Target("Router replica", _replica(ROUTER_NAME)),
}


def as_record(actor: Any) -> dict[str, Any]:
    """An ``ActorState`` (or a dict already) as a dict."""
    return asdict(actor) if is_dataclass(actor) else dict(actor)


def _class_pattern(kind: str, app: str | None) -> re.Pattern[str]:
    """The actor class names ``kind`` hits, in ``app`` (None: any app)."""
    return re.compile(TARGETS[kind].class_name.format(app=re.escape(app) if app else "[^:]+"))


def find_targets(kind: str, actors: Iterable[Any], app: str | None = None) -> list[dict[str, Any]]:
    """The alive, started actors ``kind`` may hit, ordered by name so a seeded choice repeats.

    ``app`` limits Serve replicas to one application (from --config); None = any app."""
    pattern = _class_pattern(kind, app)
    hits = [r for r in map(as_record, actors) if r.get("state") == "ALIVE"
            and (r.get("pid") or 0) > 0  # 0 = not created yet: nothing to kill
            and pattern.fullmatch(r.get("class_name") or "")]
    return sorted(hits, key=lambda r: (r.get("name") or "", r.get("pid") or 0))


def _ever_had_a_router(actors: list[Any], app: str | None) -> bool:
    """Whether Ray has seen a Router replica of ``app`` (any app: None), in any state."""
    pattern = _class_pattern("kill-router", app)
    return any(pattern.fullmatch(as_record(a).get("class_name") or "") for a in actors)


def pick_target(kind: str, actors: Iterable[Any], rng: random.Random,
                app: str | None = None) -> dict[str, Any]:
    actors = list(actors)
    hits = find_targets(kind, actors, app)
    if not hits and kind == "kill-router" and not _ever_had_a_router(actors, app):
        # a one-model app's engine replicas take HTTP themselves (router.ingress): they are
        # its ingress, and HAProxy replays what a killed one held as it would a Router's. An
        # app whose Routers are all being replaced just now is not such an app.
        hits = find_targets("kill-replica", actors, app)
    if not hits:
        raise RuntimeError(f"no alive {TARGETS[kind].what} found")
    return rng.choice(hits)


def serve_actors(actors: Iterable[Any]) -> list[dict[str, Any]]:
    """Alive, started Serve actors (proxy, controller, replicas): the processes whose memory the
    report follows."""
    return [r for r in map(as_record, actors) if r.get("state") == "ALIVE"
            and (r.get("pid") or 0) > 0 and process_role(r.get("class_name") or "") is not None]


def engine_replicas(actors: Iterable[Any]) -> list[dict[str, Any]]:
    """Alive Serve replica actors of `engine-*` deployments, of any app."""
    return find_targets("kill-replica", actors)


def model_of(class_name: str) -> str | None:
    """The model an engine replica serves (its deployment name without the prefix)."""
    m = ENGINE_REPLICA.fullmatch(class_name)
    return m.group(1)[len(ENGINE_PREFIX):] if m else None


def process_role(class_name: str) -> str | None:
    """The memory-report role of a Serve actor: its deployment, 'proxy' or 'controller'."""
    if class_name == "ProxyActor":
        return "proxy"
    if class_name == "ServeController":
        return "controller"
    if class_name.startswith("ServeReplica:"):
        return class_name.split(":", 2)[2]
    return None


def is_actor_process(cmdline: list[str], class_name: str) -> bool:
    """Whether a process is that actor's worker: Ray titles it ``ray::<class_name>`` (with
    ``.<method>`` while a call runs). Guards a signal against a pid reused since the listing,
    or one that is another node's numbering."""
    words = " ".join(cmdline).split()
    title = f"ray::{class_name}"
    return bool(words) and (words[0] == title or words[0].startswith(title + "."))


def engine_core_pids(children: Iterable[tuple[int, str, list[str]]]) -> list[int]:
    """Of a replica's child processes (pid, name, cmdline), the vLLM engine core(s); vLLM sets the
    process title to VLLM::EngineCore."""
    return [pid for pid, name, cmd in children
            if "EngineCore" in name or (cmd and "EngineCore" in cmd[0])]


def burst_size(max_sequences: int, max_waiting: int, replicas: int,
               cap: int = MAX_BURST) -> tuple[int, int]:
    """(requests to send, the admission bound) for a burst that overfills a model's queues.

    The bound is what the model can hold at once, in one-text calls (one sequence each): every
    replica's budget plus its own queue (Serve's max_ongoing_requests, deployments/config/ray_options.py
    ``serve_queue_limits``) plus Serve's queue in front of them (max_queued_requests, the same
    number), both capped at ``MAX_ONGOING_REQUESTS``."""
    from ..deployments.config.ray_options import MAX_ONGOING_REQUESTS

    per_replica = min(max_sequences + max_waiting, MAX_ONGOING_REQUESTS)
    bound = max(replicas, 1) * per_replica + per_replica
    return min(cap, math.ceil(bound * BURST_OVERFLOW)), bound


# Ray 2.60's REPLICA_HEALTH_CHECK_UNHEALTHY_THRESHOLD: failures in a row before Serve replaces it
SERVE_UNHEALTHY_AFTER_FAILURES = 3


def pause_seconds(health_stall_timeout_s: float, health_check_period_s: float) -> float:
    """How long a paused engine stays stopped by default: a hung card. The replica reports it
    stalled once its health probe has waited health_stall_timeout_s, and Serve replaces it after
    three failed checks in a row; one more period of margin."""
    return health_stall_timeout_s + (SERVE_UNHEALTHY_AFTER_FAILURES + 1) * health_check_period_s
