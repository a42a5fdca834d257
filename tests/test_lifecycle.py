"""The engine swap's shutdown: processes that outlive a clean shutdown are SIGKILLed, and the
shutdown returns only once they are gone (on a card, their exit frees the next engine's memory).

The "engine" is a STAND-IN: a process that looks like vLLM's engine core (marker environment,
VLLM in its command line) and ignores SIGTERM, started by an engine factory through the same
``EngineLifecycle`` the replica uses; its ``shutdown`` does nothing, as a hung engine core's.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from embedfleet.deployments.engine import reaper
from embedfleet.deployments.engine.lifecycle import EngineLifecycle

STUBBORN = ("import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "time.sleep(600)")


class StubbornEngineStandIn:
    def __init__(self, kwargs: dict) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", STUBBORN, "VLLM::EngineCore"])
        time.sleep(0.3)  # started, its command line in /proc

    def shutdown(self) -> None:
        pass  # hung: the process stays


def stubborn_engine(kwargs: dict) -> StubbornEngineStandIn:
    return StubbornEngineStandIn(kwargs)


def _exists(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}")  # a zombie still exists: not yet released


def test_shutdown_kills_what_outlives_it_and_waits_until_it_is_gone(monkeypatch):
    monkeypatch.setenv(reaper.MARKER_ENV, "")  # build() sets it; restored after the test
    life = EngineLifecycle("tests.test_lifecycle:stubborn_engine", lambda on: {},
                           exit_wait_s=0.5, kill_wait_s=10)
    engine = life.build(prefix_cache=True)
    pid = engine.proc.pid
    try:
        assert _exists(pid)
        t0 = time.monotonic()
        left = life.shutdown(engine)
        # Gone (not even a zombie) when shutdown returns: the swap may start the next engine.
        assert left == [] and not _exists(pid)
        assert time.monotonic() - t0 < 10
    finally:
        if _exists(pid):
            engine.proc.kill()
            engine.proc.wait()


def test_shutdown_reports_a_process_that_survives_sigkill(monkeypatch):
    monkeypatch.setenv(reaper.MARKER_ENV, "")
    life = EngineLifecycle("tests.test_lifecycle:stubborn_engine", lambda on: {},
                           exit_wait_s=0.2, kill_wait_s=0.2)
    engine = life.build(prefix_cache=True)
    pid = engine.proc.pid
    # Stands for a process stuck in the driver: SIGKILL does not take it within the wait.
    monkeypatch.setattr(reaper, "kill_engine_processes", lambda pids: 0)
    try:
        assert life.shutdown(engine) == [pid]
    finally:
        engine.proc.kill()
        engine.proc.wait()


class EngineWithTrackerStandIn(StubbornEngineStandIn):
    """An engine core that exits on shutdown, started beside a process whose command line is
    multiprocessing's resource tracker's (it lives as long as the replica)."""

    def __init__(self, kwargs: dict) -> None:
        self.tracker = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)",
                                         "from multiprocessing.resource_tracker import main"])
        super().__init__(kwargs)

    def shutdown(self) -> None:
        self.proc.kill()


def engine_with_tracker(kwargs: dict) -> EngineWithTrackerStandIn:
    return EngineWithTrackerStandIn(kwargs)


def test_shutdown_does_not_wait_for_the_replicas_resource_tracker(monkeypatch):
    monkeypatch.setenv(reaper.MARKER_ENV, "")
    life = EngineLifecycle("tests.test_lifecycle:engine_with_tracker", lambda on: {},
                           exit_wait_s=30, kill_wait_s=1)
    engine = life.build(prefix_cache=True)
    try:
        t0 = time.monotonic()
        assert life.shutdown(engine) == [] and not _exists(engine.proc.pid)
        assert time.monotonic() - t0 < 10  # not the 30 s a tracker that never exits would cost
        assert engine.tracker.poll() is None  # left alone: it serves the next engine too
    finally:
        engine.tracker.kill()
        engine.tracker.wait()
