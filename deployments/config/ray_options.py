"""The one mapping from config to Serve deployment options.

Both the in-process app builder (``deployments/app.py``) and the Serve YAML renderer
(``cluster/render.py``) use these functions, so a YAML deploy and ``embedfleet up`` place replicas
the same way.
"""

from __future__ import annotations

from typing import Any

from .schema import EmbedfleetConfig, ModelConfig, RouterConfig

ROUTER_NAME = "Router"
REGISTRY_NAME = "FleetRegistry"
GOVERNOR_NAME = "MemoryGovernor"
RUNTIME_ENV_VARS = {
    "HF_HUB_OFFLINE": "1",  # weights come from local folders or packages, never a hub at run time
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM's import runs logging.config.dictConfig, which closes every handler already made in
    # the process, Serve's replica log handler among them. A restarted Serve controller then
    # fails to recover each engine replica (`is_allocated` reads that handler's file) and
    # replaces them all: every model's requests wait out an engine cold start. vLLM's loggers
    # still log, through the root logger Ray sets up.
    "VLLM_CONFIGURE_LOGGING": "0",
}

# The Ray head's own environment (`ray start` here, the head container on KubeRay): Serve's
# controller reads it. A dead proxy is replaced only after 3 failed health checks, 10 s apart by
# default: 33 s with the HTTP port closed, timed here. 2 s apart: about 8 s in the soak; a check
# is one cheap call.
HEAD_ENV_VARS = {
    "RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S": "2",
}


# HAProxy's replay of a request whose Router replica died with it (Serve reads these where its
# HAProxyManager runs; Ray 2.60, ignored by 2.55.1). Serve's default retries only refused
# connections, so a request in flight on a Router that died was lost: on a kept-alive client
# connection HAProxy closes it with no answer at all, so that the client retries (a 500 on a
# new one). An embedding call is idempotent, so replaying it on the other Router is safe.
# - retry-on: a connection closed with no answer, or with a broken one.
# - option http-buffer-request: HAProxy replays only a request it held whole when it first sent
#   it; without it a request sent at once over a reused server connection was not replayed
#   (8 of 8 runs lost one in tests/test_haproxy_replay.py's scenario, 0 of 8 with it). Serve's
#   template has no setting for it, so it rides on the retry-on line, which Serve renders as
#   given into its `defaults` section; that test renders Serve's own config and checks the line.
# - tune.bufsize (router.http_replay_max_bytes): the whole request must fit in one buffer.
# - retries 5, not 3: leastconn sends a retry to the dead Router (it has the fewest
#   connections) until 3 errors mark it down, so 3 retries could all land on it.
HAPROXY_REPLAY_ENV = {
    "RAY_SERVE_HAPROXY_RETRY_ON":
        "conn-failure empty-response junk-response\n    option http-buffer-request",
    "RAY_SERVE_HAPROXY_RETRIES": "5",
}


def ray_node_env(cfg: EmbedfleetConfig) -> dict[str, str]:
    """What `ray start` needs in its environment on every node (head and workers: local,
    KubeRay's containers, the launcher's start commands). Serve's controller reads HAProxy mode
    from the head's; each Router replica reads it from its own node's to open its own HTTP
    server for HAProxy, so every node must agree. HAProxy's manager reads its retry policy and
    buffer size from its own node's (the head's, or every node's with EveryNode)."""
    if cfg.router.http_ingress != "haproxy":
        return {}
    return {"RAY_SERVE_ENABLE_HA_PROXY": "1", **HAPROXY_REPLAY_ENV,
            "RAY_SERVE_HAPROXY_TUNE_BUFSIZE": str(cfg.router.http_replay_max_bytes)}


def ray_head_env(cfg: EmbedfleetConfig) -> dict[str, str]:
    """The head's `ray start` environment: HEAD_ENV_VARS and every node's."""
    return {**HEAD_ENV_VARS, **ray_node_env(cfg)}


ENGINE_PREFIX = "engine-"


def engine_deployment_name(model: str) -> str:
    return f"{ENGINE_PREFIX}{model}"


def model_of_deployment(deployment: str) -> str:
    return deployment.removeprefix(ENGINE_PREFIX)


def card_actor_options(cfg: EmbedfleetConfig) -> dict[str, Any]:
    """One card per replica: ``{"NPU": 1}`` on Ascend and CPU, ``num_gpus: 1`` on CUDA."""
    if cfg.platform.kind == "cuda" and cfg.platform.card_resource == "GPU":
        return {"num_cpus": 1, "num_gpus": 1}
    # On CPU the engine's cores are chosen by card (deployments/engine/platform.py), so the replica
    # reserves no Ray CPU: the NPU resource alone bounds one replica per card.
    num_cpus = 0 if cfg.platform.kind == "cpu" else 1
    return {"num_cpus": num_cpus, "resources": {cfg.platform.card_resource: 1}}


# Ray runs an async actor's calls up to its max_concurrency: 1000, unless Serve raises it to a
# larger max_ongoing_requests. Serve's health checks and routing-stats calls take slots too, so a
# replica holding max_concurrency requests answers no health check, and after
# health_check_timeout_s Serve kills it with everything in flight: seen in the soak, a burst of
# 1,024 held requests at the router gave 996 x 500. Every deployment's max_ongoing_requests stays
# this far below Ray's default (Serve's ray_actor_options cannot raise max_concurrency).
RAY_ASYNC_ACTOR_CONCURRENCY = 1000
CONTROL_CALL_HEADROOM = 64
MAX_ONGOING_REQUESTS = RAY_ASYNC_ACTOR_CONCURRENCY - CONTROL_CALL_HEADROOM


def router_model_share(models: int, share: float) -> int:
    """Requests one model may hold in the router at once; beyond it, 429 + Retry-After.

    Each router replica has ``MAX_ONGOING_REQUESTS`` calls for every model, and it holds a call
    for as long as the model takes, a cold start included. Seen in the soak: 1,024 calls to
    a scale-to-zero model whose replica was killed held every router slot for ~100 s, and the
    other models' requests waited behind them at the proxy. With more than one model, one model
    may take ``share`` (``router.max_model_share``) of the router; the rest stays for the others."""
    if models <= 1 or share >= 1:
        return MAX_ONGOING_REQUESTS
    return max(1, int(share * MAX_ONGOING_REQUESTS))


def serve_queue_limits(m: ModelConfig) -> dict[str, int]:
    """Serve's two limits, derived from the replica's own queue — the one rule:

    * ``max_ongoing_requests`` = the budget's sequences + ``admission.max_waiting``: every call a
      replica's owner queue can hold (each call is at least one sequence), so Serve hands a
      replica all it can take and the owner queue alone decides what runs and what waits;
    * ``max_queued_requests`` = the same number: calls Serve's handle may hold while it assigns
      them to a replica (a burst of concurrent single-text queries sits there for a moment even
      when every replica has room — with ``admission.max_waiting`` here, 16 queries in flight got
      429 from an idle cluster) or while every replica is full. Beyond it, 429 + Retry-After;
      the owner queue's ``max_waiting`` still bounds what waits inside each replica.

    Both are capped at ``MAX_ONGOING_REQUESTS`` (above), so a full replica still answers its
    health checks; beyond the cap, calls wait in Serve's handle instead of in the replica.
    """
    ceiling = m.budget_ceiling
    per_replica = min(ceiling.max_sequences + m.admission.max_waiting, MAX_ONGOING_REQUESTS)
    return {"max_ongoing_requests": per_replica, "max_queued_requests": per_replica}


# Slots of a direct app's engine deployment (router.ingress: engine) kept for HTTP calls that are
# not embeddings (/health, /ready, /v1/models): see direct_model_share.
DIRECT_ONGOING_HEADROOM = 16


def direct_model_share(m: ModelConfig) -> int:
    """Embedding requests one replica of a direct app takes in at once; past it, 429 +
    Retry-After with an OpenAI body (``EmbedPipeline``'s share check).

    With no Router in front, HTTP goes straight into the replica, and Serve itself rejects what
    is past ``max_ongoing_requests`` + ``max_queued_requests`` with a plain-text 503 and no
    Retry-After (Ray 2.60's default ``backpressure_config``; 2.55.1 has no setting for it). The
    pipeline refuses first: it keeps its in-flight embedding requests below Serve's
    ``max_ongoing_requests``, so Serve never queues or rejects one."""
    ongoing = serve_queue_limits(m)["max_ongoing_requests"]
    return max(1, ongoing - DIRECT_ONGOING_HEADROOM)


def request_bound_s(router: RouterConfig, m: ModelConfig) -> float:
    """The bound on one request's time in the cluster, retries and holds included: the Router's
    (``RemoteCaller``) and a direct app's replica's, where a call may wait out an engine's cold
    start at the gate."""
    return max(router.request_timeout_s, m.replicas.cold_start_hold_s)


# How much longer than request_bound_s Serve's proxy holds an HTTP request of a direct app: it
# is HAProxy's backup while the app has no replica up, and it holds a request until one is (a
# killed single replica: 29 s here); with no bound it would wait for ever if none can start.
PROXY_HOLD_MARGIN_S = 30


def proxy_request_timeout_s(cfg: EmbedfleetConfig) -> float | None:
    """Serve's ``http_options.request_timeout_s``: set for a direct app only (a Router bounds
    its own calls and answers 503 + Retry-After; Serve's proxy answers 408)."""
    if not cfg.direct_ingress:
        return None
    return request_bound_s(cfg.router, cfg.models[0]) + PROXY_HOLD_MARGIN_S


AFFINITY_ROUTER_CLASS = "embedfleet.deployments.ingress.affinity:PrefixAffinityPolicy"
# How often Serve asks each replica whether its prefix cache is on (``record_routing_stats``):
# a replica whose canary switched the cache off stops getting keyed calls within this time.
ROUTING_STATS_PERIOD_S = 5


def affinity_router_config(m: ModelConfig) -> dict[str, Any]:
    """Serve's ``request_router_config`` for prefix affinity (each Router replica builds one
    router per engine deployment, from this)."""
    return {"request_router_class": AFFINITY_ROUTER_CLASS,
            "request_router_kwargs": m.routing.router_kwargs(),
            "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S}


def engine_deployment_options(cfg: EmbedfleetConfig, m: ModelConfig) -> dict[str, Any]:
    r = m.replicas
    opts: dict[str, Any] = {
        "name": engine_deployment_name(m.name),
        "ray_actor_options": card_actor_options(cfg),
        **serve_queue_limits(m),
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": cfg.health_check_timeout_s,
        "graceful_shutdown_timeout_s": 30,
    }
    # a direct app's replicas are Serve's ingress, which HAProxy balances (Serve refuses a
    # request router there); it has one replica whenever its policy is affinity
    if m.routing.affinity(m.prefix_cache) and not cfg.direct_ingress:
        opts["request_router_config"] = affinity_router_config(m)
    if r.fixed:
        opts["num_replicas"] = r.min_replicas
    else:
        opts["autoscaling_config"] = {
            "min_replicas": r.min_replicas,
            "max_replicas": r.max_replicas,
            "initial_replicas": r.min_replicas if r.initial_replicas is None
            else r.initial_replicas,
            "target_ongoing_requests": r.target_ongoing_requests,
            "upscale_delay_s": r.upscale_delay_s,
            "downscale_delay_s": r.downscale_delay_s,
            "look_back_period_s": r.look_back_period_s,
        }
    return opts


def router_deployment_options(cfg: EmbedfleetConfig) -> dict[str, Any]:
    return {
        "name": ROUTER_NAME,
        "num_replicas": cfg.router.replicas,
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": MAX_ONGOING_REQUESTS,
    }


def registry_deployment_options(cfg: EmbedfleetConfig) -> dict[str, Any]:
    return {"name": REGISTRY_NAME, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}


def governor_deployment_options(cfg: EmbedfleetConfig) -> dict[str, Any]:
    """One replica, no card: it only queries Prometheus and hands out limits."""
    return {"name": GOVERNOR_NAME, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0},
            "max_ongoing_requests": MAX_ONGOING_REQUESTS}
