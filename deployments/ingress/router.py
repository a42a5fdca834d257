"""The Router: the HTTP ingress of a multi-model application (FastAPI under Serve).

``class Router`` is the deployment; ``mount_routes(new_api(), Router)`` gives each Serve
application its own FastAPI app with the routes on it, so what belongs to one application — its
API keys above all — is that app's state, never a module global shared by whatever else runs in
the process. Each model is reached through its Serve handle (``ingress.remote.RemoteCaller``);
the routes are ``ingress.routes.ApiRoutes``.
"""

from __future__ import annotations

import asyncio
import logging
import types
from collections.abc import Callable
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


def route(method: str, path: str) -> Callable[[Callable], Callable]:
    """Marks an ``ApiIngress`` method as the handler of ``method path`` (``mount_routes`` adds it
    to each application's own app; a FastAPI decorator here would need one app for all)."""
    def mark(handler: Callable) -> Callable:
        handler.route = (method, path)  # type: ignore[attr-defined]
        return handler
    return mark


class ApiIngress:
    """embedfleet's HTTP routes, over ``self.api`` (an ``ApiRoutes`` the subclass's ``__init__``
    sets): the Router's, and a one-model app's engine replica's (``ingress/direct.py``). Each
    route's body, responses and errors are documented by ``ingress.openapi.doc``: the handlers
    read the raw request themselves, so FastAPI cannot see them."""

    api: ApiRoutes
    _app: FastAPI  # this application's own app, set by ``mount_routes``

    @route("POST", "/v1/embeddings")
    async def embeddings(self, request: Request) -> Response:
        return await self.api.embeddings(request)

    @route("POST", "/embed")
    async def tei_embed(self, request: Request) -> Response:
        return await self.api.tei_embed(request)

    @route("POST", "/v2/embed")
    async def cohere_embed(self, request: Request) -> Response:
        return await self.api.cohere_embed(request)

    @route("POST", "/tokenize")
    async def tei_tokenize(self, request: Request) -> Response:
        return await self.api.tei_tokenize(request)

    @route("POST", "/rerank")
    async def tei_rerank(self, request: Request) -> Response:
        return await self.api.tei_rerank(request)

    @route("POST", "/v1/rerank")
    async def rerank_v1(self, request: Request) -> Response:
        return await self.api.rerank_api(request, "/v1/rerank")

    @route("POST", "/v2/rerank")
    async def rerank_v2(self, request: Request) -> Response:
        return await self.api.rerank_api(request, "/v2/rerank")

    @route("POST", "/score")
    async def score(self, request: Request) -> Response:
        return await self.api.score(request)

    async def embed_batch(self, call: BatchCall) -> BatchResult:
        """Not HTTP: the corpus job's call through this deployment's Serve handle."""
        return await self.api.embed_batch(call)

    @route("GET", "/v1/models")
    async def models(self, request: Request) -> Response:
        return await self.api.models(request)

    @route("GET", "/health")
    async def health(self) -> Response:
        return await self.api.health()

    @route("GET", "/ready")
    async def ready(self) -> Response:
        return await self.api.ready()


class Router(ApiIngress):
    """The HTTP ingress of a multi-model application: every model through its Serve handle
    (``RemoteCaller``). Deployed as ``mount_routes(new_api(), Router)``."""

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
        self.api.rerank.callers.update(
            {m.name: RemoteCaller(engines[m.name], m, cfg.router, self.readiness, method="rerank")
             for m in cfg.models if m.task == "rerank" and m.name in engines})


def _own_handler(handler: Callable) -> Callable:
    """A copy of a route handler for one application: Serve's ``ingress`` rewrites a handler's
    signature and tags it with its class, so two applications must not share one."""
    copy = types.FunctionType(handler.__code__, handler.__globals__, handler.__name__,
                              handler.__defaults__, handler.__closure__)
    copy.__qualname__, copy.__module__ = handler.__qualname__, handler.__module__
    copy.__doc__, copy.__annotations__ = handler.__doc__, dict(handler.__annotations__)
    copy.__kwdefaults__ = handler.__kwdefaults__
    return copy


def mount_routes(app: FastAPI, cls: type) -> type:
    """``cls`` (``Router``, or a one-model app's engine class) as the Serve ingress class of one
    application, serving ``ApiIngress``'s routes on ``app``, that application's own FastAPI app
    (``new_api()``): its API keys are its own state, never a module global shared by whatever
    else runs in the process (tests pass their own app to read its OpenAPI document and call its
    routes without Serve).

    The class Serve runs is ``cls`` with ``_app`` bound, under ``cls``'s name. It is pickled by
    value with the handlers, so the copy of ``app`` that ``serve.ingress`` freezes rebinds its
    ``_app`` (``tests/test_openapi.py`` checks that the keys land on the app Serve serves)."""
    bases = (cls,) if issubclass(cls, ApiIngress) else (ApiIngress, cls)
    name = cls.__name__.removesuffix("Core")
    on_app = type(name, bases, {"_app": app, "__module__": cls.__module__, "__qualname__": name})
    for handler in vars(ApiIngress).values():
        if hasattr(handler, "route"):
            method, path = handler.route
            app.add_api_route(path, _own_handler(handler), methods=[method], **openapi.doc(path))
    return serve.ingress(app)(on_app)
