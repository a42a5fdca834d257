"""The CPU scope of an embedfleet cluster: every process of the Ray cluster behind its URL.

A ``process_cpu`` scope (see that module for what a scope and a meter are): ``RayCluster`` finds
the Ray cluster serving an HTTP port once, then at every reading picks its processes by command
line (session name, GCS address, node ids) with all their descendants, groups them by Serve
deployment (a replica's vLLM engine core and workers count with the replica), and adds the
Prometheus that `embedfleet up` started.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

import psutil

from .process_cpu import Proc, descendants, process_table

SESSION_RE = re.compile(r"--session-name=(session_[\w-]+)")
NODE_ID_RE = re.compile(r"--node[_-]id=([0-9a-f]{16,})")
GCS_RE = re.compile(r"--gcs-address=(\S+)")
RAY_DAEMONS = ("gcs_server", "raylet")
RAY_SYSTEM = "ray system (gcs, raylet, dashboard, agents, monitors, idle workers)"


@dataclass
class RaySession:
    name: str
    gcs_address: str | None = None
    node_ids: set[str] = field(default_factory=set)
    daemons: set[int] = field(default_factory=set)

    def tokens(self) -> list[re.Pattern[str]]:
        """What in a command line marks a process as this cluster's: its session name, its GCS
        address (``ray.util.client.server`` names only that) or one of its node ids."""
        toks = [re.escape(self.name)] + [re.escape(n) for n in sorted(self.node_ids)]
        if self.gcs_address:
            toks.append(r"(?<![\d.])" + re.escape(self.gcs_address) + r"(?!\d)")
        return [re.compile(t) for t in toks]


def ray_sessions(table: Mapping[int, Proc]) -> dict[str, RaySession]:
    """Ray clusters running here, by session name, from their gcs_server and raylet lines."""
    out: dict[str, RaySession] = {}
    for p in table.values():
        exe = Path(p.cmdline[0]).name if p.cmdline else ""
        if exe not in RAY_DAEMONS:
            continue
        line = " ".join(p.cmdline)
        m = SESSION_RE.search(line)
        if not m:
            continue
        s = out.setdefault(m.group(1), RaySession(m.group(1)))
        s.daemons.add(p.pid)
        if exe == "raylet":
            s.node_ids.update(NODE_ID_RE.findall(line))
            if g := GCS_RE.search(line):
                s.gcs_address = g.group(1)
    return out


def ray_role(pid: int, table: Mapping[int, Proc]) -> str:
    """The group of a Ray process: the Serve deployment (or controller, proxy) of the nearest
    actor above it or itself, so a replica's vLLM engine core and workers count with the replica;
    anything else (daemons, dashboard, agents, idle workers) is "ray system"."""
    seen: set[int] = set()
    while pid in table and pid not in seen:
        seen.add(pid)
        t = table[pid].title
        if t.startswith("ray::ServeReplica:"):
            app_deployment = t.split(":", 3)[-1]  # "embedfleet:Router"
            # the title carries the running method, if any: "...:Router.handle" -> "...:Router"
            return re.sub(r"\.[a-z_][a-z0-9_]*$", "", app_deployment)
        if t.startswith("ray::ServeController"):
            return "serve controller"
        if t.startswith("ray::ProxyActor"):
            return "serve proxy"
        if t.startswith("ray::HAProxyManager"):  # router.http_ingress: haproxy, with its haproxy
            return "serve haproxy"
        pid = table[pid].ppid
    return RAY_SYSTEM


def is_embedfleet_up(p: Proc) -> bool:
    """``embedfleet up`` staying in the foreground (``make run``): the CLI that owns the cluster."""
    args = [Path(a).name for a in p.cmdline]
    return any(a == "embedfleet" and nxt == "up" for a, nxt in pairwise(args))


def listener_pid(port: int) -> int | None:
    """The process listening on TCP ``port`` here (None: none, or not visible to this user)."""
    try:
        conns = psutil.net_connections("tcp")
    except (psutil.AccessDenied, OSError):
        return None
    return next((c.pid for c in conns if c.status == psutil.CONN_LISTEN and c.laddr
                 and c.laddr.port == port and c.pid), None)


@dataclass
class RayCluster:
    """Every process of the Ray cluster serving ``port``, and its Prometheus.

    The cluster is found once (``locate``): the process listening on ``port`` (Serve's proxy, or
    the HAProxy its HAProxyManager actor runs) is
    walked up to its raylet, whose ``--session-name`` names the cluster. Its processes are then,
    at every reading, all processes whose command line carries that session name, its GCS address
    or one of its node ids (gcs_server, raylets, dashboard, log monitors, autoscaler monitor,
    client server), plus all their descendants (the dashboard and runtime-env agents, the Serve
    controller and proxy, every replica and the vLLM engine core and workers under it), plus the
    process in ``prometheus_pidfile`` and its descendants. When the listener cannot be seen,
    every Ray cluster on the machine is counted (and ``describe()`` says so).
    """

    port: int | None
    prometheus_pidfile: Path | None
    count_reaped: bool = True
    sessions: list[str] | None = None
    how: str = "not located yet"
    prometheus_seen: int | None = None

    def locate(self, table: Mapping[int, Proc] | None = None) -> None:
        table = table if table is not None else process_table()
        found = ray_sessions(table)
        pid = first = listener_pid(self.port) if self.port else None
        seen: set[int] = set()
        while pid is not None and pid in table and pid not in seen:
            seen.add(pid)
            for s in found.values():
                if pid in s.daemons:
                    self.sessions = [s.name]
                    self.how = (f"the process listening on :{self.port} (pid {first}, "
                                f"{table[first].title}) runs under {table[pid].title} pid {pid}")
                    return
            pid = table[pid].ppid
        self.sessions = sorted(found)
        self.how = (f"no Ray process found listening on :{self.port}; counting every Ray "
                    f"cluster on this machine ({len(found)})")

    def prometheus_pid(self, table: Mapping[int, Proc]) -> int | None:
        try:
            pid = int(self.prometheus_pidfile.read_text().split()[0]) \
                if self.prometheus_pidfile else None
        except (OSError, ValueError, IndexError):
            return None
        ok = pid in table and "prometheus" in " ".join(table[pid].cmdline[:1] or (table[pid].title,))
        return pid if ok else None

    def select(self, table: Mapping[int, Proc]) -> dict[int, str]:
        if not self.sessions:  # not located yet, or no cluster was running then
            self.locate(table)
        live = ray_sessions(table)
        patterns = [t for name in self.sessions or () if name in live
                    for t in live[name].tokens()]
        roots = {p.pid for p in table.values() if p.pid != os.getpid()
                 and any(t.search(" ".join(p.cmdline)) for t in patterns)}
        out = {pid: ray_role(pid, table) for pid in descendants(table, roots)}
        out.update({p.pid: "embedfleet up (CLI)" for p in table.values()
                    if is_embedfleet_up(p) and p.pid not in out})
        prom = self.prometheus_pid(table)
        self.prometheus_seen = prom or self.prometheus_seen
        if prom is not None:
            out.update({pid: "prometheus" for pid in descendants(table, [prom])})
        return out

    def describe(self) -> dict[str, Any]:
        return {"processes": "every process of the Ray cluster (command line naming its session, "
                             "GCS address or node ids, and all their descendants: Ray daemons, "
                             "dashboard and agents, Serve controller and proxy, every replica with "
                             "its vLLM engine core and workers), a foreground `embedfleet up`, "
                             "and Prometheus (pid file) with its children",
                "ray_sessions": self.sessions, "located_by": self.how,
                "prometheus_pidfile": str(self.prometheus_pidfile)
                if self.prometheus_pidfile else None,
                "prometheus_pid": self.prometheus_seen}
