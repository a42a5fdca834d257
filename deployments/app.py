"""Serve application builder: ``import_path: embedfleet.deployments.app:build_app`` with ``args.config``.

The Serve YAML rendered by ``embedfleet render`` points here and carries the whole config as
``args.config``; this builder validates it (same schema, same errors) and binds the deployments
with the options from ``deployments/config/ray_options.py``.
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve import Application

from .config.schema import ConfigError, EmbedfleetConfig, config_to_data, parse_config
from .fleet.governor import MemoryGovernor
from .config.ray_options import (engine_deployment_options, governor_deployment_options,
                                 registry_deployment_options, router_deployment_options)
from .fleet.registry import FleetRegistry
from .engine.lifecycle import DEFAULT_ENGINE_FACTORY
from .replica.engine_replica import EngineReplica
from .ingress.direct import direct_deployment
from .ingress.router import Router, mount_routes, new_api


def build(cfg: EmbedfleetConfig,
          engine_factories: dict[str, str] | None = None) -> Application:
    """``engine_factories`` maps a model name to the import path of its engine factory; the
    default is the real vLLM engine. Tests and demos use it to wrap one model's engine in a fault
    injector (``deployments/fault_injectors.py``) — it is deliberately not part of the config."""
    factories = engine_factories or {}
    data = config_to_data(cfg)
    registry = serve.deployment(FleetRegistry).options(
        **registry_deployment_options(cfg)).bind(data)
    governor = serve.deployment(MemoryGovernor).options(
        **governor_deployment_options(cfg)).bind(data)
    if cfg.direct_ingress:  # the one model's replicas take HTTP themselves: no Router hop
        m = cfg.models[0]
        return serve.deployment(direct_deployment()).options(
            **engine_deployment_options(cfg, m)).bind(
                data, m.name, registry, factories.get(m.name, DEFAULT_ENGINE_FACTORY), governor)
    engines = {
        m.name: serve.deployment(EngineReplica).options(
            **engine_deployment_options(cfg, m)).bind(
                data, m.name, registry, factories.get(m.name, DEFAULT_ENGINE_FACTORY), governor)
        for m in cfg.models
    }
    return serve.deployment(mount_routes(new_api(), Router)).options(
        **router_deployment_options(cfg)).bind(data, engines, registry, governor)


def build_app(args: dict[str, Any]) -> Application:
    """Serve's application-builder entry point."""
    cfg = parse_config(args.get("config"), "Serve application args.config")
    unknown = set(args) - {"config", "engine_factories"}
    if unknown:
        raise ConfigError(f"unknown Serve application args: {sorted(unknown)}")
    factories = args.get("engine_factories") or {}
    missing = sorted(set(factories) - {m.name for m in cfg.models})
    if missing:
        raise ConfigError(f"engine_factories names models that are not configured: {missing}")
    return build(cfg, factories)
