"""The engine reaper: engine processes die with their replica, even when it is SIGKILLed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from embedfleet.deployments.engine import reaper

# A stand-in "replica": starts a child that looks like a vLLM engine (marker env, VLLM in its
# command line) and a reaper for it, prints the child's pid, then waits to be killed.
REPLICA = """
import os, subprocess, sys, time
from embedfleet.deployments.engine import reaper
os.environ[reaper.MARKER_ENV] = str(os.getpid())
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", "VLLM::EngineCore"])
reaper.start_reaper([child.pid])
print(child.pid, flush=True)
time.sleep(600)
"""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_engine_dies_when_its_replica_is_sigkilled():
    replica = subprocess.Popen([sys.executable, "-c", REPLICA], stdout=subprocess.PIPE,
                               text=True, cwd=os.path.dirname(os.path.dirname(__file__)))
    engine = int(replica.stdout.readline())
    assert alive(engine)
    replica.send_signal(signal.SIGKILL)
    replica.wait(10)
    deadline = time.monotonic() + 10
    while alive(engine) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not alive(engine), "engine process outlived its replica"


def test_reaper_never_kills_a_process_without_the_marker():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "VLLM"])
    try:
        assert reaper.kill_engine_processes([other.pid]) == 0
        assert alive(other.pid)
    finally:
        other.kill()
        other.wait()
