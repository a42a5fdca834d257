"""Helpers the end-to-end tests share: polling for a state, a model's state over HTTP, Ray's view
of live actors, and a short-lived Ray driver script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import requests

ROOT = Path(__file__).resolve().parents[2]


# A replica's cold start, as a bound for tests that wait for one: ~1 min on a quiet machine, 5 to
# 13 min in a CI run on a starved one (engine replicas started 13:47:02 -> 13:59:59 there).
COLD_START_BOUND_S = 900


def wait_for(predicate, timeout: float, what: str, every: float = 0.5):
    """Poll ``predicate`` until it returns something truthy (returned), or fail after ``timeout``
    seconds naming ``what`` and the last value seen."""
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}; last={last}")


def model_status(cluster: str, name: str) -> dict:
    """The model's entry in /v1/models (ready, state, waiting, cards): polled over HTTP, because
    each `embedfleet status` costs ~2 CPU-seconds of a Ray driver on two cores that the replicas
    being waited for need."""
    r = requests.get(f"{cluster}/v1/models", timeout=30)
    if r.status_code != 200:  # e.g. 503 while the registry restarts: poll again
        return {"ready": None, "state": None, "waiting": "", "cards": []}
    return next(m["replicas"] for m in r.json()["data"] if m["id"] == name)


def _actors(filters: list[tuple[str, str, str]]) -> tuple[list[Any], dict[str, str]]:
    """(Ray's actors matching ``filters``, with detail, {node id: node name} of the nodes alive)
    from a short-lived driver."""
    import ray
    from ray.util.state import list_actors

    try:
        ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
        node_name = {n["NodeID"]: n["NodeName"] for n in ray.nodes() if n["Alive"]}
        actors = list_actors(filters=filters, limit=10000, detail=True)
    finally:
        ray.shutdown()
    return actors, node_name


def alive_actors() -> tuple[list[Any], dict[str, str]]:
    """(Ray's ALIVE actors, {node id: node name} of the nodes alive)."""
    return _actors([("state", "=", "ALIVE")])


def actors_of_class(class_name: str) -> tuple[list[Any], dict[str, str]]:
    """(Every actor of ``class_name`` Ray has seen, in any state, {node id: node name} of the
    nodes alive)."""
    return _actors([("class_name", "=", class_name)])


def ray_script(script: str, *args: str, timeout: float = 120) -> str:
    """Run ``script`` as its own Ray driver (``python -c``, token auth) and return its stdout."""
    env = {**os.environ, "RAY_AUTH_MODE": "token"}
    done = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout.strip()


def ray_script_json(script: str, *args: str, timeout: float = 120) -> Any:
    """The JSON document ``script`` prints last, on a line of its own. Ray's driver can print
    cluster messages to stdout before it (a raylet's "N PYTHON worker processes have been
    started" warning, even with ``log_to_driver=False``), so stdout as a whole is not JSON."""
    out = ray_script(script, *args, timeout=timeout)
    lines = [line for line in out.splitlines() if line.lstrip().startswith(("{", "["))]
    assert lines, f"no JSON line in the script's stdout: {out[-3000:]}"
    return json.loads(lines[-1])


_DELETE_APP = """
import sys
import ray
from ray import serve
ray.init(address="auto", logging_level="ERROR", log_to_driver=False)
if sys.argv[1] in serve.status().applications:
    serve.delete(sys.argv[1], _blocking=sys.argv[2] == "wait")
"""


def delete_app(app: str, wait: bool = True) -> None:
    """Delete a test's own Serve app from the session cluster (nothing when it is not there).
    ``wait=False`` returns once Serve's controller has the order: its replicas stop in the
    background (Router replicas wait out Serve's graceful shutdown, an engine stops vLLM: about
    30 s), and a deploy that needs the card it frees waits for it in Serve's scheduler."""
    ray_script(_DELETE_APP, app, "wait" if wait else "nowait")


def engine_core_of(pid: int) -> psutil.Process:
    for child in psutil.Process(pid).children(recursive=True):
        try:  # the engine replaced after a canary failure can linger as a zombie: skip it
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if "EngineCore" in " ".join(child.cmdline()) or "EngineCore" in child.name():
                return child
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
    raise AssertionError(f"no vLLM EngineCore process under replica pid {pid}")
