"""The `embedfleet` peer of `embedfleet bench`: the whole stack over HTTP, one replica.

If a cluster already answers at ``--embedfleet-url`` it is used as it is (its config is whatever
it was started with; ``describe()`` records what ``/v1/models`` says, replicas included, so a
report of a 2-replica cluster cannot pass for a 1-replica one). If nothing answers, the peer
writes the bench config (``bench_config``: the same model and engine settings the ``vllm`` peer
runs, one card, exactly one replica) and starts a cluster with ``embedfleet up --detach``; it
stops only a cluster it started itself, with ``embedfleet down``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import yaml

from .peers import OpenAIHttpPeer, PeerUnavailable, cpu_env, port_in_use
from .workloads import Workload

UP_TIMEOUT_S = 1500  # Ray head + Serve + one engine's cold start on 2 cores
DOWN_TIMEOUT_S = 300
EMBEDFLEET_CLI = str(Path(sys.executable).with_name("embedfleet"))


def bench_config(base: Any, url: str, replicas: int = 1) -> Any:
    """``base`` (an EmbedfleetConfig) cut to its first model on ``replicas`` cards with exactly
    that many replicas, its router on ``url``'s port. The ``vllm`` peer runs this config's engine
    kwargs (one replica); the lanes bench uses two."""
    port = urlparse(url).port or 8000
    m = base.models[0]
    bounds = m.replicas.model_copy(update={"min_replicas": replicas, "max_replicas": replicas,
                                           "initial_replicas": replicas})
    return base.model_copy(update={
        "cards": replicas, "models": [m.model_copy(update={"replicas": bounds})],
        "router": base.router.model_copy(update={"port": port})})


def write_bench_config(cfg: Any, path: Path) -> Path:
    from ..deployments.config.schema import config_to_data, parse_config

    data = config_to_data(cfg)
    parse_config(data, str(path))  # what `embedfleet up --config` will load must validate
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("# written by `embedfleet bench` (its cluster of the run)\n"
                    + yaml.safe_dump(data, sort_keys=False))
    return path


def _host_addresses() -> list[str]:
    """Loopback and this host's primary address (where Ray binds its head's ports)."""
    addrs = ["127.0.0.1"]
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("10.255.255.255", 1))  # UDP connect sends nothing; it only picks a route
            addrs.append(s.getsockname()[0])
        except OSError:
            pass
    return addrs


def ray_ports_taken() -> list[str]:
    """Ray head ports (GCS, dashboard) that something already listens on.

    `embedfleet up` would join a running head, and `embedfleet down` stops whatever head runs on
    this machine: starting a bench cluster beside someone else's Ray would end theirs."""
    from ..deployments.common.settings import settings

    s = settings()
    return [f"{host}:{port}" for port in (s.ray_port, s.dashboard_port)
            for host in _host_addresses() if port_in_use(port, host)]


def served_model(models_body: dict[str, Any], model: str) -> dict[str, Any] | None:
    """The ``/v1/models`` entry of ``model`` (None when the cluster does not serve it)."""
    return next((m for m in models_body.get("data", []) if m.get("id") == model), None)


class EmbedfleetPeer(OpenAIHttpPeer):
    def __init__(self, url: str, model: str, concurrency: int, config: Any, out_dir: Path,
                 cores: list[int] | None):
        super().__init__("embedfleet", url, model, concurrency)
        self.config = config
        self.config_path = out_dir / "embedfleet-bench-config.yaml"
        self.log = out_dir / "embedfleet-cli.log"
        self.cores = cores
        self.started_cluster = False
        self.origin = "not started"
        self.models_entry: dict[str, Any] | None = None
        self.startup_s: float | None = None
        self._scope: Any = None

    def skip_reason(self, workload: Workload) -> str | None:
        return None  # embedfleet chunks long inputs itself (`long_input: chunk`)

    def cpu_scope(self, others: list[Any]) -> Any:
        """Every process of the Ray cluster behind the URL (found from the process listening on
        its port) and the Prometheus that `embedfleet up` started (its pid file in the state
        dir): see ``ray_cluster_scope.RayCluster``."""
        from .ray_cluster_scope import RayCluster
        from ..cluster.prometheus_server import PID_NAME
        from ..deployments.common.settings import settings

        if self._scope is None:  # located at its first reading, once the cluster is up
            self._scope = RayCluster(urlparse(self.base_url).port or 80,
                                     settings().state_dir / "prometheus" / PID_NAME)
        return self._scope

    def request_extra(self, workload: Workload) -> dict[str, Any]:
        return {"long_input": "chunk"} if workload.chunked else {}

    async def _models(self) -> dict[str, Any] | None:
        """``/v1/models``, or None when nothing answers at the URL."""
        import httpx

        # A refused connection means nothing is there; a slow answer (the other peers' engines
        # starting on the same cores) is retried before concluding so.
        for attempt in range(4):
            try:
                r = await self._client().get("/v1/models", timeout=30)
            except httpx.ConnectError:
                return None
            except httpx.TransportError:
                if attempt == 3:
                    return None
                await asyncio.sleep(5)
                continue
            r.raise_for_status()
            return r.json()
        return None

    async def _cli(self, *args: str, timeout: float) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "RAY_AUTH_MODE": "token",
               **(cpu_env(self.cores) if self.cores else {})}
        with self.log.open("ab") as log:
            log.write(f"$ embedfleet {' '.join(args)}\n".encode())
            log.flush()
            proc = await asyncio.create_subprocess_exec(EMBEDFLEET_CLI, *args, env=env,
                                                        stdout=log, stderr=log)
            try:
                rc = await asyncio.wait_for(proc.wait(), timeout)
            except asyncio.TimeoutError:
                proc.kill()
                await proc.wait()
                raise RuntimeError(f"`embedfleet {args[0]}` timed out after {timeout:.0f} s; "
                                   f"see {self.log}") from None
        if rc != 0:
            raise RuntimeError(f"`embedfleet {' '.join(args)}` exited {rc}; see {self.log}")

    async def start(self) -> None:
        t0 = time.monotonic()
        body = await self._models()
        if body is None:
            if taken := ray_ports_taken():
                raise PeerUnavailable(
                    f"nothing answers at {self.base_url}, but a Ray head is running here "
                    f"({', '.join(taken)}): not starting a bench cluster, since `embedfleet down` "
                    "would stop that head too; point --embedfleet-url at its router or stop it")
            write_bench_config(self.config, self.config_path)
            self.started_cluster = True  # set first: a half-started cluster is still ours to stop
            self.origin = "started by the harness (embedfleet up --detach)"
            await self._cli("up", "--detach", "--config", str(self.config_path),
                            timeout=UP_TIMEOUT_S)
            body = await self._models()
        else:
            self.origin = "already running (its own config; not stopped by the harness)"
        self.models_entry = served_model(body or {}, self.model)
        if self.models_entry is None:
            ids = [m.get("id") for m in (body or {}).get("data", [])]
            raise RuntimeError(f"the cluster at {self.base_url} does not serve {self.model!r} "
                               f"(it serves {ids}); pass --embedfleet-model")
        await self._wait_ready()
        self.startup_s = time.monotonic() - t0

    async def _wait_ready(self, timeout_s: float = 300) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if (await self._client().get("/ready", timeout=10)).status_code == 200:
                return
            await asyncio.sleep(2)
        raise RuntimeError(f"{self.base_url}/ready is not 200 after {timeout_s:.0f} s")

    async def stop(self) -> None:
        await self.close_client()
        if self.started_cluster:
            self.started_cluster = False
            await self._cli("down", timeout=DOWN_TIMEOUT_S)

    def _path(self) -> str:
        """The request's way in, from the config the harness started the cluster with."""
        if not self.config_path.exists():
            return "the running cluster's own path"
        from ..deployments.config.schema import load_config

        if load_config(self.config_path).direct_ingress:  # router.ingress resolved to engine
            return "engine replica as the HTTP ingress -> vLLM, no Router"
        return "router -> replica -> vLLM"

    def describe(self) -> dict[str, Any]:
        replicas = (self.models_entry or {}).get("replicas", {})
        return {"kind": f"embedfleet over HTTP ({self._path()})", "url": self.base_url,
                "model": self.model,
                "cluster": self.origin,
                "cores": self.cores if self.config_path.exists()
                else "the running cluster's own binding (deployments/engine/platform.py)",
                "config": str(self.config_path) if self.config_path.exists() else None,
                "replicas_ready": replicas.get("ready"),
                "one_replica": replicas.get("ready") == 1,
                "prefix_cache": (self.models_entry or {}).get("prefix_cache"),
                "startup_s": self.startup_s, "log": str(self.log)}
