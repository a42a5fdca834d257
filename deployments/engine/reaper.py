"""Engine-process reaper: vLLM's engine core must not outlive its replica.

vLLM starts its engine core (and that starts its workers) as child processes of the replica. When
Ray kills a replica actor (a failed health check, `ray.kill`, `ray stop --force`), the replica gets
no chance to shut its engine down, and the engine core is re-parented to init and keeps its memory
and threads — seen here as gigabytes of orphaned ``VLLM::EngineCore`` processes after a few
restarts. So each replica starts one tiny watchdog per engine: it polls its parent (the replica)
once a second and, when the parent is gone, SIGKILLs the engine processes it was given (checking
each is still a vLLM process, so a reused pid is never hit). Engine processes also carry
``EMBEDFLEET_ENGINE_OF=<replica pid>`` in their environment, so `embedfleet down` can sweep any
that are left.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

MARKER_ENV = "EMBEDFLEET_ENGINE_OF"


def _is_engine_process(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read()
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:
        return False
    return (b"VLLM" in cmd or b"vllm" in cmd or b"multiprocessing" in cmd) and \
        MARKER_ENV.encode() in env


def is_resource_tracker(pid: int) -> bool:
    """multiprocessing's resource tracker (one per process tree, started with the first
    spawned child): not part of any one engine."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"multiprocessing.resource_tracker" in f.read()
    except OSError:
        return False


def engine_pids(root: int | None = None) -> list[int]:
    """The replica's descendant processes (the engine core and its workers)."""
    import psutil

    proc = psutil.Process(root or os.getpid())
    return [c.pid for c in proc.children(recursive=True)]


def start_reaper(pids: list[int]) -> subprocess.Popen | None:
    if not pids:
        return None
    return subprocess.Popen([sys.executable, "-m", "embedfleet.deployments.engine.reaper", str(os.getpid()),
                             *map(str, pids)], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)  # survives signals aimed at the replica's group


def wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """Wait until ``pids`` have exited (reaped or not our children); the ones still alive."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return [p.pid for p in alive]


def kill_engine_processes(pids: list[int]) -> int:
    killed = 0
    for pid in pids:
        if _is_engine_process(pid):
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
    return killed


def sweep_orphans() -> int:
    """Kill engine processes whose replica is gone (parent is init); returns how many."""
    killed = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == 1 and _is_engine_process(int(entry)):
            killed += kill_engine_processes([int(entry)])
    return killed


def _watch(parent: int, pids: list[int]) -> None:
    while os.getppid() == parent:
        time.sleep(1)
    kill_engine_processes(pids)


if __name__ == "__main__":
    _watch(int(sys.argv[1]), [int(p) for p in sys.argv[2:]])
