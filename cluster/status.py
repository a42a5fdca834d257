"""`embedfleet status` and `embedfleet prefix-cache`: what is deployed, read from the cluster.

Nothing here reads a config file: every Serve application that carries an embedfleet
FleetRegistry is asked for its ``FleetStatus`` (assembled by ``fleet.status``, the same code
behind `/v1/models` and `/ready`), and Serve adds its own word on each deployment (replica
states, messages).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from pydantic import BaseModel, ConfigDict

from ..deployments.common.contracts import FleetStatus, ModelStatus
from ..deployments.config.ray_options import REGISTRY_NAME, engine_deployment_name


class ServeView(BaseModel):
    """Serve's word on one engine deployment."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    deployment_status: str
    message: str
    replica_states: dict[str, int]


class AppStatus(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    app: str
    app_status: str
    app_message: str
    settled: bool
    """Every replica of every deployment is running or waiting for a card; none is loading its
    engine or stopping (a rolling update under way)."""
    fleet: FleetStatus | None
    serve: dict[str, ServeView]
    error: str = ""


def _states(dep: Any) -> dict[str, int]:
    return {str(k.value if hasattr(k, "value") else k): v
            for k, v in (dep.replica_states or {}).items()}


def connect(address: str | None = None) -> None:
    """Make this process a driver of the cluster once, for the rest of the command.

    Not a connection per call: Serve's handle threads (its router loop and long-poll client)
    outlive ``ray.shutdown()``, and their next call re-connects by Ray's auto-init, with Ray's
    defaults: every cluster log then streams to the operator's terminal, and a later
    ``ray.init`` here raises "called ray.init twice". CI saw `prefix-cache --clear` exit 1 so,
    between the status read and the clear. Ray's exit hook disconnects."""
    import ray

    if not ray.is_initialized():
        ray.init(address=address or "auto", namespace="serve", logging_level="ERROR",
                 log_to_driver=False)


def collect(address: str | None = None, app: str | None = None) -> list[AppStatus]:
    """Every embedfleet application deployed (or just ``app``), from the running cluster."""
    from ray import serve

    from ..deployments.fleet.placement import pending_replica_actors

    connect(address)
    out = []
    for name, a in serve.status().applications.items():
        if app not in (None, name) or REGISTRY_NAME not in a.deployments:
            continue
        fleet, error = None, ""
        try:
            handle = serve.get_deployment_handle(REGISTRY_NAME, name)
            fleet = handle.status.remote().result(timeout_s=30)
        except Exception as exc:  # registry not up yet
            error = f"FleetRegistry did not answer: {exc!r}"
        pending = pending_replica_actors(name)
        settled = all(sum(v for k, v in _states(d).items() if k != "RUNNING")
                      == pending.get(n, 0) for n, d in a.deployments.items())
        serve_view = {}
        for m in (fleet.models if fleet else []):
            dep = a.deployments.get(engine_deployment_name(m.model))
            serve_view[m.model] = ServeView(
                deployment_status=str(dep.status.value) if dep else "NOT_DEPLOYED",
                message=dep.message if dep else "", replica_states=_states(dep) if dep
                else {})
        out.append(AppStatus(app=name, app_status=str(a.status.value),
                             app_message=a.message, settled=settled, fleet=fleet,
                             serve=serve_view, error=error))
    return out


def _print_model(m: ModelStatus, serve: ServeView | None) -> None:
    states = ", ".join(f"{k}={v}" for k, v in sorted((serve.replica_states if serve else
                                                      {}).items()))
    print(f"  model {m.model}: {serve.deployment_status if serve else '?'}, {m.ready} ready "
          f"({m.state}) [{states or 'no replicas'}]")
    for c in m.cards:
        b = c.budget
        print(f"    card {c.node}/{c.device}: replica {c.replica_id} "
              f"{'ready' if c.ready else 'NOT ready'}; budget {b.max_sequences} seqs / "
              f"{b.max_tokens} tokens{' (STALE)' if b.stale else ''} — {b.reason}")
    if m.waiting:
        print(f"    waiting: {m.waiting}")
    if m.state == "scaled to zero":
        print("    scaled to zero: the next request starts a replica (and is held until it is "
              "ready)")
    if serve and serve.message:
        print(f"    serve says: {serve.message}")
    pc = m.prefix_cache
    print(f"    prefix cache: {pc.state} ({pc.reason})")


def cmd_status(args: argparse.Namespace) -> int:
    apps = collect(args.address, args.app)
    if args.json:
        print(json.dumps([a.model_dump(mode="json") for a in apps], indent=2))
        return 0
    if not apps:
        print("no embedfleet application is deployed on this cluster")
        return 1
    for a in apps:
        print(f"application {a.app}: {a.app_status}" + (f" — {a.error}" if a.error else ""))
        for m in (a.fleet.models if a.fleet else []):
            _print_model(m, a.serve.get(m.model))
    return 0


def cmd_prefix_cache(args: argparse.Namespace) -> int:
    """Show the fleet's prefix-cache overrides (set when a canary failed), or clear one."""
    from ray import serve

    apps = [a for a in collect(args.address, args.app) if a.fleet is not None]
    if not apps:
        print("no embedfleet application is deployed on this cluster")
        return 1
    for a in apps:
        registry = serve.get_deployment_handle(REGISTRY_NAME, a.app)
        models = [m.model for m in a.fleet.models]
        if args.clear:
            if args.clear not in models:
                print(f"error: --clear {args.clear!r}: not a model of application {a.app} "
                      f"({', '.join(models)})", file=sys.stderr)
                return 2
            cleared = registry.clear_prefix_cache_override.remote(args.clear).result(
                timeout_s=30)
            print(f"{args.clear}: override cleared" if cleared else
                  f"{args.clear}: no override to clear")
            if cleared:
                print("  new replicas follow the model's prefix_cache setting again; "
                      "running replicas keep caching off until they restart")
            continue
        for name in models:
            o = registry.prefix_cache_override.remote(name).result(timeout_s=30)
            print(f"{name}: " + (f"OFF by override since {time.ctime(o.at)} — {o.reason}"
                                 if o else "no override"))
    return 0


def add_parsers(sub: Any) -> None:
    st = sub.add_parser("status", help="what is deployed: models, replicas per card, "
                        "budgets, readiness")
    st.add_argument("--address", help="Ray address (default: the local cluster)")
    st.add_argument("--app", help="one application (default: every embedfleet application)")
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)
    pc = sub.add_parser("prefix-cache",
                        help="show the prefix-cache overrides a failed canary set, or clear one")
    pc.add_argument("--clear", metavar="MODEL", help="forget MODEL's override (after a fix)")
    pc.add_argument("--address", help="Ray address (default: the local cluster)")
    pc.add_argument("--app", help="one application (default: every embedfleet application)")
    pc.set_defaults(func=cmd_prefix_cache)
