"""CPU time (user + system) that a set of processes spent during one timed bench run.

Texts/s alone hides what a peer costs: a server can look fast by burning more cores, and on a
shared 2-core machine every CPU-second one peer spends is taken from the others. So each run also
records CPU-seconds per 1,000 texts for the peer's *whole* process tree.

A **scope** picks the processes of one peer from a table of every process on the machine, at a
moment; a **meter** reads the table before and after the run and sums, per process:

* alive at both ends (same pid and start time): end minus start;
* appeared during the run: everything it has used (it did not exist at the start);
* gone by the end: its parent's ``children_user + children_system`` grows by the child's whole
  lifetime when the parent reaps it, so when the parent is itself measured the child's share is
  already counted and only what the child had used *before* the run is subtracted. A process whose
  parent was not measured cannot be recovered and is counted in ``lost`` (its time in the run is
  missing: the figure is then a lower bound);
* left the scope alive (its parent exited and it was re-parented out of the tree: a daemon that
  detached, such as a Ray head started by a child that has since exited): nobody measured reaped
  it, so nothing of it is counted or subtracted, and it is counted in ``left`` (a lower bound too).
  Subtracting its pre-run time as if reaped made a run's figure negative (-13.8 s in one CI run,
  when `embedfleet up --detach`, a child of the bench's process, exited during a run).

Every process's time includes what it has reaped from its own children, so short-lived helpers
(a child and its grandchild that start and finish inside the run) are counted too.

Scopes: ``OwnProcess`` (one process, optionally without reaped children: the load driver),
``ProcessTree`` (roots and all their descendants, minus excluded subtrees: a server subprocess, or
this process and its vLLM engine core and workers) and, in ``ray_cluster_scope.py``,
``RayCluster`` (every process of the Ray cluster that serves an HTTP port, plus the Prometheus
that `embedfleet up` started).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import psutil

NEW_PROCESS_SLACK_S = 1.0  # start times are clock ticks since boot: allow for rounding


@dataclass(frozen=True)
class Proc:
    """One row of the process table."""

    pid: int
    ppid: int
    create_time: float
    title: str
    cmdline: tuple[str, ...]
    own_s: float
    """user + system CPU of the process itself (all its threads)."""
    reaped_s: float
    """children_user + children_system: the whole CPU of children it has waited for."""

    @property
    def total_s(self) -> float:
        return self.own_s + self.reaped_s


def title_of(name: str, cmdline: Iterable[str]) -> str:
    """How a process calls itself: Ray actors and vLLM's processes set their title
    (``ray::ServeReplica:app:Router``, ``VLLM::EngineCore``); others are their executable's name."""
    args = [a for a in cmdline if a]
    first = args[0].strip() if args else ""
    if first.startswith(("ray::", "VLLM::")):
        return first.split()[0] if first.startswith("VLLM::") else first
    return name or (Path(first).name if first else "?")


def _row(info: Mapping[str, Any]) -> Proc | None:
    ct = info.get("cpu_times")
    if ct is None or info.get("create_time") is None:
        return None  # vanished while being read, or not readable
    cmdline = tuple(info.get("cmdline") or ())
    return Proc(pid=info["pid"], ppid=info.get("ppid") or 0, create_time=info["create_time"],
                title=title_of(info.get("name") or "", cmdline), cmdline=cmdline,
                own_s=ct.user + ct.system,
                reaped_s=getattr(ct, "children_user", 0.0) + getattr(ct, "children_system", 0.0))


def process_table() -> dict[int, Proc]:
    """Every process readable on this machine, with its CPU times."""
    attrs = ["pid", "ppid", "name", "cmdline", "create_time", "cpu_times"]
    table = {}
    for p in psutil.process_iter(attrs, ad_value=None):
        row = _row(p.info)
        if row is not None:
            table[row.pid] = row
    return table


def read_process(pid: int) -> Proc | None:
    """One process's row, read now."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return _row({"pid": pid, "ppid": p.ppid(), "name": p.name(), "cmdline": p.cmdline(),
                         "create_time": p.create_time(), "cpu_times": p.cpu_times()})
    except psutil.Error:
        return None


def children_map(table: Mapping[int, Proc]) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for p in table.values():
        kids.setdefault(p.ppid, []).append(p.pid)
    return kids


def descendants(table: Mapping[int, Proc], roots: Iterable[int],
                exclude: Iterable[int] = ()) -> set[int]:
    """``roots`` (those in the table) and everything below them, without the subtrees of
    ``exclude``."""
    kids = children_map(table)
    skip = set(exclude)
    out: set[int] = set()
    stack = [r for r in roots if r in table and r not in skip]
    while stack:
        pid = stack.pop()
        if pid in out:
            continue
        out.add(pid)
        stack.extend(k for k in kids.get(pid, ()) if k not in skip)
    return out


# -- scopes ------------------------------------------------------------------------------------
class ProcessScope(Protocol):
    count_reaped: bool
    """Whether a process's reaped children's time counts (False: its own threads only)."""

    def select(self, table: Mapping[int, Proc]) -> dict[int, str]:
        """{pid: group label} of this scope's processes in ``table``."""

    def describe(self) -> dict[str, Any]:
        """Which processes, in words, for the report."""


@dataclass
class OwnProcess:
    """One process. Without its reaped children: the bench process as the load driver."""

    pid: int
    label: str
    count_reaped: bool = False

    def select(self, table: Mapping[int, Proc]) -> dict[int, str]:
        return {self.pid: self.label} if self.pid in table else {}

    def describe(self) -> dict[str, Any]:
        return {"processes": f"pid {self.pid} only ({self.label}), all its threads"
                + ("" if self.count_reaped else ", not its children")}


@dataclass
class ProcessTree:
    """``roots()`` and all their descendants, minus the subtrees of ``exclude()``. The roots are
    labelled ``root_label``; every other process by its title (``VLLM::EngineCore``, ...)."""

    roots: Callable[[], Iterable[int]]
    root_label: str
    exclude: Callable[[], Iterable[int]] = lambda: ()
    what: str = ""
    count_reaped: bool = True

    def select(self, table: Mapping[int, Proc]) -> dict[int, str]:
        roots = set(self.roots())
        return {pid: self.root_label if pid in roots else table[pid].title
                for pid in descendants(table, roots, self.exclude())}

    def describe(self) -> dict[str, Any]:
        return {"processes": self.what or f"{self.root_label} and all its descendants",
                "roots": sorted(self.roots()), "excluded_subtrees": sorted(self.exclude())}


# -- the meter ---------------------------------------------------------------------------------
@dataclass
class Snapshot:
    at: float
    procs: dict[int, Proc]
    groups: dict[int, str]
    alive: dict[int, float] = field(default_factory=dict)
    """{pid: create_time} of every process in the table, in the scope or not."""


def take(scope: ProcessScope, table: Mapping[int, Proc], at: float,
         alive: dict[int, float]) -> Snapshot:
    """``alive``: the table's {pid: create_time}, read once for every scope of a reading."""
    groups = scope.select(table)
    return Snapshot(at, {pid: table[pid] for pid in groups}, groups, alive)


def usage(before: Snapshot, after: Snapshot, count_reaped: bool = True) -> dict[str, Any]:
    """CPU-seconds the scope's processes used between two snapshots (see the module docstring)."""
    def total(p: Proc) -> float:
        return p.total_s if count_reaped else p.own_s

    def same(pid: int) -> bool:
        return (pid in before.procs and pid in after.procs
                and abs(before.procs[pid].create_time - after.procs[pid].create_time) < 1e-3)

    by_group: dict[str, float] = {}
    appeared = unbaselined = 0
    for pid, p in after.procs.items():
        if same(pid):
            d = total(p) - total(before.procs[pid])
        elif p.create_time >= before.at - NEW_PROCESS_SLACK_S:
            d, appeared = total(p), appeared + 1
        else:  # existed before the run but was not in the scope then: no baseline to diff
            unbaselined += 1
            continue
        g = after.groups[pid]
        by_group[g] = by_group.get(g, 0.0) + d

    def left(pid: int) -> bool:
        """Whether ``pid`` is still alive at the end, outside the scope (re-parented out)."""
        ct = after.alive.get(pid)
        return ct is not None and abs(ct - before.procs[pid].create_time) < 1e-3

    def recovered(pid: int) -> bool:
        """Whether a measured ancestor reaped ``pid`` (so its lifetime is in that ancestor)."""
        if not count_reaped:
            return False
        parent = before.procs[pid].ppid
        if same(parent):
            return True
        return (parent in before.procs and parent not in after.procs and not left(parent)
                and recovered(parent))

    vanished = lost = gone_out = 0
    for pid, p in before.procs.items():
        if same(pid):
            continue
        if left(pid):
            gone_out += 1
            continue
        vanished += 1
        if recovered(pid):
            g = after.groups.get(p.ppid) or before.groups[pid]
            by_group[g] = by_group.get(g, 0.0) - total(p)  # its pre-run share
        else:
            lost += 1
    return {"cpu_s": round(sum(by_group.values()), 3),
            "by_group": {g: round(v, 3) for g, v in sorted(by_group.items(),
                                                           key=lambda kv: -kv[1])},
            "processes": len(set(before.procs) | set(after.procs)),
            "appeared": appeared, "vanished": vanished, "lost": lost, "left": gone_out,
            "unbaselined": unbaselined}


def machine_busy_s() -> float:
    """CPU-seconds every core of the machine has spent not idle, since boot."""
    t = psutil.cpu_times()
    # guest time is already inside user/nice; steal is the hypervisor's, not this machine's work
    return sum(v for k, v in t._asdict().items() if k not in ("idle", "iowait", "steal", "guest",
                                                              "guest_nice"))


class CpuMeter:
    """Reads several scopes at once around one run: ``start()`` then ``stop()`` ->
    ``{"scopes": {name: usage}, "machine_busy_cpu_s": ..., "wall_s": ...}``.

    One process-table scan serves every scope. This process's own row is read after the scan at
    the start and before it at the end, so the scans' own CPU (tens of ms) is not charged to a
    scope that contains this process (the in-process vLLM peer, the load driver).
    """

    def __init__(self, scopes: Mapping[str, ProcessScope]):
        self.scopes = dict(scopes)
        self._before: dict[str, Snapshot] = {}
        self._t0 = self._busy0 = 0.0

    def _snapshots(self, table: dict[int, Proc], at: float) -> dict[str, Snapshot]:
        alive = {pid: p.create_time for pid, p in table.items()}
        return {name: take(s, table, at, alive) for name, s in self.scopes.items()}

    def start(self) -> CpuMeter:
        at = time.time()
        table = process_table()
        if (me := read_process(os.getpid())) is not None:
            table[me.pid] = me
        self._before = self._snapshots(table, at)
        self._busy0, self._t0 = machine_busy_s(), time.perf_counter()
        return self

    def stop(self) -> dict[str, Any]:
        wall = time.perf_counter() - self._t0
        busy = machine_busy_s() - self._busy0
        me = read_process(os.getpid())
        table = process_table()
        if me is not None:
            table[me.pid] = me
        after = self._snapshots(table, time.time())
        return {"scopes": {name: usage(self._before[name], after[name],
                                       self.scopes[name].count_reaped)
                           for name in self.scopes},
                "machine_busy_cpu_s": round(busy, 3), "wall_s": round(wall, 4),
                "machine_cores": psutil.cpu_count() or 1}
