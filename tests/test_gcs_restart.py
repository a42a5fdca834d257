"""Durable means durable: embedfleet's control state survives a Ray head restart with GCS fault
tolerance on an external Redis, the mechanism the KubeRay render turns on
(``gcsFaultToleranceOptions``, cluster/manifest_security.py).

A throwaway Ray head of its own, never the session cluster: its own Redis (Debian's
redis-server, installed by `make setup`) and Ray ports, all free ports on 127.0.0.1, its own temp
dir, its own token and external-storage namespace. A driver writes a prefix-cache override
through ``DurableStore`` (what the FleetRegistry keeps when a canary fails); every process of
the head is then SIGKILLed (a crashed head pod), a new head starts on the same Redis, and a new
driver reads the override back. Cleanup kills only the processes this test started, by pid.

Tiered with ``engine`` (a heavyweight process tree without the session cluster, a minute or
two), so `make test-unit` does not run it.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

pytestmark = pytest.mark.engine

RAY = str(Path(sys.executable).with_name("ray"))
APP = "gcs-restart-test"

WRITE = """
import sys, ray
from embedfleet.deployments.common.contracts import Override
from embedfleet.deployments.fleet.durable import DurableStore
from embedfleet.deployments.fleet.registry import OVERRIDES
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
store = DurableStore.connected(sys.argv[2])
store.put(OVERRIDES, "tiny-qwen3", Override(reason="canary failed: 0.93 < 0.99", at=1.5))
print("written")
"""

READ = """
import json, sys, ray
from embedfleet.deployments.common.contracts import Override
from embedfleet.deployments.fleet.durable import DurableStore
from embedfleet.deployments.fleet.registry import OVERRIDES
ray.init(address=sys.argv[1], logging_level="ERROR", log_to_driver=False)
items = DurableStore.connected(sys.argv[2]).items(OVERRIDES, Override)
print(json.dumps({k: v.model_dump(mode="json") for k, v in items.items()}))
"""


# Every port handed to a throwaway head of this process, never handed out twice: `ray start`
# refuses a head whose own ports fall inside its worker range ("the same port is not used by
# multiple components"; an ephemeral port landed in it once), and the never-placeable head
# (tests/test_e2e_never_placeable.py) runs beside this file's, so neither may take the other's.
_HANDED_OUT: set[int] = set()


def free_ports(n: int) -> list[int]:
    """``n`` ports free now, none handed out before (worker ranges included)."""
    ports: list[int] = []
    for _ in range(20 * n):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            ports.append(port)
            if len(ports) == n:
                return ports
    raise AssertionError(f"no {n} free ports for a throwaway head")


def worker_port_range(width: int = 40) -> tuple[int, int]:
    """A run of ``width`` ports free now, above Ray's default worker range (10002-19999), none
    handed out before."""
    for _ in range(50):
        base, socks = 30000 + secrets.randbelow(20000), []
        if _HANDED_OUT.intersection(range(base, base + width)):
            continue
        try:
            for port in range(base, base + width):
                socks.append(socket.socket())
                socks[-1].bind(("127.0.0.1", port))
            _HANDED_OUT.update(range(base, base + width))
            return base, base + width - 1
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise AssertionError("no free run of ports for the throwaway head's workers")


class ThrowawayHead:
    """A Ray head with GCS fault tolerance on a Redis of its own; every port and path its own."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.workers = worker_port_range()  # first: the ports below are picked outside it
        (self.redis_port, self.gcs_port, self.nm_port, self.om_port, self.client_port,
         self.agent_port, self.agent_grpc, self.metrics_port, self.rt_env_port,
         self.dashboard_port) = free_ports(10)
        self.password = secrets.token_hex(16)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        self.env.update({
            "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(24),
            "RAY_REDIS_ADDRESS": f"127.0.0.1:{self.redis_port}",
            "RAY_external_storage_namespace": f"embedfleet-test-{secrets.token_hex(4)}",
            "RAY_USAGE_STATS_ENABLED": "0"})
        self.redis: subprocess.Popen | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def start_redis(self) -> None:
        (self.root / "redis").mkdir()
        self.redis = subprocess.Popen(
            ["redis-server", "--port", str(self.redis_port), "--bind", "127.0.0.1",
             "--requirepass", self.password, "--dir", str(self.root / "redis"),
             "--appendonly", "yes", "--save", ""],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def start(self) -> None:
        """`ray start --head`, once more after a startup timeout: Ray gives the raylet a fixed
        30 s to register with the GCS (ray/_private/node.py), which a starved 2-core machine can
        miss; what this test checks comes after the head is up."""
        cmd = [RAY, "start", "--head", f"--temp-dir={self.root / 'ray'}",
               "--node-ip-address=127.0.0.1", f"--port={self.gcs_port}",
               f"--redis-password={self.password}",
               f"--node-manager-port={self.nm_port}", f"--object-manager-port={self.om_port}",
               f"--ray-client-server-port={self.client_port}",
               f"--dashboard-agent-listen-port={self.agent_port}",
               f"--dashboard-agent-grpc-port={self.agent_grpc}",
               f"--metrics-export-port={self.metrics_port}",
               f"--runtime-env-agent-port={self.rt_env_port}",
               # not used with the dashboard off, but Ray still checks that its port is free
               f"--dashboard-port={self.dashboard_port}",
               f"--min-worker-port={self.workers[0]}", f"--max-worker-port={self.workers[1]}",
               "--include-dashboard=false", "--num-cpus=1", "--object-store-memory=100000000",
               "--disable-usage-stats"]
        self.ray_start(cmd)

    def ray_start(self, cmd: list[str]) -> None:
        """Run ``cmd`` (a `ray start --head`) in this head's environment, once more after a
        startup timeout (killing what the first attempt left)."""
        for attempt in (1, 2):
            done = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
            if done.returncode == 0 or "timed out during startup" not in done.stderr:
                break
            self.kill()
            time.sleep(5)
        assert done.returncode == 0, (attempt, done.stderr[-3000:])

    def processes(self) -> list[psutil.Process]:
        """This head's processes: those whose command line names its temp dir."""
        mark = str(self.root / "ray")
        out = []
        for p in psutil.process_iter(["cmdline"]):
            try:
                if any(mark in arg for arg in p.info["cmdline"] or []):
                    out.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def gcs_pid(self) -> int:
        (gcs,) = [p for p in self.processes() if "gcs_server" in p.name()]
        return gcs.pid

    def kill(self) -> None:
        """SIGKILL every process of the head, as a crashed pod loses them."""
        procs = self.processes()
        for p in procs:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(procs, timeout=30)

    def driver(self, script: str) -> str:
        done = subprocess.run([sys.executable, "-c", script, self.address, APP], env=self.env,
                              capture_output=True, text=True, timeout=180)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    def close(self) -> None:
        self.kill()
        if self.redis is not None:
            self.redis.terminate()
            try:
                self.redis.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.redis.kill()


@pytest.fixture
def head():
    assert shutil.which("redis-server"), "redis-server missing: `make setup` installs it"
    # short: Ray's unix sockets live under the temp dir (108-character limit)
    root = Path(tempfile.mkdtemp(prefix="efgcs-", dir="/tmp"))
    h = ThrowawayHead(root)
    try:
        h.start_redis()
        yield h
    finally:
        h.close()
        shutil.rmtree(root, ignore_errors=True)


def test_a_prefix_cache_override_survives_a_head_restart(head):
    head.start()
    assert head.driver(WRITE) == "written"
    first_gcs = head.gcs_pid()
    head.kill()
    assert head.processes() == []
    time.sleep(1)
    head.start()  # the same Redis and namespace: the new GCS loads the tables back
    assert head.gcs_pid() != first_gcs
    assert json.loads(head.driver(READ)) == {
        "tiny-qwen3": {"reason": "canary failed: 0.93 < 0.99", "canary": None, "at": 1.5}}
    # The control: a head on another namespace of the same Redis starts empty, so what came
    # back above came from the GCS tables in Redis, not from anything the first head left.
    head.kill()
    assert head.processes() == []
    time.sleep(1)
    head.env["RAY_external_storage_namespace"] += "-other"
    head.start()
    assert json.loads(head.driver(READ)) == {}
