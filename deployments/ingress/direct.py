"""A one-model app's engine replica that takes HTTP itself: the Router hop taken out.

With ``router.ingress`` resolved to ``engine`` (one model, always at least one replica, no
prefix-affinity routing), the engine deployment is the app's ingress: HAProxy (or Serve's proxy)
hands each request to a replica, and the replica runs the same ``ApiRoutes`` and ``EmbedPipeline``
as the Router, with its own request path as the model's only caller. What the Router did besides
that, and where it went:

* choosing a replica: HAProxy's least-connections (each replica is one of its servers);
* admission: the replica's own owner queue (429 + Retry-After), as before, and the Router's
  share check, sized so Serve never rejects an embedding request in plain text itself
  (``options.direct_model_share``);
* the bound on a request's time (``options.request_bound_s``, the Router's): 503 +
  Retry-After past it;
* holding calls through an engine swap: the replica's engine gate, as before; a replica that
  is starting gets no HTTP until it is ready;
* a replica whose engine died: HAProxy replays requests whose connection it closed
  (``options.HAPROXY_REPLAY_ENV``); a request the dead engine held gets 503 + Retry-After from
  its replica (the Router would have retried it on another replica);
* ``/ready``, ``/v1/models``: the registry's view of the fleet, as the Router's.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI

from .router import FleetView, mount_routes, new_api, serve_api_keys
from .routes import ApiRoutes
from ..config.schema import parse_config
from ..common.contracts import EmbedCall, EmbedResult, Lane
from ..engine.lifecycle import DEFAULT_ENGINE_FACTORY
from ..common.errors import EngineUnavailable
from ..config.ray_options import direct_model_share, request_bound_s
from ..replica.engine_replica import EngineReplica
from .pipeline import EmbedPipeline


class DirectEngineCore(EngineReplica):
    """An ``EngineReplica`` with the HTTP API in front of its own request path."""

    _app: FastAPI  # set by ``mount_routes``

    async def __init__(self, config: dict[str, Any], model_name: str, registry: Any = None,
                       engine_factory: str = DEFAULT_ENGINE_FACTORY, governor: Any = None) -> None:
        # Keys first: a replica that must fail closed (keys named, none here) fails before it
        # loads an engine for minutes.
        serve_api_keys(self._app, parse_config(config, "direct ingress args"))
        await EngineReplica.__init__(self, config, model_name, registry, engine_factory,
                                     governor)
        fleet = FleetView(registry)
        m = self.cfg.model(model_name)
        # A call's bound, as the Router's: a request never outlives it (a paused engine).
        self._bound_s = request_bound_s(self.cfg.router, m)
        pipeline = EmbedPipeline(self.cfg, {model_name: self._bounded_embed},
                                 share=direct_model_share(m))
        self.api = ApiRoutes(self.cfg, pipeline, fleet.status, self._tokenize, self.recorder)

    async def _bounded_embed(self, call: EmbedCall) -> EmbedResult:
        """The model's one caller: this replica's own request path (``EngineReplica.embed``),
        within the bound; past it, 503 + Retry-After."""
        try:
            return await asyncio.wait_for(self.embed(call), self._bound_s)
        except asyncio.TimeoutError:
            raise EngineUnavailable(
                f"replica {self.replica_id} did not answer within {self._bound_s:g}s",
                retry_after_s=self.cfg.router.retry_after_s) from None

    async def _tokenize(self, model: str, texts: list[str], add_special_tokens: bool,
                        prompt_name: str | None, lane: Lane) -> list:
        return await self.tokenize_tei(texts, add_special_tokens, prompt_name, lane)


def direct_deployment(app: FastAPI | None = None) -> type:
    """The engine deployment class of a one-model app that takes HTTP (a new FastAPI app each
    call, as ``router_deployment``)."""
    return mount_routes(new_api() if app is None else app, DirectEngineCore)
