"""Serve application builder: ``import_path: deployments.app:build_app`` with ``args.config``.

The Serve YAML rendered by ``embedfleet render`` points here and carries the whole config as
``args.config``; this builder validates it (same schema, same errors) and binds the deployments
with the options from ``deployments/options.py``.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from deployments.config import EmbedfleetConfig, config_to_data, parse_config
from deployments.options import (
    engine_deployment_options,
    registry_deployment_options,
    router_deployment_options,
)
from deployments.registry import FleetRegistry
from deployments.replica import DEFAULT_ENGINE_FACTORY, EngineReplica
from deployments.router import Router


def build(cfg: EmbedfleetConfig, engine_factory: str = DEFAULT_ENGINE_FACTORY) -> Application:
    data = config_to_data(cfg)
    registry = serve.deployment(FleetRegistry).options(
        **registry_deployment_options(cfg)).bind()
    engines = {
        m.name: serve.deployment(EngineReplica).options(
            **engine_deployment_options(cfg, m)).bind(data, m.name, registry, engine_factory)
        for m in cfg.models
    }
    return serve.deployment(Router).options(**router_deployment_options(cfg)).bind(
        data, engines, registry)


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application-builder entry point."""
    cfg = parse_config(args.get("config"), "Serve application args.config")
    return build(cfg, args.get("engine_factory", DEFAULT_ENGINE_FACTORY))
