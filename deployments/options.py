"""The one mapping from config to Serve deployment options.

Both the in-process app builder (``deployments/app.py``) and the Serve YAML renderer
(``cluster/render.py``) use these functions, so a YAML deploy and ``embedfleet up`` place replicas
the same way.
"""

from __future__ import annotations

from typing import Any

from embedfleet.deployments.config import EmbedfleetConfig, ModelConfig

ROUTER_NAME = "Router"
REGISTRY_NAME = "FleetRegistry"
GOVERNOR_NAME = "MemoryGovernor"
RUNTIME_ENV_VARS = {
    "HF_HUB_OFFLINE": "1",  # weights come from local folders or packages, never a hub at run time
    "TOKENIZERS_PARALLELISM": "false",
}


def engine_deployment_name(model: str) -> str:
    return f"engine-{model}"


def card_actor_options(cfg: EmbedfleetConfig) -> dict[str, Any]:
    """One card per replica: ``{"NPU": 1}`` on Ascend and CPU, ``num_gpus: 1`` on CUDA."""
    if cfg.platform.kind == "cuda" and cfg.platform.card_resource == "GPU":
        return {"num_cpus": 1, "num_gpus": 1}
    # On CPU the engine's cores are chosen by card (deployments/engine/platform.py), so the replica
    # reserves no Ray CPU: the NPU resource alone bounds one replica per card.
    num_cpus = 0 if cfg.platform.kind == "cpu" else 1
    return {"num_cpus": num_cpus, "resources": {cfg.platform.card_resource: 1}}


def engine_deployment_options(cfg: EmbedfleetConfig, m: ModelConfig) -> dict[str, Any]:
    r = m.replicas
    opts: dict[str, Any] = {
        "name": engine_deployment_name(m.name),
        "ray_actor_options": card_actor_options(cfg),
        "max_ongoing_requests": r.max_ongoing_requests,
        "max_queued_requests": r.max_queued_requests,
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": cfg.health_check_timeout_s,
        "graceful_shutdown_timeout_s": 30,
    }
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
        }
    return opts


def router_deployment_options(cfg: EmbedfleetConfig) -> dict[str, Any]:
    return {
        "name": ROUTER_NAME,
        "num_replicas": 1,
        "ray_actor_options": {"num_cpus": 0},
        "max_ongoing_requests": 1000,
    }


def registry_deployment_options(cfg: EmbedfleetConfig) -> dict[str, Any]:
    return {"name": REGISTRY_NAME, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0}}


def governor_deployment_options(cfg: EmbedfleetConfig) -> dict[str, Any]:
    """One replica, no card: it only queries Prometheus and hands out limits."""
    return {"name": GOVERNOR_NAME, "num_replicas": 1, "ray_actor_options": {"num_cpus": 0},
            "max_ongoing_requests": 1000}
