"""The faults of the chaos tool: which to inject and when, and the ``Cluster`` that injects them.

What each fault kind does is told in benchmarks/chaos.py's docstring, which is also the --help
text users read; which actor each one hits is in chaos_targets.py.
"""

from __future__ import annotations

import asyncio
import functools
import math
import random
import signal
import time
from collections.abc import Callable, Iterable
from typing import Any

from .chaos_load import send_burst
from .chaos_stats import Sample, by_model
from .chaos_targets import (FAULT_KINDS, TARGETS, burst_size, engine_core_pids, find_targets,
                            is_actor_process, model_of, pick_target, process_role, serve_actors)

DEFAULT_BURST = 256  # without --burst or --config the admission bound is unknown
FLOOD_LEAD_S = 1.0  # the burst is sent this long before the kill, so it is queued when it lands


# -- pure parts (unit-tested in tests/test_chaos_tool.py) ----------------------------------------
def parse_faults(text: str) -> tuple[str, ...]:
    kinds = tuple(k.strip() for k in text.split(",") if k.strip() and k.strip() != "none")
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown:
        raise ValueError(f"unknown fault(s) {unknown}; choose from {', '.join(FAULT_KINDS)}")
    return kinds


def fault_schedule(duration_s: float, every_s: float, faults: Iterable[str],
                   until_s: float | None = None) -> list[tuple[float, str]]:
    """(seconds from start, kind): one fault per period, kinds in turn, none at t=0 (warm-up)
    nor at or after the end (its effect could not be observed), nor at or after ``until_s``
    (a soak's quiet tail, whose memory slope needs the processes a fault would replace)."""
    kinds = list(faults)
    if not kinds or every_s <= 0:
        return []
    n = math.ceil(min(duration_s, until_s or duration_s) / every_s) - 1
    return [(round(every_s * (i + 1), 3), kinds[i % len(kinds)]) for i in range(max(n, 0))]


def flood_plan(flag: int | None, admission: tuple[int, int] | None,
               replicas: int) -> tuple[int, str]:
    """(burst size, what it is measured against) for a flood of a model with ``replicas`` alive.
    ``admission`` is (max_sequences, max_waiting) per replica, from --config."""
    size, bound = (DEFAULT_BURST, None) if admission is None else burst_size(*admission, replicas)
    if flag is not None:
        size = flag
    if bound is None:
        return size, f"burst {size} (admission bound unknown without --config)"
    if size <= bound:
        return size, f"burst {size} <= admission bound {bound}: the queue is not overfilled"
    return size, f"burst {size} > admission bound {bound}"


# -- the cluster side (needs Ray, psutil and a running cluster) ----------------------------------
class Cluster:
    """Finds Serve actors through Ray's state API and injects the faults. ``cfg`` (from --config)
    limits Serve replicas to its app and gives admission bounds; None = any app, no bounds."""

    def __init__(self, config: str | None, rng: random.Random, cfg: Any = None) -> None:
        from ..cluster.local import ensure_token_auth

        ensure_token_auth()  # a Ray client without RAY_AUTH_MODE=token is refused
        self.config = config
        self.cfg = cfg
        self.app = cfg.app_name if cfg is not None else None
        self.rng = rng
        self.prometheus_stopped = False
        self.paused: list[Any] = []  # psutil.Process of engines stopped and not yet resumed
        self._ray = None

    def _connect(self):
        if self._ray is None:
            import ray

            ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
            self._ray = ray
        return self._ray

    def actors(self) -> list[Any]:
        from ..cluster.local import dashboard_url
        from ray.util.state import list_actors

        # Through the local dashboard's state API: listing needs no driver connection (ray.init
        # is only for ray.kill), so a load-only run stays light.
        return list_actors(address=dashboard_url(None), filters=[("state", "=", "ALIVE")],
                           limit=10_000, detail=True, raise_on_missing_output=False)

    def memory(self) -> list[dict[str, Any]]:
        """One record per Serve actor process on this machine: its own RSS and its tree's."""
        import psutil

        out = []
        for a in serve_actors(self.actors()):
            try:
                proc = psutil.Process(a["pid"])
                if not is_actor_process(proc.cmdline(), a["class_name"]):
                    continue  # another node's pid numbering, or reused
                own = proc.memory_info().rss
                tree = own + sum(c.memory_info().rss for c in proc.children(recursive=True))
            except psutil.Error:
                continue  # died between the listing and now (a fault)
            out.append({"pid": a["pid"], "role": process_role(a["class_name"]),
                        "rss_mb": round(own / 2 ** 20, 1), "tree_rss_mb": round(tree / 2 ** 20, 1)})
        return out

    def kill_actor(self, kind: str, record: dict[str, Any] | None = None) -> str:
        """ray.kill the actor; Serve replaces replicas and proxies, Ray restarts the controller."""
        ray = self._connect()
        a = record or pick_target(kind, self.actors(), self.rng, self.app)
        restart = TARGETS[kind].ray_restarts
        ray.kill(ray.get_actor(a["name"], namespace=a.get("ray_namespace") or "serve"),
                 no_restart=not restart)
        return (f"actor {a['name']} ({a['class_name']}, pid {a.get('pid')})"
                + (", restarted by Ray" if restart else ""))

    def _engine_core(self, kind: str):
        import psutil

        a = pick_target(kind, self.actors(), self.rng, self.app)
        replica = psutil.Process(a["pid"])
        if not is_actor_process(replica.cmdline(), a["class_name"]):
            raise RuntimeError(f"pid {a['pid']} is not {a['class_name']} on this machine")
        kids = {c.pid: c for c in replica.children(recursive=True)}
        pids = engine_core_pids((c.pid, c.name(), c.cmdline()) for c in kids.values())
        if not pids:
            raise RuntimeError(f"no EngineCore child under replica pid {a['pid']}")
        return a, kids[pids[0]]

    def kill_engine(self) -> str:
        a, core = self._engine_core("kill-engine")
        core.send_signal(signal.SIGKILL)  # psutil refuses a pid reused since the listing
        return f"EngineCore pid {core.pid} of {a['name']}"

    def pause_engine(self, seconds: float) -> tuple[str, list[Any]]:
        """SIGSTOP the engine core and its workers: alive but making no progress, as a hung card
        is. If this tool dies before resume_engine, Serve's failing health checks replace the
        replica, which is the recovery under test anyway."""
        a, core = self._engine_core("pause-engine")
        procs = [core, *core.children(recursive=True)]
        try:
            for p in procs:
                p.send_signal(signal.SIGSTOP)
                self.paused.append(p)
        except Exception:
            self.resume_engine(procs)  # no half-stopped engine without its resume scheduled
            raise
        return (f"SIGSTOP EngineCore pid {core.pid} (+{len(procs) - 1} workers) of {a['name']} "
                f"for {seconds:g}s"), procs

    def resume_engine(self, procs: list[Any]) -> str:
        import psutil

        gone = []
        for p in procs:
            try:
                p.send_signal(signal.SIGCONT)
            except psutil.NoSuchProcess:
                gone.append(p.pid)  # Serve replaced the hung replica, killing its engine
            if p in self.paused:
                self.paused.remove(p)
        return f"SIGCONT pids {[p.pid for p in procs]}" + (f"; gone: {gone}" if gone else "")

    def flood_target(self) -> tuple[dict[str, Any], str, int]:
        """(replica to kill, its model, that model's alive replicas)."""
        actors = self.actors()
        a = pick_target("flood-kill", actors, self.rng, self.app)
        same = [r for r in find_targets("flood-kill", actors, self.app)
                if r["class_name"] == a["class_name"]]
        return a, model_of(a["class_name"]) or "?", len(same)

    def admission(self, model: str) -> tuple[int, int] | None:
        m = next((m for m in self.cfg.models if m.name == model), None) if self.cfg else None
        return None if m is None else (m.budget_ceiling.max_sequences, m.admission.max_waiting)

    async def flood(self, url: str, model: str, size: int, timeout_s: float,
                    t0: float) -> list[Sample]:
        return await send_burst(url, model, size, timeout_s, t0, seed=self.rng.randrange(2 ** 31))

    def stop_prometheus(self) -> str:
        from ..cluster.monitoring_stack import stop_monitoring

        if not stop_monitoring():
            # not ours or not running: nothing to restart later either
            raise RuntimeError("no Prometheus started by `embedfleet up` is running")
        self.prometheus_stopped = True
        return "stopped"

    def start_prometheus(self) -> str:
        from ..cluster.monitoring_stack import start_monitoring
        from ..deployments.config.schema import load_config

        url = start_monitoring(self.cfg or load_config(self.config))
        self.prometheus_stopped = False
        return f"restarted at {url}"


# -- the schedule, beside the load ----------------------------------------------------------
async def inject_faults(opts: dict[str, Any], cluster: Cluster, t0: float, log: list[dict],
                        restarts: list[asyncio.Task], done: asyncio.Event) -> None:
    """Inject the scheduled faults until ``done``; blocking Ray/psutil calls run in a thread so
    the load continues meanwhile. ``restarts`` collects the tasks that undo a fault later
    (restart Prometheus, resume an engine) or finish one (a flood's burst)."""
    for at, kind in fault_schedule(opts["duration"], opts["fault_every"], opts["faults"],
                                   opts.get("faults_until")):
        try:
            await asyncio.wait_for(done.wait(), max(0.0, t0 + at - time.monotonic()))
            return  # the load ended first (e.g. --max-requests reached)
        except TimeoutError:
            pass
        entry: dict[str, Any] = {"t_s": round(time.monotonic() - t0, 1), "kind": kind}
        try:
            entry["target"] = await _inject(kind, entry, opts, cluster, t0, log, restarts, done)
            entry["ok"] = True
        except Exception as exc:  # a fault that could not be injected is reported, not fatal
            entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
        log.append(entry)
        print(f"fault t={entry['t_s']}s {kind}: {entry.get('target') or entry.get('error')}",
              flush=True)


async def _inject(kind: str, entry: dict[str, Any], opts: dict[str, Any], cluster: Cluster,
                  t0: float, log: list[dict], restarts: list[asyncio.Task],
                  done: asyncio.Event) -> str:
    def undo_later(delay_s: float, undo: Callable[[], str], label: str) -> None:
        restarts.append(asyncio.create_task(_undo_later(delay_s, undo, label, log, t0, done)))

    if kind == "stop-prometheus":
        target = await asyncio.to_thread(cluster.stop_prometheus)
        undo_later(opts["prometheus_down_s"], cluster.start_prometheus, "restart-prometheus")
        return target
    if kind == "pause-engine":
        target, procs = await asyncio.to_thread(cluster.pause_engine, opts["pause_s"])
        undo_later(opts["pause_s"], functools.partial(cluster.resume_engine, procs),
                   "resume-engine")
        return target
    if kind == "kill-engine":
        return await asyncio.to_thread(cluster.kill_engine)
    if kind == "flood-kill":
        return await _flood_kill(entry, opts, cluster, t0, restarts)
    return await asyncio.to_thread(cluster.kill_actor, kind)


async def _flood_kill(entry: dict[str, Any], opts: dict[str, Any], cluster: Cluster, t0: float,
                      restarts: list[asyncio.Task]) -> str:
    """Fill one model's queues with a burst, then kill one of its replicas under it. The burst's
    outcomes go on the fault's entry (``burst``), not into the load's tally: its 429s are the
    intended overflow, not requests the steady clients lost."""
    a, model, replicas = await asyncio.to_thread(cluster.flood_target)
    size, plan = flood_plan(opts.get("burst"), cluster.admission(model), replicas)
    burst = asyncio.create_task(cluster.flood(opts["url"], model, size,
                                              opts["request_timeout_s"], t0))

    async def record_burst() -> None:
        try:
            entry["burst"] = by_model(await burst)
        except Exception as exc:
            entry["burst_error"] = f"{type(exc).__name__}: {exc}"
    restarts.append(asyncio.create_task(record_burst()))  # it runs on while the faults go on
    await asyncio.sleep(opts.get("flood_lead_s", FLOOD_LEAD_S))
    killed = await asyncio.to_thread(cluster.kill_actor, "flood-kill", a)
    return f"{plan} to {model} ({replicas} replicas); killed {killed}"


async def _undo_later(delay_s: float, undo: Callable[[], str], label: str, log: list[dict],
                      t0: float, done: asyncio.Event) -> None:
    """Undo after the delay, or as soon as the load is over. Never cancelled: cancelling a
    thread's await leaves the thread running, and a second undo could race it."""
    try:
        await asyncio.wait_for(done.wait(), delay_s)
    except TimeoutError:
        pass
    entry: dict[str, Any] = {"kind": label}
    try:
        entry.update(target=await asyncio.to_thread(undo), ok=True)
    except Exception as exc:
        entry.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    log.append({"t_s": round(time.monotonic() - t0, 1), **entry})
