"""Local Ray head and Serve deployment management for `embedfleet up` / `down` / `deploy`.

Deploys go through Serve's declarative REST API on the Ray dashboard, the same path as
`serve deploy <rendered YAML>`, so `up` exercises exactly what users apply to a real cluster.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from ..deployments.common.settings import settings

RAY = str(Path(sys.executable).with_name("ray"))


def ensure_token_auth() -> None:
    """Use Ray's token authentication for the cluster and every client this process starts.

    Ray 2.60 turns token auth on for a new head whenever ``~/.ray/auth_token`` exists, and a
    client without ``RAY_AUTH_MODE=token`` is then refused; so embedfleet always uses it: it makes
    the token if missing and sets the mode for itself and its children.
    """
    os.environ.setdefault("RAY_AUTH_MODE", "token")
    if os.environ["RAY_AUTH_MODE"] != "token":
        return
    token = Path(os.environ.get("RAY_AUTH_TOKEN_PATH", Path.home() / ".ray" / "auth_token"))
    if not os.environ.get("RAY_AUTH_TOKEN") and not token.exists():
        subprocess.run([RAY, "get-auth-token", "--generate"], check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def ray_running(address: str) -> bool:
    try:
        out = subprocess.run([RAY, "status", "--address", address], capture_output=True,
                             text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return False
    return out.returncode == 0


def local_node_name(i: int) -> str:
    """Node ``i``'s Ray node name. The head keeps Ray's default, its IP: Serve takes a node's
    name for its address (its node cache reads ``node_name`` as the IP), and its HAProxy reaches
    a replica on its own node at localhost only when the replica's IP equals that address. A
    named head sent HAProxy to the machine's address for every Router replica, which binds
    ``router.host`` (loopback by default): all of them were DOWN and HAProxy ran on its backup,
    Serve's proxy, which cannot replay a request whose Router died. The worker nodes share the
    machine's IP, so their names are what tells their cards apart."""
    return node_ip() if i == 0 else f"local-node-{i}"


def start_head(cards: int, resource: str = "NPU", nodes: int = 1,
               ray_env: dict[str, str] | None = None) -> str:
    """Start a local Ray cluster with ``cards`` logical cards, or join the one already running.

    ``nodes > 1`` starts a head and ``nodes - 1`` worker nodes on this machine, each with
    ``cards / nodes`` cards and the name ``local_node_name`` gives it (they all share this
    machine's IP, so the name is what tells their cards apart; the head keeps its IP). ``ray_env`` is every node's `ray start` environment
    (``options.ray_head_env``: on one machine the head's serves the worker nodes too)."""
    s = settings()
    address = f"{node_ip()}:{s.ray_port}"
    if ray_running(address):
        print(f"joining the Ray head already running at {address}")
        return address
    per_node = cards // nodes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", **(ray_env or {})}
    env.update(haproxy_env(env))
    cmd = [RAY, "start", "--head", f"--port={s.ray_port}",
           f"--dashboard-port={s.dashboard_port}", "--dashboard-host=127.0.0.1",
           f"--resources={json.dumps({resource: per_node})}", "--disable-usage-stats"]
    _ray_start(cmd, env)
    for i in range(1, nodes):
        # Port 0 = any free port: the head's dashboard agent already holds the default one.
        # No log monitor: every node on this machine writes to the head's session log folder,
        # which the head's monitor already reads. A second one read the same files again (each
        # line sent to drivers twice) and cost as much CPU as the first, growing with the
        # session's log files (Ray's help: one log monitor per physical host).
        _ray_start([RAY, "start", f"--address={address}", f"--node-name={local_node_name(i)}",
                    f"--resources={json.dumps({resource: per_node})}",
                    "--dashboard-agent-listen-port=0", "--include-log-monitor=False",
                    "--disable-usage-stats"], env)
    shape = f"{nodes} nodes x {per_node}" if nodes > 1 else str(cards)
    print(f"started a Ray cluster at {address} with {shape} logical {resource} card(s)")
    return address


# Serve's HAProxy through `embedfleet-haproxy` (cluster/haproxy_loopback.py): its stats page and
# metrics frontend on loopback, its admin socket the owner's. Ray 2.60 runs the binary this names.
HAPROXY_BINARY_ENV = "RAY_SERVE_HAPROXY_BINARY_PATH"
HAPROXY_LOOPBACK = Path(sys.executable).with_name("embedfleet-haproxy")


def haproxy_env(env: dict[str, str], wrapper: Path = HAPROXY_LOOPBACK) -> dict[str, str]:
    """The local nodes' HAProxy binary in HAProxy mode: ``embedfleet-haproxy`` unless the
    environment names one already (an operator's choice is kept)."""
    if env.get("RAY_SERVE_ENABLE_HA_PROXY") != "1" or env.get(HAPROXY_BINARY_ENV):
        return {}
    if not os.access(wrapper, os.X_OK):
        raise RuntimeError(f"{wrapper} is missing: reinstall embedfleet (make setup), which "
                           "installs it as a console script beside `embedfleet`")
    return {HAPROXY_BINARY_ENV: str(wrapper)}


def _ray_start(cmd: list[str], env: dict[str, str]) -> None:
    """`ray start`, its stderr shown without Ray's NPU-detection traceback (see below); all of
    it when the command fails."""
    proc = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stderr)
        raise subprocess.CalledProcessError(proc.returncode, cmd)
    if rest := without_npu_probe_noise(proc.stderr).strip():
        print(rest, file=sys.stderr)


# Ray logs a full traceback ("Failed to detect NPU type.") whenever a node with an `NPU`
# resource has no CANN runtime: every local CPU cluster, where the NPU cards are logical.
# On a real Ascend node `acl` imports and the message never appears, so nothing is hidden there.
_NPU_PROBE_START = "Failed to detect NPU type"
_NPU_PROBE_END = "No module named 'acl'"


def without_npu_probe_noise(text: str) -> str:
    """``text`` without each block from a "Failed to detect NPU type" line through the
    "No module named 'acl'" line that ends its traceback."""
    out, skipping = [], False
    for line in text.splitlines(keepends=True):
        if not skipping and _NPU_PROBE_START in line:
            skipping = True
        if not skipping:
            out.append(line)
        elif _NPU_PROBE_END in line:
            skipping = False
    return "".join(out) if not skipping else text  # an unterminated block: show everything


def node_ip() -> str:
    """The address Ray binds this node to (Ray picks the host's primary address)."""
    from ray.util import get_node_ip_address

    return get_node_ip_address()


def stop_head() -> None:
    subprocess.run([RAY, "stop", "--force"], check=False, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    stop_serve_haproxy()


# Serve's HAProxy mode runs `haproxy -db -f <RAY_SERVE_HAPROXY_CONFIG_FILE_LOC>/<hash>/haproxy.cfg`
# as a child of its HAProxyManager actor. `ray stop --force` kills the actor, not the child, and the
# orphan keeps the HTTP port: the next `embedfleet up` would then answer from a dead cluster's
# HAProxy (measured: port 8000 still held after `embedfleet down`).
_SERVE_HAPROXY_CONFIG_DIR = "/haproxy-serve/"


def stop_serve_haproxy(config_dir: str = _SERVE_HAPROXY_CONFIG_DIR,
                       timeout_s: float = 5.0) -> list[int]:
    """Terminate every HAProxy on this machine whose config lies under ``config_dir`` (Serve's
    HAProxy folder); the pids it stopped."""
    import psutil

    procs = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if (p.info["name"] == "haproxy" or (cmd and Path(cmd[0]).name == "haproxy")) and any(
                config_dir in arg for arg in cmd):
            procs.append(p)
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    return [p.pid for p in procs]


def dashboard_url(address: str | None) -> str:
    if address and address.startswith("http"):
        return address.rstrip("/")
    host = (address or "127.0.0.1").split(":")[0]
    return f"http://{host}:{settings().dashboard_port}"


def rest_deploy(dashboard: str, serve_config: dict[str, Any], timeout_s: float = 120) -> None:
    """Submit the Serve config to the dashboard, as `serve deploy` does.

    Ray's own client is used because Ray 2.60 enables token authentication on the dashboard and
    that client attaches the cluster's token (``~/.ray/auth_token`` or ``RAY_AUTH_TOKEN``).
    """
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            ServeSubmissionClient(dashboard).deploy_applications(serve_config)
            return
        except (ConnectionError, RuntimeError, OSError) as err:
            # The dashboard comes up a few seconds after `ray start` returns.
            if time.monotonic() > deadline:
                raise RuntimeError(f"Serve deploy to {dashboard} failed: {err}") from None
            time.sleep(2)


def rest_delete(dashboard: str) -> None:
    from ray.dashboard.modules.serve.sdk import ServeSubmissionClient

    try:
        ServeSubmissionClient(dashboard).delete_applications()
    except (ConnectionError, RuntimeError, OSError):
        pass


def http_json(url: str, timeout: float = 5) -> tuple[int, Any]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, json.loads(resp.read() or b"null")
    except urllib.error.HTTPError as err:
        try:
            return err.code, json.loads(err.read() or b"null")
        except ValueError:
            return err.code, None
    except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError):
        return 0, None


REPEAT_S = 10.0


def wait_ready(endpoint: str, timeout_s: float, progress=print) -> dict[str, Any]:
    """Poll ``/ready`` until every model has a ready replica; returns the last body.

    Says what it waits for when that changes, and at least every ``REPEAT_S`` with the time
    waited and the bound, so a cluster waiting for a card never looks hung."""
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    last, said_at = None, 0.0
    while time.monotonic() < deadline:
        code, body = http_json(f"{endpoint}/ready")
        if code == 200:
            return body
        msg = json.dumps(body.get("models")) if isinstance(body, dict) else "HTTP ingress not up"
        now = time.monotonic()
        if msg != last or now - said_at >= REPEAT_S:
            progress(f"waiting for replicas ({now - t0:.0f}s of {timeout_s:.0f}s): {msg}")
            last, said_at = msg, now
        time.sleep(2)
    raise TimeoutError(f"not ready after {timeout_s:.0f}s: {last}")


def have(binary: str) -> bool:
    return shutil.which(binary) is not None
