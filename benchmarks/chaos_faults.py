"""The faults of the chaos tool: which to inject and when, and the ``Cluster`` that injects them.

What each fault kind does is told in benchmarks/chaos.py's docstring, which is also the --help
text users read.
"""

from __future__ import annotations

import asyncio
import math
import os
import random
import re
import signal
import time
from dataclasses import asdict
from typing import Any, Iterable

FAULT_KINDS = ("kill-replica", "kill-engine", "stop-prometheus")
ENGINE_REPLICA = re.compile(r"ServeReplica:[^:]+:(engine-.+)")


# -- pure parts (unit-tested in tests/test_chaos_tool.py) ----------------------------------------
def parse_faults(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip() and k.strip() != "none")
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; choose from {', '.join(FAULT_KINDS)}")
    return kinds


def fault_schedule(duration_s: float, every_s: float,
                   faults: Iterable[str]) -> list[tuple[float, str]]:
    """(seconds from start, kind): one fault per period, kinds in turn, none at t=0 (warm-up)
    nor at or after the end (its effect could not be observed)."""
    kinds = list(faults)
    if not kinds or every_s <= 0:
        return []
    n = math.ceil(duration_s / every_s) - 1
    return [(round(every_s * (i + 1), 3), kinds[i % len(kinds)]) for i in range(max(n, 0))]


def engine_replicas(actors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Alive Serve replica actors of `engine-*` deployments."""
    return [a for a in actors if a.get("state") == "ALIVE"
            and ENGINE_REPLICA.fullmatch(a.get("class_name") or "")]


def process_role(class_name: str) -> str | None:
    """The memory-report role of a Serve actor: its deployment, or 'proxy'; None otherwise."""
    if class_name == "ProxyActor":
        return "proxy"
    if class_name.startswith("ServeReplica:"):
        return class_name.split(":", 2)[2]
    return None


def engine_core_pids(children: Iterable[tuple[int, str, list[str]]]) -> list[int]:
    """Of a replica's child processes (pid, name, cmdline), the vLLM engine core(s); vLLM sets the
    process title to VLLM::EngineCore."""
    return [pid for pid, name, cmd in children
            if "EngineCore" in name or (cmd and "EngineCore" in cmd[0])]


# -- the cluster side (needs Ray, psutil and a running cluster) ----------------------------------
class Cluster:
    """Finds Serve actors through Ray's state API and injects the faults."""

    def __init__(self, config: str | None, rng: random.Random) -> None:
        from embedfleet.cluster.local import ensure_token_auth

        ensure_token_auth()  # a Ray client without RAY_AUTH_MODE=token is refused
        self.config = config
        self.rng = rng
        self.prometheus_stopped = False
        self._ray = None

    def _connect(self):
        if self._ray is None:
            import ray

            ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
            self._ray = ray
        return self._ray

    def actors(self) -> list[dict[str, Any]]:
        from ray.util.state import list_actors

        from embedfleet.cluster.local import dashboard_url

        # Through the local dashboard's state API: listing needs no driver connection (ray.init
        # is only for ray.kill), so a load-only run stays light.
        return [a if isinstance(a, dict) else asdict(a) for a in
                list_actors(address=dashboard_url(None), filters=[("state", "=", "ALIVE")],
                            limit=10_000, detail=True, raise_on_missing_output=False)]

    def memory(self) -> dict[str, dict[str, Any]]:
        """RSS per role, summed over the role's processes and their children (an engine
        replica's memory is mostly in its EngineCore and worker children)."""
        import psutil

        out: dict[str, dict[str, Any]] = {}
        for a in self.actors():
            role = process_role(a.get("class_name") or "")
            if role is None or not a.get("pid"):
                continue
            try:
                proc = psutil.Process(a["pid"])
                tree = [proc, *proc.children(recursive=True)]
                rss = sum(p.memory_info().rss for p in tree if p.is_running())
            except psutil.Error:
                continue  # died between the listing and now (a fault), or on another node
            slot = out.setdefault(role, {"processes": 0, "rss_mb": 0.0})
            slot["processes"] += 1
            slot["rss_mb"] = round(slot["rss_mb"] + rss / 2 ** 20, 1)
        return dict(sorted(out.items()))

    def _pick_engine_replica(self) -> dict[str, Any]:
        replicas = engine_replicas(self.actors())
        if not replicas:
            raise RuntimeError("no alive engine replica actor found")
        return self.rng.choice(sorted(replicas, key=lambda a: a["name"]))

    def kill_replica(self) -> str:
        ray = self._connect()
        a = self._pick_engine_replica()
        # no_restart: Serve's controller, not Ray, must notice and replace the replica.
        ray.kill(ray.get_actor(a["name"], namespace=a.get("ray_namespace") or "serve"),
                 no_restart=True)
        return f"actor {a['name']} (pid {a.get('pid')})"

    def kill_engine(self) -> str:
        import psutil

        a = self._pick_engine_replica()
        replica = psutil.Process(a["pid"])
        # Guard against a pid that was reused (or belongs to another node's numbering).
        if "ServeReplica" not in " ".join(replica.cmdline()):
            raise RuntimeError(f"pid {a['pid']} is not {a['class_name']} on this machine")
        kids = [(c.pid, c.name(), c.cmdline()) for c in replica.children(recursive=True)]
        pids = engine_core_pids(kids)
        if not pids:
            raise RuntimeError(f"no EngineCore child under replica pid {a['pid']}")
        os.kill(pids[0], signal.SIGKILL)
        return f"EngineCore pid {pids[0]} of {a['name']}"

    def stop_prometheus(self) -> str:
        from embedfleet.cluster.monitoring_stack import stop_monitoring

        if not stop_monitoring():
            # not ours or not running: nothing to restart later either
            raise RuntimeError("no Prometheus started by `embedfleet up` is running")
        self.prometheus_stopped = True
        return "stopped"

    def start_prometheus(self) -> str:
        from embedfleet.cluster.monitoring_stack import start_monitoring
        from embedfleet.deployments.config import load_config

        url = start_monitoring(load_config(self.config))
        self.prometheus_stopped = False
        return f"restarted at {url}"


# -- the schedule, beside the load ----------------------------------------------------------
async def inject_faults(opts: dict[str, Any], cluster: Cluster, t0: float, log: list[dict],
                        restarts: list[asyncio.Task], done: asyncio.Event) -> None:
    """Inject the scheduled faults until ``done``; blocking Ray/psutil calls run in a thread so
    the load continues meanwhile."""
    actions = {"kill-replica": cluster.kill_replica, "kill-engine": cluster.kill_engine,
               "stop-prometheus": cluster.stop_prometheus}
    for at, kind in fault_schedule(opts["duration"], opts["fault_every"], opts["faults"]):
        try:
            await asyncio.wait_for(done.wait(), max(0.0, t0 + at - time.monotonic()))
            return  # the load ended first (e.g. --max-requests reached)
        except asyncio.TimeoutError:
            pass
        entry: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1), "kind": kind}
        try:
            entry["target"] = await asyncio.to_thread(actions[kind])
            entry["ok"] = True
        except Exception as exc:  # a fault that could not be injected is reported, not fatal
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        log.append(entry)
        print(f"fault t={entry['t_s']}s {kind}: {entry.get('target') or entry.get('error')}",
              flush=True)
        if kind == "stop-prometheus" and entry["ok"]:
            restarts.append(asyncio.create_task(
                _restart_prometheus(opts, cluster, log, t0, done)))


async def _restart_prometheus(opts: dict[str, Any], cluster: Cluster, log: list[dict],
                              t0: float, done: asyncio.Event) -> None:
    """Restart after the down time, or as soon as the load is over. Never cancelled: cancelling
    a thread's await leaves the thread running, and a second start could race it."""
    try:
        await asyncio.wait_for(done.wait(), opts["prometheus_down_s"])
    except asyncio.TimeoutError:
        pass
    entry: dict[str, Any] = {"kind": "restart-prometheus"}
    try:
        entry.update(target=await asyncio.to_thread(cluster.start_prometheus), ok=True)
    except Exception as exc:
        entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    log.append({"t_s": round(time.monotonic() - t0, 1), **entry})
