"""The Router: the HTTP ingress of a multi-model application (FastAPI under Serve).

``router_deployment()`` makes a fresh FastAPI app and ingress class per Serve application, so
what belongs to one application — its API keys above all — is that app's state, never a module
global shared by whatever else runs in the process. Each model is reached through its Serve
handle (``ingress.remote.RemoteCaller``); the routes are ``ingress.routes.ApiRoutes``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from ray import serve
from starlette.responses import Response

from ..common import metrics
from . import openapi
from .auth import ApiKeyMiddleware, ApiKeys, KeyRing, KeysError
from .http import install_error_handlers
from .routes import ApiRoutes
from ..config.schema import EmbedfleetConfig, parse_config
from ..config.router import is_loopback
from ..common.contracts import (BatchCall, BatchResult, FleetStatus,
                         ModelReadiness, ReplicaDescription)
from .pipeline import EmbedPipeline
from .readiness import ReadinessView
from .remote import RemoteCaller

logger = logging.getLogger("embedfleet.router")
TITLE = "embedfleet"
DESCRIPTION = "OpenAI-compatible embeddings over vLLM pooling engines on Ray Serve."


class FleetView:
    """The registry's view of the fleet (off the request path, bounded in time)."""

    def __init__(self, registry: Any) -> None:
        self._registry = registry

    async def snapshot(self) -> dict[str, list[ReplicaDescription]]:
        try:
            return await asyncio.wait_for(self._registry.snapshot.remote(), timeout=5)
        except Exception as exc:
            logger.warning("FleetRegistry snapshot failed: %r", exc)
            return {}

    async def status(self) -> FleetStatus:
        return await asyncio.wait_for(self._registry.status.remote(), timeout=15)

    async def readiness(self) -> dict[str, ModelReadiness]:
        return await self._registry.readiness.remote()


def new_api() -> FastAPI:
    """A FastAPI app with embedfleet's error handling and per-app API keys
    (``app.state.api_keys``, empty = open; each key's lane and model limits beside them)."""
    app = FastAPI(title=TITLE, version="0.1.0", redirect_slashes=False, description=DESCRIPTION)
    app.state.api_keys, app.state.key_lanes, app.state.key_models = (), {}, {}
    app.state.key_ring = None
    app.add_middleware(ApiKeyMiddleware, keys_provider=lambda: _current_keys(app),
                       lanes_provider=lambda: app.state.key_lanes,
                       models_provider=lambda: app.state.key_models)
    install_error_handlers(app)
    return app


def _set_keys(app: FastAPI, keys: ApiKeys) -> None:
    app.state.loaded_keys = keys
    app.state.api_keys = keys.keys
    app.state.key_lanes = {k: v.lane for k, v in (keys.limits or {}).items() if v.lane}
    app.state.key_models = {k: v.models for k, v in (keys.limits or {}).items()
                            if v.models is not None}


def _current_keys(app: FastAPI) -> tuple[bytes, ...]:
    """The app's keys for this request: the key ring's, when the keys file changed since."""
    ring = app.state.key_ring
    if ring is not None and (keys := ring.current()) is not app.state.loaded_keys:
        _set_keys(app, keys)
    return app.state.api_keys


def serve_api_keys(app: FastAPI, cfg: EmbedfleetConfig) -> None:
    """Load the app's API keys (and what each may use) into its state, as this ingress replica
    finds them on its own node, and re-read the keys file when it changes (``auth.KeyRing``).
    Fails closed: when the config names a source of keys and it gives none here, raise, so the
    replica never starts."""
    router = cfg.router
    try:
        ring = KeyRing(router.api_keys_file, router.api_keys_env, [m.name for m in cfg.models],
                       log=logger)
    except KeysError as err:
        logger.error("HTTP ingress refuses to start: %s", err)
        raise
    _set_keys(app, ring.keys)
    app.state.key_ring = ring
    if ring.keys.keys:
        logger.info("HTTP ingress up; API keys required (%d, %s)", len(ring.keys.keys),
                    ring.keys.fingerprint())
    elif is_loopback(router.host):
        logger.info("HTTP ingress up on loopback (%s); no API keys configured", router.host)
    else:
        logger.warning("HTTP ingress up on %s with NO API keys (router.allow_unauthenticated): "
                       "anyone who reaches it may use it", router.host)


class RouterCore:
    """The Router's state: every model through its Serve handle (``RemoteCaller``)."""

    _app: FastAPI  # set by ``mount_routes``

    async def __init__(self, config: dict[str, Any], engines: dict[str, Any],
                       registry: Any, governor: Any = None) -> None:
        cfg = parse_config(config, "router args")
        serve_api_keys(self._app, cfg)
        self.fleet = FleetView(registry)
        self.readiness = ReadinessView(self.fleet.readiness)
        callers = {m.name: RemoteCaller(engines[m.name], m, cfg.router, self.readiness)
                   for m in cfg.models if m.name in engines}
        self.recorder = metrics.Batched()
        loop = asyncio.get_running_loop()
        self._background = [loop.create_task(self.recorder.flush_forever()),
                            loop.create_task(self.readiness.refresh_forever())]
        self.api = ApiRoutes(cfg, EmbedPipeline(cfg, callers), self.fleet.status,
                             lambda model, texts, special, prompt, lane:
                             engines[model].tokenize_tei.remote(texts, special, prompt, lane),
                             self.recorder)


def mount_routes(app: FastAPI, core: type) -> type:
    """``core`` (whose ``__init__`` sets ``self.api``, an ``ApiRoutes``) as a Serve ingress class
    with embedfleet's routes on ``app``: the Router, or a one-model app's engine replica
    (``ingress/direct.py``). Each route's body, responses and errors are documented by
    ``ingress.openapi.doc``: the handlers read the raw request themselves, so FastAPI cannot see
    them."""

    class Ingress(core):  # type: ignore[misc, valid-type]
        _app = app

        @app.post("/v1/embeddings", **openapi.doc("/v1/embeddings"))
        async def embeddings(self, request: Request) -> Response:
            return await self.api.embeddings(request)

        @app.post("/embed", **openapi.doc("/embed"))
        async def tei_embed(self, request: Request) -> Response:
            return await self.api.tei_embed(request)

        @app.post("/tokenize", **openapi.doc("/tokenize"))
        async def tei_tokenize(self, request: Request) -> Response:
            return await self.api.tei_tokenize(request)

        async def embed_batch(self, call: BatchCall) -> BatchResult:
            """Not HTTP: the corpus job's call through this deployment's Serve handle."""
            return await self.api.embed_batch(call)

        @app.get("/v1/models", **openapi.doc("/v1/models"))
        async def models(self, request: Request) -> Response:
            return await self.api.models(request)

        @app.get("/health", **openapi.doc("/health"))
        async def health(self) -> Response:
            return await self.api.health()

        @app.get("/ready", **openapi.doc("/ready"))
        async def ready(self) -> Response:
            return await self.api.ready()

    # Serve's name for the class (not __qualname__: Serve finds the routes by it)
    Ingress.__name__ = core.__name__.removesuffix("Core")
    return serve.ingress(app)(Ingress)


def router_deployment(app: FastAPI | None = None) -> type:
    """The Router class for one Serve application (a new FastAPI app each call; tests pass their
    own ``new_api()`` to read its OpenAPI document and call its routes without Serve)."""
    return mount_routes(new_api() if app is None else app, RouterCore)
